"""State classes of the gradsparse DDP communication hook: one per selection method.

A state is a method's configuration, agreed on by every rank, and the step that the hook runs
with it. What it holds lives beside it, one responsibility each: the model it serves
(gradsparse.binding), the bucket table of methods and residuals keyed by parameter name
(gradsparse.buckets), the checkpoint format (gradsparse.checkpoint) and the statistics
(gradsparse.metrics). The engine thread (C++) runs the exchanges.

Life of a state:

1. **Construction** checks the options on this rank only; it needs no process group, so a state
   can be built before ``init_process_group`` (as Lightning's ``DDPStrategy`` does with its
   ``ddp_comm_state``).
2. **Set-up** (:meth:`State.setup`) is collective: the state makes its own process group, every
   rank checks that all ranks were given the same method and options, and the engine starts. It
   runs in :func:`gradsparse.register`, or at the first hook call, or when called explicitly,
   bounded by the state's ``timeout``.
3. **Binding** to a model (:func:`gradsparse.register`) teaches the state the parameter names
   under which residuals are checkpointed.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import difflib
import inspect
import math
import numbers
import os
import pickle
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse import _C, launch
from gradsparse.binding import ModelBinding, group_ranks, new_group_among
from gradsparse.buckets import Bucket, BucketTable, memory_order
from gradsparse.checkpoint import (
    STATE_DICT_VERSION,
    Loaded,
    called_by_dcp,
    check_same_steps,
    saved_stats,
    this_ranks,
    upgrade,
    with_checksums,
)
from gradsparse.config import (
    REQUIRED,
    Option,
    check_bool,
    check_choice,
    check_int,
    check_momentum,
    check_timeout,
)
from gradsparse.exchange_trial import ExchangeTrial
from gradsparse.metrics import Metrics

__all__ = ["State"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The engine's non-finite policy for each ``nonfinite`` option: "propagate" skips there, and the
# bucket is filled with NaN once the engine is done with it (State._submit).
_ENGINE_POLICY = {"raise": "raise", "skip": "skip", "propagate": "skip"}
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
#: A bucket that skips its update (nonfinite="skip" or "propagate") in this many steps in a row
#: gets a warning (State._count_skips).
SKIPS_BEFORE_WARNING = 100
_LIVE_STATES: weakref.WeakSet[State] = weakref.WeakSet()
_NOT_A_MEMBER = (
    ". If this rank was meant to stay out of a sub-group: torch.distributed.new_group(ranks, "
    "use_local_synchronization=True) returns None on the ranks outside ranks, and process_group=None means "
    "the default group; create the state (and its DDP model) on the sub-group's ranks only"
)


#: The exchange groups (and the processes that made them) of states collected without close(),
#: given back at the next set-up: each held three threads and five sockets on Gloo until the job
#: ended (a search over hyperparameters ran out of file descriptors). Not in the collection itself,
#: which can run inside another torch.distributed call.
_ABANDONED: list[tuple[dist.ProcessGroup, int]] = []


def _give_back(comm: dist.ProcessGroup, pid: int | None) -> None:
    """Destroys a state's own group, where the process that made it (``pid``) is this one: a
    forked child's copy is its parent's."""
    if pid == os.getpid() and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # already destroyed (destroy_process_group() of them all)
            dist.destroy_process_group(comm)


def _give_back_abandoned() -> None:
    while _ABANDONED:
        _give_back(*_ABANDONED.pop())


@atexit.register
def _close_all_states() -> None:
    # Stop every engine thread before the interpreter tears down (the GIL is released while
    # they finish, so a pending callback cannot deadlock the exit).
    for state in list(_LIVE_STATES):
        state.close()


class _Taken(NamedTuple):
    """A sparse bucket of a step under nonfinite="propagate": what it may have to take back."""

    bucket: frozenset[str]  # its parameters' names, as its statistics are kept (gradsparse.metrics)
    report: Any  # its _C.ReduceReport, which holds what the step took (taken_message)
    residual: torch.Tensor
    put_back: Callable[..., None]  # puts the pieces held out of the step back again (_hold_unused)


class _PropagatedStep:
    """nonfinite="propagate": what one step's buckets did so far (State._propagate)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.overflowed = False  # a bucket of the step was skipped (handed back as NaN)
        # The outputs that may hold NaN/Inf that the step's inputs did not: its dense buckets' (which
        # pass NaN on) and its float16 sparse ones' (a transport that rounds each partial sum of the
        # union and shared all-reduces, as Gloo does, can carry the ranks' values / P past 65504).
        # Read at the step's last bucket: any such makes the step a skipped one.
        self.outputs: list[torch.Tensor] = []
        self.taken: list[_Taken] = []  # its sparse buckets
        # On a GPU, an event after each bucket's job: the step's last bucket reads the others' outputs,
        # residuals and taken messages on a stream ordered after its own job only.
        self.ready: list[tuple[torch.device, torch.cuda.Event]] = []


