"""Each TORCH_LIBRARY op against a plain PyTorch reference, its error handling, and opcheck."""

import math
import re
import struct

import pytest
import torch

import gradsparse as gs
from tests.python import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 40_000, 100_003]


def sample(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_select_threshold_matches_reference(dtype, n, with_residual):
    grad = sample(n, dtype, 1)
    residual = sample(n, dtype, 2, 0.5) if with_residual else None
    want_residual = residual.clone() if with_residual else None
    idx, val = gs.select_threshold(grad, residual, 1.3)
    want_idx, want_val = reference.select_threshold(grad, want_residual, 1.3)
    assert torch.equal(idx, want_idx)
    assert torch.equal(val, want_val)
    if with_residual:
        assert torch.equal(residual, want_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [0, 1, 50, 10**6])
def test_select_topk_matches_reference(dtype, n, k):
    grad = sample(n, dtype, 3)
    residual = sample(n, dtype, 4, 0.5)
    want_residual = residual.clone()
    idx, val = gs.select_topk(grad, residual, k)
    want_idx, want_val = reference.select_topk(grad, want_residual, k)
    assert torch.equal(idx, want_idx)
    assert torch.equal(val, want_val)
    assert torch.equal(residual, want_residual)


def test_select_topk_breaks_ties_by_lowest_index():
    grad = torch.ones(100_000)
    idx, _ = gs.select_topk(grad, None, 1000)
    assert torch.equal(idx, torch.arange(1000))


def test_nonfinite_elements_keep_their_residual():
    # A non-finite sum leaves the residual as it was, and the selection sees that old value.
    grad = torch.tensor([1.0, float("nan"), -3.0, float("inf")])
    residual = torch.tensor([0.5, 0.25, 0.0, -1.5])
    idx, val = gs.select_threshold(grad, residual, 1.0)
    assert idx.tolist() == [0, 2, 3]
    assert val.tolist() == [1.5, -3.0, -1.5]
    assert residual.tolist() == [0.0, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_scatter_add_matches_index_add(dtype, index_dtype):
    out = sample(1000, dtype, 5)
    want = out.float().clone()
    idx = torch.randint(0, 1000, (5000,), generator=torch.Generator().manual_seed(6), dtype=index_dtype)
    val = sample(5000, dtype, 7)
    gs.scatter_add_(out, idx, val, 4.0)
    for i, v in zip(idx.tolist(), val.float().tolist(), strict=True):  # sequential float32 reference
        want[i] = (want[i] + torch.tensor(v) / 4.0).to(dtype).float()
    assert torch.equal(out.float(), want)


def test_scatter_add_rejects_out_of_range_without_writing():
    out = torch.zeros(10)
    for bad in ([0, 10], [-1, 3]):
        with pytest.raises(IndexError, match=r"is outside \[0, \d+\), the elements of the tensor it adds into"):
            gs.scatter_add_(out, torch.tensor(bad), torch.ones(2))
        assert torch.equal(out, torch.zeros(10))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dense_size", [0, 5, 100_000, 2**33])
def test_pack_unpack_round_trip(dtype, dense_size):
    count = min(dense_size, 37)
    idx = torch.arange(count, dtype=torch.int64) * max(1, dense_size // max(count, 1))
    idx = idx.clamp(max=max(dense_size - 1, 0))
    idx = torch.unique(idx)
    val = sample(idx.numel(), dtype, 8)
    message = gs.pack(idx, val, dense_size)
    assert message.dtype == torch.uint8
    index_bytes = 4 if dense_size <= 2**32 else 8
    assert (
        message.numel() == 32 + -(-idx.numel() * index_bytes // 8) * 8 + -(-idx.numel() * val.element_size() // 8) * 8
    )
    got_idx, got_val = gs.unpack(message, dtype, dense_size)
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_val, val)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 2, 3, 4, 6])
def test_unpack_reads_a_message_at_any_offset_of_a_byte_buffer(dtype, offset):
    """A message is any 1-D uint8 tensor, for example one received behind a prefix in a larger
    buffer. unpack viewed its indices and values in place and failed there with PyTorch's "must
    be divisible by 4 to view Byte as Int", naming neither the op nor the message."""
    idx = torch.tensor([1, 3, 4])
    val = sample(3, dtype, 9)
    message = gs.pack(idx, val, 5)
    received = torch.cat([torch.zeros(offset, dtype=torch.uint8), message])[offset:]
    assert received.storage_offset() == offset
    got_idx, got_val = gs.unpack(received, dtype, 5)
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_val, val)


