"""The standalone norm kernel: argument checks on any machine, numerics on the GPU."""

import pytest
import torch

from mk import _native, ops


def reference_add_rmsnorm(x, delta, gamma, eps):
    """float64 oracle of the fused kernel; returns (new residual, normed output)."""
    v = x.double() + (delta.double() if delta is not None else 0)
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    return v, y


def test_cpu_tensors_are_refused_with_a_reason():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        ops.add_rmsnorm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)


def test_native_reports_missing_gpu_clearly():
    if _native.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(_native.GpuError, match="driver"):
        _native.add_rmsnorm(0, 0, 1, 0, 1, 1, 1, 64, 1e-6)


def test_build_info_names_the_hopper_target():
    info = _native.build_info()
    assert "sm_90a" in info["gencode"]
    assert info["cubins"]["kernels"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim", [(1, 2048), (3, 2048), (8, 2048), (5, 128), (2, 8192), (7, 4104)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm_matches_float64(rows, dim, with_delta):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(torch.seed() % 2**31)
    x = torch.randn(rows, dim, device=dev, generator=g).mul(3).bfloat16()
    delta = torch.randn(rows, dim, device=dev, generator=g).bfloat16() if with_delta else None
    gamma = (1 + 0.5 * torch.randn(dim, device=dev, generator=g)).bfloat16()
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    ops.add_rmsnorm(x, gamma, 1e-6, delta=delta, out=out)
    torch.cuda.synchronize()

    v, y = reference_add_rmsnorm(x_before, delta, gamma, 1e-6)
    assert not out.isnan().any(), "kernel left elements unwritten"
    rel = (out.double() - y).norm() / y.norm()
    assert rel < 4e-3, f"relative error {rel:.2e}"
    # The residual is rounded once from the fp32 sum, exactly as PyTorch rounds it.
    expected_x = v.float().bfloat16() if with_delta else x_before
    assert torch.equal(x, expected_x)


@pytest.mark.gpu
def test_add_rmsnorm_runs_on_the_current_stream():
    """The input is only ready late on a side stream; a launch anywhere else would read stale data."""
    dev = torch.device("cuda")
    fresh = torch.randn(4, 2048, device=dev).bfloat16()
    gamma = torch.randn(2048, device=dev).bfloat16()
    x = torch.full_like(fresh, float("nan"))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy for tens of milliseconds
        x.copy_(fresh)
        out = ops.add_rmsnorm(x, gamma, 1e-6)
    s.synchronize()
    _, y = reference_add_rmsnorm(fresh, None, gamma, 1e-6)
    assert not out.isnan().any()
    assert (out.double() - y).norm() / y.norm() < 4e-3


def test_gemv_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensors"):
        ops.gemv(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(16, 256, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 9, 16, 23, 32, 64])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (1536, 2048), (2048, 768), (48, 256), (32, 96)])
def test_gemv_matches_float64(batch, n, k):
    dev = torch.device("cuda")
    x = torch.randn(batch, k, device=dev).bfloat16()
    w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
    out = torch.full((batch, n), float("nan"), dtype=torch.bfloat16, device=dev)
    ops.gemv(x, w, out=out)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T
    assert not out.isnan().any(), "unwritten outputs"
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 5e-3, f"relative error {rel:.2e}"


@pytest.mark.gpu
def test_gemv_bad_shape_is_a_value_error():
    x = torch.randn(2, 100, device="cuda").bfloat16()
    w = torch.randn(16, 100, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="k % 32"):
        ops.gemv(x, w)
