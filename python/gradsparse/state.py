"""State classes of the gradsparse DDP communication hook: one per selection method.

A state holds, per DDP bucket, the selection method's C++ object, the error-feedback residual and
the statistics, and owns the engine thread that runs the exchanges. Register it with
``model.register_comm_hook(state, gradsparse.hook)``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import warnings
import weakref
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradsparse import _C
from gradsparse.config import (
    check_bool,
    check_choice,
    check_int,
    check_timeout,
)
from gradsparse.metrics import Metrics

__all__ = ["State"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STATE_DICT_VERSION = 1
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_LIVE_STATES: weakref.WeakSet[State] = weakref.WeakSet()


@atexit.register
def _close_all_states() -> None:
    # Stop every engine thread before the interpreter tears down (the GIL is released while
    # they finish, so a pending callback cannot deadlock the exit).
    for state in list(_LIVE_STATES):
        state.close()


class _Bucket:
    """One DDP bucket's layout, method object and residual."""

    __slots__ = ("index", "key", "method", "names", "numels", "residual")

    def __init__(self, index: int, key: tuple[int, ...], names: list[str], numels: list[int], method):
        self.index = index
        self.key = key  # ids of the bucket's parameters, in bucket order
        self.names = names  # the same parameters' names, for checkpoints
        self.numels = numels
        self.method = method  # C++ method object, or None for dense states
        self.residual: torch.Tensor | None = None

    def residual_views(self) -> dict[str, torch.Tensor]:
        """The residual split by parameter (views)."""
        if self.residual is None:
            return {}
        return dict(zip(self.names, self.residual.split(self.numels), strict=True))


