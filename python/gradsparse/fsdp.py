"""Gradient sparsification for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduces each parameter group's gradients with one reduce-scatter per backward: the flat,
padded gradient of the group (P chunks, chunk r holding rank r's shard of every parameter) goes
in, and rank r's shard of the sum or average comes out. :func:`sparsify` replaces that
reduce-scatter, on every FSDP module of a model, by the state's sparse exchange with error
feedback: the flat gradient of a group is one bucket of the state (its own residual and method
object, named after the module), the method selects from ``residual + gradient``, the state's
exchange averages the selected pairs of every rank, and the rank's shard of the result is what
FSDP receives. See docs/architecture.md, "FSDP2".

Residuals, method states and statistics differ from rank to rank: :class:`ShardedState` hands
them to ``torch.distributed.checkpoint`` as DTensors with one block per rank, so that ``dcp.save``
writes every rank's and ``dcp.load`` gives each rank its own back; it serves states registered on
a DistributedDataParallel (gradsparse.register) as well.
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse.binding import group_ranks, same_group
from gradsparse.checkpoint import STATE_DICT_VERSION, with_checksums
from gradsparse.hooks import _check_state
from gradsparse.state import State, unfrozen_since

__all__ = ["ShardedState", "sparsify"]


def _fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch.distributed.fsdp import FSDPModule

    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]


def _group_layout(module: nn.Module, world_size: int) -> tuple[int, torch.dtype] | None:
    """The numel and dtype of the flat gradient FSDP reduce-scatters for ``module`` (None: the
    module manages no parameters of its own, or only frozen ones, whose gradients FSDP never
    reduces). Read from FSDP's parameter group; FSDP hands over the gradients of the parameters
    that have one, so frozen parameters (``requires_grad=False``) take no place. The first call
    of the comm checks it against what FSDP hands over."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None
    group = groups[0]
    params = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    if not params:
        return None
    numel = sum(p.padded_sharded_param_size.numel() for p in params) * world_size
    # The mixed-precision policy: per parameter from torch 2.15 on (param_dtype_override_fn gives
    # parameters of one group different param_dtypes), per group before.
    dtypes = {_reduce_dtype(p, getattr(p, "mp_policy", None) or getattr(group, "mp_policy", None)) for p in params}
    return numel, functools.reduce(torch.promote_types, dtypes)


def _reduce_dtype(param, policy) -> torch.dtype:
    """The dtype in which FSDP reduce-scatters ``param``'s gradient: the policy's ``reduce_dtype``,
    else, up to torch 2.14, the dtype the gradient is computed in (``param_dtype``), and from
    torch 2.15 on the one it accumulates in: the parameter's ``grad_dtype`` where one was set,
    else its own dtype (a ``param_dtype=bfloat16`` policy then reduces in float32). Read from the
    policy and the parameter, as sparsify() runs before FSDP's first forward sets its own."""
    param_dtype = policy.param_dtype if policy is not None else None
    if policy is not None and policy.reduce_dtype is not None:
        return policy.reduce_dtype
    own = param.sharded_param.dtype
    if not hasattr(type(param), "unsharded_grad_dtype"):  # torch 2.14 and before
        return param_dtype or own
    if getattr(param.sharded_param, "_has_grad_dtype_override", False):
        # set on the sharded parameter (model.parameters()) since fully_shard, or by it: FSDP's
        # first forward takes this one (_capture_grad_dtype_policy)
        grad_dtype = param.sharded_param.grad_dtype
    elif getattr(param, "_has_sharded_grad_dtype_override", False):  # the one fully_shard found
        grad_dtype = param.sharded_grad_dtype
    else:
        return own
    # grad_dtype=None: no accumulation dtype, the gradient's own (FSDP's _get_reduce_dtype)
    return grad_dtype or param_dtype or own


