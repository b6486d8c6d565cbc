"""Checkpoints of a state: the state dict's format and its checks, and every rank's residuals in
one file.

A state dict (version 2) holds ``class``, ``config``, ``step``, ``rank``, ``world_size``,
``fsdp`` (whether the state was under FSDP, whose residuals have no resharded form; absent in
earlier state dicts, read as False), ``residuals`` (parameter name -> tensor, the model's own
names), ``checksums`` (name -> CRC-32 of the residual's bytes), ``velocities`` and
``velocity_checksums`` (the same for momentum correction's velocities; absent or empty without it), ``methods`` and ``layout`` (by bucket
index: the method's state and the bucket's parameter names), ``parked_methods`` (method states
waiting for their bucket when the state dict was taken, each with its parameters' names or its
bucket index, and its loss scale; empty unless an error stopped a step before the buckets that
were to take them), ``stats`` (each bucket's counters with its parameters' names; a dict by
bucket index before 2026-12-06, read through ``layout``, or kept under ``<bucket N>`` where it
names no parameters at that index), ``link`` and
``exchanges`` (exchange="auto": the measured latency and seconds per byte, and the trial's
decision by bucket index, for the parameters ``layout`` names there; None otherwise),
``loss_scale`` (the scale the residuals are in: 1 without a scaler), ``strides`` (parameter
name -> strides, of the parameters whose elements are not in row-major order, such as
channels_last convolutions: a residual holds its parameter's elements in the parameter's memory
order, which a load into a parameter of another order converts; absent before 2026-12-06) and
``version``;
docs/architecture.md, "Checkpoints", says why.

Error-feedback residuals differ from rank to rank, but most frameworks write a checkpoint from
rank 0 only (Lightning's ``Trainer.save_checkpoint``, Accelerate's ``save_state``), from what
``state_dict()`` returned there. :class:`AllRanks` gathers every rank's state dict to rank 0 for
such a file and, on resume, gives each rank its own part back.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from gradsparse.config import _describe, check_int, is_link
from gradsparse.exchange_trial import CHOICES
from gradsparse.metrics import BucketStats, Metrics
from gradsparse.wrappers import strip_wrapper_prefixes

__all__ = ["AllRanks", "reshard"]

STATE_DICT_VERSION = 2  # 2: residual names without wrapper prefixes, layout as lists of names


#: The per-element tensors of a state dict: (kind, key of the tensors by name, key of their checksums).
TENSORS = (("residual", "residuals", "checksums"), ("velocity", "velocities", "velocity_checksums"))


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (any dtype, on any device)."""
    return zlib.crc32(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())


class Loaded:
    """A state dict given to ``load_state_dict``, until the first step after the load has put
    everything in place (``state_dict()`` returns it as it was until then)."""

    def __init__(self, saved: dict, parts: list[dict] | None = None) -> None:
        self.saved = saved  # version 2, this rank's
        self.parts = parts  # every rank's, of a state dict of gradsparse.AllRanks (None otherwise)
        self.layout: list[list[str]] = [list(names) for names in saved["layout"] if names]

    def method_states(self) -> list[tuple[frozenset[str] | int, dict, float]]:
        """Each saved method state, keyed by the names of its bucket's parameters (by its bucket
        index where the layout names none), with the loss scale it is in: the buckets' and those
        that were parked when it was saved."""
        layout, scale = self.saved["layout"], float(self.saved.get("loss_scale", 1.0))
        in_buckets = [
            (frozenset(names) if (names := _names_at(layout, index)) else index, state, scale)
            for index, state in enumerate(self.saved["methods"])
            if state is not None
        ]
        parked = [
            (frozenset(entry["names"]) if "names" in entry else entry["index"], entry["state"], entry["loss_scale"])
            for entry in self.saved.get("parked_methods", [])
        ]
        return in_buckets + parked

    def exchanges(self) -> dict[frozenset[str], str] | None:
        """exchange="auto"'s saved decision, each bucket's keyed by the names of its parameters in
        the saved layout (a bucket index that the layout names none for is dropped: such a bucket
        is timed again), or None (no decision saved)."""
        saved, layout = self.saved.get("exchanges"), self.saved["layout"]
        if saved is None:
            return None
        indices = {int(i): name for i, name in saved.items()}  # decimal text after a JSON round trip
        return {frozenset(names): name for i, name in indices.items() if (names := _names_at(layout, i))}