class State:
    """Base class of every gradsparse state; use a subclass such as :class:`TopK`.

    Options shared by every method (keyword-only):

    - ``process_group``: the group the model's DDP reduces over (None: the default group). The
      state must be created on every rank of that group, with the same options.
    - ``warmup_steps`` (0): steps that use a dense all-reduce before sparsification starts.
      DDP rebuilds its buckets after the first step; gradsparse re-maps residuals by parameter
      when that happens, so no warm-up is needed for correctness.
    - ``error_feedback`` (True): keep what was not sent in a residual and add it to the next
      gradient (ALGORITHMS.md section 0). Without it, unsent gradient is dropped.
    - ``nonfinite`` ("raise"): what every rank does when any rank's gradient holds NaN/Inf:
      "raise" an error naming the bucket, or "skip" the bucket's update for that step. Either
      way the residuals keep every finite value (ALGORITHMS.md decision 5).
    - ``timeout`` (30 min): seconds (or a timedelta) after which a stuck exchange fails.
    - ``reference`` (False): reproduce the original code's behaviour where the project's rulings
      differ (docs/method-spec.md); methods without such differences behave the same either way.
    - ``transport`` ("process_group"): what the exchanges run on: a torch.distributed process
      group (Gloo, NCCL, MPI backends), or "mpi" for gradsparse's own OpenMPI transport
      (programs launched with mpirun; needs a build with MPI).

    The exchanges run on a process group of their own, created from the model's group when that
    is the default group, so that they never interleave with other collectives (DDP's own, or the
    training script's). For a sub-group, the state shares the given group.

    Example::

        >>> state = gradsparse.TopK(density=0.01)
        >>> ddp_model.register_comm_hook(state, gradsparse.hook)
    """

    #: Options of the subclass's method, in signature order (validated by _validate_method).
    _METHOD_OPTIONS: ClassVar[tuple[str, ...]] = ()
    _GLOBAL_TARGET: ClassVar[bool] = False  # density counts all ranks' pairs together (stats)
    _SHARED_OPTIONS: ClassVar[tuple[str, ...]] = (
        "process_group",
        "warmup_steps",
        "error_feedback",
        "nonfinite",
        "timeout",
        "reference",
        "transport",
    )

    def __init__(self, **options: Any) -> None:
        owner = type(self).__name__
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{owner}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
                f"(launched by torchrun, mpirun or srun) before creating the state"
            )
        process_group = options.get("process_group")
        group_ok = process_group is None or isinstance(process_group, dist.ProcessGroup)
        error: Exception | None = None
        try:
            self._validate(options)
        except (TypeError, ValueError) as e:
            error = e
        # Agree with every other rank before going further: a configuration error anywhere is
        # raised everywhere, and no rank goes on to a collective the others never reach.
        consensus_group = process_group if group_ok else None
        self._agree(owner, consensus_group, error)

        self._process_group = process_group or dist.group.WORLD
        self._world_size = dist.get_world_size(self._process_group)
        self._rank = dist.get_rank(self._process_group)
        self._engine = self._make_engine()
        self._step = 0
        self._buckets: dict[int, _Bucket] = {}
        self._retired: dict[int, torch.Tensor] = {}  # residual per parameter id, after a bucket rebuild
        self._retired_methods: dict[frozenset, dict] = {}  # method state per parameter set, after a rebuild
        self._paused = False
        self._loaded: dict[str, torch.Tensor] = {}  # residual per parameter name, from load_state_dict
        self._loaded_methods: dict[int, dict[str, float]] = {}
        self._param_names: dict[int, str] | None = None  # id(parameter) -> name, from the DDP module
        self._metrics = Metrics()
        _LIVE_STATES.add(self)

    # ----------------------------------------------------------------------------------------
    # Configuration

    def _validate(self, options: dict[str, Any]) -> None:
        owner = type(self).__name__
        allowed = self._METHOD_OPTIONS + self._SHARED_OPTIONS
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(
                f"{owner}: unknown option(s) {', '.join(unknown)}; the options of {owner} are {', '.join(allowed)}"
            )
        pg = options.get("process_group")
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"{owner}: process_group must be a torch.distributed.ProcessGroup or None (the default group), "
                f"got {type(pg).__name__}; pass the group your DistributedDataParallel uses"
            )
        self._warmup_steps = check_int(owner, "warmup_steps", options.get("warmup_steps", 0), 0, "warmup_steps=10")
        self._error_feedback = check_bool(owner, "error_feedback", options.get("error_feedback", True))
        self._nonfinite = check_choice(owner, "nonfinite", options.get("nonfinite", "raise"), ("raise", "skip"))
        self._timeout = check_timeout(owner, "timeout", options.get("timeout"))
        self._reference = check_bool(owner, "reference", options.get("reference", False))
        self._transport = check_choice(
            owner, "transport", options.get("transport", "process_group"), ("process_group", "mpi")
        )
        if self._transport == "mpi" and not _C.mpi_available():
            raise ValueError(
                f'{owner}: transport="mpi" needs gradsparse built with MPI; install an MPI (for example '
                "apt-get install libopenmpi-dev openmpi-bin) and reinstall gradsparse, or use "
                'transport="process_group" (the default)'
            )
        self._method_config = self._validate_method({k: options[k] for k in self._METHOD_OPTIONS if k in options})

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        """Checks the subclass's own options; returns them normalised."""
        return {}

    def _make_method(self, numels: list[int]):
        """A new C++ method object for one bucket whose parameters hold ``numels`` elements
        (None: dense all-reduce)."""
        return None

    def config(self) -> dict[str, Any]:
        """The options this state was created with (method options and shared options)."""
        return {
            **self._method_config,
            "warmup_steps": self._warmup_steps,
            "error_feedback": self._error_feedback,
            "nonfinite": self._nonfinite,
            "timeout": None if self._timeout is None else self._timeout.total_seconds(),
            "reference": self._reference,
            "transport": self._transport,
        }

    def _agree(self, owner: str, group: dist.ProcessGroup | None, error: Exception | None) -> None:
        mine = None if error is None else (type(error).__name__, str(error))
        fingerprint = (owner, repr(sorted(self.config().items()))) if error is None else None
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(f"{owner}: this rank is not a member of the given process_group")
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (mine, fingerprint), group=group)
        if error is not None:
            raise error
        for rank, (theirs, _) in enumerate(gathered):
            if theirs is not None:
                kind = ValueError if theirs[0] == "ValueError" else TypeError
                raise kind(f"{owner}: rank {rank} rejected its configuration: {theirs[1]}")
        fingerprints = {fp for _, fp in gathered}
        if len(fingerprints) > 1:
            raise ValueError(
                f"{owner}: the ranks were given different configurations: "
                + "; ".join(f"rank {r}: {fp}" for r, (_, fp) in enumerate(gathered))
                + ". Create the state with the same method and options on every rank."
            )

    def _make_engine(self):
        """The engine thread and its transport: MPI_COMM_WORLD for transport="mpi"; else a process
        group of its own (for the default group) or the given sub-group."""
        if self._transport == "mpi":
            engine = _C.Engine.mpi()
            if (engine.rank, engine.size) != (dist.get_rank(), dist.get_world_size()) or (
                self._process_group is not dist.group.WORLD
            ):
                engine.shutdown()
                raise ValueError(
                    f'{type(self).__name__}: transport="mpi" runs on MPI_COMM_WORLD (rank {engine.rank} of '
                    f"{engine.size}) but torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()} "
                    "or a sub-group was given; launch with mpirun and initialise torch.distributed from its "
                    "variables (gradsparse.launch.setup_environment()), on the default group"
                )
            return engine
        timeout = self._timeout or _DEFAULT_TIMEOUT
        group = self._process_group
        if group is dist.group.WORLD:
            kwargs = {"backend": dist.get_backend(group)}
            if self._timeout is not None:
                kwargs["timeout"] = self._timeout
            group = dist.new_group(**kwargs)
        self._comm_group = group
        return _C.Engine(group, timeout.total_seconds())

    # ----------------------------------------------------------------------------------------
    # The hook's work

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        if self._paused:  # see paused(): the bucket goes back untouched
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(buffer)
            return future
        if buffer.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"gradsparse: bucket {index} holds {buffer.dtype} gradients, but gradsparse sparsifies float32, "
                "float16 and bfloat16 buckets only; convert the model (for example model.float()) before "
                "wrapping it in DistributedDataParallel"
            )
        if self._param_names is None:
            self._attach()
        entry = self._bucket(bucket)
        dense = self._step < self._warmup_steps or entry.method is None
        residual = None
        if self._error_feedback and not dense:
            if entry.residual is None:
                entry.residual = torch.zeros_like(buffer)
            residual = entry.residual
        report = _C.ReduceReport()
        future = self._engine.submit(buffer, residual, entry.method, dense, self._nonfinite, f"bucket {index}", report)
        if bucket.is_last():
            self._step += 1
            self._retired.clear()
            self._retired_methods.clear()
        element_size = buffer.element_size()

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()  # raises the engine's error, if any
            self._metrics.record(index, report, self._world_size, element_size)
            return value

        return future.then(finish)

    def _attach(self) -> None:
        """First call: find the DDP module this state is registered on, check its process group,
        and learn the parameter names used in checkpoints."""
        owner = type(self).__name__
        ddp = _find_ddp_module(self)
        self._param_names = {}
        if ddp is None:
            return
        model_group = ddp.process_group
        if not _same_group(model_group, self._process_group):
            raise ValueError(
                f"gradsparse: the {owner} state was created for the process group of ranks "
                f"{_group_ranks(self._process_group)} but the model's DistributedDataParallel reduces over ranks "
                f"{_group_ranks(model_group)}; create the state with process_group=<the group passed to "
                "DistributedDataParallel>"
            )
        self._param_names = {id(p): name for name, p in ddp.module.named_parameters()}

    def _bucket(self, bucket: dist.GradBucket) -> _Bucket:
        """The bucket's entry; rebuilt (residuals re-mapped by parameter) when its layout changed."""
        index = bucket.index()
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        entry = self._buckets.get(index)
        if entry is not None and entry.key == key:
            return entry
        if entry is not None:
            # DDP rebuilt its buckets (after the first step, or with another layout): keep every
            # residual by parameter, then assemble the new buckets from those pieces; a method's
            # state carries over to the new bucket holding the same parameters.
            for old in self._buckets.values():
                for pid, view in zip(old.key, old.residual_views().values(), strict=False):
                    self._retired[pid] = view
                if old.method is not None:
                    self._retired_methods[frozenset(old.key)] = old.method.state()
            self._buckets.clear()
        names = [self._param_names.get(id(p), f"bucket{index}.param{i}") for i, p in enumerate(params)]
        numels = [p.numel() for p in params]
        entry = _Bucket(index, key, names, numels, self._make_method(numels))
        if entry.method is not None and frozenset(key) in self._retired_methods:
            entry.method.load_state(self._retired_methods.pop(frozenset(key)))
        elif entry.method is not None:
            for saved_key in (frozenset(names), index):
                if saved_key in self._loaded_methods:
                    entry.method.load_state(self._loaded_methods.pop(saved_key))
                    break
        pieces = []
        found = False
        buffer = bucket.buffer()
        for p, name, numel in zip(params, names, numels, strict=True):
            piece = self._retired.pop(id(p), None)
            if piece is None:
                piece = self._loaded.pop(name, None)
            if piece is None:
                piece = torch.zeros(numel, dtype=buffer.dtype, device=buffer.device)
            else:
                found = True
                piece = piece.to(device=buffer.device, dtype=buffer.dtype).reshape(-1)
            pieces.append(piece)
        if found:
            entry.residual = torch.cat(pieces)
        if sum(numels) != buffer.numel():
            raise RuntimeError(
                f"gradsparse: bucket {index} has {buffer.numel()} elements but its parameters hold {sum(numels)}; "
                "this DDP configuration is not supported"
            )
        self._buckets[index] = entry
        return entry

    # ----------------------------------------------------------------------------------------
    # Public API

    @property
    def step(self) -> int:
        """Completed steps (incremented when DDP's last bucket of a step is submitted)."""
        return self._step

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self._process_group

    def stats(self, reset: bool = False) -> dict:
        """Statistics since creation (or the last reset), per bucket and in total.

        Keys: ``steps``, ``dense_steps`` and ``skipped_steps``; ``elements`` reduced and
        ``elements_sent`` by this rank; ``selected`` (pairs this rank sent) and
        ``selected_all`` (all ranks); ``density`` (achieved: selected / elements of sparse
        steps), ``global_density`` (all ranks: selected_all / (elements * P)) and
        ``union_density`` (elements the exchanges wrote / elements); ``achieved_density``, the
        one the method's ``density`` targets: ``union_density`` for MiCRO, ExDyna and SparDL
        (one target for all ranks together), ``density`` for the others; ``bytes_sent`` and ``bytes_received`` by this
        rank, ``dense_bytes`` (what a ring all-reduce of the same elements sends) and
        ``bytes_ratio``; ``select_seconds`` and ``exchange_seconds``; ``imbalance`` (MiCRO and
        ExDyna: the mean over steps of max count * P / total count - 1); per bucket also
        ``numel`` and the last ``threshold`` (NaN for methods without one).
        """
        summary = self._metrics.summary(self._world_size, self._GLOBAL_TARGET)
        if reset:
            self._metrics.reset()
        return summary

    def state_dict(self) -> dict:
        """This rank's state: residuals by parameter name, method states, step and statistics.

        Residuals are per rank: save one state dict per rank (for example with the rank in the
        file name). The tensors are the live residuals, like an optimizer's state dict.
        """
        residuals: dict[str, torch.Tensor] = {}
        for entry in self._buckets.values():
            residuals.update(entry.residual_views())
        return {
            "version": _STATE_DICT_VERSION,
            "class": type(self).__name__,
            "config": dict(self._method_config),
            "step": self._step,
            "rank": self._rank,
            "world_size": self._world_size,
            "residuals": residuals,
            "methods": {i: e.method.state() for i, e in self._buckets.items() if e.method is not None},
            "layout": {i: list(e.names) for i, e in self._buckets.items()},
            "stats": self._metrics.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state dict saved by the same method on the same rank. Residuals are put
        back by parameter name when the buckets are next seen, whatever their layout."""
        owner = type(self).__name__
        if not isinstance(state_dict, dict) or state_dict.get("version") != _STATE_DICT_VERSION:
            raise ValueError(
                f"{owner}.load_state_dict: not a gradsparse state dict of version {_STATE_DICT_VERSION} "
                f"(got {type(state_dict).__name__} with version "
                f"{state_dict.get('version') if isinstance(state_dict, dict) else None})"
            )
        if state_dict["class"] != owner or state_dict["config"] != self._method_config:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict was saved by {state_dict['class']}"
                f"({state_dict['config']}) but this state is {owner}({self._method_config}); "
                "create the same method with the same options before loading"
            )
        if state_dict["rank"] != self._rank:
            warnings.warn(
                f"{owner}.load_state_dict: loading rank {state_dict['rank']}'s residuals on rank {self._rank}",
                stacklevel=2,
            )
        self._step = int(state_dict["step"])
        self._buckets.clear()
        self._retired.clear()
        self._retired_methods.clear()
        self._loaded = {name: t.detach().clone() for name, t in state_dict["residuals"].items()}
        # A method's state goes to the bucket holding the same parameters (by name), else to the
        # bucket of the same index.
        layout = state_dict.get("layout", {})
        self._loaded_methods = {
            (frozenset(layout[i]) if i in layout else int(i)): dict(s) for i, s in state_dict["methods"].items()
        }
        self._metrics.load_state_dict(state_dict["stats"])

    @contextlib.contextmanager
    def paused(self):
        """Within this block the hook hands every bucket back unreduced and the state does not
        change: no selection, no communication, no step counted. For an iteration whose
        gradients are thrown away, such as one that only lets DDP settle its bucket layout
        (DDP orders its buckets by the first iteration's gradient order; examples/driver.py runs
        one such iteration when a process starts, so fresh and resumed runs see one layout)."""
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    def close(self) -> None:
        """Stops the engine thread after the queued work (also done at interpreter exit)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({options})"


def _find_ddp_module(state: State):
    """The DistributedDataParallel module whose comm hook state is `state`, or None."""
    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        # issubclass(type(obj)) rather than isinstance: it never touches attributes of arbitrary
        # objects (some modules warn on any attribute access).
        if issubclass(type(obj), DistributedDataParallel) and any(
            s is state for _, s in getattr(obj, "_comm_hooks", ())
        ):
            return obj
    return None


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    a = a or dist.group.WORLD
    b = b or dist.group.WORLD
    return a is b or _group_ranks(a) == _group_ranks(b)
