"""The DDP communication hook of gradsparse.

No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
"""

import contextlib
import inspect
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse.config import _describe
from gradsparse.state import State, _failed, _failing_late

__all__ = ["hook", "register"]


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sparsify, exchange and average one DDP bucket with the method of ``state``.

    1. The bucket goes to the state's engine thread and a future comes back at once, so the
       exchange overlaps the rest of the backward pass.
    2. On the engine thread: residual += gradient and selection in one fused pass, then the
       exchange moves every rank's (index, value) pairs and writes their average into the bucket.
    3. The future completes with the bucket itself (decompressed in place); DDP copies it into
       the gradients.

    Args:
        state: a gradsparse state (:class:`gradsparse.TopK`, ...), one per model.
        bucket: the bucket DDP hands to the hook.

    Returns:
        A future holding the averaged bucket.

    Example::

        >>> state = gradsparse.TopK(density=0.01)
        >>> ddp_model.register_comm_hook(state, gradsparse.hook)
    """
    _refuse_a_parameter(bucket)
    if not isinstance(state, State):  # as the state's own errors (_failed), not a raise inside DDP's call
        try:
            _check_state("gradsparse.hook", state)
        except TypeError as error:
            return _failed(error, bucket)
    return state._reduce(bucket)


_PYTHON_REDUCER = (
    'under torch._dynamo.config.optimize_ddp = "python_reducer" (compiled autograd\'s DDP), where DDP calls a '
    "communication hook once per parameter and drops what it returns, so no sparse exchange can run; set "
    "optimize_ddp back to its default (True) before wrapping the model in DistributedDataParallel"
)


def _refuse_a_parameter(bucket: object) -> None:
    """Raises where DDP's python_reducer mode calls the hook with one parameter, ``(grad,
    param)``, in place of a bucket: it ignores the returned future, so a failed one would leave the
    gradients unreduced without a word; the raise stops the backward instead."""
    if isinstance(bucket, tuple):
        raise RuntimeError(f"gradsparse.hook: DDP passed one parameter's gradient, not a bucket, {_PYTHON_REDUCER}")


def _what(value: object) -> str:
    """``value`` for an error message: its repr and type where that is short (None, a number, a
    string), else its type (a module's repr is its whole tree)."""
    if value is None or isinstance(value, (numbers.Number, str, bytes)):
        return _describe(value)
    return f"a {type(value).__module__.split('.')[0]}.{type(value).__qualname__}"


def _check_state(
    owner: str, state: object, model: object = None, call: str = "gradsparse.register(model, state)"
) -> None:
    """Refuses a ``state`` that is no gradsparse state, saying what it is and what to pass
    (``call``: how the function that takes it is called, for swapped arguments)."""
    if isinstance(state, State):
        return
    example = "gradsparse.TopK(density=0.01)"
    if isinstance(state, type) and issubclass(state, State):
        raise TypeError(
            f"{owner}: state must be a gradsparse state, got the class gradsparse.{state.__name__} itself; "
            f"create one with its options, for example gradsparse.{state.__name__}(density=0.01)"
        )
    if isinstance(model, State) and isinstance(state, nn.Module):
        raise TypeError(
            f"{owner}: state must be a gradsparse state, got {_what(state)}, and model got the state "
            f"gradsparse.{type(model).__name__}: the arguments are swapped; the model comes first, {call}"
        )
    raise TypeError(f"{owner}: state must be a gradsparse state such as {example}, got {_what(state)}")


def _hook_for_ddp(user_hook: object) -> Callable:
    """``user_hook`` as DistributedDataParallel.register_comm_hook takes it, checked here, before any
    collective, so that every rank refuses it alike. DDP reads the hook's ``__name__`` and its
    parameter named ``bucket``: a functools.partial, a callable object or a function whose second
    parameter has another name failed there with an AttributeError or a KeyError naming nothing.
    Every hook but gradsparse.hook is passed through a function of that form, which also raises what
    the hook raises, returns in place of a future, or fails its future with, once DDP has ended
    its step (state._failed)."""
    if user_hook is hook:
        return hook
    fix = (
        "pass a function hook(state, bucket) that returns gradsparse.hook(state, bucket) (or a future of its "
        "own), or leave hook out for gradsparse.hook"
    )
    if (isinstance(user_hook, type) and issubclass(user_hook, State)) or isinstance(user_hook, State):
        raise TypeError(
            f"gradsparse.register: hook must be a communication hook, got the state {_what(user_hook)}; the state "
            f"is the second argument, gradsparse.register(model, state); {fix}"
        )
    if not callable(user_hook):
        raise TypeError(f"gradsparse.register: hook must be callable, got {_what(user_hook)}; {fix}")
    try:
        signature = inspect.signature(user_hook)
    except (TypeError, ValueError):  # a builtin without a signature: DDP's own check decides
        return user_hook
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(user_hook, "__qualname__", type(user_hook).__qualname__)
        raise TypeError(
            f"gradsparse.register: hook must take two arguments, the state and the bucket, got {name}{signature}; {fix}"
        ) from None
    name = getattr(user_hook, "__name__", type(user_hook).__name__)

    def adapted(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        _refuse_a_parameter(bucket)  # before the errors below, which that mode would drop
        # What the hook raises, returns in place of a future or fails its future with is raised
        # once DDP has ended its step: DDP crashed the process on a hook that returned None, and a
        # raise inside its call, or a failed future, leaves its reducer broken (state._failed).
        try:
            future = user_hook(state, bucket)
        except Exception as error:
            return _failed(error, bucket)
        if not isinstance(future, torch._C.Future):
            return _failed(
                TypeError(
                    f"gradsparse.register: the hook {name} returned {_what(future)}, not a future; "
                    "return gradsparse.hook(state, bucket) from it (or a torch.futures.Future of its own)"
                ),
                bucket,
            )
        return _failing_late(future, bucket)

    adapted.__name__ = adapted.__qualname__ = name
    return adapted


def register(model: nn.Module, state: State, *, hook: Callable = hook) -> State:
    """Registers ``state`` as the communication hook of the DistributedDataParallel at or inside
    ``model`` (DDP itself, ``torch.compile(DDP(m))``, a Fabric module); call it on every rank.

    Unlike ``model.register_comm_hook(state, gradsparse.hook)``, which also works, it teaches the
    state the model's parameter names (those of the innermost module, without wrapper prefixes),
    so that its residuals can be checkpointed and restored by name; it checks that the state and
    the model use one process group and that the state serves only this model; and it runs the
    state's collective set-up now (see :meth:`State.setup`) rather than in the first backward.

    ``hook`` (default :func:`gradsparse.hook`) registers another hook that calls
    ``gradsparse.hook(state, bucket)`` itself, for example one that records or times buckets: any
    callable of two arguments (state, bucket), a ``functools.partial`` or a callable object
    included. Wrong arguments are refused before any collective, alike on every rank.

    Returns the state.

    Example::

        >>> state = gradsparse.register(ddp_model, gradsparse.TopK(density=0.01))
    """
    _check_state("gradsparse.register", state, model)
    ddp_hook = _hook_for_ddp(hook)  # before the set-up's collectives: every rank refuses alike
    # A registration that fails leaves the state as it was: bind() may have raised after taking
    # the model (a loaded state dict whose names do not fit, another process group), and a state
    # left bound there would refuse the retry as a second registration, without a hook.
    before = state._binding.saved()
    try:
        state._bind(model)
        ddp = state._binding.model()
        if getattr(ddp, "_use_python_reducer", False):
            raise ValueError(f"gradsparse.register: this DistributedDataParallel was built {_PYTHON_REDUCER}")
        if getattr(ddp, "skip_all_reduce_unused_params", False):
            # DDP then hands no bucket of unused parameters to the hook: where that is its last
            # bucket, no bucket ends the step, which the state never counted (warmup_steps never
            # ended), and the first step after load_state_dict waited for that bucket for ever.
            raise ValueError(
                "gradsparse.register: this DistributedDataParallel was built with skip_all_reduce_unused_params=True, "
                "so DDP hands gradsparse no bucket of unused parameters, and where that is its last bucket no bucket "
                "ends the step: the state would count no step (warm-up would never end) and wait for ever after a "
                "load_state_dict. Build DistributedDataParallel without it: with find_unused_parameters=True (or "
                "static_graph=True) alone DDP hands such a bucket over with zero gradients, and under "
                "gradsparse.register an unused parameter sits the step out"
            )
        already_hooked = ValueError(
            "gradsparse.register: this DistributedDataParallel already has a communication hook "
            "(model.register_comm_hook or register_builtin_comm_hook was called on it), and DDP takes one: "
            "register gradsparse on a model that has none, for example one wrapped anew with "
            "DistributedDataParallel(module); with Accelerate, leave comm_hook out of DistributedDataParallelKwargs"
        )
        if getattr(ddp, "_comm_hooks", None):  # before the set-up, which starts an engine and a group
            raise already_hooked
        state.setup()
        try:
            ddp.register_comm_hook(state, ddp_hook)
        except RuntimeError as e:
            if "only be called once" not in str(e):
                raise
            # A builtin hook, which only DDP's reducer knows of: DDP listed this state before its
            # reducer refused it, and held it, its engine and its group for the DDP's life.
            with contextlib.suppress(ValueError):
                ddp._comm_hooks.remove((ddp_hook, state))
            raise already_hooked from e
    except BaseException:
        state._unbind(before)
        raise
    return state


#: By state, the GradScaler that a framework's last run handed to it (None: none): a later run
#: without loss scaling drops that one, and keeps a scaler the user set.
_HANDED: "weakref.WeakKeyDictionary[State, Any]" = weakref.WeakKeyDictionary()


def register_under_scaler(
    state: State, scaler: Any, refusal: tuple[str, str], registration: Callable[[], object]
) -> None:
    """For the frameworks' integrations: hands the framework's GradScaler (``scaler``; None where it
    scales no loss) to ``state`` (State.set_scaler: its residuals follow the loss scale), then runs
    ``registration``. Without the framework's scaler, one that the user set stays, and the one that
    the framework's earlier run handed over goes. A state that cannot follow it (sparse, without
    nonfinite="propagate") is refused with ``refusal``, what scales the loss and the alternative, around
    the state's reason; a registration that raises leaves the state's scaler as it was."""
    before = state._scaler
    chosen = before if scaler is None and before is not _HANDED.get(state) else scaler
    try:
        state.set_scaler(chosen)
    except ValueError as e:  # the scale would never come down: an overflow would not reach the scaler
        raise ValueError(f"{refusal[0]}. {e} ({refusal[1]})") from None
    try:
        registration()
    except BaseException:
        state.set_scaler(before)
        raise
    _HANDED[state] = scaler
