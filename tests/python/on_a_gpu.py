"""The marks of a test that runs on a GPU: `cuda` (scripts/gpu_check.sh runs `pytest -m cuda`), and
a skip where there is no CUDA device or gradsparse was built without CUDA."""

import pytest
import torch

import gradsparse as gs

ON_A_GPU = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not gs.built_with_cuda(), reason="gradsparse was built without CUDA (GRADSPARSE_CUDA=1)"),
]
