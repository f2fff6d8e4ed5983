# `make test` sets up everything it needs (a virtualenv with the CUDA compiler from PyPI),
# builds the extension, and runs the Rust and Python test suites. GPU tests skip without a GPU.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(BIN):$(PATH)
PY_SOURCES := python tests benches scripts

.PHONY: test develop lint fmt wheel clean

$(VENV)/.installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $@

develop: $(VENV)/.installed
	$(BIN)/maturin develop --release --quiet

test: develop
	cargo test --quiet
	$(BIN)/python -m pytest -q

# stubtest compares python/mk/_native.pyi with the built extension, so lint builds it first.
lint: develop
	cargo fmt --check
	cargo clippy --quiet --all-targets -- -D warnings
	cargo clippy --quiet --all-targets --features python -- -D warnings
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)
	cd python && $(BIN)/python -m mypy.stubtest mk._native --allowlist mk/_native.stubtest-allowlist

fmt: $(VENV)/.installed
	cargo fmt
	$(BIN)/ruff format $(PY_SOURCES)
	$(BIN)/ruff check --fix $(PY_SOURCES)

# The wheel carried to the GPU machine (abi3: installs on its Python 3.12), without the built-in
# model's weights: a device call carries at most 64 MiB, and the working tree there has them
# (scripts/device-env.sh puts them beside the installed package).
wheel: $(VENV)/.installed
	rm -rf .whl/mk-*.whl
	$(BIN)/maturin build --release --quiet --compatibility linux -o .whl
	zip -q -d .whl/mk-*.whl 'mk/embedded/*.safetensors' || [ $$? -eq 12 ]  # 12: none to delete

clean:
	cargo clean
	rm -rf $(VENV) .whl