def saved_stats(saved: dict) -> list[dict]:
    """A state dict's statistics as Metrics.load_state_dict takes them: each bucket's counters with
    its parameters' names. Those of a state dict saved before they were kept by name (a dict by
    bucket index) are named through its layout; an index it names none for (gradsparse.reshard
    emptied the layout) is kept under ``<bucket N>``, so that the total still counts it."""
    stats = saved["stats"]
    if not isinstance(stats, dict):
        return stats
    indices = {int(i): counters for i, counters in stats.items()}  # decimal text after a JSON round trip
    return [
        {"names": _names_at(saved["layout"], i) or [f"<bucket {i}>"], "counters": counters}
        for i, counters in indices.items()
    ]


def _names_at(layout: list[list[str]], index: int) -> list[str] | None:
    """The parameters' names of bucket ``index`` in a saved layout; None where it names none."""
    return layout[index] if index < len(layout) and layout[index] else None


def with_checksums(residuals: dict[str, torch.Tensor], velocities: dict[str, torch.Tensor]) -> dict:
    """The state dict's entries for these residuals and velocities, each with its checksums."""
    entries = {}
    for (_, key, checksums_key), tensors in zip(TENSORS, (residuals, velocities), strict=True):
        entries[key] = tensors
        entries[checksums_key] = {name: checksum(t) for name, t in tensors.items()}
    return entries


#: What one rank's state dict must hold (its optional entries are read with defaults).
RANK_KEYS = ("class", "config", "step", "rank", "world_size", "residuals", "methods", "layout", "stats")
#: What gradsparse.AllRanks' state dict must hold (each of its ranks holds RANK_KEYS).
ALL_RANKS_KEYS = ("class", "config", "world_size", "ranks")


def _require(where: str, state_dict: dict, keys: tuple[str, ...], what: str) -> None:
    """Each of ``keys`` is in ``state_dict`` (``what`` it is, for the message; ``where``, the
    function that reads it)."""
    missing = [k for k in keys if k not in state_dict] if isinstance(state_dict, dict) else None
    if missing is None or missing:
        lacks = f"lacks {', '.join(missing)}" if missing else f"is {_describe(state_dict)}, no dict"
        raise ValueError(
            f"{where}: {what} {lacks} (it should hold {', '.join(keys)}): it was "
            "cut short or changed after it was saved; load what State.state_dict() or "
            "gradsparse.AllRanks(state).state_dict() returned, as saved"
        )


def upgrade(owner: str, state_dict: Any) -> dict:
    """A state dict of the current version (version 1, of gradsparse 0.1, is converted)."""
    version = state_dict.get("version") if isinstance(state_dict, dict) else None
    if version == STATE_DICT_VERSION:  # one rank's, or gradsparse.AllRanks' (its rank is picked at load)
        if state_dict.get("all_ranks"):
            _require(f"{owner}.load_state_dict", state_dict, ALL_RANKS_KEYS, "the state dict of gradsparse.AllRanks")
        else:
            _require(f"{owner}.load_state_dict", state_dict, RANK_KEYS, "the state dict")
        if not isinstance(state_dict["config"], dict):  # read before this rank's part is picked
            _refuse(f"{owner}.load_state_dict", "config", "a dict of options", state_dict["config"])
        return state_dict
    if version == 1:
        _require(
            f"{owner}.load_state_dict",
            state_dict,
            ("class", "config", "residuals", "methods"),
            "the state dict (version 1)",
        )
        # Names came from DDP's inner module: strip the wrappers that could sit there (a leading
        # "module." there is the user's own submodule, not DDP's).
        layout = state_dict.get("layout", {})
        count = max((int(i) for i in (*layout, *state_dict["methods"])), default=-1) + 1
        return {
            **state_dict,
            "version": STATE_DICT_VERSION,
            "residuals": {strip_wrapper_prefixes(n, inside_ddp=True): t for n, t in state_dict["residuals"].items()},
            "layout": [[strip_wrapper_prefixes(n, inside_ddp=True) for n in layout.get(i, [])] for i in range(count)],
            "methods": [state_dict["methods"].get(i) for i in range(count)],
        }
    raise ValueError(
        f"{owner}.load_state_dict: not a gradsparse state dict (got {type(state_dict).__name__} with version "
        f"{version}); pass what State.state_dict() or gradsparse.AllRanks(state).state_dict() returned"
    )