class State:
    """Base class of every gradsparse state; use a subclass such as :class:`TopK`.

    Options shared by every method (keyword-only):

    - ``process_group``: the group the model's DDP reduces over (None: the default group). The
      state must be created on every rank of that group, with the same options, and on no other
      rank: ``torch.distributed.new_group(ranks, use_local_synchronization=True)`` returns None on
      the ranks outside ``ranks``, which reads as the default group here (and in DDP), so a state
      made there with that None waits for every rank at set-up and fails after its ``timeout``.
    - ``warmup_steps`` (0): steps that use a dense all-reduce before sparsification starts.
      DDP rebuilds its buckets after the first step; gradsparse re-maps residuals by parameter
      when that happens, so no warm-up is needed for correctness.
    - ``error_feedback`` (True): keep what was not sent in a residual and add it to the next
      gradient (docs/method-spec.md 1). Without it, unsent gradient is dropped.
    - ``momentum`` (0.0): momentum correction (docs/method-spec.md 1): each rank keeps a velocity
      ``u = momentum * u + gradient`` and sends from the residual of velocities, so that delayed
      coordinates carry their momentum; where a step emptied the residual the velocity restarts
      from zero (momentum factor masking). Give the optimizer's momentum here and build the
      optimizer with momentum 0 (plain SGD). Warm-up steps, and the Dense state, apply it too:
      there it is momentum SGD.
    - ``nonfinite`` ("raise"): what every rank does when any rank's gradient holds NaN/Inf in
      a step (a warm-up step too): "raise" an error naming the bucket, "skip" the bucket's
      update for that step (its gradient comes back as zeros), or "propagate": skip it and hand
      the bucket back filled with NaN on every rank, as DDP's all-reduce hands an overflow on,
      so that a torch.amp.GradScaler sees it (float16 loss scaling: see :meth:`set_scaler`).
      Each way the residuals keep every finite value (docs/method-spec.md ruling 5). The Dense
      state all-reduces as DDP does: NaN/Inf reach every rank's gradient. SparDL in float16
      treats a step alike where some rank would keep a partial sum past 65504 (docs/methods.md).
    - ``timeout`` (30 min): seconds (or a timedelta) after which a stuck exchange, or a set-up
      that not every rank reaches, fails.
    - ``reference`` (False): reproduce the original code's behaviour where the project's rulings
      differ (docs/method-spec.md); methods without such differences behave the same either way.
    - ``transport`` ("process_group"): what the exchanges run on: a torch.distributed process
      group (Gloo, NCCL, MPI backends), or "mpi" for gradsparse's own OpenMPI transport
      (programs launched with mpirun; needs a build with MPI).

    The exchanges run on a process group of their own, created from the model's group when that
    is the default group, so that they never interleave with other collectives (DDP's own, or the
    training script's). For a sub-group, it is created over the sub-group's ranks, by them alone.

    Example::

        >>> state = gradsparse.TopK(density=0.01)    # before or after init_process_group
        >>> gradsparse.register(ddp_model, state)     # or ddp_model.register_comm_hook(state, gradsparse.hook)
    """

    #: The method's own options, declared once (gradsparse.config.Option): the subclass's
    #: signature, docstring, validation, config() and C++ construction follow from them.
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    _CORE: ClassVar[str | None] = None  # the C++ method class (gradsparse._C); None: dense all-reduce
    _CORE_EXTRAS: ClassVar[tuple[str, ...]] = ()  # what else it takes: "reference", "segments"
    _GLOBAL_TARGET: ClassVar[bool] = False  # density counts all ranks' pairs together (stats)
    _SHARED_OPTIONS: ClassVar[tuple[str, ...]] = (
        "process_group",
        "warmup_steps",
        "error_feedback",
        "momentum",
        "nonfinite",
        "timeout",
        "reference",
        "transport",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Gives every method class the constructor its OPTIONS declare: a real signature
        (positional options first, then keyword-only ones, then the shared options) and an
        "Args" section in its docstring."""
        super().__init_subclass__(**kwargs)
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for option in cls.OPTIONS:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if option.positional else inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(option.name, kind, default=option.default))
        params.append(inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD))
        signature = inspect.Signature(params)
        usage = signature.replace(parameters=params[1:])

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError as e:
                self._refuse_unknown(kwargs)  # a misspelt option is named as such, not as the one it misses
                raise TypeError(f"{cls.__name__}: {e}; call it as {cls.__name__}{usage}") from None
            given = {k: v for k, v in bound.arguments.items() if k not in ("self", "options")}
            State.__init__(self, **given, **bound.arguments.get("options", {}))

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__qualname__ = f"{cls.__name__}.__init__"
        cls.__init__ = __init__  # type: ignore[method-assign]
        if cls.OPTIONS and cls.__doc__ and "\n    Args:\n" not in cls.__doc__:
            lines = [f"        {o.name}: {o.doc}" + ("" if o.default is REQUIRED else f" (default {o.default!r})")
                     for o in cls.OPTIONS]  # fmt: skip
            cls.__doc__ = cls.__doc__.rstrip() + "\n\n    Args:\n" + "\n".join(lines) + "\n"

    def __init__(self, **options: Any) -> None:
        # Options are checked here, on this rank; the ranks compare them in setup().
        self._validate(options)
        self._group_option: dist.ProcessGroup | None = options.get("process_group")
        self._process_group: dist.ProcessGroup | None = None  # from setup() on
        self._rank = 0
        self._world_size = 1
        self._engine = None
        self._step = 0
        self._binding = ModelBinding(type(self).__name__)  # the model
        self._table = BucketTable()  # methods and residuals, by bucket and by parameter name
        self._loaded: Loaded | None = None  # from load_state_dict, until the next step put it in place
        self._saved_layout: list[list[str]] | None = None  # the loaded layout, kept until DDP rebuilds
        self._unchecked: tuple[dict, bool] | None = None  # (state dict, any_rank) loaded before this rank was known
        self._refused_names: Exception | None = None  # a loaded state dict's names, refused at register before set-up
        self._before_load: dict[str, Any] | None = None  # what a load before set-up replaced (setup() may undo it)
        self._comm: dist.ProcessGroup | None = None  # the exchanges' own group (from setup): also agrees on loads
        self._pid: int | None = None  # the process that set the state up (its engine thread runs there)
        self._deferred: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]] = []
        self._paused = False
        self._handed: tuple[int, set[int]] = (0, set())  # buckets and parameter ids handed over in this step
        self._failed_step = False  # a bucket of this step failed: the rest go back untouched
        self._sharded_called: set[int] = set()  # FSDP: the groups reduced so far in this step
        self._link: tuple[float, float] | None = None  # (alpha, beta) of exchange="auto", from setup()
        self._trial: ExchangeTrial | None = None  # exchange="auto" at several ranks: the exchanges timed
        self._saved_exchanges: dict[frozenset[str], str] | None = None  # exchange="auto": a loaded decision
        self._metrics = Metrics()
        self._scaler = None  # set_scaler(): the GradScaler whose scale the gradients carry
        self._scale_read_at: int | None = None  # the step whose loss scale was read (_follow_scale)
        self._propagated: _PropagatedStep | None = None  # nonfinite="propagate": this step's buckets so far
        self._overflowed_at: int | None = None  # the step whose loss scale the residuals could not follow
        self._skipped_in_a_row: dict[int, int] = {}  # bucket index -> its last steps skipped for NaN/Inf, in a row
        _LIVE_STATES.add(self)

    def __getstate__(self) -> dict[str, Any]:
        """A state is pickled (``torch.save(state)``, ``copy.deepcopy``, ``mp.spawn``'s arguments)
        only before its set-up or registration: from then on it holds its process group, its engine
        thread and its model, which no copy can take along (pickle failed on the ProcessGroup,
        naming nothing of gradsparse)."""
        if self._engine is not None or self._binding.is_named():
            owner = type(self).__name__
            raise TypeError(
                f"{owner}: a state that is set up or registered cannot be pickled or copied (torch.save(state), "
                "copy.deepcopy): it holds its process group, its engine thread and its model. Save "
                f"state.state_dict() and load it with load_state_dict into a new {owner} (README, Checkpoints); "
                f"for its options alone, gradsparse.{owner}(**state.config(), process_group=state.process_group). "
                "A DistributedDataParallel that carries its hook holds it too (copy.deepcopy(model), torch.save(model) "
                "of the DDP): copy or save the module inside instead, copy.deepcopy(model.module) or "
                "torch.save(model.module.state_dict(), path)"
            )
        return self.__dict__

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """A copy is a state of its own: its engine, once started, is stopped at exit too."""
        self.__dict__.update(saved)
        _LIVE_STATES.add(self)

    # ----------------------------------------------------------------------------------------
    # Configuration

    def _refuse_unknown(self, options: dict[str, Any]) -> None:
        owner = type(self).__name__
        allowed = tuple(o.name for o in self.OPTIONS) + self._SHARED_OPTIONS
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            meant = [f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, allowed, 1)) else name
                     for name in unknown]  # fmt: skip
            raise TypeError(
                f"{owner}: unknown option(s) {', '.join(meant)}; the options of {owner} are {', '.join(allowed)}"
            )

    def _validate(self, options: dict[str, Any]) -> None:
        owner = type(self).__name__
        self._refuse_unknown(options)
        pg = options.get("process_group")
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"{owner}: process_group must be a torch.distributed.ProcessGroup or None (the default group), "
                f"got {type(pg).__name__}; pass the group your DistributedDataParallel uses"
            )
        self._warmup_steps = check_int(owner, "warmup_steps", options.get("warmup_steps", 0), 0, "warmup_steps=10")
        self._error_feedback = check_bool(owner, "error_feedback", options.get("error_feedback", True))
        self._momentum = check_momentum(owner, "momentum", options.get("momentum", 0.0))
        if self._momentum and not self._error_feedback and self._CORE is not None:
            raise ValueError(
                f"{owner}: momentum={self._momentum!r} needs error_feedback=True: momentum correction keeps its "
                "velocity where the residual holds what was not sent; drop error_feedback=False, or give the "
                "momentum to the optimizer instead (momentum=0 here)"
            )
        self._nonfinite = check_choice(
            owner, "nonfinite", options.get("nonfinite", "raise"), ("raise", "skip", "propagate")
        )
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
        self._method_config = {o.name: o.validate(owner, options.get(o.name, o.default)) for o in self.OPTIONS}
        self._check_options(self._method_config)

    # The shared options that decide what state a rank keeps: saved with the method's options and
    # checked when a state dict is loaded.
    _STATE_OPTIONS = ("error_feedback", "momentum")

    def _saved_config(self) -> dict[str, Any]:
        """The options a state dict records and load_state_dict() requires to match."""
        shared = self.config()
        return {**self._method_config, **{k: shared[k] for k in self._STATE_OPTIONS}}

    def _check_options(self, config: dict[str, Any]) -> None:
        """Rules that tie several of the method's options together (each option is checked alone
        by its declaration)."""

    def _make_method(self, numels: list[int], value_bytes: int = 4):
        """A new C++ method object for one bucket whose parameters hold ``numels`` elements of
        ``value_bytes`` bytes each (None: dense all-reduce): the C++ class receives the method's
        options by name."""
        if self._CORE is None:
            return None
        extras = {"reference": self._reference, "segments": list(numels)}
        config = dict(self._method_config)
        if config.get("exchange") == "auto":
            config["exchange"] = self._faster_exchange(sum(numels), value_bytes)
        return getattr(_C, self._CORE)(**config, **{k: extras[k] for k in self._CORE_EXTRAS})

    def _faster_exchange(self, numel: int, value_bytes: int) -> str:
        """What exchange="auto" means for a bucket of ``numel`` elements of ``value_bytes`` bytes
        each (4 for float32, 2 for float16 and bfloat16) until its exchanges are
        timed (gradsparse.exchange_trial): the exchange that gradsparse.simulate's model finds
        faster at this world size on the link measured at set-up (before set-up, at one rank:
        gather-and-add). Every rank decides alike: the same figures."""
        density = self._method_config.get("density")
        if density is None or self._link is None:  # a fixed threshold: no k to plan with
            return "gather"
        from gradsparse import simulate  # at first use: python -m gradsparse.simulate runs it as __main__

        return simulate.faster_exchange(
            self._world_size, numel, density, self._link, fixed=self._CORE == "TopK", value_bytes=value_bytes
        )

    def check_world_size(self, world_size: int) -> None:
        """Raises ValueError where an option does not fit ``world_size`` ranks (SparDL's ``teams``
        must divide it). :meth:`setup` checks it on every rank alike; call it before a job starts
        (a launcher, a driver checking its options) to refuse such options before any training."""
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
            raise ValueError(
                f"{type(self).__name__}.check_world_size: world_size must be an integer >= 1 (the number of "
                f"ranks), got {world_size!r}; for example dist.get_world_size()"
            )
        self._check_world_size(int(world_size))

    def _check_world_size(self, world_size: int) -> None:
        """The options that depend on the number of ranks (methods override it)."""

    def config(self) -> dict[str, Any]:
        """The options this state was created with: the method's and the shared ones, but for
        ``process_group`` (a group is no option to compare or record; a copy on the same group
        is ``type(state)(**state.config(), process_group=state.process_group)``)."""
        return {
            **self._method_config,
            "warmup_steps": self._warmup_steps,
            "error_feedback": self._error_feedback,
            "momentum": self._momentum,
            "nonfinite": self._nonfinite,
            "timeout": None if self._timeout is None else self._timeout.total_seconds(),
            "reference": self._reference,
            "transport": self._transport,
        }

    # ----------------------------------------------------------------------------------------
    # Set-up (collective)

    def setup(self) -> State:
        """The collective part of the state's creation, on every rank of its process group: its own
        process group, the check that every rank has the same method and options (a mismatch
        raises on every rank), and the engine thread. A state dict loaded before it is checked
        here, and the same agreement refuses it on every rank where one rank refuses it.

        Runs once; :func:`gradsparse.register` and the first hook call run it when it has not run.
        Every step is bounded by the state's ``timeout``: a rank that never arrives (the state was
        not created there, or its options raised there) makes the others fail with an error that
        says so, instead of hanging. Returns the state.
        """
        if self._engine is not None:
            return self
        owner = type(self).__name__
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{owner}.setup: torch.distributed is not initialized; call torch.distributed.init_process_group() "
                "(launched by torchrun, mpirun or srun) before the state's set-up. The state itself can be "
                "created earlier: its set-up runs in gradsparse.register() or at the first backward"
            )
        group = self._group_option or dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError(f"{owner}: this rank is not a member of the given process_group")
        timeout = self._wait_timeout
        world_size = dist.get_world_size(group)
        # A state dict loaded before the process group existed (or whose names register refused) is
        # checked now, and the agreement below carries each rank's verdict: a state dict refused on
        # one rank is refused on every rank, naming it, and no rank goes on to wait for that rank in
        # the first step until the timeout. It loads once the state is set up on every rank.
        load, refusal = None, self._refused_names
        self._refused_names = None
        if self._unchecked is not None and refusal is None:
            try:
                load = self._read(*self._unchecked)
            except Exception as e:  # any error: one left to this rank alone would leave the others waiting
                refusal = e
        comm = None
        try:
            _give_back_abandoned()
            comm = self._make_comm_group(group)
            gathered: list[Any] = [None] * world_size
            # the step each rank goes on from: its load's, or its own (a load put in place already)
            step = load.step if load is not None else self._step
            mine = (_wire(), owner, repr(sorted(self.config().items())), _verdict(refusal), step)
            dist.all_gather_object(gathered, mine, group=comm)
        except RuntimeError as e:  # c10d's errors (DistBackendError, DistStoreError) derive from it
            _give_back_own(comm, group, os.getpid())
            raise RuntimeError(
                f"{owner}.setup: not every rank of the process group {group_ranks(group)} reached the set-up of "
                f"this state within its timeout ({timeout.total_seconds():g} s): {e}. Create the state with the "
                "same options on every rank, and register it (or run the first backward) on every rank; a rank "
                "that raised before it (a load_state_dict refused there) never arrives: see that rank's error"
                + (_NOT_A_MEMBER if self._group_option is None else "")
            ) from e
        try:
            self._check_agreement(owner, gathered)
            # A load refused on any rank is refused on every rank, and the state is set up without
            # it (one put in place before set-up, after init_process_group, is undone); an accepted
            # one is put in place. Both before the engine starts: exchange="auto"'s trial and link
            # start from the state every rank goes on from (after an undone load they started from
            # the loaded one, on the loading rank only, and the ranks ran different exchanges).
            self._unchecked = None
            before, self._before_load = self._before_load, None
            refused = None
            try:
                self._refuse_where_refused(refusal, [entry[3] for entry in gathered], [entry[4] for entry in gathered])
            except Exception as e:
                vars(self).update(before or {})
                refused = e
            else:
                if load is not None:
                    load()
                    self._before_load = None  # nothing to undo: accepted on every rank
            self._start(group, comm, len(gathered))
        except BaseException:
            _give_back_own(comm, group, os.getpid())
            raise
        self._comm, self._pid = comm, os.getpid()
        self._agreements = 0  # those of _gather_beside_the_exchanges on this group, alike on every rank
        # A state collected without close() gives its group back (not a sub-group's: see close).
        if group is dist.group.WORLD:
            self._abandoned = weakref.finalize(self, _ABANDONED.append, (comm, self._pid))
            self._abandoned.atexit = False
        self._binding.check_group(group)
        if refused is not None:
            raise refused
        return self

    def _check_agreement(self, owner: str, gathered: list[Any]) -> None:
        """Once every rank has arrived: refuses what the ranks disagree on (versions,
        configurations, in ``gathered``) and a world size the method cannot run at."""
        if len({_wire_of(entry) for entry in gathered}) > 1:  # their messages and control words may differ
            raise ValueError(
                f"{owner}: the ranks run different gradsparse versions: "
                + "; ".join(f"rank {r}: {_wire_of(entry)}" for r, entry in enumerate(gathered))
                + ". Install the same gradsparse on every rank."
            )
        if len({entry[:3] for entry in gathered}) > 1:
            raise ValueError(
                f"{owner}: the ranks were given different configurations: "
                + "; ".join(f"rank {r}: {entry[1:3]}" for r, entry in enumerate(gathered))
                + ". Create the state with the same method and options on every rank."
            )
        self.check_world_size(len(gathered))

    def _start(self, group: dist.ProcessGroup, comm: dist.ProcessGroup, world_size: int) -> None:
        """Starts the engine on ``comm``, and exchange="auto"'s trial from the link every rank holds:
        the loaded one where every rank loaded the same, else one measured now on every rank (a
        collective: a rank that measured alone waited for the others until the timeout)."""
        self._process_group = group
        self._world_size = world_size
        self._rank = dist.get_rank(group)
        if self._method_config.get("exchange") == "auto" and world_size > 1:
            links: list[Any] = [None] * world_size
            dist.all_gather_object(links, self._link, group=comm)
            if None in links or len(set(links)) > 1:
                from gradsparse import simulate

                self._link = simulate.measure_link(comm)  # what exchange="auto" starts from
            self._trial = self._new_trial(self._step, self._saved_exchanges)
        self._engine = self._make_engine(comm)

    @property
    def _wait_timeout(self) -> datetime.timedelta:
        """How long a collective of this state waits for the other ranks: its ``timeout``."""
        return self._timeout or _DEFAULT_TIMEOUT

    def _make_comm_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The exchanges' own process group over the ranks of ``group``, created with the state's
        timeout. Never ``group`` itself: the engine thread's collectives would interleave with
        those DDP issues on it from the training thread (the used-parameter map of
        find_unused_parameters=True), in a different order on each rank. For a sub-group only its
        members create it (use_local_synchronization). With transport="mpi" the exchanges run on
        MPI_COMM_WORLD, but the set-up's agreement still runs here: every rank creates the group
        alike, so a rank given another transport is refused by name, not left waiting."""
        return new_group_among(group, group_ranks(group), backend=dist.get_backend(group), timeout=self._wait_timeout)

    def _make_engine(self, comm: dist.ProcessGroup):
        """The engine thread and its transport: MPI_COMM_WORLD for transport="mpi"; else the
        exchanges' own group (_make_comm_group), over the ranks of the model's group."""
        if self._transport == "mpi":
            fix = (
                "launch with mpirun and initialise torch.distributed from its variables "
                "(gradsparse.launch.setup_environment()), on the default group"
            )
            if self._process_group is not dist.group.WORLD:  # before MPI_Init, which waits for the whole world
                raise ValueError(
                    f'{type(self).__name__}: transport="mpi" runs on MPI_COMM_WORLD, but the process group '
                    f"{group_ranks(self._process_group)} given is not the default group; use "
                    f'transport="process_group" for a group of your own, or {fix}'
                )
            # The launcher's numbering first: MPI_Init waits for every process of the MPI job, and
            # where torch's world is smaller (a process of the job that trains not) it waited for ever.
            self._refuse_other_mpi_numbering(comm, launch.mpi_numbering(), ", as the launcher numbers it", fix)
            # Refused on every rank alike where MPI's thread level admits no engine beside torch's MPI group.
            engine = _C.Engine.mpi(other_mpi_threads=_torch_mpi_threads(dist.get_backend(self._process_group)))
            try:
                self._refuse_other_mpi_numbering(comm, (engine.rank, engine.size), "", fix)
            except ValueError:
                engine.shutdown()
                raise
            _end_the_mpi_job_on_an_uncaught_error(engine.rank)
            return engine
        timeout = self._wait_timeout
        return _C.Engine(comm, timeout.total_seconds())

    def _refuse_other_mpi_numbering(
        self, comm: dist.ProcessGroup, mine: tuple[int, int] | None, source: str, fix: str
    ) -> None:
        """Refuses, on every rank alike, an MPI numbering (rank, size; ``source`` says where it
        comes from) other than torch's on any rank; None (not known on this rank) passes. An object
        collective, as the set-up's agreement: on an NCCL-only group a CPU tensor has no backend."""
        world = dist.get_world_size()
        numbered: list[Any] = [None] * world
        dist.all_gather_object(numbered, mine, group=comm)
        differ = sum(theirs not in (None, (r, world)) for r, theirs in enumerate(numbered))
        if differ:
            here = f"here rank {mine[0]} of {mine[1]}{source}" if mine is not None else f"here not known{source}"
            raise ValueError(
                f'{type(self).__name__}: transport="mpi" runs on MPI_COMM_WORLD ({here}) but torch.distributed has '
                f"rank {dist.get_rank()} of {world}; the two differ on {differ} of the {world} ranks: {fix}"
            )

    # ----------------------------------------------------------------------------------------
    # The model (gradsparse.binding)

    def _bind(self, model: nn.Module) -> None:
        """Ties the state to the DistributedDataParallel at or inside ``model`` (called by
        gradsparse.register): learns the parameter names, checks the process group."""
        self._rename(self._binding.bind(model))
        if self._engine is not None:
            self._binding.check_group(self._process_group)
        if self._loaded is not None:
            # register, on every rank, goes on to set-up (its agreement refuses them on every rank), or
            # is past it (agreed here)
            self._check_names_on_every_rank(self._loaded.parts, self._loaded.saved)
        elif self._table.buckets:
            # A new DDP over the model the state already reduced for (Lightning's next fit()): its
            # first step comes in a fresh DDP's layout, so it is reduced in the layout of the steps
            # so far, as after load_state_dict, and continues the run as the old DDP would have.
            self._saved_layout = [names for names in self._table.layout() if names]

    def _unbind(self, saved: dict) -> None:
        """Undoes _bind (gradsparse.register failed after it): the binding saved() gave, and the
        placeholder names of what it renamed."""
        self._rename(self._binding.restore(saved))

    def _rename(self, renamed: dict[str, str]) -> None:
        """Moves what the state holds by parameter name (residuals, velocities, method states,
        statistics, exchange="auto"'s trial) from the names that are keys of ``renamed`` to the
        names they map to: those register gave the parameters of a state that knew them by
        identity (hooked with model.register_comm_hook), or back."""
        self._table.rename(renamed)
        self._metrics.rename(renamed)
        if self._trial is not None:
            self._trial.rename(renamed)

    def _bind_sharded(self, model: nn.Module, groups: dict[str, tuple[int, torch.dtype]]) -> None:
        """Ties the state to an FSDP model (gradsparse.fsdp.sparsify)."""
        self._binding.bind_sharded(model, groups)
        if self._loaded is not None:
            self._check_names_on_every_rank(self._loaded.parts, self._loaded.saved)

    def _check_names_on_every_rank(self, parts: list[dict] | None, state_dict: dict) -> None:
        """_check_names at registration (gradsparse.register, gradsparse.fsdp.sparsify, called on every
        rank): refused on one rank, the names are refused on every rank. Before set-up the refusal
        waits for the set-up that registration runs next, whose agreement carries it; after it, the
        ranks agree here."""
        refusal = None
        try:
            self._check_names(parts, state_dict)
        except Exception as e:
            refusal = e
        if self._engine is None:
            self._refused_names = refusal
        else:
            self._agree_on_load(refusal)

    def _check_names(self, parts: list[dict] | None, state_dict: dict) -> None:
        """Every residual and velocity names a parameter of the bound model (before it is bound:
        at registration): of a state dict of every rank (AllRanks), every rank checks every part,
        so that a wrong one is refused on every rank, not on its own while the others wait."""
        for part in parts or [state_dict]:
            self._binding.check_names(part, _part_label(parts, part))

    # ----------------------------------------------------------------------------------------
    # The step: what gradsparse.hook does with one DDP bucket, top down

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Never raises, and never hands DDP a failed future: an error, raised here or by the
        engine, is raised when the backward ends, after DDP has ended its step (_failed,
        _failing_late), so the next step works once the cause is fixed."""
        # Where the bucket stands in its step (_place): a failed step ends at its last bucket, and
        # in DDP's first static-graph iteration no bucket says is_last().
        index, last = self._place(bucket.index(), bucket.is_last(), bucket.parameters())
        if self._paused or self._failed_step:  # see paused(); or an earlier bucket of this step failed
            if last:
                self._failed_step = False
            return _done(bucket.buffer())
        try:
            return _failing_late(self._reduce_bucket(bucket, index, last), bucket)
        except Exception as error:
            _release(self._deferred)  # the first step after a load: let them go
            self._deferred = []
            self._failed_step = not last
            self._scale_read_at = None  # the step is not counted: its retry reads the scale again
            self._propagated = None
            return _failed(error, bucket)

    def _reduce_bucket(self, bucket: dist.GradBucket, index: int, last: bool) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.layout == torch.sparse_coo:
            # A parameter with sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True):
            # DDP hands it over alone, as a sparse tensor, and takes a sparse one back. Its dense form
            # is reduced like any bucket (its residual is dense: what it keeps is not limited to the
            # rows of one step), and the rows where the average is nonzero go back.
            shape, rows = buffer.shape, buffer.sparse_dim()
            future = self._reduce_dense(bucket, buffer.to_dense().view(-1), index, last)
            return future.then(lambda done: done.value().view(shape).to_sparse(sparse_dim=rows))
        return self._reduce_dense(bucket, buffer, index, last)

    def _reduce_dense(
        self, bucket: dist.GradBucket, buffer: torch.Tensor, index: int, last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        if buffer.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"gradsparse: bucket {bucket.index()} holds {buffer.dtype} gradients, but gradsparse sparsifies "
                "float32, float16 and bfloat16 buckets only; convert the model (for example model.float()) before "
                "wrapping it in DistributedDataParallel"
            )
        self.setup()  # collective, once
        params = bucket.parameters()
        self._binding.check_params(params, last)  # one state, one model
        if self._loaded is not None or self._in_saved_layout():  # after load_state_dict: in the saved layout
            if self._binding.model() is None:
                raise ValueError(
                    f"gradsparse: the {type(self).__name__} state was given a state dict but does not know its "
                    "model's parameter names (it was registered with model.register_comm_hook), so the residuals "
                    "cannot be put back; register it with gradsparse.register(ddp_model, state) instead"
                )
            return self._defer(buffer, params, index, last)
        entry = self._bucket(index, params, buffer)  # its method and residual, re-mapped if DDP rebuilt
        return self._submit(entry, buffer, last)  # error feedback, selection and exchange, on the engine

    def _place(self, index: int, last: bool, params: list[torch.Tensor]) -> tuple[int, bool]:
        """The bucket's index and whether it ends the step. DDP's first iteration with
        ``static_graph=True`` reduces every bucket at the end of backward (one per dtype then, or
        per ``bucket_cap_mb_list`` entry) and hands each over as bucket 0, none as the last: such a
        bucket takes its place in the step as index, and the one that completes the model's
        parameters ends the step. A state that does not know its model's parameters yet (registered
        with ``model.register_comm_hook``) ends that step when the backward ends (_end_delayed_step).
        Elsewhere DDP's own index and is_last() stand, and a bucket 0 starts a new step (also after
        a backward that stopped half-way: a new DDP wrapper's first bucket 0 may then hold none of
        the stopped step's parameters)."""
        count, ids = self._handed
        mine = {id(p) for p in params}
        delayed = index == 0 and not last and self._delayed()
        if delayed and ids and not ids & mine:  # bucket 0 again, with other parameters
            index = count
            last = self._binding.params is not None and self._binding.params <= ids | mine
        elif index == 0:  # a new step (or one that a failed backward left half-way)
            count, ids = 0, set()
            # A step that failed at a bucket ends at its last one; a backward that stopped before
            # it (an error of autograd's own) left the flag set, and the next step's buckets were
            # all handed back unreduced. Such a step also left its buckets' "propagate" record,
            # whose entries a later overflow took back again (and counted as skipped twice).
            self._failed_step = False
            self._propagated = None
        if delayed and self._binding.params is None:
            with contextlib.suppress(RuntimeError):  # outside a backward: no step to end there
                _queue_callback(self._end_delayed_step)
        self._handed = (0, set()) if last else (count + 1, ids | mine)
        return index, last

    def _delayed(self) -> bool:
        """Whether DDP hands this bucket over in its delayed reduction, the first iteration of a
        static graph: its model has ``static_graph=True`` (a state registered with
        ``model.register_comm_hook`` cannot read it), and the bucket comes from a callback at the
        end of backward, where no autograd node runs, not from a gradient's hook."""
        ddp = self._binding.model()
        if ddp is not None and not getattr(ddp, "static_graph", False):
            return False
        current = getattr(torch._C, "_current_autograd_node", None)
        return current is None or current() is None

    def _end_delayed_step(self) -> None:
        """The end of a backward in which DDP's delayed reduction handed buckets to a state that
        does not know its model's parameters: no bucket could say it was the last, so the step
        ends here (counted, and the parameters learned, unless a bucket failed or it was paused)."""
        if not self._handed[1]:  # it ended at a bucket already
            return
        self._handed = (0, set())
        if self._failed_step or self._paused:
            self._failed_step = False
            return
        self._binding.check_params([], True)  # learns the parameters met in this step
        self._settle_propagated()  # the record is this step's: its bucket 0 dropped any older one (_place)
        self._step += 1
        self._table.end_step()

    def _bucket(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor) -> Bucket:
        """The bucket's entry in the table; when DDP rebuilt its buckets (after the first step, or
        with another layout), the residuals and method states of this bucket and the ones after it
        are parked by parameter and the new buckets are assembled from them."""
        names = [self._binding.name(p) for p in params]
        numels = [p.numel() for p in params]
        strides = [memory_order(p) for p in params]
        entry = self._table.get(index, names, numels, strides, buffer)
        if entry is not None:
            return entry
        if self._trial is not None and not self._trial.decided and self._step > self._trial.first_step:
            # DDP rebuilt its buckets after a timed step of the trial (with static_graph=True it
            # rebuilds after the second step): the times so far belong to the old buckets. Every
            # rank times the new ones anew, from the next step.
            self._trial = self._trial.reopen(self._step)
        self._table.park_from(index)
        if sum(numels) != buffer.numel():
            raise RuntimeError(
                f"gradsparse: bucket {index} has {buffer.numel()} elements but its parameters hold {sum(numels)}; "
                "this DDP configuration is not supported"
            )
        self._check_bucket_agrees(index, buffer)
        shapes = [list(p.shape) for p in params]
        return self._table.add(
            index, names, shapes, strides, lambda: self._make_method(numels, buffer.element_size()), buffer
        )

    def _average(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """The average over the ranks of a small float32 tensor (on the buckets' device: a group of
        NCCL alone reduces no CPU tensor), on the CPU: a dense all-reduce queued on the engine like
        a bucket, so it keeps its place among the exchanges on every rank."""
        report = _C.ReduceReport()  # of its own: not counted in any bucket's statistics
        done = self._engine.submit(values, None, None, True, "raise", name, report, False, None, 0.0, False)
        return done.wait().cpu()

    def _check_bucket_agrees(self, index: int, buffer: torch.Tensor) -> None:
        """Every rank's size and dtype of a new bucket, compared once (one small all-reduce queued
        on the engine like a bucket). A message whose count its receiver already knows travels
        without a header naming its bucket, so buckets that differ between ranks would reach the
        exchanges unnoticed: DDP gives every rank the same buckets, except with
        find_unused_parameters=True and another bucket_cap_mb on some rank (no single first bucket,
        no rebuild), where Gloo would end the process and MPI accept a short receive."""
        p = self._world_size
        if p < 2:
            return
        # This rank's row only (the average of the rows hands every rank every row), in float32
        # (the engine's dense dtypes): the size in 16-bit digits, which come back exactly.
        row = torch.zeros(p, 5)
        digits = [(buffer.numel() >> 16 * j) & 0xFFFF for j in range(4)]
        row[self._rank] = torch.tensor([*digits, _SUPPORTED_DTYPES.index(buffer.dtype)])
        rows = (self._average(row.to(buffer.device), f"the size of bucket {index}") * p).round().long().tolist()
        every = [(sum(seen[j] << 16 * j for j in range(4)), _SUPPORTED_DTYPES[seen[4]]) for seen in rows]
        if any(seen != every[0] for seen in every):
            raise ValueError(
                f"gradsparse: DDP's bucket {index} differs between the ranks: "
                + "; ".join(f"rank {r}: {n} elements of {dtype}" for r, (n, dtype) in enumerate(every))
                + ". With find_unused_parameters=True DDP keeps the buckets that bucket_cap_mb gives each rank: "
                "give every rank the same bucket_cap_mb (and the same model)"
            )

    def _hold_unused(self, entry: Bucket, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """With ``find_unused_parameters=True`` (or ``static_graph=True``) DDP leaves the gradient of
        a parameter that no rank used untouched, so it drops whatever the exchange averaged for it:
        what a selection took from that parameter's residual would be lost. So a parameter whose gradient is zero on
        this rank (DDP hands an unused one over as zeros) sits the step out on this rank: its
        residual and velocity are set aside as zeros for the step and put back after it (added to
        what the exchange wrote there: other ranks' mass). Returns the (piece, saved copy) pairs
        to put back."""
        ddp = self._binding.model()
        tensors = [t for t in (entry.residual, entry.velocity) if t is not None]
        unused_found = getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False)
        if ddp is None or not unused_found or not tensors:
            return []
        used = torch.stack([piece.ne(0).any() for piece in buffer.split(entry.numels)]).tolist()
        held = []
        for tensor in tensors:
            for piece, is_used in zip(tensor.split(entry.numels), used, strict=True):
                if not is_used:
                    held.append((piece, piece.clone()))
                    piece.zero_()
        return held

    def _follow_scale(self) -> None:
        """Loss scaling (set_scaler): at a step's first bucket, the residuals, velocities and
        methods move to the loss scale of this step's gradients, the scaler's scale now (1 without
        a scaler: a state dict saved under a scaler and loaded without one moves back). Read once a
        step: on CUDA, reading the scale waits for the device."""
        if self._scale_read_at == self._step or (self._CORE is None and not self._momentum):  # Dense: nothing held
            return
        scale = 1.0 if self._scaler is None else float(self._scaler.get_scale())
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(
                f"gradsparse: the loss scale of {type(self).__name__}'s GradScaler is {scale}; it must be a positive "
                "finite number (the scaler's init_scale, or a scale it came to): check the scaler's settings"
            )
        self._scale_read_at = self._step
        self._overflowed_at = self._step if self._table.overflows(scale) else None
        if self._overflowed_at is not None:
            # A float16 residual or velocity cannot follow the scale up. This rank hands the step to
            # the engine as NaN instead (_submit): every rank skips it and hands back NaN, so every
            # scaler backs off, and the residuals keep what they held (this rank's gradient of the
            # step is dropped, as DDP drops an overflowed step's). The table stays at its scale.
            return
        self._table.rescale(scale)

    def _submit(
        self, entry: Bucket, buffer: torch.Tensor, last: bool, shard_only: bool = False
    ) -> torch.futures.Future[torch.Tensor]:
        """Hands the bucket to the engine (selection and exchange run there, C++); the future's
        callback records the statistics and yields the reduced bucket."""
        if self._forked():
            raise RuntimeError(
                f"gradsparse: this {type(self).__name__} state was set up in process {self._pid}, and this process "
                f"({os.getpid()}) was forked from it: its engine thread and process group stay in that process. Create "
                "the state (and its DDP model) in this process, after the fork, or start the workers with torchrun "
                "or torch.multiprocessing's spawn"
            )
        self._follow_scale()
        if self._overflowed_at == self._step:
            buffer.fill_(math.nan)
        dense = self._step < self._warmup_steps or entry.method is None
        residual = None
        if self._error_feedback and not dense:
            if entry.residual is None:
                entry.residual = torch.zeros_like(buffer)
            residual = entry.residual
        if self._momentum and entry.velocity is None:
            entry.velocity = torch.zeros_like(buffer)
        # Momentum factor masking reads the residual's zeros as the previous step's sent positions:
        # only when that step was sparse (a warm-up step leaves the residual alone).
        masking = not dense and self._step > self._warmup_steps
        report = _C.ReduceReport()
        index, key = entry.index, frozenset(entry.names)
        timed = self._choose_exchange(entry, buffer.device) if not dense and not shard_only else None
        trial = self._trial  # the trial this step's time belongs to (a rebuild may start a new one)
        label = f"module {entry.names[0]!r}" if shard_only else f"bucket {index}"  # FSDP's groups: by module
        held = [] if dense or shard_only else self._hold_unused(entry, buffer)

        def put_back(undone: bool = False) -> None:
            # What the exchange wrote into a held piece (zero for the step) is other ranks' mass:
            # SparDL with several teams leaves a team's sum in an owner's residual at an index
            # another team's owner took. It stays, on top of what was held; after a take-back
            # (``undone``), which undid this rank's part of the step, the piece is what was held.
            for piece, saved in held:
                if saved.is_cuda:  # read on this callback's stream, not the one it was cloned on
                    saved.record_stream(torch.cuda.current_stream(saved.device))
                if undone:
                    piece.copy_(saved)
                else:
                    piece.add_(saved)

        propagate = self._nonfinite == "propagate"
        try:
            future = self._engine.submit(
                buffer, residual, entry.method, dense, _ENGINE_POLICY[self._nonfinite], label, report, shard_only,
                entry.velocity, self._momentum, masking, propagate and residual is not None,
            )  # fmt: skip
        except BaseException:
            put_back()
            raise
        step = self._step
        if last:
            self._step += 1
            self._table.end_step()
        element_size = buffer.element_size()

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            put_back()
            try:
                value = fut.value()  # raises the engine's error, if any
            except Exception:
                self._propagated = None
                raise
            self._metrics.record(key, report, self._world_size, element_size)
            self._count_skips(index, label, report.skipped)
            if timed is not None and not report.skipped:
                trial.record(key, timed, report.exchange_seconds)
            if propagate:
                if report.skipped:
                    value.fill_(math.nan)
                self._propagate(step, key, report, residual, put_back, value, last)
            return value

        return future.then(finish)

    def _count_skips(self, index: int, label: str, skipped: bool) -> None:
        """Warns, on every rank (they skip together), when a bucket has skipped its update for
        NaN/Inf in residual + gradient in each of SKIPS_BEFORE_WARNING steps in a row: its
        parameters have stopped training, which neither policy that skips would say otherwise."""
        run = self._skipped_in_a_row.get(index, 0) + 1 if skipped else 0
        self._skipped_in_a_row[index] = run
        if run == SKIPS_BEFORE_WARNING:
            warnings.warn(
                f"{type(self).__name__}: {label} skipped its update on every rank in each of the last {run} steps "
                f"(nonfinite={self._nonfinite!r}), each time for NaN/Inf in residual + gradient, so its parameters "
                "have stopped training. Find the source (the loss, the learning rate, a float16 overflow: clip "
                'gradients or lower the loss scale), or construct the state with nonfinite="raise" to stop at the '
                "first such step with the ranks and counts named",
                RuntimeWarning,
                stacklevel=1,  # raised in a future's callback: no caller of the user's to point at
            )

    def _propagate(
        self,
        step: int,
        bucket: frozenset[str],
        report,
        residual: torch.Tensor | None,
        put_back: Callable[..., None],
        value: torch.Tensor,
        last: bool,
    ) -> None:
        """nonfinite="propagate": a step that hands back NaN in any bucket is skipped whole by the
        loss scaler (or whoever reads the NaN), so what the step's other buckets sent is applied
        nowhere. At the step's last bucket every such bucket takes back what its selection took from
        its residual (ReduceReport.taken_message), which leaves it residual + gradient, as a skipped
        bucket's (ruling 5): nothing is lost. A bucket reduced densely (a method-less one) passes
        NaN on as DDP does, and counts too, as does a float16 sparse bucket that handed back Inf from
        finite inputs (its all-reduce's sum rounded past 65504). The pieces held out of the step (_hold_unused) were put
        back after it, added to what the exchange wrote there; after the take-back, which undoes
        this rank's part of the step, they are put back as they were held (put_back(undone=True))."""
        pending = self._propagated
        if pending is None or pending.step != step:
            pending = self._propagated = _PropagatedStep(step)
        if value.is_cuda:  # this callback's stream waited for the bucket's job
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(value.device))
            pending.ready.append((value.device, ready))
        if report.skipped:
            pending.overflowed = True
        elif report.dense:
            pending.outputs.append(value)
        elif residual is not None:
            pending.taken.append(_Taken(bucket, report, residual, put_back))
            if value.dtype == torch.float16:
                pending.outputs.append(value)
        if last:
            self._settle_propagated()

    def _settle_propagated(self) -> None:
        """The end of a step under nonfinite="propagate" (its last bucket, or the end of the
        backward of DDP's first static-graph step for a state that cannot tell its last bucket):
        where the step handed back NaN anywhere, its sparse buckets take back what they sent
        (_propagate)."""
        pending, self._propagated = self._propagated, None
        if pending is None:
            return
        for device, ready in pending.ready:
            torch.cuda.current_stream(device).wait_event(ready)
        if pending.taken and (pending.overflowed or any(not bool(torch.isfinite(v).all()) for v in pending.outputs)):
            for taken in pending.taken:
                message = taken.report.taken_message(taken.residual.device)
                indices, values = torch.ops.gradsparse.unpack(message, taken.residual.dtype, taken.residual.numel())
                taken.residual.index_copy_(0, indices, values)
                taken.put_back(undone=True)
                self._metrics.withdraw(taken.bucket, taken.report)

    def _new_trial(self, step: int, chosen: dict[frozenset[str], str] | None) -> ExchangeTrial:
        """exchange="auto": a trial from the first sparse step at or after ``step``, or the decision ``chosen``."""
        return ExchangeTrial(max(step, self._warmup_steps), chosen)

    def _by_index(self, by_bucket: dict[frozenset[str], Any]) -> dict[int, Any]:
        """exchange="auto"'s figures or decisions, kept by the names of a bucket's parameters, by
        the index of the bucket that holds those parameters now (as stats() and the state dict,
        beside its layout, give them)."""
        layout = self._layout()
        return {i: by_bucket[key] for i, key in sorted(layout.items()) if key in by_bucket}

    def _layout(self) -> dict[int, frozenset[str]]:
        """The parameters' names of each bucket by index: the table's, or between a load and the
        step that puts it in place (which is reduced in it), the loaded layout."""
        if not self._table.buckets and self._loaded is not None:
            return {i: frozenset(names) for i, names in enumerate(self._loaded.saved["layout"]) if names}
        return {i: frozenset(bucket.names) for i, bucket in self._table.buckets.items()}

    def _choose_exchange(self, entry: Bucket, device: torch.device) -> str | None:
        """exchange="auto" at several ranks: sets the exchange of this sparse step of the bucket
        (gradsparse.exchange_trial); at the first bucket after the trial the ranks agree on the
        faster ones first. Returns the exchange when this step is one of the trial's timed ones.
        A method keeps the model's pick it was made with until the trial switches it. The timings
        are averaged on the buckets' ``device``: a group of NCCL alone reduces no CPU tensor."""
        trial = self._trial
        if trial is None:
            return None
        key = frozenset(entry.names)
        if trial.decided and key not in trial.chosen:
            # A bucket of other parameters than any decided on (DDP's buckets differ from those of
            # the run that decided: another bucket_cap_mb): timed, the others keep their exchange.
            trial = self._trial = trial.reopen(self._step)
        if trial.due(self._step):
            entries = [self._table.buckets[i] for i in sorted(self._table.buckets)]
            keys = [frozenset(bucket.names) for bucket in entries]
            figures = trial.medians(keys).to(device)
            trial.decide(self._average(figures, "the timings of exchange=auto"), keys, self._step)
            for bucket_key, bucket in zip(keys, entries, strict=True):  # not timed on every rank: the model's pick
                if trial.decided and bucket_key not in trial.chosen:
                    trial.chosen[bucket_key] = self._faster_exchange(sum(bucket.numels), bucket.value_bytes)
        exchange = trial.exchange_at(key, self._step)
        if exchange is not None:
            entry.method.set_exchange(exchange)
        return exchange if trial.timed(key) else None

    def _in_saved_layout(self) -> bool:
        """Whether this step, though not the first after the load, is reduced in the saved layout:
        DDP rebuilds its buckets after the first step, but with ``static_graph=True`` only after the
        second, so a new DDP reduces two steps in its first layout where the saved run had rebuilt."""
        ddp = self._binding.model()
        if self._saved_layout is None or ddp is None:
            return False
        rebuilds = ddp.static_graph or not ddp.find_unused_parameters  # as DDP's reducer decides
        if not rebuilds or getattr(ddp, "_has_rebuilt_buckets", True):
            self._saved_layout = None
        return self._saved_layout is not None

    def _defer(self, buffer: torch.Tensor, params: list[torch.Tensor], index: int, last: bool) -> torch.futures.Future:
        """The first step after load_state_dict: DDP hands its buckets in the layout of a fresh
        process (parameter order), which need not be the layout the saved run reduced in. The
        buckets are held until the last one arrives, then reduced in the saved layout, so that a
        resumed run does exactly what the uninterrupted run would have done."""
        gate = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        if index == 0 and self._deferred:
            # DDP starts every step at bucket 0: what is still held was left by a backward that
            # stopped half-way (or by a DDP wrapper since replaced). Nothing of it was reduced, and
            # its residuals wait by name; held on, it would be reduced again with this step's.
            _release(self._deferred)
            self._deferred = []
        self._deferred.append((buffer, params, gate))
        if last:  # on an error, _reduce_in_saved_layout releases what it held
            held, self._deferred = self._deferred, []
            self._reduce_in_saved_layout(held)
        # DDP reads what a future holds as a tensor: an error set on the gate reaches it through
        # then(), as a failed future, not as a Python object that is no tensor.
        return gate.then(_value)

    def _reduce_in_saved_layout(self, held: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]]):
        """Reduces the held buckets in the saved layout. An error before the last saved bucket was
        handed to the engine raises (the step fails, as at any bucket): the saved buckets handed
        over before it are reduced and copied into DDP's buckets, the others go back untouched
        with their residuals waiting by name, as when a bucket of an ordinary step fails; when
        none was handed over, the next step runs the saved layout again."""
        where: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (parameter, its slice of DDP's bucket)
        current: list[list[str]] = []
        for buffer, params, _ in held:
            names = [self._binding.name(p) for p in params]
            current.append(names)
            for name, p, view in zip(names, params, buffer.split([p.numel() for p in params]), strict=True):
                where[name] = (p, view)
        layout = self._loaded.layout if self._loaded is not None else self._saved_layout
        if layout == current or sorted(n for names in layout for n in names) != sorted(where):
            # The same layout, or one that does not cover this model: DDP's own buckets.
            layout = current
        self._saved_layout = None if layout is current else layout
        loaded, self._loaded = self._loaded, None
        futures, copies = [], []

        def deliver(done: torch.futures.Future) -> None:
            try:
                for fut in done.value():
                    fut.value()  # raises the engine's error, if any
                for buffer, views in copies:
                    for view, piece in zip(views, buffer.split([v.numel() for v in views]), strict=True):
                        view.copy_(piece)
            except Exception as e:
                for _, _, fut in held:
                    if not fut.done():
                        fut.set_exception(e)
                return
            _release(held)

        try:
            for index, names in enumerate(layout):
                params = [where[n][0] for n in names]
                views = [where[n][1] for n in names]
                buffer = held[index][0] if layout is current else torch.cat(views)
                entry = self._bucket(index, params, buffer)
                futures.append(self._submit(entry, buffer, index == len(layout) - 1))
                if layout is not current:
                    copies.append((buffer, views))
        except BaseException:
            if not futures:  # nothing reduced: the next step is still the first after the load
                self._loaded = loaded
            raise
        finally:  # what was handed to the engine reaches DDP's buckets, even when a later bucket failed
            torch.futures.collect_all(futures).add_done_callback(deliver)

    def _reduce_flat(self, index: int, name: str, flat: torch.Tensor, groups: int) -> torch.futures.Future:
        """Reduces one FSDP parameter group's flat gradient in place (gradsparse.fsdp): bucket
        ``index`` of ``groups`` per step, with one residual named ``name``; only this rank's shard
        (its 1/P of ``flat``, in rank order) of the result is wanted."""
        if flat.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"gradsparse.fsdp: module {name!r} reduces {flat.dtype} gradients, but gradsparse sparsifies "
                "float32, float16 and bfloat16 ones; set FSDP's MixedPrecisionPolicy(reduce_dtype=torch.float32)"
            )
        if index in self._sharded_called:  # a group reduced twice: the groups missing last step sent nothing
            self._sharded_called.clear()
            self._step += 1
        numel = flat.numel()
        expected = self._binding.numels.get(name, numel)
        if numel > expected:
            raise RuntimeError(unfrozen_since(name, numel, expected))
        if numel < expected:  # at every step: a parameter may get a gradient in some steps only
            raise RuntimeError(
                f"gradsparse.fsdp: module {name!r} hands over {numel} gradient elements where its parameters "
                f"that require gradients hold {expected} (padded): some of them got no gradient in this "
                "backward (FSDP reduces only the gradients it has). gradsparse keeps one residual per module "
                "and needs the same parameters to get gradients at every step: freeze a parameter that is "
                "never used (requires_grad_(False)) before gradsparse.fsdp.sparsify, or give the module a "
                "fully_shard of its own"
            )
        entry = self._table.buckets.get(index)
        if entry is None:
            entry = self._table.add(
                index, [name], [[numel]], [None], lambda: self._make_method([numel], flat.element_size()), flat
            )
        last = len(self._sharded_called | {index}) == groups
        future = self._submit(entry, flat, last, shard_only=True)
        # Recorded once the engine has taken it: a group refused above was not reduced in this step.
        self._sharded_called.add(index)
        # A group has moved on from what was loaded: state_dict() returns the live residuals (what
        # the groups not reduced yet wait for is parked by name, and saved with them), also when
        # this step leaves a group out.
        self._loaded = None
        if last:
            self._sharded_called.clear()
        return future

    # ----------------------------------------------------------------------------------------
    # Public API

    @property
    def step(self) -> int:
        """Completed steps (incremented when DDP's last bucket of a step is submitted; under FSDP,
        the last module's). Under FSDP a step in which a module reduced nothing (it got no
        gradient) is counted when the next step's first module reduces, the first sign that it
        ended: while a module gets none, the count is one behind after each backward; checkpoints
        hold the full count. A state dict loaded before init_process_group counts from the process
        group's creation on (until then this rank, and so its part of the state dict, is not known)."""
        self._load_unchecked()
        return self._step

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The model's process group (the default group unless one was given)."""
        return self._process_group or self._group_option or dist.group.WORLD

    def stats(self, reset: bool = False) -> dict:
        """Statistics since creation (or the last reset), per bucket and in total. A bucket's
        counters are kept by its parameters (DDP's first step, and a run resumed with another
        ``bucket_cap_mb``, reduce in other buckets than the steps after them): ``buckets`` gives
        those of the current buckets by index, the total those of every bucket counted.

        Keys: ``steps``, ``dense_steps`` and ``skipped_steps`` (in total, the most of any parameter
        over the buckets that held it: ``nonfinite="skip"`` skips bucket by bucket); ``elements`` reduced and
        ``elements_sent`` by this rank; ``selected`` (pairs this rank sent) and
        ``selected_all`` (all ranks); ``density`` (achieved: selected / elements of sparse
        steps; a skipped step counts in no density), ``global_density`` (all ranks: selected_all / (elements * P)) and
        ``union_density`` (elements the exchanges wrote / elements; gather-and-add, which adds
        every rank's pairs without merging them, counts each pair, so there it is selected_all /
        elements and exceeds 1 where the ranks chose the same elements); in total only,
        ``achieved_density``, the one the method's ``density`` targets: ``union_density`` for MiCRO, ExDyna and SparDL
        (one target for all ranks together), ``density`` for the others; ``bytes_sent`` and ``bytes_received`` by this
        rank, ``dense_bytes`` (what a ring all-reduce of the same elements sends) and
        ``bytes_ratio``; ``select_seconds`` (this rank's selection, momentum correction included) and ``exchange_seconds``
        (this rank's time in the exchange's collectives, which includes waiting for the slowest
        rank to arrive: a rank whose backward ends first shows the longest exchange); ``imbalance`` (MiCRO and
        ExDyna: the mean over steps of max count * P / total count - 1); per bucket also
        ``numel``, the last ``threshold`` (NaN for methods without one) and ``exchange`` (the
        exchange of its last step, by its glossary name: what ``exchange="auto"`` chose). With
        ``exchange="auto"`` at several ranks, ``exchange_trial``: None while its trial alternates
        the exchanges, then per bucket index each exchange's median seconds in the trial,
        averaged over the ranks (after a resume, of the buckets timed again: none where the saved
        decision covered the buckets' parameters).
        """
        check_bool(f"{type(self).__name__}.stats", "reset", reset)
        self._load_unchecked()
        summary = self._metrics.summary(self._world_size, self._layout(), self._GLOBAL_TARGET)
        if self._trial is not None:
            trial = self._trial
            summary["exchange_trial"] = (
                {i: dict(m) for i, m in self._by_index(trial.means).items()} if trial.decided else None
            )
        if reset:
            self._metrics.reset()
        return summary

    def state_dict(self) -> dict:
        """This rank's state: residuals by parameter name (the model's own names, without wrapper
        prefixes such as ``module.`` or ``_orig_mod.``), method states, the bucket layout, the step
        and statistics.

        Residuals are per rank: save one state dict per rank (for example with the rank in the
        file name), or all ranks' in one file with :class:`gradsparse.AllRanks`. The tensors are
        the live residuals, like an optimizer's state dict. Between load_state_dict() and the next
        step, the loaded state is returned as it was loaded, as this rank's.
        """
        owner = type(self).__name__
        self._load_unchecked()
        if self._unchecked is not None:  # before init_process_group: this rank is not known yet
            return self._unchecked[0]
        rank, world_size = self._rank, self._world_size
        if self._engine is None and dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        if world_size > 1 and called_by_dcp():
            raise TypeError(
                f"{owner}.state_dict: torch.distributed.checkpoint (dcp.save or dcp.load) was handed the {owner} "
                f"state itself, on {world_size} ranks; its residuals, method states and statistics differ by rank, and "
                "DCP takes them for the same on every rank: it would save one rank's (the other ranks' gradient mass "
                "lost) and load that rank's on every rank. Hand it over as gradsparse.ShardedState(state), which "
                "gives DCP one block per rank: dcp.save({..., 'gradsparse': gradsparse.ShardedState(state)}) and "
                "the same in dcp.load"
            )
        if self._loaded is not None:  # this rank's now, though loaded from another's (any_rank=True)
            # with the options it loaded under: an AllRanks part's own config does not hold the
            # momentum changed on purpose in the state dict's (load_state_dict)
            config = self._saved_config()
            return dict(self._loaded.saved, rank=rank, config=config, stats=self._metrics.state_dict())
        if self._table.holds_state() and not self._binding.is_named():
            raise ValueError(
                f"{owner}.state_dict: this state does not know its model's parameter names (it was registered with "
                "model.register_comm_hook), so its residuals cannot be saved under them; register it with "
                "gradsparse.register(ddp_model, state) instead"
            )
        residuals = self._table.tensors("residual")
        velocities = self._table.tensors("velocity")
        return {
            "version": STATE_DICT_VERSION,
            "class": owner,
            "config": self._saved_config(),
            # Under FSDP a step in which some module reduced nothing is counted at the next step's
            # first module that reduces again (_reduce_flat): saved between the two, it is over.
            "step": self._step + (1 if self._sharded_called else 0),
            "rank": rank,
            "world_size": world_size,
            # under FSDP each residual is a module's flat gradient, laid out by the world size (no reshard)
            "fsdp": self._binding.sharded is not None,
            **with_checksums(residuals, velocities),  # velocities: momentum correction's (empty without it)
            # the parameters whose residuals hold their elements in another order than row-major (channels_last)
            "strides": self._table.strides(),
            "methods": self._table.methods(),
            "layout": self._table.layout(),
            # method states that a rebuild or a load left waiting for their bucket, when a bucket's
            # error stopped the step before it (their residuals are in "residuals" by name)
            "parked_methods": self._table.parked_method_states(),
            "stats": self._metrics.state_dict(),
            # exchange="auto": the link its first picks come from, and what its trial kept
            "link": self._link,
            "exchanges": None if self._trial is None or not self._trial.decided else self._by_index(self._trial.chosen),
            # set_scaler: the loss scale residuals, velocities and method states are in
            "loss_scale": self._table.scale,
        }

    def load_state_dict(self, state_dict: dict, *, any_rank: bool = False) -> None:
        """Restores a state dict saved by the same method with the same options (the method's, and
        ``error_feedback`` and ``momentum``, which decide what state is kept), on the same rank of
        the same world size (``any_rank=True`` accepts another rank's). A state dict of
        :class:`gradsparse.AllRanks` gives each rank its own part.

        Residuals are put back by parameter name at the next step; that step is reduced in the
        saved bucket layout, so a resumed run repeats the uninterrupted run bit for bit. Loading
        before the process group exists is fine: the rank checks then run once it exists (in
        setup(), or at the first state_dict(), step or stats() before it).

        A state dict refused on one rank is refused on every rank, naming that rank and why, and
        no rank loads it (each rank's state is left as it was): the other ranks would otherwise
        go on training and wait for that rank in their first step until the state's ``timeout``.
        Loaded before set-up, the set-up's agreement refuses it on every rank (a load after
        init_process_group is checked at once too, and raises on its own rank then). After set-up,
        with more than one rank, load_state_dict is collective: every rank of the state's group
        calls it, each with its own state dict (as resuming from per-rank files does, and
        :class:`gradsparse.AllRanks` and :class:`gradsparse.ShardedState`); a rank that does not
        makes the others fail after the state's ``timeout``, saying so. State dicts of different
        steps on different ranks (files of two checkpoints) are refused on every rank alike.
        """
        if self._engine is None or self._world_size == 1:
            self._checked(state_dict, any_rank)()
            return
        refusal, load = None, None
        try:
            load = self._checked(state_dict, any_rank)
        except Exception as e:  # any error: one left to this rank alone would leave the others waiting
            refusal = e
        self._agree_on_load(refusal, None if load is None else load.step)
        load()

    def _checked(self, state_dict: dict, any_rank: bool) -> _Load:
        """load_state_dict's checks of ``state_dict`` (which raise): returns what loads it."""
        owner = type(self).__name__
        check_bool(f"{owner}.load_state_dict", "any_rank", any_rank)
        state_dict = upgrade(owner, state_dict)
        mine = self._saved_config()
        # A method option added since the state dict was saved takes its default; error feedback and
        # momentum, which older state dicts do not name, are not compared with theirs.
        saved_config = {
            **{o.name: o.default for o in self.OPTIONS},
            **{k: mine[k] for k in self._STATE_OPTIONS},
            **state_dict["config"],
        }
        if state_dict["class"] != owner:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict was saved by {state_dict['class']}"
                f"({state_dict['config']}) but this state is {owner}({mine}); create the same method with the same "
                "options before loading"
            )
        unknown = sorted(set(state_dict["config"]) - set(mine), key=str)
        if unknown:  # no state of this version can be created with it
            options = ", ".join(f"{k}={state_dict['config'][k]!r}" for k in unknown)
            removal = "; ".join(f"del sd['config'][{k!r}]" for k in unknown)
            raise ValueError(
                f"{owner}.load_state_dict: the state dict comes from a later gradsparse version, with "
                f"option{'s' if len(unknown) > 1 else ''} {options} that {owner} of this version "
                f"(gradsparse {_version()}) does not know; upgrade gradsparse to resume with "
                f"{'them' if len(unknown) > 1 else 'it'}, or remove {'them' if len(unknown) > 1 else 'it'} from the "
                f"state dict ({removal}) to resume with this version's default"
            )
        differ = [k for k in sorted(saved_config.keys() | mine.keys()) if saved_config.get(k) != mine.get(k)]
        if differ:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict was saved with other options ("
                + ", ".join(f"{k}={saved_config.get(k)!r} saved, {mine.get(k)!r} here" for k in differ)
                + f"); create {owner} with the saved options before loading"
                + (
                    " (to change the momentum on purpose, set the state dict's config['momentum'] first: the saved "
                    "velocities are then dropped, or start at zero)"
                    if "momentum" in differ
                    else ""
                )
            )
        if self._engine is None and not (dist.is_available() and dist.is_initialized()):
            # checked against this rank in setup(), which reads its step then
            return _Load(None, lambda: setattr(self, "_unchecked", (state_dict, any_rank)))
        return self._read(state_dict, any_rank)

    def _agree_on_load(self, refusal: Exception | None, step: int | None = None) -> None:
        """After set-up: every rank of the state's group tells the others whether it refused a state
        dict (``refusal``) and the step it would resume at (``step``; None: no step to compare), on
        the exchanges' own group (between steps, when the engine has nothing in flight), bounded by
        the state's timeout; refused anywhere, or at different steps, it raises on every rank."""
        owner = type(self).__name__
        if self._world_size == 1:
            self._refuse_where_refused(refusal, [])
            return
        if self._comm is None:
            raise RuntimeError(f"{owner}: this state was closed (state.close()); create a new state and load into it")
        try:
            gathered = self._gather_beside_the_exchanges((_verdict(refusal), step))
        except RuntimeError as e:  # c10d's errors (DistBackendError, DistStoreError) derive from it
            if refusal is not None:
                raise refusal from e
            raise RuntimeError(
                f"{owner}.load_state_dict: after set-up, loading is collective: every rank of the process group "
                f"{group_ranks(self.process_group)} loads its own state dict, so that one refused on any rank is "
                f"refused on every rank, but not every rank called load_state_dict (or gradsparse.register, "
                f"gradsparse.fsdp.sparsify of a loaded state) within the state's timeout "
                f"({self._wait_timeout.total_seconds():g} s): {e}. Call state.load_state_dict(torch.load("
                'f"gradsparse-rank{rank}.pt")) on every rank, or load gradsparse.AllRanks\' file on every rank'
            ) from e
        self._refuse_where_refused(refusal, [verdict for verdict, _ in gathered], [step for _, step in gathered])

    def _gather_beside_the_exchanges(self, mine: Any) -> list[Any]:
        """Every rank's ``mine``, by rank of the state's group, through the rendezvous store (keys
        named after the exchanges' own group), bounded by the state's timeout. Not a collective on
        that group: a rank that loads while another trains (a load under ``if rank == 0:``) met the
        other rank's exchange there, and Gloo, matching the two, aborted the process. Where there
        is no store (the MPI backend's group), an object all-gather on that group."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            store = None
        if store is None:
            gathered: list[Any] = [None] * self._world_size
            dist.all_gather_object(gathered, mine, group=self._comm)
            return gathered
        prefix = f"gradsparse/{self._comm.group_name}/agreement/{self._agreements + 1}/"
        store.set(f"{prefix}{self._rank}", pickle.dumps(mine))
        keys = [f"{prefix}{r}" for r in range(self._world_size)]
        try:
            store.wait(keys, self._wait_timeout)
        except RuntimeError:
            # Not every rank came: this rank takes its answer back and does not count the agreement,
            # so that a later one on every rank (the fix the caller's error names) meets at one key.
            store.delete_key(f"{prefix}{self._rank}")
            raise
        self._agreements += 1
        return [pickle.loads(store.get(key)) for key in keys]

    def _refuse_where_refused(
        self, refusal: Exception | None, verdicts: list[str | None], steps: list[int | None] | None = None
    ) -> None:
        """Raises ``refusal`` (this rank's), or where another rank refused its state dict (``verdicts``,
        by rank of the state's group: None where it was accepted), an error that names it and why;
        or, where the ranks would resume at different ``steps`` (None: not known), one that names them."""
        if refusal is not None:
            raise refusal
        refused = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
        ranks = group_ranks(self.process_group)
        if not refused and steps and None not in steps:
            check_same_steps(
                f"{type(self).__name__}.load_state_dict",
                steps,
                ranks,
                "none is loaded (this rank's state is left as it was), as files of different checkpoints, a save "
                "stopped on some ranks, or a load on some ranks only, cannot resume together (the ranks' residuals "
                "and method states would be of different steps). Load one checkpoint on every rank (each rank its "
                "own file of it, or the same AllRanks file), in the run that saved it once every rank's write has "
                "ended (accelerator.wait_for_everyone() after Accelerate's save_state)",
            )
        if not refused:
            return
        raise ValueError(
            f"{type(self).__name__}.load_state_dict: the state dict of "
            + "; ".join(f"rank {ranks[rank]} was refused there: {verdict}" for rank, verdict in refused)
            + ". So it is refused on every rank (this rank's state is left as it was), rather than the other ranks "
            "training on and waiting for that rank in their first step: load an intact checkpoint on that rank (its "
            "own file, as saved), then load again on every rank"
        )

    def _check_method_states(self, state_dict: dict, part: str = "") -> None:
        """Each saved method state (of the buckets, and those parked) loads into a new method
        object now, so that one the method refuses ('step' NaN or 2.5) raises here, not in the
        first backward after the load (``part``: which rank's part of the state dict, for the
        message)."""
        entries = [(f"methods[{i}]", saved) for i, saved in enumerate(state_dict["methods"])]
        entries += [
            (f"parked_methods[{i}]['state']", e["state"]) for i, e in enumerate(state_dict.get("parked_methods", []))
        ]
        for entry, saved in entries:
            if saved is None or self._CORE is None:
                continue
            try:
                self._make_method([1]).load_state(saved)
            except (ValueError, IndexError, KeyError) as e:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict{part}: the state dict's {entry} is refused by "
                    f"the method: {e}"
                ) from e

    def _load_unchecked(self) -> None:
        """A state dict loaded before init_process_group is loaded once the process group exists,
        as a load then would have been: state_dict(), step and stats() read this rank's part of
        it from then on, not the whole state dict (an AllRanks one nested in a new AllRanks file).

        Before set-up it stays pending until it loads, so a load that fails raises here and again
        in setup(). setup() takes it itself: its agreement carries each rank's verdict, so that a
        load refused on one rank is refused on every rank, and leaves the state set up without it."""
        if self._unchecked is None or self._engine is not None or not (dist.is_available() and dist.is_initialized()):
            return
        saved, any_rank = self._unchecked
        self._read(saved, any_rank)()
        self._unchecked = None

    def _read(self, state_dict: dict, any_rank: bool) -> _Load:
        """Checks and reads everything that loading ``state_dict`` puts in place (it raises where
        the state dict is refused), and returns what puts it in place."""
        group = self.process_group
        parts = state_dict.get("ranks") if state_dict.get("all_ranks") else None
        state_dict = this_ranks(
            type(self).__name__, state_dict, dist.get_rank(group), dist.get_world_size(group), any_rank
        )
        # Of a state dict of every rank (AllRanks), every part is checked on every rank, so that
        # every rank refuses it alike (this_ranks).
        self._check_names(parts, state_dict)
        for part in parts or [state_dict]:
            self._check_method_states(part, _part_label(parts, part))
        # Everything the load puts in place is read first, so that a state dict that fails on the
        # way leaves this state as it was (its step, residuals and statistics), not half loaded.
        step = int(state_dict["step"])
        loaded = Loaded(state_dict, parts)
        link = None if state_dict.get("link") is None else tuple(state_dict["link"])
        metrics = Metrics()
        metrics.load_state_dict(saved_stats(state_dict))
        exchanges = loaded.exchanges()
        # A state dict whose momentum was changed on purpose (load_state_dict): velocities saved
        # with momentum are dropped when this state has none, and start at zero in the opposite case.
        velocities = state_dict.get("velocities", {}) if self._momentum else {}
        return _Load(step, lambda: self._put_in_place(state_dict, loaded, step, link, exchanges, velocities, metrics))

    def _put_in_place(
        self, state_dict: dict, loaded: Loaded, step: int, link, exchanges, velocities: dict, metrics: Metrics
    ) -> None:
        """Loads what _read read. Before set-up it keeps what it replaces, which set-up puts back
        where its agreement refuses the load (another rank refused its own, or resumes at another step)."""
        if self._engine is None:
            replaced = ("_step", "_loaded", "_link", "_saved_exchanges", "_trial", "_metrics", "_scale_read_at")
            self._before_load = {name: getattr(self, name) for name in replaced}
            self._before_load.update(_table=self._table.copy(), _sharded_called=set(self._sharded_called))
        # exchange="auto": the saved decision, or a new trial; before set-up, set-up starts it
        trial = None if self._trial is None else self._new_trial(step, exchanges)
        self._table.park(
            {"residual": state_dict["residuals"], "velocity": velocities},
            loaded.method_states(),
            float(state_dict.get("loss_scale", 1.0)),  # 1: saved before set_scaler existed
            state_dict.get("strides"),  # None: saved before memory orders were recorded
        )
        self._scale_read_at = None  # the next step moves them to its own loss scale
        self._step = step
        self._sharded_called.clear()  # the saved step counts any step left uncounted (state_dict)
        self._loaded = loaded
        if link is not None:
            self._link = link
        self._saved_exchanges = exchanges
        if trial is not None:
            self._trial = trial
        self._metrics = metrics

    def set_scaler(self, scaler) -> State:
        """Float16 loss scaling: ``scaler`` (a ``torch.amp.GradScaler``, or anything with its
        ``get_scale()``) multiplies the loss, and so the gradients, by its scale, which it halves
        after a step whose gradients overflowed and raises after a run of good ones. The
        residuals, velocities and the thresholds a method carries are gradient waiting to be
        sent, in the scale of the step that left them: at each step's first bucket the state
        reads the scaler's scale and moves them to it (GradScaler's factors are powers of two,
        so they move exactly), and the scale they are in is saved in the state dict. A sparse
        state needs ``nonfinite="propagate"`` here, so that an overflow reaches the scaler as
        NaN gradients on every rank. ``None`` stops following a scaler (the state moves back
        to scale 1 at its next step). Returns the state.

        Example::

            >>> scaler = torch.amp.GradScaler("cuda")
            >>> state = gradsparse.TopK(density=0.01, nonfinite="propagate").set_scaler(scaler)
            >>> gradsparse.register(ddp_model, state)
            >>> scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
        """
        owner = f"{type(self).__name__}.set_scaler"
        if isinstance(scaler, type):  # its get_scale() is callable, but only on an instance
            raise TypeError(
                f"{owner}: scaler must be a torch.amp.GradScaler (anything with get_scale()) or None, got the class "
                f'{scaler.__name__} itself; create one, for example torch.amp.GradScaler("cuda"), and pass it to '
                "set_scaler and to the training loop alike"
            )
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(
                f"{owner}: scaler must be a torch.amp.GradScaler (anything with get_scale()) or None, got "
                f"{type(scaler).__name__}; pass the GradScaler whose scale() multiplies the loss"
            )
        if scaler is not None and self._CORE is not None and self._nonfinite != "propagate":
            raise ValueError(
                f"{owner}: a GradScaler finds the steps whose scaled gradients overflowed by their Inf/NaN, but "
                f"nonfinite={self._nonfinite!r} hands none back, so the scale would never come down; create "
                f'{type(self).__name__} with nonfinite="propagate"'
            )
        self._scaler = scaler
        return self

    @contextlib.contextmanager
    def paused(self):
        """Within this block the hook hands every bucket back unreduced (under FSDP, each rank's
        shard of its own gradient) and the state does not change: no selection, no
        communication, no step counted. For an iteration whose gradients are thrown away. Blocks
        nest: leaving an inner one leaves the state paused until the outer one ends."""
        paused, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = paused

    def close(self) -> None:
        """Stops the engine thread after the queued work and gives back the state's own process
        group (also done at interpreter exit). A closed state trains no more: create a new one. In
        a process forked from the one that set the state up, nothing of that process is touched."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()  # in a forked process the C++ engine leaves the thread it does not have
        comm, self._comm = getattr(self, "_comm", None), None
        if getattr(self, "_abandoned", None) is not None:
            self._abandoned.detach()
        # Each state's group holds threads and connections of its own (three threads and five
        # sockets on Gloo), which stayed until the job's destroy_process_group().
        _give_back_own(comm, self._process_group, self._pid)

    def _forked(self) -> bool:
        """Whether this process was forked from the one that set the state up."""
        return getattr(self, "_pid", None) not in (None, os.getpid())

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({options})"


