"""What the native module says about its GPU side on any machine: the build target, and a clear
error (not a crash) when a launch is asked for without a GPU."""

import pytest

from mk import _native


def test_build_info_names_the_hopper_target_and_the_embedded_megakernel():
    info = _native.build_info()
    assert "sm_90a" in info["gencode"]
    assert set(info["cubins"]) == {"abi_probe", "megakernel"}
    assert info["cubins"]["megakernel"] > 0
    # The build variant's nvcc defines (the device scripts compile source kernels with them) agree
    # with what the host was built for.
    assert ("-DMK_STEP_MAX_BATCH=16" in info["defines"]) == (_native.STEP_MAX_BATCH == 16)
    assert set(info["defines"]) <= {"-DMK_STEP_MAX_BATCH=16", "-DMK_WEIGHT_SWIZZLE=1"}


def test_a_launch_without_a_gpu_is_a_clear_error():
    if _native.gpu_available():
        pytest.skip("a GPU is present")
    _, size = _native.step_args_layout()
    with pytest.raises(_native.GpuError, match="driver|does not exist"):
        _native.decode_step(0, 0, bytes(size), 1)