def this_ranks(owner: str, state_dict: dict, rank: int, world_size: int, any_rank: bool) -> dict:
    """This rank's part of a (version 2) state dict, checked: world size, rank, and every
    residual finite and matching its checksum. Of a state dict of every rank (AllRanks), every
    rank checks every part alike, so that a damaged part is refused on every rank: refused on its
    own rank only, it left the others to wait for that rank in the first step until the timeout."""
    where = f"{owner}.load_state_dict"
    if not state_dict.get("all_ranks"):
        return _checked_part(owner, where, state_dict, rank, world_size, any_rank)
    _check_integer(where, state_dict, "world_size", 1)
    if state_dict["world_size"] != world_size:
        fsdp = any(isinstance(part, dict) and part.get("fsdp") for part in state_dict.get("ranks") or [])
        raise ValueError(_world_size_error(owner, state_dict["world_size"], world_size, fsdp))
    _check_rank_count(where, state_dict)
    for r, part in enumerate(state_dict["ranks"]):
        _require(where, part, RANK_KEYS, f"rank {r}'s part of the state dict")
        _check_same_options(where, state_dict, part, r)
        _checked_part(owner, f"{where} (rank {r}'s part)", part, r, world_size, any_rank=True)
        _check_in_place(where, part, r)
    return state_dict["ranks"][rank]


def check_same_steps(where: str, steps: list[int | None], ranks: Iterable[int], fix: str) -> None:
    """The ranks' state dicts (their ``steps``, of the ranks named ``ranks``) are of one step;
    ``fix`` says what to do where they are not."""
    if len(set(steps)) > 1:
        raise ValueError(
            f"{where}: the ranks' state dicts are of different steps ("
            + ", ".join(f"rank {rank}: {step}" for rank, step in zip(ranks, steps, strict=True))
            + f"): {fix}"
        )


def _check_in_place(where: str, part: dict, r: int) -> None:
    """Rank ``r``'s place in an AllRanks state dict holds rank ``r``'s part."""
    if part["rank"] != r:
        raise ValueError(
            f"{where}: the state dict of gradsparse.AllRanks holds rank {part['rank']}'s residuals in the place "
            f"of rank {r}'s: it was changed after it was saved; load an intact copy"
        )


def _check_same_options(where: str, state_dict: dict, part: dict, r: int) -> None:
    """Rank ``r``'s part of an AllRanks state dict was saved by the method and options that the
    state dict names at its top, which load_state_dict compares with the state's. The momentum is
    not compared: load_state_dict's refusal of another momentum says to change it in the state
    dict's config (sd['config']['momentum']), and a part's velocities then go as a state dict's do."""
    if not isinstance(part["config"], dict):
        _refuse(f"{where} (rank {r}'s part)", "config", "a dict of options", part["config"])
    fix = (
        "its parts come from another run's file, or it was changed after it was saved; load the file "
        "gradsparse.AllRanks(state).state_dict() returned, as saved"
    )
    if part["class"] != state_dict["class"]:
        raise ValueError(
            f"{where}: rank {r}'s part of the state dict of gradsparse.AllRanks was saved by {part['class']}, but the "
            f"state dict's class is {state_dict['class']}: {fix}"
        )
    config = state_dict["config"]
    differ = sorted((k for k in part["config"].keys() & config.keys() if k != "momentum"), key=str)
    differ = [k for k in differ if part["config"][k] != config[k]]
    if differ:
        raise ValueError(
            f"{where}: rank {r}'s part of the state dict of gradsparse.AllRanks was saved with "
            + ", ".join(f"{k}={part['config'][k]!r}" for k in differ)
            + ", but the state dict's config holds "
            + ", ".join(f"{k}={config[k]!r}" for k in differ)
            + f": {fix}"
        )


def _checked_part(owner: str, where: str, state_dict: dict, rank: int, world_size: int, any_rank: bool) -> dict:
    """``state_dict``, checked as the part of rank ``rank``."""
    # compared below: "0" or 4.0 would have read as another rank's or world size's ("rank 0's ... this is rank 0")
    _check_integer(where, state_dict, "world_size", 1)
    _check_integer(where, state_dict, "rank", 0)
    if state_dict["world_size"] != world_size:
        raise ValueError(_world_size_error(owner, state_dict["world_size"], world_size, bool(state_dict.get("fsdp"))))
    if state_dict["rank"] != rank and not any_rank:
        raise ValueError(
            f"{where}: the state dict holds rank {state_dict['rank']}'s residuals but this is "
            f"rank {rank}; residuals are per rank: load the file this rank saved (e.g. with the rank in its name), "
            "or save all ranks' with gradsparse.AllRanks(state); any_rank=True loads it anyway"
        )
    _check(where, state_dict)
    return state_dict