def _part_label(parts: list[dict] | None, part: dict) -> str:
    """Which rank's part of a state dict of every rank ``part`` is, for a message ("" for a
    state dict of one rank)."""
    return "" if parts is None else f" (rank {part['rank']}'s part)"


def unfrozen_since(module: str, numel: int, expected: int) -> str:
    """The error of an FSDP module that hands over more gradient elements (``numel``) than its
    parameters that required gradients held (``expected``) at gradsparse.fsdp.sparsify."""
    return (
        f"gradsparse.fsdp: module {module!r} hands over {numel} gradient elements where its parameters that "
        f"required gradients at gradsparse.fsdp.sparsify held {expected} (padded): a parameter was unfrozen "
        "since (requires_grad_(True)). gradsparse lays out one residual per module at sparsify, for the "
        "parameters that train then: unfreeze parameters before gradsparse.fsdp.sparsify, or sparsify the "
        "model again with a new state after unfreezing (its residuals start from zero)"
    )


def _version() -> str:
    from gradsparse import __version__

    return __version__


def _wire() -> str:
    """This installation's version and the version of what its ranks exchange (messages, control
    words), which every rank of a group must share."""
    return f"gradsparse {_version()} (wire version {_C.WIRE_VERSION})"


def _wire_of(entry: tuple) -> str:
    """The version a rank's set-up entry names (one of a gradsparse that sent none: no version)."""
    return entry[0] if len(entry) >= 3 else "an earlier gradsparse (wire version 1)"


