"""Plain PyTorch re-statements of the ops, for comparison (no blocks, no threads, no histograms)."""

from __future__ import annotations

import torch


def accumulate(grad: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The values the selection sees after error feedback, and the number of non-finite sums.
    Updates ``residual`` where the sum is finite."""
    if residual is None:
        finite = torch.isfinite(grad)
        return torch.where(finite, grad, torch.zeros_like(grad)), int((~finite).sum())
    total = residual + grad  # rounded to the dtype, like the kernels
    finite = torch.isfinite(total)
    residual.copy_(torch.where(finite, total, residual))
    return residual.clone(), int((~finite).sum())


def select_threshold(grad, residual, threshold):
    a, _ = accumulate(grad, residual)
    t = torch.tensor(threshold, dtype=torch.float32).to(grad.dtype).float()  # threshold rounded to the dtype
    idx = torch.nonzero(a.float().abs() >= t).flatten()
    if residual is not None:
        residual[idx] = 0
    return idx, a[idx]


def select_topk(grad, residual, k):
    a, _ = accumulate(grad, residual)
    k = min(k, a.numel())
    # Stable sort by descending magnitude: equal magnitudes keep ascending index order.
    order = torch.sort(a.float().abs(), descending=True, stable=True).indices[:k]
    idx = torch.sort(order).values
    if residual is not None:
        residual[idx] = 0
    return idx, a[idx]