def test_unpack_rejects_corrupt_messages():
    message = gs.pack(torch.tensor([1, 3, 4]), torch.tensor([1.0, 2.0, 3.0]), 5)
    cases = {
        "bad magic": (0, 0),
        "version": (4, 9),
        "dense size": (8, 9),
        "count": (16, 200),
    }
    for what, (offset, value) in cases.items():
        bad = message.clone()
        bad[offset] = value
        with pytest.raises(IndexError):
            gs.unpack(bad, torch.float32, 5)
        assert what
    # the caller's argument, named as such (it said "the bucket is float16", as an IndexError)
    with pytest.raises(TypeError, match=r"gradsparse.unpack: the message carries float32 values, but "
                       r"dtype=torch.float16 was passed; pass dtype=torch.float32"):  # fmt: skip
        gs.unpack(message, torch.float16, 5)
    with pytest.raises(IndexError, match="shorter than its 32-byte header"):
        gs.unpack(message[:20], torch.float32, 5)
    bad = message.clone()
    bad[32 + 4] = 9  # second index -> 9 (out of range)
    with pytest.raises(IndexError, match="indices must lie in"):
        gs.unpack(bad, torch.float32, 5)


@pytest.mark.parametrize("index_bytes, count", [(8, 2**62), (4, 2**62)])
def test_unpack_rejects_a_count_whose_size_wraps_around_64_bits(index_bytes, count):
    """The length check computed count * width in 64 bits: a 32-byte header claiming 2^62 pairs
    (for a dense_size that large) laid out in 32 bytes, passed, and unpacked as no pairs at all."""
    header = struct.pack("<IBBBBQQQ", 0x4D505347, 1, 0, index_bytes, 0, 2**63 - 1, count, 0)
    message = torch.tensor(list(header) + [0] * 32, dtype=torch.uint8)
    with pytest.raises(IndexError, match=f"claims {count} pairs .* but only 64 bytes arrived"):
        gs.unpack(message, torch.float32, 2**63 - 1)


def test_pack_rejects_unsorted_or_out_of_range_indices():
    with pytest.raises(IndexError, match=r"strictly ascending .*, but position 2 holds 2 after 4; sort the pairs"):
        gs.pack(torch.tensor([1, 4, 2]), torch.ones(3), 5)
    with pytest.raises(IndexError, match=r"position 1 holds 3 after 3; .* add up the values of a repeated index"):
        gs.pack(torch.tensor([3, 3]), torch.ones(2), 5)
    with pytest.raises(IndexError, match="lie in"):
        gs.pack(torch.tensor([1, 5]), torch.ones(2), 5)


@pytest.mark.parametrize("kind", ["residual", "velocity"])
def test_thread_group_refuses_a_residual_or_velocity_that_is_not_contiguous(kind):
    """ThreadGroup.reduce (gradsparse.testing's thread ranks) checked only the gradient's layout
    and read a strided residual or velocity as if it were contiguous, so the step's error feedback
    landed in other elements of its storage."""
    group = gs._C.ThreadGroup(1)
    strided = torch.zeros(8, 2)[:, 0]
    residual, velocity = (strided, None) if kind == "residual" else (torch.zeros(8), strided)
    with pytest.raises(
        ValueError, match=rf"gradsparse: {kind} must be contiguous, got strides \[2\]; pass a contiguous {kind}"
    ):
        group.reduce(0, torch.arange(8.0), residual, gs._C.TopK(0.25, "gather"), velocity=velocity, momentum=0.9)
    assert not strided.any()


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 1e300, -1.0, 0.0, 1e-4])
def test_thread_group_refuses_a_timeout_it_cannot_wait(timeout):
    """ThreadGroup (gradsparse.testing.thread_ranks.run_steps's timeout) converted the seconds to
    milliseconds unchecked: inf (as for "no timeout"), NaN or a huge timeout became a negative wait,
    and a step failed at once with "waited -9223372036854775808 ms for the other ranks"; one under
    a millisecond waited 0 ms."""
    with pytest.raises(
        ValueError,
        match=re.escape("ThreadGroup: timeout_seconds must be a positive number of seconds, from 0.001 (")
        + r".* to 4611686018 \(146 years\), got "
        + re.escape(f"{timeout:g}; for example timeout_seconds=60"),
    ):
        gs._C.ThreadGroup(2, timeout)
    assert gs._C.ThreadGroup(2, 0.001) is not None


