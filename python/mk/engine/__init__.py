"""The engine: its options, the memory plan, the runners that prefill (and decode with PyTorch), sampling
parameters, outputs, and `Engine`, the `AsyncEngine` (`api`) over the Rust decode loop. Import the modules
(`mk.engine.engine`; `mk.engine.Engine` loads on first use), so that `import mk` stays light."""


def __getattr__(name: str):
    # `from mk.engine import Engine`, loaded on first use (it brings torch and the runners).
    if name == "Engine":
        from mk.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'mk.engine' has no attribute {name!r}")
