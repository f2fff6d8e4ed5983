import pytest

try:  # (the GPU machine, which runs the GPU tests, may lack hypothesis)
    from hypothesis import settings
except ImportError:
    settings = None
else:
    # The same examples on every run (CI on a clean clone included): a property test finds a new
    # failure when its strategies change, not by chance on someone else's commit.
    settings.register_profile("mk", derandomize=True, database=None)
    settings.load_profile("mk")


def _gpu_ready() -> bool:
    try:
        import torch

        from mk import _native
    except ImportError:
        return False
    return torch.cuda.is_available() and _native.gpu_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a CUDA driver")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server():
    """`python -m mk.server` on the built-in model on the CPU, one per test module
    that asks for it (modules with a server of their own define their own `server`)."""
    from server_util import ServerProcess

    s = ServerProcess("--device", "cpu", "--max-batch", "8", "--max-context", "1024").wait_ready()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    """The official client on that server."""
    import openai  # imported here: the GPU machine, which runs these tests too, lacks it

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each module, hand its GPU memory back: the last failed test's frames (pytest keeps them
    in sys.last_traceback for post-mortem debugging) and reference cycles would otherwise hold its
    tensors through every later module, and on an 80 GB card one failure became dozens. This runs
    after the module's last test, once pytest has dropped that test's fixture values (a module-scoped
    fixture's teardown still sees them, so its model's weights stayed in torch's cache). Memory still
    held after that is a leak, reported with the module that left it."""
    yield
    module = getattr(item, "module", None)
    if nextitem is not None and getattr(nextitem, "module", None) is module:
        return
    import sys

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if total - free > LEFT_HELD_BYTES:
        held = torch.cuda.memory_reserved()
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"{getattr(module, '__name__', item.nodeid)} left {(total - free) / 2**30:.1f} GiB of the card in use "
            f"({held / 2**30:.1f} GiB reserved by torch)"
        )
        if reporter is not None:
            reporter.write_line(f"warning: {message}")
        else:
            sys.stderr.write(f"warning: {message}\n")


# GPU memory in use after a module that is more than a CUDA context and the extension's buffers.
LEFT_HELD_BYTES = 2 << 30