@pytest.mark.parametrize("divisor", [1e-300, -1e-50, 1e39, -3.5e38, 0.0, math.inf, math.nan])
def test_scatter_add_refuses_a_divisor_that_float32_cannot_hold(divisor):  # 0, Inf and NaN too
    """The kernels divide in float32. A divisor finite in float64 but 0 or Inf in float32 passed
    the check: a tiny one failed in the kernel with "divisor must be non-zero", which the divisor
    given was not, and a huge one added zeros where it should have added the values divided."""
    out = torch.zeros(3)
    with pytest.raises(
        ValueError, match=re.escape(f"divisor must be finite and non-zero in float32, got {divisor:g};")
    ):
        gs.scatter_add_(out, torch.tensor([1]), torch.tensor([1e30]), divisor)
    assert not out.any()


def test_ops_reject_bad_arguments():
    with pytest.raises(TypeError, match="grad must be float32, float16 or bfloat16"):
        gs.select_topk(torch.ones(4, dtype=torch.int64), None, 1)
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        gs.select_threshold(torch.ones(4), None, -1.0)
    with pytest.raises(ValueError, match="k must be >= 0"):
        gs.select_topk(torch.ones(4), None, -2)
    with pytest.raises(ValueError, match="same number of elements"):
        gs.select_topk(torch.ones(4), torch.zeros(3), 1)
    with pytest.raises(TypeError, match="same dtype"):
        gs.select_topk(torch.ones(4), torch.zeros(4, dtype=torch.float16), 1)
    with pytest.raises(ValueError, match="contiguous"):
        gs.select_topk(torch.ones(4, 2).t().reshape(-1)[::2], None, 1)
    with pytest.raises(ValueError, match="divisor"):
        gs.scatter_add_(torch.zeros(3), torch.tensor([0]), torch.ones(1), 0.0)


def test_scatter_add_names_the_argument_and_the_fix():
    """scatter_add_'s refusals of a strided indices or values tensor said only that "indices and
    values must be contiguous", naming neither which one nor what to do, and values of another
    dtype than out got no way out."""
    out = torch.zeros(5)
    strided = torch.tensor([1, 0, 2, 0])[::2]
    with pytest.raises(ValueError, match=r"scatter_add_: indices must be contiguous, got strides \[2\]; call \.contig"):
        gs.scatter_add_(out, strided, torch.ones(2))
    with pytest.raises(ValueError, match=r"scatter_add_: values must be contiguous, got strides \[2\]; call \.contig"):
        gs.scatter_add_(out, torch.tensor([1, 2]), torch.ones(4)[::2])
    with pytest.raises(TypeError, match=r"values are Half but out is Float; .*pass values\.to\(out\.dtype\)"):
        gs.scatter_add_(out, torch.tensor([1]), torch.ones(1, dtype=torch.float16))
    assert not out.any()


def _opcheck_samples():
    grad = sample(5000, torch.float32, 9)
    yield torch.ops.gradsparse.select_threshold.default, (grad, sample(5000, torch.float32, 10), 1.0)
    yield torch.ops.gradsparse.select_threshold.default, (grad.half(), None, 0.5)
    yield torch.ops.gradsparse.select_topk.default, (grad, sample(5000, torch.float32, 11), 20)
    yield torch.ops.gradsparse.select_topk.default, (grad.bfloat16(), None, 7)
    yield torch.ops.gradsparse.scatter_add_.default, (torch.zeros(50), torch.tensor([1, 1, 49]), torch.ones(3), 2.0)
    idx = torch.tensor([2, 5, 9])
    yield torch.ops.gradsparse.pack.default, (idx, torch.ones(3), 10)
    yield torch.ops.gradsparse.pack.default, (idx.int(), torch.ones(3, dtype=torch.float16), 2**33)
    yield torch.ops.gradsparse.pack.default, (idx[:0], torch.ones(0, dtype=torch.bfloat16), 0)
    yield torch.ops.gradsparse.unpack.default, (gs.pack(idx, torch.ones(3), 10), torch.float32, 10)


