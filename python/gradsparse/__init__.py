"""gradsparse: gradient sparsification with error feedback for PyTorch DDP.

>>> import gradsparse as gs
>>> state = gs.TopK(density=0.01)
>>> ddp_model.register_comm_hook(state, gs.hook)
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from gradsparse import _C, launch
from gradsparse.hooks import hook
from gradsparse.methods import (
    DGC,
    SAGE,
    Dense,
    ExDyna,
    GaussianK,
    MiCRO,
    RandomK,
    RedSync,
    SIDCo,
    SparDL,
    Threshold,
    TopK,
)
from gradsparse.ops import pack, scatter_add_, select_threshold, select_topk, unpack
from gradsparse.state import State

__version__ = "0.1.0"

#: Selection methods by name (the same names as in the docs and the examples' --method flag).
METHODS = {
    "dense": Dense,
    "topk": TopK,
    "threshold": Threshold,
    "randomk": RandomK,
    "gaussiank": GaussianK,
    "dgc": DGC,
    "redsync": RedSync,
    "sage": SAGE,
    "micro": MiCRO,
    "exdyna": ExDyna,
    "sidco": SIDCo,
    "spardl": SparDL,
}

set_num_threads = _C.set_num_threads
get_num_threads = _C.get_num_threads
built_with_cuda = _C.built_with_cuda

__all__ = [
    "DGC",
    "METHODS",
    "SAGE",
    "Dense",
    "ExDyna",
    "GaussianK",
    "MiCRO",
    "RandomK",
    "RedSync",
    "SIDCo",
    "SparDL",
    "State",
    "Threshold",
    "TopK",
    "built_with_cuda",
    "get_num_threads",
    "hook",
    "launch",
    "pack",
    "scatter_add_",
    "select_threshold",
    "select_topk",
    "set_num_threads",
    "unpack",
]