def _check_integer(where: str, state_dict: dict, key: str, least: int) -> None:
    value = state_dict[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        _refuse(where, key, f"an integer >= {least}", value)


def _check_rank_count(where: str, state_dict: dict) -> None:
    """An AllRanks state dict holds one state dict per rank of its world size."""
    ranks, world_size = state_dict["ranks"], state_dict["world_size"]
    if ranks is None:
        raise ValueError(
            f"{where}: this state dict of gradsparse.AllRanks was returned on a rank other than 0, which holds no "
            "residuals: save the one rank 0 returned, and load that file on every rank (for a checkpointer that "
            "writes on each node, wrap the state in gradsparse.AllRanks(state, each_node=True))"
        )
    if not isinstance(ranks, list) or len(ranks) != world_size:
        count = len(ranks) if isinstance(ranks, list) else type(ranks).__name__
        raise ValueError(
            f"{where}: the state dict of gradsparse.AllRanks holds {count} ranks' state dicts but was saved at world "
            f"size {world_size}: it was cut short or changed after it was saved; load an intact copy"
        )


_COUNTERS = frozenset(f.name for f in fields(BucketStats))
#: What each counter of the statistics holds (an integer, a number or a name), by the type of its default.
_COUNTER_TYPES = {
    f.name: {int: numbers.Integral, float: numbers.Real, str: str}[type(f.default)] for f in fields(BucketStats)
}
_COUNTER_KINDS = {numbers.Integral: "an integer", numbers.Real: "a number", str: "a string"}


def _refuse(where: str, key: str, expected: str, value: object) -> None:
    """A state dict's entry ``key`` is not what state_dict() gives it (``expected``)."""
    described = _describe(value)
    if isinstance(value, torch.Tensor):
        described = f"a tensor of {value.dtype}, shape {list(value.shape)}"
        if value.is_meta:
            described += ", on the meta device"
    elif len(described) > 120:  # a long list or an array: its type says enough
        described = f"a {type(value).__module__}.{type(value).__name__}"
    raise ValueError(
        f"{where}: the state dict's {key} should be {expected}, got {described}: it was changed after it "
        "was saved; load what State.state_dict() or gradsparse.AllRanks(state).state_dict() returned, as saved"
    )


def _is_bucket_index(key: object) -> bool:
    """A bucket index as a state dict's stats and exchanges hold it: an integer, or its decimal
    text (what a JSON round trip of the state dict makes of it)."""
    return isinstance(key, numbers.Integral) or (isinstance(key, str) and key.isdecimal())


def _is_names(names: object) -> bool:
    return isinstance(names, list) and all(isinstance(n, str) for n in names)


def _is_bucket_stats(entry: object) -> bool:
    """An entry of a state dict's ``stats``: a bucket's parameters' names and its counters."""
    return (
        isinstance(entry, dict)
        and set(entry) == {"names", "counters"}
        and _is_names(entry["names"])
        and bool(entry["names"])
        and isinstance(entry["counters"], dict)
    )


def _is_loss_scale(scale: object) -> bool:
    return not isinstance(scale, bool) and isinstance(scale, numbers.Real) and 0 < scale < math.inf


def _check_numbers(refuse: Callable[[str, str, object], None], key: str, method_state: dict) -> None:
    """A method state (entry ``key``) maps names to numbers."""
    for name, value in method_state.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            refuse(f"{key}[{name!r}]", "a number (a method state maps names to numbers)", value)


def _check(where: str, state_dict: dict) -> None:
    """One rank's entries have the types state_dict() gives them: what the load reads is refused
    here, naming the entry, and not with an error of Python's half-way through the load. Then
    every residual and velocity is finite and, where the state dict has checksums (those of
    gradsparse 0.2 on), matches its own; none that has a checksum is missing where the names are
    the saved ones."""

    def refuse(key: str, expected: str, value: object) -> None:
        _refuse(where, key, expected, value)

    _check_integer(where, state_dict, "step", 0)
    for _, key, checksums_key in TENSORS:
        tensors = state_dict.get(key, {})
        if not isinstance(tensors, dict):
            refuse(key, "a dict of tensors by parameter name", tensors)
        for name, tensor in tensors.items():
            if not isinstance(name, str):  # (failed in Python's words where a message names the entries)
                refuse(f"names in {key}", "parameter names (strings)", name)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                refuse(f"{key}[{name!r}]", "a floating-point tensor", tensor)
            if tensor.is_meta:  # (its checksum and values cannot be read)
                refuse(f"{key}[{name!r}]", "a floating-point tensor that holds its values", tensor)
        checksums = state_dict.get(checksums_key, {})
        if not isinstance(checksums, dict):
            refuse(checksums_key, "a dict of checksums by parameter name", checksums)
        for name in checksums:
            if not isinstance(name, str):
                refuse(f"names in {checksums_key}", "parameter names (strings)", name)
    strides = state_dict.get("strides", {})
    if not isinstance(strides, dict) or not all(
        isinstance(name, str) and isinstance(s, list) and all(isinstance(i, int) for i in s)
        for name, s in strides.items()
    ):
        refuse("strides", "a dict of stride lists by parameter name", strides)
    methods, layout = state_dict["methods"], state_dict["layout"]
    if not isinstance(methods, list) or not all(m is None or isinstance(m, dict) for m in methods):
        refuse("methods", "a list of method states (dicts, or None) by bucket index", methods)
    for index, method in enumerate(methods):
        _check_numbers(refuse, f"methods[{index}]", method or {})
    if not isinstance(layout, list) or not all(_is_names(names) for names in layout):
        refuse("layout", "a list of parameter-name lists by bucket index", layout)
    parked = state_dict.get("parked_methods", [])
    entry_keys = ({"names", "state", "loss_scale"}, {"index", "state", "loss_scale"})
    if not isinstance(parked, list) or not all(isinstance(e, dict) and set(e) in entry_keys for e in parked):
        refuse("parked_methods", "a list of dicts of names (or index), state and loss_scale", parked)
    for index, entry in enumerate(parked):
        key = f"parked_methods[{index}]"
        if "names" in entry and not _is_names(entry["names"]):
            refuse(f"{key}['names']", "a list of parameter names", entry["names"])
        bucket = entry.get("index", 0)  # True was taken for bucket 1
        if isinstance(bucket, bool) or not (isinstance(bucket, int) and bucket >= 0):
            refuse(f"{key}['index']", "a bucket index (an integer >= 0)", entry["index"])
        if not isinstance(entry["state"], dict):
            refuse(f"{key}['state']", "a method state (a dict of numbers by name)", entry["state"])
        _check_numbers(refuse, f"{key}['state']", entry["state"])
        if not _is_loss_scale(entry["loss_scale"]):
            refuse(
                f"{key}['loss_scale']", "a positive finite number (the loss scale of its state)", entry["loss_scale"]
            )
    for key, counters in _saved_counters(refuse, state_dict["stats"]):
        unknown = sorted(set(counters) - _COUNTERS)
        if unknown:
            raise ValueError(
                f"{where}: the state dict's {key} holds {', '.join(map(str, unknown))}, which gradsparse does not "
                f"keep (it keeps {', '.join(sorted(_COUNTERS))}): the state dict was changed after it was saved, or "
                "saved by a later gradsparse; load it with that version, or drop the statistics (sd['stats'] = []) "
                "to resume without them"
            )
        for name, value in counters.items():
            kind = _COUNTER_TYPES[name]
            if isinstance(value, bool) or not isinstance(value, kind):
                refuse(f"{key}[{name!r}]", f"{_COUNTER_KINDS[kind]} (a counter of statistics)", value)
    link = state_dict.get("link")
    if link is not None and not is_link(link):  # a NaN or negative one priced every bucket's exchanges wrongly
        refuse("link", "None or the pair (alpha, beta) of seconds that set-up measured (finite, >= 0)", link)
    fsdp = state_dict.get("fsdp", False)
    if not isinstance(fsdp, bool):
        refuse("fsdp", "True or False (whether the state was under FSDP)", fsdp)
    loss_scale = state_dict.get("loss_scale", 1.0)
    if not _is_loss_scale(loss_scale):
        refuse("loss_scale", "a positive finite number (the loss scale of the residuals and method states)", loss_scale)
    exchanges = state_dict.get("exchanges")
    if exchanges is not None and not (
        isinstance(exchanges, dict) and all(_is_bucket_index(i) and name in CHOICES for i, name in exchanges.items())
    ):
        refuse("exchanges", f"None or the exchange by bucket index, one of {', '.join(CHOICES)}", exchanges)
    for kind, key, checksums_key in TENSORS:
        checksums = state_dict.get(checksums_key, {})
        tensors = state_dict.get(key, {})
        missing = sorted(set(checksums) - set(tensors))
        # (residuals renamed on purpose, as load_state_dict's hint for wrapper prefixes says, are
        # named apart from their checksums: only a state dict whose names are all saved ones is short)
        if missing and set(tensors) <= set(checksums):
            raise ValueError(
                f"{where}: the state dict lacks the {kind} of {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}, of which it holds the checksum: it was cut short or changed "
                "after it was saved (a corrupt or partly written file); load an intact copy"
            )
        for name, tensor in tensors.items():
            if name in checksums and checksum(tensor) != checksums[name]:
                raise ValueError(
                    f"{where}: the {kind} of {name} does not match its checksum: the state dict was "
                    "damaged after it was saved (a corrupt or partly written file), or it was kept in memory while "
                    "training went on (its tensors are the state's live ones, as in an optimizer's state dict: keep "
                    "copy.deepcopy(state.state_dict()) to return to); load an intact copy"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(
                    f"{where}: the {kind} of {name} holds NaN or Inf; a {kind} is gradient mass "
                    "waiting to be sent, and a non-finite one would poison every later step (with nonfinite='skip', "
                    "skip them all); load a checkpoint from before the divergence"
                )


def _saved_counters(refuse: Callable[[str, str, object], None], stats: object) -> list[tuple[str, dict]]:
    """Each bucket's counters in a state dict's ``stats`` (a list of each bucket's parameters' names
    and counters; before they were kept by name, a dict of counters by bucket index), with the key
    that names them in a message."""
    if isinstance(stats, dict):  # by bucket index, read through the layout (saved_stats)
        if not all(_is_bucket_index(i) and isinstance(c, dict) for i, c in stats.items()):
            refuse("stats", "a list of statistics by bucket (or a dict of them by bucket index)", stats)
        return [(f"stats[{index!r}]", counters) for index, counters in stats.items()]
    if not isinstance(stats, list) or not all(_is_bucket_stats(entry) for entry in stats):
        refuse("stats", "a list of statistics by bucket: dicts of names (its parameters') and counters", stats)
    return [(f"stats[{i}]['counters']", entry["counters"]) for i, entry in enumerate(stats)]


def called_by_dcp() -> bool:
    """Whether the caller of the ``state_dict()`` that calls this is torch.distributed.checkpoint's
    own code: dcp.save and dcp.load call state_dict() on every ``Stateful`` of the state dict they
    are given, and a State handed to them as it is (or an AllRanks) would be saved as one rank's.
    Those that wrap a state (gradsparse.ShardedState, AllRanks, a framework's callback) call its
    state_dict() from their own module."""
    try:
        caller = sys._getframe(2)  # 0: this function, 1: the state_dict() that asks
    except ValueError:
        return False
    return caller.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint")


def _world_size_error(owner: str, saved: int, now: int, fsdp: bool) -> str:
    head = f"{owner}.load_state_dict: the state dict was saved at world size {saved} but this run has {now} ranks"
    if fsdp:  # gradsparse.reshard refuses these: no fix should send the user there
        return f"{head}, and it {_no_resharded_form(saved, now)}"
    return (
        f"{head}; resume with {saved} ranks, or reshard a state dict holding every rank's residuals "
        f"(gradsparse.AllRanks(state).state_dict() at {saved} ranks) with gradsparse.reshard(saved, {now}): "
        "each rank then takes the mean of the saved residuals, which conserves the pending gradient mass"
    )


def _no_resharded_form(saved: int, now: int) -> str:
    return (
        f"is of a state under FSDP (gradsparse.fsdp.sparsify), whose residuals are each module's flat gradient in "
        f"{saved} padded shards: laid out by the world size, they have no resharded form. Resume at {saved} ranks, or "
        f"load no gradsparse state at {now} (the residuals then start from zero)"
    )


class AllRanks:
    """Wraps a state for checkpointers that save from rank 0 only.

    ``state_dict()`` is collective (every rank must call it, as Lightning and Accelerate do):
    rank 0 receives every rank's state dict, with tensors on the CPU; on the other ranks it
    returns a stub that says so. ``load_state_dict(d)`` on every rank loads that rank's part of
    ``d`` (the world size must match). Rank 0 holds every rank's residuals while it saves: for
    large models on many ranks, save each rank's ``state.state_dict()`` to a file of its own instead.

    ``each_node=True`` is for checkpointers that write on every node, from its first process
    (``LOCAL_RANK`` 0), for nodes without a shared file system (Accelerate's
    ``ProjectConfiguration(save_on_each_node=True)``, the Trainer's ``save_on_each_node``): rank 0
    then sends every rank's state dict on to the first process of each other node.

    Example (Accelerate; its ``save_state`` does not wait for rank 0's write, so a ``load_state``
    in the same run follows ``accelerator.wait_for_everyone()``)::

        >>> accelerator.register_for_checkpointing(gradsparse.AllRanks(state))
    """

    def __init__(self, state, *, each_node: bool = False) -> None:
        from gradsparse.state import State

        if not isinstance(state, State):
            raise TypeError(
                f"gradsparse.AllRanks: state must be a gradsparse state such as gradsparse.TopK(density=0.01), "
                f"got {type(state).__name__}"
            )
        if not isinstance(each_node, bool):
            raise TypeError(f"gradsparse.AllRanks: each_node must be True or False, got {each_node!r}")
        self.state = state
        self.each_node = each_node
        self._node_firsts: list[dist.ProcessGroup] | None = None  # each_node: the nodes' first processes' group

    def state_dict(self) -> dict:
        state = self.state
        group = state.process_group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size > 1 and called_by_dcp():
            raise TypeError(
                f"gradsparse.AllRanks.state_dict: torch.distributed.checkpoint (dcp.save or dcp.load) was handed "
                f"gradsparse.AllRanks(state), on {world_size} ranks. AllRanks is for checkpointers that write on rank 0 "
                "(torch.save, Lightning, Accelerate): it gives rank 0 every rank's residuals and the other ranks none, "
                "which DCP would save as a file that loads on no rank. DCP writes each rank's own part itself: hand "
                "it gradsparse.ShardedState(state) instead, dcp.save({..., 'gradsparse': gradsparse.ShardedState("
                "state)}) and the same in dcp.load"
            )
        mine = _to_cpu(state.state_dict())
        if world_size > 1 and dist.get_backend(group) == "gloo":
            # Called on rank 0 alone (under `if rank == 0:`), the gather waited for ranks that never
            # came, then failed with Gloo's "Connection closed by peer" once one exited. A monitored
            # barrier (Gloo's) first bounds the wait by the state's timeout and names who is missing.
            try:
                dist.monitored_barrier(group, timeout=state._wait_timeout, wait_all_ranks=True)
            except RuntimeError as e:
                raise RuntimeError(
                    f"gradsparse.AllRanks.state_dict is collective: every rank of the state's group calls it, and "
                    f"rank 0 receives every rank's residuals, but not every rank came: {e}. Call it on every rank, "
                    "and save on rank 0: sd = gradsparse.AllRanks(state).state_dict(); if rank == 0: torch.save(sd, path); "
                    "a checkpointer that calls it (Lightning's trainer.save_checkpoint, Accelerate's save_state) is "
                    "called on every rank too, and writes on rank 0 itself"
                ) from None
        gathered: list | None = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0), group=group)
        saved = {
            "version": STATE_DICT_VERSION,
            "all_ranks": True,
            "class": mine["class"],
            "config": mine["config"],
            "world_size": world_size,
            "ranks": gathered,  # None on the ranks that do not save (all but 0, or each node's first)
        }
        return self._to_each_node(saved) if self.each_node and world_size > 1 else saved

    def _to_each_node(self, saved: dict) -> dict:
        """``saved`` as rank 0 holds it, on the first process of every node (LOCAL_RANK 0)."""
        group = self.state.process_group
        local_rank = os.environ.get("LOCAL_RANK")
        if self._node_firsts is None:  # once, on every rank; [] where this rank is no node's first
            firsts = [None] * dist.get_world_size(group)
            dist.all_gather_object(firsts, local_rank, group=group)
            if firsts[0] != "0" or any(r is None for r in firsts):
                raise ValueError(
                    f"gradsparse.AllRanks(each_node=True): every rank needs LOCAL_RANK (its place on its node, set by "
                    f"torchrun, accelerate launch and gradsparse.launch), and rank 0 must be its node's first, but "
                    f"the ranks have LOCAL_RANK {firsts}: launch with one of those, or use each_node=False and a "
                    "shared file system"
                )
            ranks = [dist.get_global_rank(group, r) for r, local in enumerate(firsts) if local == "0"]
            from gradsparse.binding import new_group_among  # binding imports this module

            node_firsts = new_group_among(group, ranks, timeout=self.state._wait_timeout)
            self._node_firsts = [node_firsts] if node_firsts is not None else []
        for node_firsts in self._node_firsts:
            box = [saved]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=node_firsts)
            saved = box[0]
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)  # a copy of a rank other than 0 is refused there