@pytest.mark.parametrize("op,args", list(_opcheck_samples()), ids=lambda x: str(x)[:40])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def _compress_and_add(grad, residual, k, out, divisor):
    """What a training loop compressing its own gradients runs: select, pack, unpack, add."""
    indices, values = gs.select_topk(grad, residual, k)
    message = gs.pack(indices, values, grad.numel())
    got_indices, got_values = gs.unpack(message, grad.dtype, grad.numel())
    gs.scatter_add_(out, got_indices, got_values, divisor)
    above, above_values = gs.select_threshold(grad, residual, 0.5)
    return message, above, above_values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_ops_compile_with_fullgraph_and_match_eager(dtype, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(_compress_and_add, fullgraph=True, dynamic=dynamic)
    for n, k in [(1000, 10), (3000, 31), (5003, 7)]:
        grad, residual, out = sample(n, dtype, 12), sample(n, dtype, 13, 0.5), sample(n, dtype, 14)
        eager_residual, eager_out = residual.clone(), out.clone()
        got = compiled(grad, residual, k, out, 2.0)
        want = _compress_and_add(grad, eager_residual, k, eager_out, 2.0)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert torch.equal(residual, eager_residual)
        assert torch.equal(out, eager_out)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_compiled_function_can_use_the_size_of_a_packed_message(dynamic):
    """pack's fake kernel gave the message a data-dependent size, though the size follows from the
    arguments, so a compiled function that looked at it (to cut it, to size a receive buffer)
    failed to trace with "Could not guard on data-dependent expression u0 > 64"."""

    def first_bytes(grad, k):
        indices, values = gs.select_topk(grad, None, k)
        message = gs.pack(indices, values, grad.numel())
        if message.numel() > 64:
            return message[:64]
        return message

    torch._dynamo.reset()
    compiled = torch.compile(first_bytes, fullgraph=True, dynamic=dynamic)
    for n, k, dtype in [(1000, 3, torch.float32), (1000, 10, torch.float16), (2000, 20, torch.bfloat16)]:
        grad = sample(n, dtype, 15)
        assert torch.equal(compiled(grad, k), first_bytes(grad, k))


@pytest.mark.parametrize("dynamic", [False, True])
def test_select_topk_refuses_a_negative_k_under_torch_compile_as_in_eager(dynamic):
    """select_topk's fake kernel made an empty of size k for a negative k, so torch.compile failed
    with PyTorch's "Trying to create tensor with negative dimension -1" instead of the op's error."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda grad, k: gs.select_topk(grad, None, k), fullgraph=True, dynamic=dynamic)
    assert compiled(torch.ones(10), 3)[0].tolist() == [0, 1, 2]
    for k in (-1, -5):
        with pytest.raises(
            ValueError, match=f"gradsparse.select_topk: k must be >= 0, got {k}; pass the number of elements"
        ):
            compiled(torch.ones(10), k)


def test_a_threshold_near_float32s_largest_value_still_selects():
    """A threshold between 3.0e38 and the largest float32 selected nothing, as if it were +inf;
    only one that rounds to +inf in float32 selects nothing (ruling 8: the threshold in the dtype)."""
    grad = torch.tensor([3.3e38, 1.0, -3.39e38])
    assert gs.select_threshold(grad, None, 3.1e38)[0].tolist() == [0, 2]
    assert gs.select_threshold(grad, None, torch.finfo(torch.float32).max)[0].tolist() == []
    assert gs.select_threshold(grad, None, 3.5e38)[0].tolist() == []  # rounds to +inf


@pytest.mark.parametrize("threshold", [math.inf, -math.inf, math.nan, -1.0])
def test_select_threshold_refuses_what_is_no_magnitude_naming_the_fix(threshold):
    """An infinite or NaN threshold is refused, before the residual takes the gradient (one that
    only float32 rounds to +inf selects nothing, above); the refusal named no fix."""
    grad, residual = torch.tensor([1.0, -2.0]), torch.zeros(2)
    with pytest.raises(ValueError, match=re.escape(f"threshold must be a finite number >= 0, got {threshold:g}; pass")):
        gs.select_threshold(grad, residual, threshold)
    assert not residual.any()


def test_scatter_add_refuses_values_or_indices_that_share_memory_with_out():
    """A values tensor that was a view of out read what the kernel had already written: the sums
    depended on the order of the writes, where torch's index_add_ refuses such arguments."""
    out = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    with pytest.raises(ValueError, match=r"scatter_add_: values shares memory with out, .*pass values\.clone\(\)"):
        gs.scatter_add_(out, torch.tensor([1, 2]), out[1:3])
    same = out.view(torch.int32)[:2]  # the same bytes as indices
    with pytest.raises(ValueError, match=r"scatter_add_: indices shares memory with out, .*pass indices\.clone\(\)"):
        gs.scatter_add_(out, same, torch.ones(2))
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    gs.scatter_add_(out, torch.tensor([1, 2]), out[1:3].clone())
    assert out.tolist() == [1.0, 4.0, 6.0, 4.0, 5.0]


def test_a_backward_through_the_ops_raises():
    """The ops have no derivative: a backward through a selection's values passed with only
    PyTorch's warning, and the gradient silently stopped there."""
    grad = torch.randn(100, requires_grad=True)
    _, values = gs.select_topk(grad, None, 5)
    with pytest.raises(RuntimeError, match="derivative for gradsparse::select_topk is not implemented"):
        values.sum().backward()
    _, values = gs.select_threshold(grad, None, 0.5)
    with pytest.raises(RuntimeError, match="derivative for gradsparse::select_threshold is not implemented"):
        values.sum().backward()


def test_tensors_the_ops_write_or_add_in_are_refused_where_they_require_grad():
    """A residual that requires grad (not a leaf, which torch refuses) was rewritten with its old
    history kept, and values that required grad were added into out with none: the gradients came
    out wrong, without an error. Under torch.no_grad() they are taken."""
    w = torch.ones(4, requires_grad=True)
    residual = w * 1.0
    with pytest.raises(RuntimeError, match=r"gradsparse.select_topk: residual requires grad, .* Pass "
                       r"residual.detach\(\), or call it under torch.no_grad\(\)"):  # fmt: skip
        gs.select_topk(torch.ones(4), residual, 1)
    with pytest.raises(RuntimeError, match=r"gradsparse\.select_threshold: residual requires grad"):
        gs.select_threshold(torch.ones(4), residual, 0.5)
    with pytest.raises(RuntimeError, match=r"gradsparse\.scatter_add_: values requires grad"):
        gs.scatter_add_(torch.zeros(4), torch.tensor([0]), w[:1] * 2.0)
    with pytest.raises(RuntimeError, match=r"gradsparse\.scatter_add_: out requires grad"):
        gs.scatter_add_(w * 1.0, torch.tensor([0]), torch.ones(1))
    with torch.no_grad():
        gs.select_topk(torch.ones(4), residual, 1)
        out = torch.zeros(4)
        gs.scatter_add_(out, torch.tensor([2]), w[:1] * 2.0)
    assert out.tolist() == [0.0, 0.0, 2.0, 0.0]


def test_a_residual_that_is_grad_under_another_shape_is_taken_as_grad_itself():
    """grad.view(2, 3) and grad cover the same elements, which the kernels read flat: it was
    refused as a residual that "partly overlaps grad"."""
    for op, arg in ((gs.select_threshold, 0.5), (gs.select_topk, 2)):
        base = torch.tensor([0.1, -2.0, 0.3, 1.0, -0.2, 0.05])
        same = base.clone()
        expected = op(same, same, arg)
        got = op(base.view(2, 3), base, arg)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert torch.equal(base, same)


def test_sizes_from_a_dynamic_shape_compile_once():
    """k and dense_size were ints in the ops' schemas, so torch.compile(dynamic=True) fixed each to
    the value it saw and compiled again for every bucket size."""
    from torch._dynamo.testing import CompileCounter

    def compress(grad):
        indices, values = gs.select_topk(grad, None, grad.numel() // 10)
        return gs.unpack(gs.pack(indices, values, grad.numel()), grad.dtype, grad.numel())

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(compress, backend=counter, fullgraph=True, dynamic=True)
    for n in (100, 250, 400, 1000):
        grad = sample(n, torch.float32, 16)
        for got, want in zip(compiled(grad), compress(grad), strict=True):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "call,error,message",
    [  # the shared argument checks said "gradsparse: ...", the core's errors named no op
        (lambda: gs.select_topk(torch.ones(10)[::2], None, 2), ValueError,
         r"gradsparse\.select_topk: grad must be contiguous, got strides \[2\]; pass a contiguous grad"),
        (lambda: gs.select_threshold(torch.ones(4, dtype=torch.int64), None, 1.0), TypeError,
         r"gradsparse\.select_threshold: grad must be float32, float16 or bfloat16, got Long"),
        (lambda: gs.select_topk(torch.ones(4), torch.zeros(3), 1), ValueError,
         r"gradsparse\.select_topk: grad has 4 elements but residual has 3"),
        (lambda: gs.scatter_add_(torch.zeros(5), torch.tensor([7]), torch.ones(1)), IndexError,
         r"gradsparse\.scatter_add_: sparse index 7 at position 0 is outside \[0, 5\), the elements of the tensor it "),
        (lambda: gs.unpack(gs.pack(torch.tensor([1, 2]), torch.ones(2), 9), torch.float32, 5), IndexError,
         r"gradsparse\.unpack: sparse message is for a bucket of 9 elements but the receiving bucket has 5"),
        (lambda: gs.unpack(torch.zeros(10, dtype=torch.uint8), torch.float32, 5), IndexError,
         r"gradsparse\.unpack: sparse message is 10 bytes, shorter than its 32-byte header"),
        (lambda: gs.pack(torch.tensor([2, 1]), torch.ones(2), 9), IndexError,
         r"gradsparse\.pack: indices must be strictly ascending"),
        # PyTorch's dispatcher refused these without the wrapper's name or a fix, or took a bool
        (lambda: gs.select_topk(torch.ones(10), None, 0.01 * 10), TypeError,
         r"gradsparse\.select_topk: k must be a 64-bit int, got 0\.1 \(float\); pass the count to select"),
        (lambda: gs.select_topk(torch.ones(10), None, True), TypeError,
         r"gradsparse\.select_topk: k must be a 64-bit int, got True \(bool\)"),
        (lambda: gs.select_threshold(torch.ones(4), None, "1"), TypeError,
         r"gradsparse\.select_threshold: threshold must be a number, got '1' \(str\)"),
        (lambda: gs.scatter_add_(torch.zeros(5), torch.tensor([1]), torch.ones(1), None), TypeError,
         r"gradsparse\.scatter_add_: divisor must be a number, got None \(NoneType\)"),
        # an int past float's range: the dispatcher's RuntimeError "Expected a value of type 'float'"
        (lambda: gs.select_threshold(torch.ones(4), None, 10**400), ValueError,
         r"gradsparse\.select_threshold: threshold must be a finite number, got 10{400} \(int\); pass the magnitude"),
        (lambda: gs.scatter_add_(torch.zeros(5), torch.tensor([1]), torch.ones(1), -(10**400)), ValueError,
         r"gradsparse\.scatter_add_: divisor must be a finite number, got -10{400} \(int\); pass the number of ranks"),
        (lambda: gs.pack(torch.tensor([1]), torch.ones(1), 9.0), TypeError,
         r"gradsparse\.pack: dense_size must be a 64-bit int, got 9\.0 \(float\)"),
        # a meta tensor among others ran the fake kernel: uninitialised pairs, nothing written
        (lambda: gs.select_topk(torch.ones(10), torch.zeros(10, device="meta"), 3), ValueError,
         r"gradsparse\.select_topk: grad is on cpu, residual is on meta; put them on one device"),
        (lambda: gs.scatter_add_(torch.zeros(5), torch.tensor([7], device="meta"), torch.ones(1)), ValueError,
         r"gradsparse\.scatter_add_: out is on cpu, indices is on meta, values is on cpu; put them on one device"),
        (lambda: gs.unpack(gs.pack(torch.tensor([1]), torch.ones(1), 9), "float32", 9), TypeError,
         r"gradsparse\.unpack: dtype must be a torch\.dtype, got 'float32' \(str\); e\.g\. torch\.float32"),
    ],
)  # fmt: skip
def test_every_error_of_an_op_names_the_op(call, error, message):
    with pytest.raises(error, match="^" + message):
        call()


@pytest.mark.parametrize("op,arg", [(gs.select_threshold, 100.0), (gs.select_topk, 2)])
def test_selection_refuses_a_residual_that_partly_overlaps_grad(op, arg):
    """A residual that is a shifted view of the same storage as grad (residual = buf[1:], grad =
    buf[:-1]) read grad values the kernel had already written into the residual: residual +=
    grad gave the running sums [2, 3, 4, ...] where the elementwise sums [2, 2, 2, ...] were due,
    and what was selected depended on the kernel's order of writes. torch's own in-place ops
    (residual.add_(grad)) refuse such arguments, as scatter_add_ here refuses values that share
    memory with out."""
    buf = torch.ones(9)
    message = r"gradsparse\.select_\w+: residual partly overlaps grad in memory, .*grad\.clone\(\)"
    with pytest.raises(ValueError, match=message):
        op(buf[:-1], buf[1:], arg)
    assert buf.tolist() == [1.0] * 9
    # a residual apart from grad is taken
    grad = buf[:-1].clone()
    op(grad, buf[1:], arg)
    assert buf[1:].tolist() == ([2.0] * 8 if op is gs.select_threshold else [0.0] * 2 + [2.0] * 6)


@pytest.mark.parametrize("op", ["scatter_add_", "select_topk", "select_threshold"])
def test_an_op_bumps_the_version_of_the_tensor_it_writes(op):
    """The ops wrote into out or the residual without bumping its version counter (PyTorch's
    autograd fallback bumps only the written tensors an op returns, and these return none), so a
    backward through a value autograd had saved before the write took the new values, silently,
    where torch's own in-place ops (written.add_) make it raise."""
    weight = torch.ones(4, requires_grad=True)
    written = torch.tensor([1.0, -2.0, 3.0, 0.5])
    loss = (weight * written).sum()  # saves written for weight's gradient
    version = written._version
    if op == "scatter_add_":
        gs.scatter_add_(written, torch.tensor([1]), torch.ones(1))
    elif op == "select_topk":
        gs.select_topk(torch.ones(4), written, 2)
    else:
        gs.select_threshold(torch.ones(4), written, 2.5)
    assert not torch.equal(written, torch.tensor([1.0, -2.0, 3.0, 0.5]))
    assert written._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert weight.grad is None


@pytest.mark.parametrize("dense_size", [10, 2**33])
@pytest.mark.parametrize(
    "indices,values",
    [
        (torch.tensor([3, 9], dtype=torch.int32)[::2], torch.tensor([5.0, 7.0])[::2]),
        (torch.tensor(3).expand(1), torch.tensor(5.0).expand(1)),
    ],
    ids=["every-other", "expanded"],
)
def test_pack_takes_one_pair_of_any_stride(indices, values, dense_size):
    """contiguous() keeps a one-element tensor as it is, with its stride (2 for x[::2], 0 for an
    expanded scalar), and pack then failed with PyTorch's "self.stride(-1) must be 1 to view
    Float as Byte", naming neither the op nor the argument."""
    assert indices.stride() != (1,) and values.stride() != (1,)
    message = gs.pack(indices, values, dense_size)
    got_indices, got_values = gs.unpack(message, torch.float32, dense_size)
    assert got_indices.tolist() == [3]
    assert got_values.tolist() == [5.0]


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda written: gs.scatter_add_(written, torch.tensor([1]), torch.ones(1)), "out"),
        (lambda written: gs.select_topk(torch.ones(4), written, 2), "residual"),
        (lambda written: gs.select_threshold(torch.ones(4), written, 2.0), "residual"),
    ],
    ids=["scatter_add_", "select_topk", "select_threshold"],
)
def test_refusing_a_strided_tensor_it_writes_names_a_fix_that_keeps_the_writes(call, name):
    """A strided out or residual was refused with "call .contiguous() first": the call then ran
    on the copy .contiguous() made, and the tensor passed kept its old values (the added pairs,
    the error feedback silently lost)."""
    buffer = torch.zeros(4, 2)
    written = buffer[:, 0]
    with pytest.raises(
        ValueError, match=rf"{name} must be contiguous, got strides \[2\]; pass a contiguous {name}"
    ) as err:
        call(written)
    assert "call .contiguous() first" not in str(err.value)
    assert f"copy_ that copy back into {name} after it" in str(err.value)
    # the fix the message names keeps the writes
    dense = written.contiguous()
    call(dense)
    written.copy_(dense)
    assert buffer[:, 0].any()
    assert not buffer[:, 1].any()
