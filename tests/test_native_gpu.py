"""What the native module says about its GPU side on any machine: the build target, and a clear
error (not a crash) when a launch is asked for without a GPU."""

import pytest

from mk import _native


def test_build_info_names_the_hopper_target_and_the_embedded_megakernel():
    info = _native.build_info()
    assert "sm_90a" in info["gencode"]
    assert set(info["defines"]) <= {"-DMK_WEIGHT_SWIZZLE=1"}
    swizzled = "-DMK_WEIGHT_SWIZZLE=1" in info["defines"]
    # The megakernel's narrow image (1-8 rows a launch) and its wide one (9-16), which the swizzled
    # variant lacks; the host's rows per launch agree.
    assert set(info["cubins"]) == {"abi_probe", "megakernel"} | (set() if swizzled else {"megakernel_wide"})
    assert all(size > 0 for size in info["cubins"].values())
    assert _native.STEP_MAX_ROWS == (8 if swizzled else 16)


def test_a_launch_without_a_gpu_is_a_clear_error():
    if _native.gpu_available():
        pytest.skip("a GPU is present")
    _, size = _native.step_args_layout()
    with pytest.raises(_native.GpuError, match="driver|does not exist"):
        _native.decode_step(0, 0, bytes(size), 1)