class _Load(NamedTuple):
    """What loading a checked state dict puts in place (State._read), and the step it resumes at
    (None before init_process_group, where this rank's part is not known yet)."""

    step: int | None
    put_in_place: Callable[[], None]

    def __call__(self) -> None:
        self.put_in_place()


def _verdict(refusal: Exception | None) -> str | None:
    """What a rank tells the others of its load: None (accepted), or why it was refused."""
    return None if refusal is None else f"{type(refusal).__name__}: {refusal}"


def _release(held: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]]) -> None:
    """Hands held DDP buckets back as they are now."""
    for buffer, _, gate in held:
        if not gate.done():
            gate.set_result(buffer)


def _value(future: torch.futures.Future):
    return future.value()


def _give_back_own(comm: dist.ProcessGroup | None, group: dist.ProcessGroup, pid: int | None) -> None:
    """Gives back a state's own group ``comm`` made over ``group`` by the process ``pid`` (at
    close(), or where every rank refused the set-up: each refusal kept three threads and five
    sockets on Gloo). Not a sub-group's: torch names those by their ranks alone
    (use_local_synchronization), and a rank that destroyed one before another rank did named
    the next one differently (their set-up then never met)."""
    if comm is not None and group is dist.group.WORLD:
        _give_back(comm, pid)


