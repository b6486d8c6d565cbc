"""State classes of the gradsparse DDP communication hook: one per selection method.

A state holds, per DDP bucket, the selection method's C++ object, the error-feedback residual and
the statistics, and owns the engine thread that runs the exchanges.

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
import inspect
import weakref
import zlib
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse import _C
from gradsparse.config import (
    REQUIRED,
    Option,
    check_bool,
    check_choice,
    check_int,
    check_timeout,
)
from gradsparse.metrics import Metrics
from gradsparse.wrappers import find_ddp, parameter_names, strip_wrapper_prefixes

__all__ = ["State"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STATE_DICT_VERSION = 2  # 2: residual names without wrapper prefixes, layout as lists of names
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_LIVE_STATES: weakref.WeakSet[State] = weakref.WeakSet()


@atexit.register
def _close_all_states() -> None:
    # Stop every engine thread before the interpreter tears down (the GIL is released while
    # they finish, so a pending callback cannot deadlock the exit).
    for state in list(_LIVE_STATES):
        state.close()


class _Bucket:
    """One bucket's layout, method object and residual."""

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


class _Pending:
    """What load_state_dict restored, waiting for the buckets it belongs to (consumed at the first
    step after the load; returned as it is by state_dict() until then)."""

    def __init__(self, saved: dict) -> None:
        self.saved = saved  # the state dict as given (version 2), for state_dict() before a step
        self.residuals: dict[str, torch.Tensor] = {n: t.detach().clone() for n, t in saved["residuals"].items()}
        # A method's state goes to the bucket holding the same parameters (by name), else to the
        # bucket of the same index.
        self.methods: dict[Any, dict[str, float]] = {}
        layout = saved["layout"]
        for index, state in enumerate(saved["methods"]):
            if state is not None:
                key = frozenset(layout[index]) if index < len(layout) and layout[index] else index
                self.methods[key] = dict(state)
        self.layout: list[list[str]] = [list(names) for names in layout if names]