def sparsify(model: nn.Module, state: State) -> State:
    """Makes every FSDP module of ``model`` reduce its gradients with ``state``'s method: a sparse
    exchange with error feedback in place of FSDP's reduce-scatter. Call it on every rank, after
    ``fully_shard`` and before the first backward. Returns the state.

    The state's process group must be the one FSDP shards over (the default group for a 1-D
    mesh; ``mesh.get_group("shard")`` for HSDP, whose replica all-reduce stays dense). FSDP's
    mixed precision applies: the residuals take the dtype FSDP reduces in (the policy's
    ``reduce_dtype``; without one, ``param_dtype`` up to torch 2.14 and the parameters' own dtype,
    or their ``grad_dtype``, from torch 2.15 on). FSDP's gradient averaging
    (``AVG``) and sums (``SUM``, with its pre- and post-division for float16) are honoured; a
    custom divide factor (``set_gradient_divide_factor``) is not.

    Example::

        >>> for layer in model.layers:
        ...     fully_shard(layer)
        >>> fully_shard(model)
        >>> state = gradsparse.fsdp.sparsify(model, gradsparse.TopK(density=0.01))
    """
    _check_state("gradsparse.fsdp.sparsify", state, model, "gradsparse.fsdp.sparsify(model, state)")
    owner = type(state).__name__
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradsparse.fsdp.sparsify: model must be a torch.nn.Module, got {type(model).__name__}")
    if state._CORE is None:
        raise TypeError(
            f"gradsparse.fsdp.sparsify: {owner} sends everything; FSDP's own reduce-scatter does that with half the "
            "bytes of an all-reduce: for the dense baseline, leave the model as fully_shard made it"
        )
    modules = _fsdp_modules(model)
    if not modules:
        raise TypeError(
            f"gradsparse.fsdp.sparsify: {type(model).__name__} holds no FSDP module; call "
            "torch.distributed.fsdp.fully_shard on its layers and on the model first (for DistributedDataParallel "
            "use gradsparse.register)"
        )
    binding = state._binding
    if binding.model() is not None or binding.sharded is not None or state._table.buckets:
        raise ValueError(
            f"gradsparse.fsdp.sparsify: this {owner} state already serves a model; a state holds one model's "
            "residuals: create one state per model"
        )
    for fqn, module in modules:
        count = len(module._get_fsdp_state()._fsdp_param_groups)
        if count > 1:
            raise ValueError(
                f"gradsparse.fsdp.sparsify: FSDP module {fqn or '(root)'!r} holds {count} parameter groups (per-parameter "
                "meshes from shard_placement_fn), and FSDP takes a custom reduce-scatter only for a module with one; "
                "give every parameter of that module the same mesh"
            )
    state.setup()
    # FSDP's reduce-scatters are not timed (each module's waits on its own): exchange="auto" keeps
    # the cost model's pick for every module, and stats() has no trial that never decides.
    state._trial = None
    if state._world_size == 1:
        warnings.warn(
            f"gradsparse.fsdp.sparsify: the {owner} state's process group has one rank, and FSDP reduce-scatters "
            "nothing on one rank: gradsparse sees no gradient, selects nothing and keeps no residual, and training "
            "is dense. To try a method on one process, wrap the model in DistributedDataParallel and use "
            "gradsparse.register(ddp_model, state); under FSDP, run on two ranks or more",
            RuntimeWarning,
            stacklevel=2,
        )
    layouts, frozen = {}, []
    for fqn, module in modules:
        layout = _group_layout(module, state._world_size)
        if layout is not None:
            layouts[fqn or "(root)"] = (module, *layout)
        elif module._get_fsdp_state()._fsdp_param_groups:  # every parameter frozen, for now
            frozen.append((fqn or "(root)", module))
    # A sparsify that fails leaves the state as it was (as gradsparse.register does): bound to the
    # model, it refused the retry as a second model's.
    before = state._binding.saved()
    try:
        state._bind_sharded(model, {name: (numel, dtype) for name, (_, numel, dtype) in layouts.items()})
    except BaseException:
        state._binding.restore(before)
        raise
    recovery = _Recovery(state)
    # A model sparsified again (with a new state, after unfreezing) drops the hooks of the states
    # before: each held its state, with its residuals and engine thread, alive as long as the model.
    # A failure one of them recorded (the unfrozen module's) is still to be recovered from.
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, _Recovery):
                recovery.failure = recovery.failure or hook.failure
                del module._forward_pre_hooks[key]
    # Before FSDP's own pre-forward hooks (prepended at fully_shard): the reset must come first.
    model.register_forward_pre_hook(recovery, prepend=True)
    for index, (name, (module, _, _)) in enumerate(layouts.items()):
        module.set_custom_reduce_scatter(_SparseReduceScatter(state, index, name, len(layouts), recovery))
    # Left to FSDP, a module unfrozen later would be reduced dense, without a residual or a word.
    for name, module in frozen:
        module.set_custom_reduce_scatter(_SparseReduceScatter(state, None, name, len(layouts), recovery))
    return state


