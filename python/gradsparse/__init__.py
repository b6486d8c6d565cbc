"""gradsparse: gradient sparsification with error feedback for PyTorch DDP.

>>> import gradsparse as gs
>>> state = gs.register(ddp_model, gs.TopK(density=0.01))
"""

import importlib

import torch  # loads libtorch, which _C links against


def _check_torch() -> None:
    """_C is tied to the torch it was compiled against: on another one it would fail to load with
    an undefined symbol, or worse. Say which two and how to rebuild instead."""
    try:
        from gradsparse._build import TORCH_VERSION
    except ImportError:  # a source tree that was never built: importing _C says so
        return
    if torch.__version__ != TORCH_VERSION:
        raise ImportError(
            f"gradsparse was built against torch {TORCH_VERSION} but torch {torch.__version__} is installed; "
            "rebuild it against this torch, from the gradsparse source folder: "
            "pip install --no-build-isolation --no-deps --force-reinstall .  (or bash scripts/setup.sh)"
        )


_check_torch()


#: The most threads the CPU kernels take (set_num_threads, GRADSPARSE_NUM_THREADS).
MAX_THREADS = 4096


def _check_environment() -> None:
    """The CPU kernels read GRADSPARSE_SIMD and GRADSPARSE_NUM_THREADS once, deep inside a step,
    where a typo would pass unnoticed: refuse one here, on every rank that imports gradsparse."""
    import os

    simd = os.environ.get("GRADSPARSE_SIMD", "")
    if simd not in ("", "0", "1", "avx2"):
        raise ValueError(
            f"GRADSPARSE_SIMD={simd!r} is not a choice of the CPU kernels' paths: set it to 1 (the widest "
            "the CPU has, the default), avx2 (no AVX-512) or 0 (portable code only), or unset it"
        )
    threads = os.environ.get("GRADSPARSE_NUM_THREADS", "")
    digits = threads.strip(" ")  # ASCII digits only: the kernels' reader takes no others ('٤'), int() not all ('²')
    if threads and not (digits.isascii() and digits.isdigit() and 1 <= int(digits) <= MAX_THREADS):
        raise ValueError(
            f"GRADSPARSE_NUM_THREADS={threads!r} is not a whole number of threads from 1 to {MAX_THREADS} for the CPU "
            "kernels: set it to, for example, 2, or unset it for OpenMP's default"
        )


_check_environment()

from gradsparse import _C, fsdp, launch  # noqa: E402
from gradsparse.checkpoint import AllRanks, reshard  # noqa: E402
from gradsparse.fsdp import ShardedState  # noqa: E402
from gradsparse.hooks import hook, register  # noqa: E402
from gradsparse.methods import (  # noqa: E402
    DGC,
    METHODS,
    SAGE,
    Dense,
    ExDyna,
    GaussianK,
    MiCRO,
    RandomBlock,
    RandomK,
    RedSync,
    SIDCo,
    SparDL,
    Threshold,
    TopK,
)
from gradsparse.ops import pack, scatter_add_, select_threshold, select_topk, unpack  # noqa: E402
from gradsparse.state import State  # noqa: E402

__version__ = "0.1.0"


def set_num_threads(threads: int) -> None:
    """Threads used by the CPU kernels (0 restores the default: GRADSPARSE_NUM_THREADS or OpenMP's)."""
    from gradsparse.config import check_int

    # A negative count was taken as 0 and True as 1 without a word.
    _C.set_num_threads(check_int("gradsparse.set_num_threads", "threads", threads, 0, "threads=4", MAX_THREADS))


get_num_threads = _C.get_num_threads
simd_paths = _C.simd_paths
built_with_cuda = _C.built_with_cuda


def __getattr__(name: str):
    # gradsparse.lightning needs lightning, gradsparse.transformers transformers: imported on
    # first use, not with gradsparse.
    if name in ("lightning", "transformers"):
        return importlib.import_module(f"gradsparse.{name}")
    raise AttributeError(f"module 'gradsparse' has no attribute {name!r}")


__all__ = [
    "DGC",
    "MAX_THREADS",
    "METHODS",
    "SAGE",
    "AllRanks",
    "Dense",
    "ExDyna",
    "GaussianK",
    "MiCRO",
    "RandomBlock",
    "RandomK",
    "RedSync",
    "SIDCo",
    "ShardedState",
    "SparDL",
    "State",
    "Threshold",
    "TopK",
    "built_with_cuda",
    "fsdp",
    "get_num_threads",
    "hook",
    "launch",
    "pack",
    "register",
    "reshard",
    "scatter_add_",
    "select_threshold",
    "select_topk",
    "set_num_threads",
    "simd_paths",
    "unpack",
]
