import pytest


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