class _Recovery:
    """The way back from a reduce-scatter that raised. An exception in FSDP's post-backward (ours
    or FSDP's own reduce-scatter) ends the autograd backward before FSDP's end-of-backward
    callback: FSDP's states stay "in backward", its parameters unsharded, and every later forward
    takes FSDP's path for a recomputation inside backward, so no module reduces again and the
    optimizer's sharded parameters get no gradients, without an error (torch's FSDPModule
    docstring: call reset_iter_state() on the root after such an exception). A failure of ours is
    recorded here; the model's next forward (this pre-forward hook, ahead of FSDP's) resets FSDP's
    iteration state on every root FSDP module of the model, so that step reduces again. The failed
    step is not counted unless its last module had been handed to the engine (a DDP step counts
    at its last bucket), and the residuals keep what each module had:
    a module reduced before the failure moved on as in any step, the others as they were. When
    the root FSDP module lies outside the model (sparsify given a submodule), the hook cannot
    reset it: every forward raises until reset_iter_state() is called on that root."""

    def __init__(self, state: State) -> None:
        self._state = state
        self.failure: str | None = None

    def failed(self, name: str, error: BaseException) -> None:
        self.failure = f"module {name!r} ({type(error).__name__}: {str(error)[:300]})"
        self._state._sharded_called.clear()  # the groups reduced before it do not make the step count

    def __call__(self, model: nn.Module, args: Any) -> None:
        if self.failure is None:
            return
        modules = [m for _, m in _fsdp_modules(model)]
        roots = [m for m in modules if m._get_fsdp_state()._is_root]
        if roots and all(hasattr(root, "reset_iter_state") for root in roots):  # every torch of the supported range
            for root in roots:
                root.reset_iter_state()
            self.failure = None
            return
        contexts = [m._get_fsdp_state()._state_ctx for m in modules]
        if not roots and not any(c.post_backward_final_callback_queued for c in contexts):
            self.failure = None  # the caller reset the root outside the model
            return
        raise RuntimeError(
            f"gradsparse.fsdp: an earlier backward raised in the reduce-scatter of {self.failure}, and FSDP was left "
            "in the middle of that backward: it would reduce no gradients from here on, and the optimizer's "
            "parameters would get none, silently. Call reset_iter_state() on the root FSDP module (the outermost "
            "fully_shard) after catching the error, then go on; or restart from the last checkpoint"
        )


class _SparseReduceScatter:
    """FSDP's ReduceScatter comm (torch/distributed/fsdp/_fully_shard/_fsdp_api.py) for one
    parameter group: the state's exchange of the flat gradient with error feedback (a sparse
    reduce-scatter for gather-and-add methods), of which this rank keeps its shard."""

    def __init__(self, state: State, index: int | None, name: str, groups: int, recovery: _Recovery) -> None:
        self._state = state  # the model keeps its state alive, as DDP keeps its hook's
        self._index = index  # None: a module whose parameters were all frozen at sparsify
        self._name = name
        self._groups = groups
        self._recovery = recovery

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        try:
            self._reduce_scatter(output_tensor, input_tensor, group, op)
        except BaseException as error:
            self._recovery.failed(self._name, error)  # FSDP's backward ends here: see _Recovery
            raise

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op) -> None:
        state = self._state
        owner = type(state).__name__
        if self._index is None:
            raise RuntimeError(unfrozen_since(self._name, input_tensor.numel(), 0))
        if op == dist.ReduceOp.AVG:
            scale = 1.0
        elif op == dist.ReduceOp.SUM:
            scale = float(state._world_size)
        else:
            raise ValueError(
                f"gradsparse.fsdp: FSDP asked module {self._name!r} for a reduce-scatter with op {op}, which "
                f"{owner} cannot honour (it averages or sums); a gradient divide factor other than the world size "
                "(set_gradient_divide_factor) makes FSDP ask for PREMUL_SUM: remove it and scale the loss instead"
            )
        if not same_group(group, state.process_group):
            raise ValueError(
                f"gradsparse.fsdp: module {self._name!r} reduce-scatters over ranks {group_ranks(group)} but the "
                f"{owner} state exchanges over ranks {group_ranks(state.process_group)}; create the state with "
                "process_group=<the group FSDP shards over> (for HSDP, mesh.get_group('shard'))"
            )
        world_size = state._world_size
        if input_tensor.numel() != output_tensor.numel() * world_size or not input_tensor.is_contiguous():
            raise RuntimeError(
                f"gradsparse.fsdp: module {self._name!r}: the reduce-scatter input holds {input_tensor.numel()} "
                f"elements for an output of {output_tensor.numel()} on {world_size} ranks; this FSDP configuration "
                "is not supported"
            )
        flat = input_tensor.view(-1)
        # State.paused(): this rank's shard back unreduced, the state unchanged; scaled below as a
        # reduced one is, since FSDP divides what a SUM (float16) returns by the world size either way
        if not state._paused:
            state._reduce_flat(self._index, self._name, flat, self._groups).wait()
        shard = flat.view(world_size, -1)[state._rank]
        if scale != 1.0:
            shard.mul_(scale)
        output_tensor.view(-1).copy_(shard)


