"""The CUDA paths against the CPU ones: the fused ops on CUDA tensors give the CPU's pairs and
residuals bit for bit, the DDP hook trains every method with CUDA buckets over Gloo (two ranks
sharing one GPU) and over NCCL (one rank). Marked `cuda`: they need a GPU and a gradsparse built
with CUDA (scripts/gpu_check.sh runs them); elsewhere they skip."""

import pytest
import torch

import gradsparse as gs
from gradsparse.testing import run_distributed
from tests.distributed import workers
from tests.python.on_a_gpu import ON_A_GPU

pytestmark = ON_A_GPU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 1000, 100_003]


def inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, generator=g).to(dtype), (0.5 * torch.randn(n, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["threshold", "topk"])
def test_selection_matches_the_cpu(op, n, dtype):
    grad, residual = inputs(n, dtype)
    on_gpu = residual.cuda()
    if op == "threshold":
        cpu = gs.select_threshold(grad, residual, 1.5)
        gpu = gs.select_threshold(grad.cuda(), on_gpu, 1.5)
    else:
        cpu = gs.select_topk(grad, residual, n // 50 + 1)
        gpu = gs.select_topk(grad.cuda(), on_gpu, n // 50 + 1)
    assert cpu[0].numel() > 0 or n == 1
    for a, b in zip(gpu, cpu, strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)
    assert torch.equal(on_gpu.cpu(), residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_scatter_add_matches_the_cpu(dtype, index_dtype):
    g = torch.Generator().manual_seed(3)
    indices = torch.randint(0, 5000, (20_000,), generator=g).to(index_dtype)  # with duplicates
    values = torch.randn(20_000, generator=g).to(dtype)
    cpu = torch.zeros(5000, dtype=dtype)
    gpu = cpu.cuda()
    gs.scatter_add_(cpu, indices, values, 2.0)
    gs.scatter_add_(gpu, indices.cuda(), values.cuda(), 2.0)
    # Duplicates are summed in another order (atomics, in the dtype) on the GPU: both equal the
    # exact sum up to the dtype's rounding of about four additions.
    expected = torch.zeros(5000, dtype=torch.float64).index_add_(0, indices.long(), values.double() / 2)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(gpu.cpu().double(), expected, **tolerance)
    torch.testing.assert_close(cpu.double(), expected, **tolerance)


def test_scatter_add_rejects_an_index_out_of_range_without_writing():
    out = torch.full((4,), 7.0, device="cuda")
    with pytest.raises(IndexError):
        gs.scatter_add_(out, torch.tensor([1, 4], device="cuda"), torch.ones(2, device="cuda"))
    assert torch.equal(out.cpu(), torch.full((4,), 7.0))


@pytest.mark.parametrize("op", ["threshold", "topk"])
def test_selection_checks_its_arguments_in_the_cpu_order(op):
    """A call wrong in two ways raises the CPU's error on CUDA too: the dtype first, then the
    threshold or k."""
    errors = []
    for device in ["cpu", "cuda"]:
        grad = torch.ones(3, dtype=torch.int32, device=device)
        with pytest.raises(Exception) as raised:
            gs.select_threshold(grad, None, -1.0) if op == "threshold" else gs.select_topk(grad, None, -1)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0][0] is TypeError and "float32" in errors[0][1]
    assert errors[1] == errors[0]


# Longer than pyproject's 600 s: run_distributed's own timeout (900 s) must be the one that ends them.
@pytest.mark.timeout(1000)
@pytest.mark.distributed
def test_every_method_trains_on_cuda_over_gloo():
    """Two ranks share GPU 0; buckets, residuals and messages are CUDA tensors, Gloo moves them."""
    workers.assert_every_method_trains(run_distributed(workers.train_every_method, 2, 150, "cuda", timeout=900))


@pytest.mark.timeout(1000)
@pytest.mark.distributed
def test_every_method_trains_on_cuda_over_nccl():
    workers.assert_every_method_trains(
        run_distributed(workers.train_every_method, 1, 150, "cuda", backend="nccl", timeout=900)
    )