def reshard(state_dict: dict, world_size: int) -> dict:
    """An :class:`AllRanks` state dict made for ``world_size`` ranks from one saved at another.

    Every new rank takes the mean of the saved ranks' residuals. The exchanges average over the
    ranks, so the gradient mass still to be applied, (1/P) sum_r e_r, is conserved:
    (1/P') sum_r' e'_r' = (1/P) sum_r e_r. Momentum correction's velocities are averaged alike,
    each rank's first masked where its residual is zero (the positions its last step sent, whose
    velocity the next step restarts from zero: momentum factor masking), so that the next step
    adds the momentum the saved ranks would have added together. Method states depend on the
    number of ranks (MiCRO's and ExDyna's partitions, SparDL's blocks) and restart, as in a fresh
    run, and so do the bucket layout's guarantees of exactness (the first step after the load is
    reduced in the new DDP's own layout) and ``exchange="auto"``: its decision (timed at the old
    world size, by bucket index of the old layout) and the link it priced with (measured on the
    old ranks: the new run measures its own at set-up). The step and rank 0's statistics (by
    their buckets' parameters) are kept. Ranks saved in different loss scales (``set_scaler``) are averaged in the smallest of
    them, which the new state dict records; the mean is taken in float64 and rounded once to the
    residuals' dtype. A state of gradsparse.fsdp has no resharded form (a module's flat gradient
    is laid out by the world size) and is refused.

    Example::

        >>> saved = torch.load("gradsparse-all-ranks.pt")              # AllRanks(state).state_dict(), at 4 ranks
        >>> state.load_state_dict(gradsparse.reshard(saved, dist.get_world_size()))   # on each of 8 ranks
    """
    where = "gradsparse.reshard"
    if not (isinstance(state_dict, dict) and state_dict.get("all_ranks") and state_dict.get("ranks")):
        raise ValueError(
            f"{where}: state_dict must hold every rank's residuals, as gradsparse.AllRanks(state)."
            "state_dict() returns on rank 0; one rank's state dict cannot be resharded"
        )
    world_size = check_int(where, "world_size", world_size, 1, "world_size=dist.get_world_size()")
    _check_rank_count(where, state_dict)
    ranks = state_dict["ranks"]
    for rank, saved in enumerate(ranks):  # a damaged rank's would pass into the mean, under new checksums
        _require(where, saved, RANK_KEYS, f"rank {rank}'s part of the state dict")
        _check_same_options(where, state_dict, saved, rank)
        _check(where, saved)
        _check_in_place(where, saved, rank)
        if saved.get("fsdp"):
            raise ValueError(f"{where}: the state dict {_no_resharded_form(len(ranks), world_size)}")
    check_same_steps(
        where,
        [saved["step"] for saved in ranks],
        range(len(ranks)),
        "they come from different checkpoints; reshard the state dict that gradsparse.AllRanks(state).state_dict() "
        "returned, as saved",
    )
    # Each rank's in the loss scale it was saved in (set_scaler); the mean in the smallest of them,
    # so that no value grows on the way (a float16 residual moved up to a larger scale could pass
    # 65504), and the next step moves it to the scaler's scale.
    scales = [float(saved.get("loss_scale", 1.0)) for saved in ranks]
    common = min(scales)
    residuals = _mean_over_ranks([saved["residuals"] for saved in ranks], scales, common)
    velocities = _mean_over_ranks([_live_velocities(saved) for saved in ranks], scales, common)
    entries = with_checksums(residuals, velocities)
    stats = Metrics()  # rank 0's, by their buckets' parameters: the layout goes
    stats.load_state_dict(saved_stats(ranks[0]))
    # Every rank gets the same tensors (load_state_dict copies them; torch.save stores them once).
    new = [
        dict(
            ranks[0],
            rank=rank,
            world_size=world_size,
            **entries,
            methods=[],
            layout=[],
            stats=stats.state_dict(),
            parked_methods=[],
            link=None,
            exchanges=None,
            loss_scale=common,
        )
        for rank in range(world_size)
    ]
    return dict(state_dict, world_size=world_size, ranks=new)