class ShardedState:
    """A state as ``torch.distributed.checkpoint`` (DCP) sees it, for a state registered on a
    DistributedDataParallel (:func:`gradsparse.register`) or given to :func:`sparsify` (FSDP2):
    every residual (and velocity) becomes a DTensor over DCP's process group (the default one)
    with one block per rank, and the method states and statistics (``stats()``) one block of JSON
    per rank, so that ``dcp.save`` writes each rank's own and ``dcp.load`` puts each back on the
    rank that saved it. The class, step, world size, layout, options, the link and decisions of
    exchange="auto" and the loss scale ride in each rank's block. Implements DCP's ``Stateful``
    protocol; also exported as ``gradsparse.ShardedState``.

    The plain state handed to DCP would be saved as if every rank held the same: DCP keeps one
    rank's residuals, and the other ranks' gradient mass is lost (``State.state_dict`` refuses to
    be called by DCP on more than one rank). Same world size only: another world size is refused
    by DCP's planner ("Size mismatch ... for <key>.residuals.<name>": P blocks saved, P' here).
    To change the world size, save with :class:`gradsparse.AllRanks` (DDP) and convert with
    :func:`gradsparse.reshard`. A checkpoint of gradsparse before per-rank statistics loads with
    none (statistics start from zero).

    ``process_group`` (None: the default group) is the group ``dcp.save`` and ``dcp.load`` run
    over (their ``process_group``), whose ranks each save one block of every residual: every rank
    of it holds a state over the same parameters (data-parallel sub-groups of one model and HSDP
    replicas save over the default group, each rank its own block). States that hold different
    parameters (pipeline stages, each with its own data-parallel group) save each group's with a
    ``dcp.save`` of its own: ``dcp.save(..., checkpoint_id=<the group's>, process_group=group)``
    with ``ShardedState(state, process_group=group)``, and load alike.

    Example::

        >>> sharded = gradsparse.ShardedState(state)  # state = gradsparse.register(ddp, ...) or fsdp.sparsify(...)
        >>> dcp.save({"model": model.state_dict(), "gradsparse": sharded}, checkpoint_id=d)
        >>> dcp.load({"model": model.state_dict(), "gradsparse": sharded}, checkpoint_id=d)
    """

    def __init__(self, state: State, *, process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(state, State):
            raise TypeError(
                f"gradsparse.ShardedState: state must be a gradsparse state, got {type(state).__name__}; "
                "pass the state that gradsparse.register or gradsparse.fsdp.sparsify returned: "
                "gradsparse.ShardedState(gradsparse.register(ddp_model, state))"
            )
        binding = state._binding
        if binding.sharded is None and binding.ddp is None:
            raise TypeError(
                f"gradsparse.ShardedState: the {type(state).__name__} state serves no model it knows the parameter "
                "names of; call gradsparse.register(ddp_model, state) (DistributedDataParallel) or "
                "gradsparse.fsdp.sparsify(model, state) (FSDP2) first"
            )
        if binding.sharded is None and binding.model() is None and binding.module() is None:
            raise TypeError(_model_gone(state))
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "gradsparse.ShardedState: process_group must be a torch.distributed.ProcessGroup or None (the "
                f"default group), got {type(process_group).__name__}; pass the process_group given to dcp.save "
                "and dcp.load"
            )
        group = process_group or dist.group.WORLD
        missing = sorted(set(group_ranks(state.process_group)) - set(group_ranks(group)))
        if missing:
            raise ValueError(
                f"gradsparse.ShardedState: process_group holds ranks {group_ranks(group)}, but the "
                f"{type(state).__name__} state's ranks {missing} are outside it: their residuals would not be saved "
                "with this rank's; save over a group that holds every rank of state.process_group (dcp.save(..., "
                "process_group=state.process_group) with ShardedState(state, process_group=state.process_group)), "
                "or over the default group (None)"
            )
        self.state = state
        # Over every rank DCP saves (its default group) by default, not the state's group: under
        # HSDP, or DDP on data-parallel sub-groups of one model, the ranks of each replica hold the
        # same blocks of their own group, and DCP would keep one replica's residuals for all.
        self._group = group

    def _mesh(self, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self._group, device.type)

    def _per_rank(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard

        local = local.reshape(-1)
        shape = (local.numel() * dist.get_world_size(self._group),)
        return DTensor.from_local(
            local, self._mesh(local.device), [Shard(0)], run_check=False, shape=shape, stride=(1,)
        )

    def _tensor_keys(self) -> tuple[str, ...]:
        """The per-element state this state checkpoints: residuals, and velocities with momentum."""
        return ("residuals", "velocities") if self.state._momentum else ("residuals",)

    def _methods_blob(self, saved: dict, layout: list[list[str]]) -> torch.Tensor:
        """This rank's method states (a list of {name: float} or None) and statistics (each
        bucket's counters with its parameters' names: under FSDP its module's), with its class,
        step, world size and ``layout`` (the same on every rank of one sub-group, not on every rank
        DCP saves: saved once, as entries of their own, DCP kept one sub-group's for all), the options, the link of exchange="auto" and the loss scale (the same on
        every rank; the options as entries of their own, one key per option, made DCP refuse a
        checkpoint of another method or of an earlier gradsparse with "Missing key" before
        load_state_dict could say which options differ),
        as JSON in a zero-padded uint8 tensor of a size every rank computes alike (their keys can
        change with the steps: ExDyna's layout appears at its first step, and a bucket's counters at
        its first step, so DCP could not load them key by key; and an entry of its own would make
        DCP refuse every checkpoint saved before it). The size is that of the checkpoints before
        the statistics joined the method states, so that those load: they hold a JSON list (the
        method states alone), these a JSON object."""
        world_size = dist.get_world_size(self.state.process_group)
        size = (1024 + 64 * world_size) * max(1, len(self.state._binding.numels))
        entries = {
            "class": saved["class"],
            "step": saved["step"],
            "world_size": saved["world_size"],
            "layout": layout,
            "methods": saved["methods"],
            "parked_methods": saved["parked_methods"],  # a module's, loaded and not reduced since
            "config": saved["config"],
            "link": saved.get("link"),
            "loss_scale": saved["loss_scale"],
            "exchanges": saved.get("exchanges"),  # DDP: what exchange="auto"'s trial kept (FSDP runs none)
            # DDP: the parameters not in row-major order (channels_last); absent from older state dicts
            **({"strides": saved["strides"]} if "strides" in saved else {}),
        }
        text = json.dumps({**entries, "stats": saved["stats"]}, separators=(",", ":")).encode()
        if len(text) > size:
            text = json.dumps(entries, separators=(",", ":")).encode()
            if len(text) > size:
                raise RuntimeError(f"gradsparse.ShardedState: the method states take {len(text)} bytes, over {size}")
            warnings.warn(
                f"gradsparse.ShardedState: rank {dist.get_rank()}'s method states and statistics take over "
                f"{size} bytes; its statistics are not saved (after the load they start from zero)",
                RuntimeWarning,
                stacklevel=3,
            )
        blob = torch.zeros(size, dtype=torch.uint8)
        blob[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        return blob

    def _sizes(self) -> dict[str, tuple[int, torch.dtype, torch.device]]:
        """Every residual the state can hold, by name: its elements, dtype and device. Under FSDP
        a module's flat gradient; under DDP each parameter DDP reduces."""
        binding = self.state._binding
        if binding.sharded is not None:
            # The dtype FSDP reduces in now: the model's dtype or grad_dtype may have changed since
            # sparsify (FSDP follows such a change up to its first forward). A module whose
            # parameters have all been frozen since, or of a model gone, keeps the one sparsify found.
            model = binding.sharded()
            modules = {fqn or "(root)": module for fqn, module in _fsdp_modules(model)} if model is not None else {}
            sizes = {}
            for name, numel in binding.numels.items():
                layout = _group_layout(modules[name], self.state._world_size) if name in modules else None
                sizes[name] = (numel, layout[1] if layout else binding.dtypes[name], torch.device("cpu"))
            return sizes
        module = binding.module()
        if module is None:
            raise RuntimeError(_model_gone(self.state))
        reduced = binding.params or frozenset()
        return {
            binding.names[id(p)]: (p.numel(), p.dtype, p.device)
            for p in module.parameters()
            if id(p) in reduced and id(p) in binding.names
        }

    def state_dict(self) -> dict:
        state = self.state
        state.setup()
        saved = state.state_dict()
        binding = state._binding
        sizes = self._sizes()
        tensors = {}
        for key in self._tensor_keys():
            tensors[key] = dict(saved.get(key, {}))
            # Before the first step (a resumed process), DCP loads into this dict: it must already
            # name every residual (and velocity) with its size.
            for name, (numel, dtype, device) in sizes.items():
                if name not in tensors[key]:
                    tensors[key][name] = torch.zeros(numel, dtype=dtype, device=device)
        # FSDP: bucket i is the i-th module sparsified. DDP: its buckets' parameters, the same on
        # every rank of the state's group (DDP builds them alike), in which the step after the load is reduced.
        layout = [[name] for name in binding.numels] if binding.sharded is not None else saved["layout"]
        return {
            # once, for checkpoints of earlier gradsparse, whose blocks do not hold them
            "version": saved["version"],
            "class": saved["class"],
            "step": saved["step"],
            "world_size": saved["world_size"],
            "layout": layout,
            **{key: {name: self._per_rank(t) for name, t in held.items()} for key, held in tensors.items()},
            # The method states and statistics of each rank. Statistics differ by rank: saved once
            # (as a plain entry), DCP would keep one rank's, and a process that holds no counters
            # yet would name none of them to load.
            # exchange="auto"'s link and set_scaler's loss scale ride along.
            "methods": self._per_rank(self._methods_blob(saved, layout)),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.setup()
        try:
            saved = self._plain(state_dict)
        except Exception as e:  # refused on every rank (State.load_state_dict), not on this one alone
            self.state._agree_on_load(e)
            raise
        self.state.load_state_dict(saved)

    def _plain(self, state_dict: dict) -> dict:
        """The state dict of State.state_dict's form that ``state_dict`` (DCP's, of this rank) holds."""

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        tensors = {
            key: {name: local(t).detach().clone() for name, t in state_dict.get(key, {}).items()}
            for key in ("residuals", "velocities")
        }
        state = self.state
        blob = _decode_methods(local(state_dict["methods"]))
        # Checkpoints before 2026-12-01 hold the options as entries DCP is no longer asked for:
        # they load with this state's own (their class is still checked).
        config = blob.pop("config") or state._saved_config()
        # this rank's own, where its block holds them (a checkpoint of an earlier gradsparse holds them once)
        own = {key: state_dict[key] if (value := blob.pop(key)) is None else value for key in _ONCE}
        return {
            "version": STATE_DICT_VERSION,
            "config": config,
            "rank": state._rank,
            "fsdp": state._binding.sharded is not None,
            **own,
            **with_checksums(tensors["residuals"], tensors["velocities"]),
            **blob,
        }


def _model_gone(state: State) -> str:
    """ShardedState's refusal of a state whose DDP model was freed (at creation, and at a save after it)."""
    return (
        f"gradsparse.ShardedState: the model the {type(state).__name__} state was registered on no longer exists; "
        "register the state on the model being checkpointed (gradsparse.register(ddp_model, state))"
    )


#: What ShardedState saves once (for earlier gradsparse's checkpoints) and in each rank's block of "methods".
_ONCE = ("class", "step", "world_size", "layout")


def _decode_methods(blob: torch.Tensor) -> dict:
    """A rank's method states, statistics, link and loss scale from its block of the "methods"
    entry, each with its default where a checkpoint of an earlier gradsparse holds none. One before
    per-rank statistics holds the method states alone (a JSON list), and its statistics, saved
    once for all ranks, are not loaded: they are one rank's (or none), and a load that named them
    would fail on a checkpoint saved before a bucket's first step."""
    text = bytes(blob.cpu().numpy().tobytes()).rstrip(b"\0")
    saved = json.loads(text) if text else []
    if isinstance(saved, list):
        saved = {"methods": saved}
    return {
        **{key: saved.get(key) for key in _ONCE},
        "methods": saved["methods"],
        "parked_methods": saved.get("parked_methods", []),
        "config": saved.get("config"),
        "stats": saved.get("stats", []),
        "link": saved.get("link"),
        "loss_scale": saved.get("loss_scale", 1.0),
        "exchanges": saved.get("exchanges"),
        **({"strides": saved["strides"]} if "strides" in saved else {}),
    }
