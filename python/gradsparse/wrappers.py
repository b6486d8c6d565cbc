"""Model wrappers: finding the DistributedDataParallel inside what a framework hands over, and the
user's own module inside DDP.

Training stacks wrap a model in layers: ``torch.compile`` (an ``OptimizedModule`` holding
``_orig_mod``), DDP (``module``), Lightning's and Fabric's wrappers (``_forward_module``). Parameter names seen through a wrapper carry its attribute as a
prefix (``module.``, ``_orig_mod.``, ``_forward_module.``). gradsparse names residuals after the
innermost module, so a checkpoint saved from one stack loads into any other.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["WRAPPER_ATTRIBUTES", "find_ddp", "parameter_names", "strip_wrapper_prefixes", "unwrap"]

#: The attributes through which wrappers hold the module they wrap, in the order they are tried.
WRAPPER_ATTRIBUTES = ("_forward_module", "_orig_mod")
_INNER_PREFIXES = tuple(f"{a}." for a in WRAPPER_ATTRIBUTES)  # those that can sit inside a DDP
_PREFIXES = ("module.", *_INNER_PREFIXES)  # DDP's, then the others'


def _inner(module: nn.Module) -> nn.Module | None:
    """The module that ``module`` wraps, or None when it is no wrapper."""
    if isinstance(module, DistributedDataParallel):
        return module.module
    for attribute in WRAPPER_ATTRIBUTES:
        inner = module._modules.get(attribute)
        if inner is not None:
            return inner
    return None


def unwrap(module: nn.Module) -> nn.Module:
    """The user's own module inside every wrapper (DDP, torch.compile, Lightning, Fabric)."""
    inner = _inner(module)
    while inner is not None:
        module, inner = inner, _inner(inner)
    return module


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel at or inside ``model`` (``torch.compile(DDP(m))`` holds it
    inside), or None."""
    while model is not None and not isinstance(model, DistributedDataParallel):
        model = _inner(model)
    return model


def strip_wrapper_prefixes(name: str, *, inside_ddp: bool = False) -> str:
    """A parameter name as seen through wrappers (``module._orig_mod.fc.weight``), without them.
    ``inside_ddp``: the name was seen from DDP's inner module, where ``module.`` is no DDP's but
    the user's own submodule's, and stays."""
    prefixes = _INNER_PREFIXES if inside_ddp else _PREFIXES
    while name.startswith(prefixes):
        name = name.split(".", 1)[1]
    return name


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the parameter's name in the user's own module, without wrapper prefixes."""
    return {id(p): name for name, p in unwrap(model).named_parameters()}