def _torch_mpi_threads(backend: str) -> int:
    """The threads of this process that torch.distributed's ``backend`` (dist.get_backend's name:
    "mpi", or per device as "cpu:mpi,cuda:nccl") has call MPI: ProcessGroupMPI's worker, 1. Torch
    initialises MPI at MPI_THREAD_SERIALIZED, which admits no engine thread beside it."""
    return int("mpi" in re.split(r"[:,]", backend))


def _end_the_mpi_job_on_an_uncaught_error(rank: int) -> None:
    """transport="mpi": a process that dies of an uncaught exception ends the whole MPI job
    (MPI_Abort) once its traceback is printed. Otherwise its exit runs MPI_Finalize, which waits
    for every other rank while they wait in a collective for this one: the job hung for ever,
    where mpirun ends it at once when a rank exits without finalising. Installed once, in front
    of the hook found (sys.excepthook); ``rank`` is this process's MPI rank."""
    previous = sys.excepthook
    if getattr(previous, "_gradsparse_mpi", False):
        return

    def end_the_job(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        print(
            f"gradsparse: rank {rank} ends the MPI job (MPI_Abort) after its uncaught {kind.__name__}", file=sys.stderr
        )
        sys.stderr.flush()
        _C.mpi_abort(1)

    end_the_job._gradsparse_mpi = True  # type: ignore[attr-defined]
    sys.excepthook = end_the_job


def _queue_callback(callback) -> None:
    """Runs ``callback`` when the backward pass under way ends: torch.autograd.graph's public
    queue_callback (torch 2.15 on), else the engine's own."""
    queue = getattr(torch.autograd.graph, "queue_callback", None)
    (queue or torch.autograd.Variable._execution_engine.queue_callback)(callback)


def _done(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _after_ddp(callback: Callable[[], None]) -> bool:
    """Queues ``callback`` to run when the backward pass under way ends, after DDP has ended its
    step: queued from a callback, it runs after every callback queued before that one ran, DDP's
    end of step (finalize_backward) among them, which waits for every bucket's future. False
    outside a backward (DDP's join hook calls hooks there), where nothing is queued."""
    try:
        _queue_callback(lambda: _queue_callback(callback))
    except RuntimeError:
        return False
    return True


def _failed(error: Exception, bucket: dist.GradBucket) -> torch.futures.Future:
    """What a DDP hook returns for a ``bucket`` whose reduction raised ``error``: during a backward,
    the bucket's buffer as it was, with ``error`` raised when the backward ends (_after_ddp);
    elsewhere a future that raises it. Neither an exception thrown inside DDP's hook call nor a
    failed future lets DDP end its step: the first left its reducer half-way (every later step
    then died in one of PyTorch's internal asserts); at the second, DDP's end of step raises
    before it resets its record of the parameters used, so under find_unused_parameters=True
    every later step failed ("Expected to have finished reduction in the prior iteration")."""

    def fail(_: torch.futures.Future | None = None) -> torch.Tensor:
        raise error

    return _done(bucket.buffer()) if _after_ddp(fail) else _done(None).then(fail)


def _failing_late(future: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
    """``future`` as DDP is to get it (_failed): during a backward, a future that completes with
    ``future``'s value, or where that raises, with ``bucket``'s buffer as it was, and the error
    raised when the backward ends; elsewhere ``future`` itself."""
    buffer = bucket.buffer()
    errors: list[Exception] = []

    def fail() -> None:
        if errors:
            raise errors[0]

    if not _after_ddp(fail):
        return future

    def kept(done: torch.futures.Future) -> torch.Tensor:
        try:
            return done.value()
        except Exception as error:  # DDP waits for this future before its end of step, and fail after it
            errors.append(error)
            return buffer

    return future.then(kept)
