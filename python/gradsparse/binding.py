"""What a state knows of its model: the DistributedDataParallel (or the FSDP model) it serves,
its parameters' names and sizes, and the rule that one state serves one model.

A state bound by :func:`gradsparse.register` knows the names of the innermost module's
parameters (without wrapper prefixes), under which its residuals are checkpointed. An unbound
state (``model.register_comm_hook(state, gradsparse.hook)``) learns which parameters it reduces
during its first step and names them by identity, which is enough to train but not to save; when
gradsparse.register takes it over, what it holds under those placeholder names goes under the
parameters' names.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse.checkpoint import TENSORS
from gradsparse.wrappers import find_ddp, parameter_names, strip_wrapper_prefixes, unwrap

__all__ = ["ModelBinding"]


def _sharded_by_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) was sharded by FSDP2's fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in unwrap(model).modules())


class ModelBinding:
    """The model of one state (see the module)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the state's class name, for messages
        self.ddp: weakref.ref | None = None  # the DistributedDataParallel, from bind()
        self.module: weakref.ref | None = None  # the user's own module inside it, from bind()
        self.sharded: weakref.ref | None = None  # the FSDP model, from bind_sharded()
        self.names: dict[int, str] = {}  # id(parameter) -> name in the user's module
        self.numels: dict[str, int] = {}  # name -> elements (FSDP: of a module's flat gradient)
        self.dtypes: dict[str, torch.dtype] = {}  # FSDP: module -> reduce dtype
        self.params: frozenset[int] | None = None  # ids of the parameters the state reduces
        self._seen: set[int] = set()  # unbound: the parameters met so far in the first step

    def model(self):
        """The bound DistributedDataParallel, or None."""
        return None if self.ddp is None else self.ddp()

    def is_named(self) -> bool:
        """Whether the state knows the names it checkpoints under."""
        return self.ddp is not None or self.sharded is not None

    def binds_another_module(self, model: nn.Module) -> bool:
        """Whether the state is bound to a module other than the one inside ``model`` (the one it
        is bound to may have been freed since)."""
        return self.params is not None and (self.module is None or self.module() is not unwrap(model))

    def bind(self, model: nn.Module) -> dict[str, str]:
        """Ties the state to the DistributedDataParallel at or inside ``model`` (gradsparse.register);
        returns the names it gives the parameters that the state knew by identity, by their
        placeholder names (see name())."""
        owner = self.owner
        ddp = find_ddp(model)
        if ddp is None and _sharded_by_fsdp(model):
            raise TypeError(
                f"gradsparse.register: model ({type(model).__name__}) is sharded by FSDP (fully_shard), which calls "
                "no DDP communication hook; use gradsparse.fsdp.sparsify(model, state) instead of register"
            )
        if ddp is None:
            raise TypeError(
                f"gradsparse.register: model must be a DistributedDataParallel (or a torch.compile of one), got "
                f"{type(model).__name__}; wrap it first (DistributedDataParallel(model)); with Accelerate, register "
                "after accelerator.prepare(model), which wraps it only when several processes run (torchrun, or accelerate "
                "launch --multi_gpu --num_processes N, which on CPUs too starts N); with Lightning, use "
                "gradsparse.lightning.Sparsify"
            )
        if self.sharded is not None:
            raise ValueError(
                f"gradsparse.register: this {owner} state already sparsifies an FSDP model "
                "(gradsparse.fsdp.sparsify); a state holds one model's residuals: create one state per model"
            )
        bound = self.model()
        if bound is ddp:
            raise ValueError(
                f"gradsparse.register: this {owner} state is already registered on this model; register it once"
            )
        params = reduced_parameters(ddp)
        module = unwrap(ddp)
        # The same module: the one bound before, or for a state hooked with model.register_comm_hook,
        # which knows its model by the parameters of its first step only, one holding any of them.
        same_module = (self.module is not None and self.module() is module) or (
            self.ddp is None and not params.isdisjoint(self.params or ())
        )
        if (bound is not None or self.params is not None) and params != self.params and not same_module:
            raise ValueError(
                f"gradsparse.register: this {owner} state is already registered on another model; a state holds "
                "one model's residuals: create one state per model"
            )
        # A new DDP over the same parameters (Lightning wraps the module anew for every fit()), or
        # over the same module with parameters frozen or unfrozen since (DDP reduces those that
        # required gradients when it was made), takes the state over with its residuals.
        known = self._by_identity()
        self.ddp = weakref.ref(ddp)
        self.module = weakref.ref(module)
        self.names = parameter_names(ddp)
        self.numels = {self.names[id(p)]: p.numel() for p in ddp.parameters()}
        self.params = params
        return {placeholder(i): self.names[i] for i in known if i in self.names}

    def bind_sharded(self, model: nn.Module, groups: dict[str, tuple[int, torch.dtype]]) -> None:
        """Ties the state to an FSDP model (gradsparse.fsdp.sparsify): one bucket per parameter
        group, named after its module, holding the group's flat (padded) gradient of the given
        size and reduce dtype."""
        self.sharded = weakref.ref(model)
        self.numels = {name: numel for name, (numel, _) in groups.items()}
        self.dtypes = {name: dtype for name, (_, dtype) in groups.items()}

    def saved(self) -> dict:
        """The binding as it is now, for restore(): bind() and bind_sharded() assign new objects
        and change none in place, so a shallow copy keeps it."""
        return dict(vars(self))

    def restore(self, saved: dict) -> dict[str, str]:
        """Puts back the binding saved() returned (a registration that failed undoes its bind());
        returns the placeholder names that the parameters bind() named go back to, by name."""
        names = self.names
        self.__dict__.update(saved)
        return {names[i]: placeholder(i) for i in self._by_identity() if i in names}

    def _by_identity(self) -> frozenset[int]:
        """The parameters an unbound state has met, which it names by identity."""
        return (self.params or frozenset()) if self.ddp is None else frozenset()

    def name(self, param: torch.Tensor) -> str:
        """The parameter's name; an unbound state names it by identity."""
        return self.names.get(id(param)) or placeholder(id(param))

    def check_params(self, params: list[torch.Tensor], last: bool) -> None:
        """One state, one model: a parameter outside the model's (the bound model, or those seen in
        the first step) means the state was registered on a second model."""
        if self.params is None:  # not bound: learn the parameters during the first step
            self._seen.update(id(p) for p in params)
            if last:
                self.params = frozenset(self._seen)
            return
        if any(id(p) not in self.params for p in params):
            raise ValueError(
                f"gradsparse: this {self.owner} state is registered on more than one model: a bucket holds "
                "parameters that the model it reduced for did not hold (a second model's, or those of a layer replaced "
                "or unfrozen since, under a new DistributedDataParallel hooked with model.register_comm_hook, which "
                "cannot tell the same model from another); a state holds one model's residuals: for the same model "
                "under a new DistributedDataParallel, register the state with gradsparse.register(new_ddp, state), "
                "which takes it over; for another model, create one state per model"
            )

    def check_group(self, group: dist.ProcessGroup) -> None:
        """The bound DDP reduces over the state's process group."""
        ddp = self.model()
        if ddp is not None and not same_group(ddp.process_group, group):
            raise ValueError(
                f"gradsparse: the {self.owner} state was created for the process group of ranks "
                f"{group_ranks(group)} but the model's DistributedDataParallel reduces over ranks "
                f"{group_ranks(ddp.process_group)}; create the state with process_group=<the group passed to "
                "DistributedDataParallel>"
            )

    def check_names(self, state_dict: dict, part: str = "") -> None:
        """Every residual and velocity of the state dict names a parameter of the bound model,
        with its size (``part``: which rank's part of a state dict of every rank, for the message)."""
        if not self.numels:
            return
        for kind, key, checksums in TENSORS:
            self._check_tensor_names(state_dict.get(key, {}), kind, key, checksums, part)

    def _check_tensor_names(
        self, tensors: dict[str, torch.Tensor], kind: str, key: str, checksums: str, part: str
    ) -> None:
        owner, numels = f"{self.owner}.load_state_dict{part}", self.numels
        unknown = sorted(set(tensors) - set(numels))
        if unknown:
            hint = ""
            stripped = {n: strip_wrapper_prefixes(n) for n in unknown}
            if all(n in numels for n in stripped.values()):
                prefixes = sorted({n[: len(n) - len(s)] for n, s in stripped.items()})
                hint = (
                    f" They carry wrapper prefixes ({', '.join(prefixes)}); gradsparse names {key} after the "
                    f"model's own parameters: rename them, e.g. sd['{key}'] = "
                    f"{{k.removeprefix({prefixes[0]!r}): v for k, v in sd['{key}'].items()}}."
                )
            raise ValueError(
                f"{owner}: {len(unknown)} {kind}(s) name no parameter of the model: "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (the model's parameters are named like "
                f"{', '.join(list(numels)[:3])}).{hint} Load the state dict into a state registered on the model it "
                "was saved from"
            )
        for name, tensor in tensors.items():
            if tensor.numel() == numels[name]:
                continue
            if self.sharded is not None:  # one residual per module: its parameters that require gradients
                raise ValueError(
                    f"{owner}: the {kind} of module {name!r} holds {tensor.numel()} elements but the module's "
                    f"parameters that require gradients hold {numels[name]} (padded): under FSDP a module's "
                    f"{kind} covers those parameters together, so a parameter of it frozen or unfrozen since the "
                    "save (or another model) changes it. Freeze the same parameters as at the save, or start the "
                    f"module's {kind} from zero: del sd[{key!r}][{name!r}], sd[{checksums!r}][{name!r}] before loading"
                )
            raise ValueError(
                f"{owner}: the {kind} of {name} holds {tensor.numel()} elements but the "
                f"parameter has {numels[name]}; the state dict was saved from another model"
            )


def placeholder(param_id: int) -> str:
    """The name of a parameter that the state knows by identity only (unbound)."""
    return f"<parameter {param_id:#x}>"


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def new_group_among(parent: dist.ProcessGroup, members: list[int], **options: Any) -> dist.ProcessGroup | None:
    """A new process group over ``members`` (global ranks of ``parent``), made by its members only
    (use_local_synchronization) and called on every rank of ``parent``; None on the others.

    torch names such a group after its ranks and a count of groups on the calling rank (up to
    torch 2.14 those it belongs to), so members that belong to different numbers of groups (a
    user's groups over other ranks: every rank creates them, only their members count them) named
    it differently and each waited for the others until the timeout. The members first reach the
    same count with one-rank groups of their own. Over the default group every rank creates it,
    which keeps torch's count of groups created alike on every rank (torch 2.15 names by it)."""
    if parent is dist.group.WORLD:
        group = dist.new_group(members, **options)
        return group if dist.get_rank() in members else None
    counts: list[Any] = [None] * dist.get_world_size(parent)
    dist.all_gather_object(counts, _name_count(members), group=parent)
    me = dist.get_rank()
    if me not in members:
        return None
    theirs = [c for r, c in zip(group_ranks(parent), counts, strict=True) if r in members]
    if None not in theirs:
        while (count := _name_count(members)) is not None and count < max(theirs):
            # Gloo: an NCCL group may start a communicator
            dist.new_group([me], use_local_synchronization=True, backend="gloo", timeout=options.get("timeout"))
    return dist.new_group(members, use_local_synchronization=True, **options)


def _name_count(members: list[int]) -> int | None:
    """The count torch salts the name of a use_local_synchronization group over ``members`` with on
    this rank: the groups it belongs to (torch 2.13, 2.14) or the groups created so far (2.15,
    the same on every rank); None where neither gives torch's name."""
    c10d = dist.distributed_c10d
    world, name_of = getattr(c10d, "_world", None), getattr(c10d, "_hash_ranks_to_str", None)
    if world is None or name_of is None:
        return None
    ranks = sorted(members)
    name = name_of(ranks)
    for count in (len(getattr(world, "pg_names", ())), getattr(world, "group_count", None)):
        salted = "_".join([*map(str, ranks), str(count)])
        if count is not None and hashlib.sha1(salted.encode(), usedforsecurity=False).hexdigest() == name:
            return count
    return None


def same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    a = a or dist.group.WORLD
    b = b or dist.group.WORLD
    return a is b or group_ranks(a) == group_ranks(b)


def reduced_parameters(ddp: nn.Module) -> frozenset[int]:
    """The ids of the parameters DDP reduces: those that required gradients when it was built,
    less the ones it was told to leave alone (DistributedDataParallel.
    _set_params_and_buffers_to_ignore_for_model, delay_all_reduce_named_params). A parameter
    counted here that DDP does not reduce made DDP's first static-graph step, whose buckets end it
    once they have held every parameter, never end; one missing made its bucket look like another
    model's. Today's ``requires_grad`` tells them apart unless a parameter was frozen or unfrozen
    since DDP was built, which DDP's count and size of its parameters reveal: then its buckets
    (zero-filled copies, made once here) name them."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    try:
        built = ddp._get_ddp_logging_data()
        same = int(built["num_parameter_tensors"]) == len(params) and int(built["total_parameter_size_bytes"]) == sum(
            p.numel() * p.element_size() for p in params
        )
        if not same:
            return frozenset(
                id(p) for bucket in ddp.reducer._get_zeros_like_grad_buckets() for p in bucket.parameters()
            )
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):  # another torch: today's flags
        pass
    return frozenset(id(p) for p in params)
