"""Checkpoints of gradsparse states on 2 Gloo ranks: exact resume with no extra iteration, each rank
restoring its own residuals."""

import pytest
import torch

from gradsparse.testing import run_distributed
from tests.distributed import workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("method", sorted(workers.RESUME_METHODS))
def test_resume_is_exact_without_a_settle_iteration(tmp_path, method):
    """Stopped after 4 steps and resumed in a new DDP (which starts in its first-step bucket layout,
    not the saved run's), the parameters after 8 steps equal an uninterrupted run's, bit for bit."""
    results = run_distributed(workers.resume_exactly, 2, method, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        # the case at hand: DDP hands the resumed run's first step over in another layout
        assert r["first_step_buckets"] != r["saved_layout"], f"rank {rank}: the layouts coincide"
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {method} resumed differs from straight by {(a - b).abs().max()}"
    # residuals are per rank: the two ranks saved different ones
    assert results[0]["residual_norms"] != results[1]["residual_norms"]