def _live_velocities(saved: dict) -> dict[str, torch.Tensor]:
    """A rank's velocities as its next step will use them: zero where its residual is zero.
    Momentum factor masking reads those zeros as the positions the last step sent, and restarts
    the velocity there; a rank's residual is kept from its first sparse step on, so the velocities
    of a state that took none (a Dense state, warm-up steps) are used as they are."""
    residuals = saved["residuals"]
    return {
        name: u.masked_fill(residuals[name].reshape(u.shape) == 0, 0) if name in residuals else u
        for name, u in saved.get("velocities", {}).items()
    }


def _mean_over_ranks(
    per_rank: list[dict[str, torch.Tensor]], scales: list[float], common: float
) -> dict[str, torch.Tensor]:
    """By name, the mean of the ranks' tensors (a rank without one holds zeros), rank r's in loss
    scale ``scales[r]``, the mean in ``common``."""
    out = {}
    for name in sorted({name for tensors in per_rank for name in tensors}):
        parts = [(tensors[name], scale) for tensors, scale in zip(per_rank, scales, strict=True) if name in tensors]
        sizes = sorted({p.numel() for p, _ in parts})
        if len(sizes) > 1:
            raise ValueError(
                f"gradsparse.reshard: the ranks' residuals of {name} differ in size ({', '.join(map(str, sizes))} "
                "elements): the state dict's ranks were saved from different models; reshard a state dict that "
                "gradsparse.AllRanks(state).state_dict() returned, as saved"
            )
        total = torch.stack([p.double() * (common / scale) for p, scale in parts]).sum(0)
        out[name] = (total / len(per_rank)).to(parts[0][0].dtype)
    return out


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