class State:
    """Base class of every gradsparse state; use a subclass such as :class:`TopK`.

    Options shared by every method (keyword-only):

    - ``process_group``: the group the model's DDP reduces over (None: the default group). The
      state must be created on every rank of that group, with the same options.
    - ``warmup_steps`` (0): steps that use a dense all-reduce before sparsification starts.
      DDP rebuilds its buckets after the first step; gradsparse re-maps residuals by parameter
      when that happens, so no warm-up is needed for correctness.
    - ``error_feedback`` (True): keep what was not sent in a residual and add it to the next
      gradient (docs/method-spec.md 1). Without it, unsent gradient is dropped.
    - ``nonfinite`` ("raise"): what every rank does when any rank's gradient holds NaN/Inf:
      "raise" an error naming the bucket, or "skip" the bucket's update for that step. Either
      way the residuals keep every finite value (docs/method-spec.md ruling 5).
    - ``timeout`` (30 min): seconds (or a timedelta) after which a stuck exchange, or a set-up
      that not every rank reaches, fails.
    - ``reference`` (False): reproduce the original code's behaviour where the project's rulings
      differ (docs/method-spec.md); methods without such differences behave the same either way.
    - ``transport`` ("process_group"): what the exchanges run on: a torch.distributed process
      group (Gloo, NCCL, MPI backends), or "mpi" for gradsparse's own OpenMPI transport
      (programs launched with mpirun; needs a build with MPI).

    The exchanges run on a process group of their own, created from the model's group when that
    is the default group, so that they never interleave with other collectives (DDP's own, or the
    training script's). For a sub-group, the state shares the given group.

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
        self._buckets: dict[int, _Bucket] = {}
        self._retired: dict[int, torch.Tensor] = {}  # residual per parameter id, after a bucket rebuild
        self._retired_methods: dict[frozenset, dict] = {}  # method state per parameter set, after a rebuild
        self._paused = False
        self._pending: _Pending | None = None  # from load_state_dict, until the next step
        self._unchecked: tuple[dict, bool] | None = None  # (state dict, any_rank) loaded before this rank was known
        self._deferred: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]] = []
        self._failed_step = False  # a bucket of this step failed: the rest go back untouched
        self._model: weakref.ref | None = None  # the DistributedDataParallel, from register()
        self._param_names: dict[int, str] = {}  # id(parameter) -> name in the user's module
        self._param_numels: dict[str, int] = {}  # name -> elements, of the bound model
        self._params: frozenset[int] | None = None  # ids of the parameters this state reduces
        self._seen: set[int] = set()  # not bound: the parameters met so far in the first step
        self._sharded: weakref.ref | None = None  # the FSDP model, from gradsparse.fsdp.sparsify()
        self._sharded_dtypes: dict[str, torch.dtype] = {}  # FSDP: parameter group -> reduce dtype
        self._sharded_called: set[int] = set()  # FSDP: the groups reduced so far in this step
        self._metrics = Metrics()
        _LIVE_STATES.add(self)

    # ----------------------------------------------------------------------------------------
    # Configuration

    def _validate(self, options: dict[str, Any]) -> None:
        owner = type(self).__name__
        allowed = tuple(o.name for o in self.OPTIONS) + self._SHARED_OPTIONS
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
        self._method_config = {o.name: o.validate(owner, options.get(o.name, o.default)) for o in self.OPTIONS}
        self._check_options(self._method_config)

    def _check_options(self, config: dict[str, Any]) -> None:
        """Rules that tie several of the method's options together (each option is checked alone
        by its declaration)."""

    def _make_method(self, numels: list[int]):
        """A new C++ method object for one bucket whose parameters hold ``numels`` elements
        (None: dense all-reduce): the C++ class receives the method's options by name."""
        if self._CORE is None:
            return None
        extras = {"reference": self._reference, "segments": list(numels)}
        return getattr(_C, self._CORE)(**self._method_config, **{k: extras[k] for k in self._CORE_EXTRAS})

    def _check_world_size(self, world_size: int) -> None:
        """Options that depend on the number of ranks, checked in setup() (on every rank alike)."""

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

    # ----------------------------------------------------------------------------------------
    # Set-up (collective)

    def setup(self) -> State:
        """The collective part of the state's creation, on every rank of its process group: its own
        process group, the check that every rank has the same method and options (a mismatch
        raises on every rank), and the engine thread.

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
        timeout = self._timeout or _DEFAULT_TIMEOUT
        world_size = dist.get_world_size(group)
        try:
            comm = self._make_comm_group(group)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, (owner, repr(sorted(self.config().items()))), group=comm or group)
        except RuntimeError as e:  # c10d's errors (DistBackendError, DistStoreError) derive from it
            raise RuntimeError(
                f"{owner}.setup: not every rank of the process group {_group_ranks(group)} reached the set-up of "
                f"this state within its timeout ({timeout.total_seconds():g} s): {e}. Create the state with the "
                "same options on every rank, and register it (or run the first backward) on every rank"
            ) from e
        if len(set(gathered)) > 1:
            raise ValueError(
                f"{owner}: the ranks were given different configurations: "
                + "; ".join(f"rank {r}: {fp}" for r, fp in enumerate(gathered))
                + ". Create the state with the same method and options on every rank."
            )
        self._check_world_size(world_size)
        self._process_group = group
        self._world_size = world_size
        self._rank = dist.get_rank(group)
        self._engine = self._make_engine(comm)
        model = self._bound_model()
        if model is not None:
            self._check_group(model)
        if self._unchecked is not None:
            (saved, any_rank), self._unchecked = self._unchecked, None
            self._load(saved, any_rank)
        return self

    def _make_comm_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
        """The exchanges' own process group (a new one for the default group, created with the
        state's timeout), or None where they run on ``group`` itself or on MPI."""
        if self._transport == "mpi" or group is not dist.group.WORLD:
            return None
        kwargs = {"backend": dist.get_backend(group), "timeout": self._timeout or _DEFAULT_TIMEOUT}
        return dist.new_group(**kwargs)

    def _make_engine(self, comm: dist.ProcessGroup | None):
        """The engine thread and its transport: MPI_COMM_WORLD for transport="mpi"; else the
        state's own group or the given sub-group."""
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
        return _C.Engine(comm or self._process_group, timeout.total_seconds())

    # ----------------------------------------------------------------------------------------
    # The model

    def _bind(self, model: nn.Module) -> None:
        """Ties the state to the DistributedDataParallel at or inside ``model`` (called by
        gradsparse.register): learns the parameter names, checks the process group."""
        owner = type(self).__name__
        ddp = find_ddp(model)
        if ddp is None:
            raise TypeError(
                f"gradsparse.register: model must be a DistributedDataParallel (or a torch.compile of one), got "
                f"{type(model).__name__}; wrap it first (DistributedDataParallel(model)); with Accelerate, register "
                "after accelerator.prepare(model); with Lightning, use gradsparse.lightning.Sparsify"
            )
        if self._sharded is not None:
            raise ValueError(
                f"gradsparse.register: this {owner} state already sparsifies an FSDP model "
                "(gradsparse.fsdp.sparsify); a state holds one model's residuals: create one state per model"
            )
        bound = self._bound_model()
        if bound is ddp:
            raise ValueError(
                f"gradsparse.register: this {owner} state is already registered on this model; register it once"
            )
        params = frozenset(id(p) for p in ddp.parameters() if p.requires_grad)
        if (bound is not None or self._params is not None) and params != self._params:
            raise ValueError(
                f"gradsparse.register: this {owner} state is already registered on another model; a state holds "
                "one model's residuals: create one state per model"
            )
        # A new DDP over the same parameters (Lightning wraps the module anew for every fit())
        # takes the state over with its residuals.
        self._model = weakref.ref(ddp)
        self._param_names = parameter_names(ddp)
        self._param_numels = {self._param_names[id(p)]: p.numel() for p in ddp.parameters()}
        self._params = params
        if self._engine is not None:
            self._check_group(ddp)
        if self._pending is not None:
            self._check_names(self._pending.residuals)

    def _unbind(self) -> None:
        self._model, self._param_names, self._param_numels, self._params = None, {}, {}, None
        self._sharded, self._sharded_dtypes = None, {}

    def _bind_sharded(self, model: nn.Module, groups: dict[str, tuple[int, torch.dtype]]) -> None:
        """Ties the state to an FSDP model (gradsparse.fsdp.sparsify): one bucket per parameter
        group, named after its module, holding the group's flat (padded) gradient of the given
        size and reduce dtype."""
        self._sharded = weakref.ref(model)
        self._param_numels = {name: numel for name, (numel, _) in groups.items()}
        self._sharded_dtypes = {name: dtype for name, (_, dtype) in groups.items()}
        if self._pending is not None:
            self._check_names(self._pending.residuals)

    def _bound_model(self):
        return None if self._model is None else self._model()

    def _check_group(self, ddp) -> None:
        if not _same_group(ddp.process_group, self._process_group):
            raise ValueError(
                f"gradsparse: the {type(self).__name__} state was created for the process group of ranks "
                f"{_group_ranks(self._process_group)} but the model's DistributedDataParallel reduces over ranks "
                f"{_group_ranks(ddp.process_group)}; create the state with process_group=<the group passed to "
                "DistributedDataParallel>"
            )

    def _check_names(self, residuals: dict[str, torch.Tensor]) -> None:
        """Every residual must name a parameter of the bound model, with its size."""
        owner = type(self).__name__
        numels = self._param_numels
        unknown = sorted(set(residuals) - set(numels))
        if unknown:
            hint = ""
            stripped = {n: strip_wrapper_prefixes(n) for n in unknown}
            if all(n in numels for n in stripped.values()):
                prefixes = sorted({n[: len(n) - len(s)] for n, s in stripped.items()})
                hint = (
                    f" They carry wrapper prefixes ({', '.join(prefixes)}); gradsparse names residuals after the "
                    f"model's own parameters: rename them, e.g. sd['residuals'] = "
                    f"{{k.removeprefix({prefixes[0]!r}): v for k, v in sd['residuals'].items()}}."
                )
            raise ValueError(
                f"{owner}.load_state_dict: {len(unknown)} residual(s) name no parameter of the model: "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (the model's parameters are named like "
                f"{', '.join(list(numels)[:3])}).{hint} Load the state dict into a state registered on the model it "
                "was saved from"
            )
        for name, tensor in residuals.items():
            if tensor.numel() != numels[name]:
                raise ValueError(
                    f"{owner}.load_state_dict: the residual of {name} holds {tensor.numel()} elements but the "
                    f"parameter has {numels[name]}; the state dict was saved from another model"
                )

    def _name(self, param: torch.Tensor, index: int, position: int) -> str:
        return self._param_names.get(id(param), f"bucket{index}.param{position}")

    # ----------------------------------------------------------------------------------------
    # The hook's work

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Never raises: an error becomes the bucket's failed future. An exception thrown inside
        DDP's hook call would leave DDP's reducer half-way through the step, and every later step
        would die in one of PyTorch's internal asserts; a failed future makes backward() raise the
        error while DDP finishes the step, so the next step works once the cause is fixed."""
        if self._paused or self._failed_step:  # see paused(); or an earlier bucket of this step failed
            if bucket.is_last():
                self._failed_step = False
            return _done(bucket.buffer())
        try:
            return self._reduce_bucket(bucket)
        except Exception as error:
            for buffer, _, held in self._deferred:  # the first step after a load: let them go
                if not held.done():
                    held.set_result(buffer)
            self._deferred = []
            self._failed_step = not bucket.is_last()

            def fail(_: torch.futures.Future, error: Exception = error) -> torch.Tensor:
                raise error

            return _done(None).then(fail)

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        if buffer.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"gradsparse: bucket {index} holds {buffer.dtype} gradients, but gradsparse sparsifies float32, "
                "float16 and bfloat16 buckets only; convert the model (for example model.float()) before "
                "wrapping it in DistributedDataParallel"
            )
        self.setup()
        params = bucket.parameters()
        self._check_params(params, bucket.is_last())
        if self._pending is not None:
            if self._model is None:
                raise ValueError(
                    f"gradsparse: the {type(self).__name__} state was given a state dict but does not know its "
                    "model's parameter names (it was registered with model.register_comm_hook), so the residuals "
                    "cannot be put back; register it with gradsparse.register(ddp_model, state) instead"
                )
            return self._defer(buffer, params, bucket.is_last())
        entry = self._bucket(index, params, buffer)
        return self._submit(entry, buffer, bucket.is_last())

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
        self._sharded_called.add(index)
        last = len(self._sharded_called) == groups
        entry = self._buckets.get(index)
        if entry is None:
            numel = flat.numel()
            if numel != self._param_numels.get(name, numel):
                raise RuntimeError(
                    f"gradsparse.fsdp: module {name!r} hands over {numel} gradient elements where its parameters "
                    f"hold {self._param_numels[name]} (padded); this FSDP configuration is not supported"
                )
            entry = _Bucket(index, (index,), [name], [numel], self._make_method([numel]))
            pending = self._pending
            if pending is not None:
                saved = pending.residuals.pop(name, None)
                if saved is not None:
                    entry.residual = saved.to(device=flat.device, dtype=flat.dtype).reshape(-1)
                for key in (frozenset([name]), index):
                    if entry.method is not None and key in pending.methods:
                        entry.method.load_state(pending.methods.pop(key))
                        break
            self._buckets[index] = entry
        if last:
            self._sharded_called.clear()
            self._pending = None  # every group has taken what was saved for it
        return self._submit(entry, flat, last, shard_only=True)

    def _check_params(self, params: list[torch.Tensor], last: bool) -> None:
        """One state, one model: a parameter outside the model's (the bound model, or those seen in
        the first step) means the state was registered on a second model."""
        if self._params is None:  # not bound: learn the parameters during the first step
            self._seen.update(id(p) for p in params)
            if last:
                self._params = frozenset(self._seen)
            return
        if any(id(p) not in self._params for p in params):
            raise ValueError(
                f"gradsparse: this {type(self).__name__} state is registered on more than one model (a bucket holds "
                "parameters of another model); a state holds one model's residuals: create one state per model"
            )

    def _submit(
        self, entry: _Bucket, buffer: torch.Tensor, last: bool, shard_only: bool = False
    ) -> torch.futures.Future[torch.Tensor]:
        dense = self._step < self._warmup_steps or entry.method is None
        residual = None
        if self._error_feedback and not dense:
            if entry.residual is None:
                entry.residual = torch.zeros_like(buffer)
            residual = entry.residual
        report = _C.ReduceReport()
        index = entry.index
        label = f"module {entry.names[0]!r}" if shard_only else f"bucket {index}"  # FSDP's groups: by module
        future = self._engine.submit(buffer, residual, entry.method, dense, self._nonfinite, label, report, shard_only)
        if last:
            self._step += 1
            self._retired.clear()
            self._retired_methods.clear()
        element_size = buffer.element_size()

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()  # raises the engine's error, if any
            self._metrics.record(index, report, self._world_size, element_size)
            return value

        return future.then(finish)

    def _defer(self, buffer: torch.Tensor, params: list[torch.Tensor], last: bool) -> torch.futures.Future:
        """The first step after load_state_dict: DDP hands its buckets in the layout of a fresh
        process (parameter order), which need not be the layout the saved run reduced in. The
        buckets are held until the last one arrives, then reduced in the saved layout, so that a
        resumed run does exactly what the uninterrupted run would have done."""
        gate = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self._deferred.append((buffer, params, gate))
        if last:  # on an error, _reduce releases what is still held
            self._reduce_in_saved_layout(self._deferred)
            self._deferred = []
        # DDP reads what a future holds as a tensor: an error set on the gate reaches it through
        # then(), as a failed future, not as a Python object that is no tensor.
        return gate.then(_value)

    def _reduce_in_saved_layout(self, held: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]]):
        pending = self._pending
        where: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (parameter, its slice of DDP's bucket)
        current: list[list[str]] = []
        for index, (buffer, params, _) in enumerate(held):
            names = [self._name(p, index, i) for i, p in enumerate(params)]
            current.append(names)
            for name, p, view in zip(names, params, buffer.split([p.numel() for p in params]), strict=True):
                where[name] = (p, view)
        layout = pending.layout
        if layout == current or sorted(n for names in layout for n in names) != sorted(where):
            # The same layout, or one that does not cover this model: DDP's own buckets.
            layout = current
        futures, copies = [], []
        for index, names in enumerate(layout):
            params = [where[n][0] for n in names]
            views = [where[n][1] for n in names]
            buffer = held[index][0] if layout is current else torch.cat(views)
            if layout is not current:
                copies.append((buffer, views))
            entry = self._bucket(index, params, buffer)
            futures.append(self._submit(entry, buffer, index == len(layout) - 1))
        self._pending = None  # every bucket has taken what was saved for it

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
            for buffer, _, fut in held:
                if not fut.done():  # released already when the step failed before everything was submitted
                    fut.set_result(buffer)

        torch.futures.collect_all(futures).add_done_callback(deliver)

    def _bucket(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor) -> _Bucket:
        """The bucket's entry; rebuilt (residuals re-mapped by parameter) when its layout changed."""
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
        names = [self._name(p, index, i) for i, p in enumerate(params)]
        numels = [p.numel() for p in params]
        if sum(numels) != buffer.numel():
            raise RuntimeError(
                f"gradsparse: bucket {index} has {buffer.numel()} elements but its parameters hold {sum(numels)}; "
                "this DDP configuration is not supported"
            )
        entry = _Bucket(index, key, names, numels, self._make_method(numels))
        pending = self._pending
        if entry.method is not None and frozenset(key) in self._retired_methods:
            entry.method.load_state(self._retired_methods.pop(frozenset(key)))
        elif entry.method is not None and pending is not None:
            for saved_key in (frozenset(names), index):
                if saved_key in pending.methods:
                    entry.method.load_state(pending.methods.pop(saved_key))
                    break
        pieces = []
        found = False
        for p, name, numel in zip(params, names, numels, strict=True):
            piece = self._retired.pop(id(p), None)
            if piece is None and pending is not None:
                piece = pending.residuals.pop(name, None)
            if piece is None:
                piece = torch.zeros(numel, dtype=buffer.dtype, device=buffer.device)
            else:
                found = True
                piece = piece.to(device=buffer.device, dtype=buffer.dtype).reshape(-1)
            pieces.append(piece)
        if found:
            entry.residual = torch.cat(pieces)
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
        """The model's process group (the default group unless one was given)."""
        return self._process_group or self._group_option or dist.group.WORLD

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
        """This rank's state: residuals by parameter name (the model's own names, without wrapper
        prefixes such as ``module.`` or ``_orig_mod.``), method states, the bucket layout, the step
        and statistics.

        Residuals are per rank: save one state dict per rank (for example with the rank in the
        file name), or all ranks' in one file with :class:`gradsparse.AllRanks`. The tensors are
        the live residuals, like an optimizer's state dict. Between load_state_dict() and the next
        step, the loaded state is returned as it was loaded.
        """
        owner = type(self).__name__
        if self._unchecked is not None:
            return self._unchecked[0]
        if self._pending is not None:
            return dict(self._pending.saved, stats=self._metrics.state_dict())
        named = bool(self._retired) or any(
            e.residual is not None or e.method is not None for e in self._buckets.values()
        )
        if named and self._model is None and self._sharded is None:
            raise ValueError(
                f"{owner}.state_dict: this state does not know its model's parameter names (it was registered with "
                "model.register_comm_hook), so its residuals cannot be saved under them; register it with "
                "gradsparse.register(ddp_model, state) instead"
            )
        residuals: dict[str, torch.Tensor] = {}
        for entry in self._buckets.values():
            residuals.update(entry.residual_views())
        for pid, piece in self._retired.items():  # parked by a rebuild that an error interrupted
            residuals.setdefault(self._param_names[pid], piece)
        count = max(self._buckets, default=-1) + 1
        checksums = {name: _checksum(t) for name, t in residuals.items()}
        rank, world_size = self._rank, self._world_size
        if self._engine is None and dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return {
            "version": _STATE_DICT_VERSION,
            "class": owner,
            "config": dict(self._method_config),
            "step": self._step,
            "rank": rank,
            "world_size": world_size,
            "residuals": residuals,
            "checksums": checksums,
            "methods": [
                self._buckets[i].method.state() if i in self._buckets and self._buckets[i].method else None
                for i in range(count)
            ],
            "layout": [list(self._buckets[i].names) if i in self._buckets else [] for i in range(count)],
            "stats": self._metrics.state_dict(),
        }

    def load_state_dict(self, state_dict: dict, *, any_rank: bool = False) -> None:
        """Restores a state dict saved by the same method with the same options, on the same rank
        of the same world size (``any_rank=True`` accepts another rank's). A state dict of
        :class:`gradsparse.AllRanks` gives each rank its own part.

        Residuals are put back by parameter name at the next step; that step is reduced in the
        saved bucket layout, so a resumed run repeats the uninterrupted run bit for bit. Loading
        before the process group exists is fine: the rank checks then run in setup().
        """
        owner = type(self).__name__
        state_dict = _upgrade(owner, state_dict)
        if state_dict["class"] != owner or state_dict["config"] != self._method_config:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict was saved by {state_dict['class']}"
                f"({state_dict['config']}) but this state is {owner}({self._method_config}); "
                "create the same method with the same options before loading"
            )
        if self._engine is None and not (dist.is_available() and dist.is_initialized()):
            self._unchecked = (state_dict, any_rank)  # checked against this rank in setup()
            return
        self._load(state_dict, any_rank)

    def _load(self, state_dict: dict, any_rank: bool) -> None:
        owner = type(self).__name__
        group = self.process_group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if state_dict.get("all_ranks"):
            if state_dict["world_size"] != world_size:
                raise ValueError(_world_size_error(owner, state_dict["world_size"], world_size))
            state_dict = state_dict["ranks"][rank]
        if state_dict["world_size"] != world_size:
            raise ValueError(_world_size_error(owner, state_dict["world_size"], world_size))
        if state_dict["rank"] != rank and not any_rank:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict holds rank {state_dict['rank']}'s residuals but this is "
                f"rank {rank}; residuals are per rank: load the file this rank saved (e.g. with the rank in its name), "
                "or save all ranks' with gradsparse.AllRanks(state); any_rank=True loads it anyway"
            )
        _check_values(owner, state_dict)
        if self._param_numels:
            self._check_names(state_dict["residuals"])
        self._step = int(state_dict["step"])
        self._buckets.clear()
        self._retired.clear()
        self._retired_methods.clear()
        self._pending = _Pending(state_dict)
        self._metrics.load_state_dict(state_dict["stats"])

    @contextlib.contextmanager
    def paused(self):
        """Within this block the hook hands every bucket back unreduced and the state does not
        change: no selection, no communication, no step counted. For an iteration whose
        gradients are thrown away."""
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


def _upgrade(owner: str, state_dict: Any) -> dict:
    """A state dict of the current version (version 1, of gradsparse 0.1, is converted)."""
    version = state_dict.get("version") if isinstance(state_dict, dict) else None
    if version == _STATE_DICT_VERSION:  # one rank's, or gradsparse.AllRanks' (its rank is picked in _load)
        return state_dict
    if version == 1:
        # Names came from DDP's inner module: strip the wrappers that could sit there.
        layout = state_dict.get("layout", {})
        count = max((int(i) for i in (*layout, *state_dict["methods"])), default=-1) + 1
        return {
            **state_dict,
            "version": _STATE_DICT_VERSION,
            "residuals": {strip_wrapper_prefixes(n): t for n, t in state_dict["residuals"].items()},
            "layout": [[strip_wrapper_prefixes(n) for n in layout.get(i, [])] for i in range(count)],
            "methods": [state_dict["methods"].get(i) for i in range(count)],
        }
    raise ValueError(
        f"{owner}.load_state_dict: not a gradsparse state dict (got {type(state_dict).__name__} with version "
        f"{version}); pass what State.state_dict() or gradsparse.AllRanks(state).state_dict() returned"
    )


def _value(future: torch.futures.Future):
    return future.value()


def _done(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (any dtype, on any device)."""
    return zlib.crc32(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())


def _check_values(owner: str, state_dict: dict) -> None:
    """Every residual is finite and, where the state dict has checksums (those of gradsparse 0.2
    on), matches its own."""
    checksums = state_dict.get("checksums", {})
    for name, tensor in state_dict["residuals"].items():
        if name in checksums and _checksum(tensor) != checksums[name]:
            raise ValueError(
                f"{owner}.load_state_dict: the residual of {name} does not match its checksum: the state dict was "
                "damaged after it was saved (a corrupt or partly written file); load an intact copy"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"{owner}.load_state_dict: the residual of {name} holds NaN or Inf; a residual is gradient mass "
                "waiting to be sent, and a non-finite one would poison every later step (with nonfinite='skip', "
                "skip them all); load a checkpoint from before the divergence"
            )


def _world_size_error(owner: str, saved: int, now: int) -> str:
    return (
        f"{owner}.load_state_dict: the state dict was saved at world size {saved} but this run has {now} ranks; "
        f"resume with {saved} ranks, or reshard a state dict holding every rank's residuals "
        f"(gradsparse.AllRanks(state).state_dict() at {saved} ranks) with gradsparse.reshard(saved, {now}): "
        "each rank then takes the mean of the saved residuals, which conserves the pending gradient mass"
    )


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    a = a or dist.group.WORLD
    b = b or dist.group.WORLD
    return a is b or _group_ranks(a) == _group_ranks(b)
