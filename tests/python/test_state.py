"""The Python API in one process (a one-rank Gloo group): option validation, the hook on a real
DDP model, statistics, state_dict round trips."""

import copy
import gc
import io
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs
from gradsparse import simulate
from gradsparse.checkpoint import with_checksums
from gradsparse.testing.distributed import free_port
from tests.distributed.workers import Chain, params_of
from tests.python.on_a_gpu import ON_A_GPU


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: gs.TopK(density=0.0), ValueError, "TopK: density must be in (0, 1], got 0.0"),
        (lambda: gs.TopK(density=1.5), ValueError, "density must be in (0, 1], got 1.5; for example density=0.01"),
        (lambda: gs.TopK(density=math.nan), ValueError, "got nan"),
        (lambda: gs.TopK(density="0.1"), TypeError, "density must be a number, got '0.1' (str)"),
        (lambda: gs.TopK(density=True), TypeError, "density must be a number, got True (bool)"),
        (lambda: gs.Threshold(threshold=-1e-3), ValueError, "threshold must be a finite number >= 0, got -0.001"),
        (lambda: gs.Threshold(threshold=math.inf), ValueError, "got inf"),
        (
            lambda: gs.TopK(density=0.1, warmup=2),
            TypeError,
            "unknown option(s) warmup (did you mean warmup_steps?); the options of TopK are",
        ),
        # a misspelt required option: named as such, not as the missing one ("missing ... 'density'")
        (lambda: gs.TopK(desnity=0.01), TypeError, "unknown option(s) desnity (did you mean density?)"),
        (lambda: gs.TopK(density=0.1, warmup_steps=-1), ValueError, "warmup_steps must be >= 0, got -1"),
        (lambda: gs.TopK(density=0.1, warmup_steps=1.5), TypeError, "warmup_steps must be an integer"),
        (lambda: gs.TopK(density=0.1, error_feedback="yes"), TypeError, "error_feedback must be True or False"),
        (lambda: gs.TopK(density=0.1, nonfinite="ignore"), ValueError, "nonfinite must be one of 'raise', 'skip'"),
        (
            lambda: gs.TopK(density=0.1, nonfinite="propagate").set_scaler(2.0**16),
            TypeError,
            "TopK.set_scaler: scaler must be a torch.amp.GradScaler (anything with get_scale()) or None, got float",
        ),
        (  # the overflows would never reach the scaler
            lambda: gs.TopK(density=0.1, nonfinite="skip").set_scaler(torch.amp.GradScaler("cpu")),
            ValueError,
            "nonfinite='skip' hands none back, so the scale would never come down; create TopK with "
            'nonfinite="propagate"',
        ),
        (lambda: gs.TopK(density=0.1, momentum=1.0), ValueError, "TopK: momentum must be in [0, 1), got 1.0; for"),
        (lambda: gs.TopK(density=0.1, momentum="0.9"), TypeError, "momentum must be a number, got '0.9' (str)"),
        (
            lambda: gs.DGC(density=0.1, momentum=0.9, error_feedback=False),
            ValueError,
            "DGC: momentum=0.9 needs error_feedback=True: momentum correction keeps its velocity where the residual",
        ),
        (lambda: gs.TopK(density=0.1, timeout=-3), ValueError, "timeout must be a positive number of seconds"),
        (
            lambda: gs.TopK(density=0.1, timeout=1e15),
            ValueError,
            "timeout must be a positive number of seconds, from 0.001 (the exchanges wait in whole milliseconds) to",
        ),
        # under a millisecond: c10d's wait of 0 ms is no timeout, and timedelta(0) read as the 30 min default
        (lambda: gs.TopK(density=0.1, timeout=1e-4), ValueError, "timeout must be a positive number of seconds, from"),
        (lambda: gs.TopK(density=0.1, process_group="world"), TypeError, "process_group must be a"),
        (
            lambda: gs.TopK(),
            TypeError,
            "TopK: missing a required argument: 'density'; call it as TopK(density, *, exchange='gather', **options)",
        ),
        (lambda: gs.TopK(0.1, 0.2), TypeError, "TopK: too many positional arguments"),
        (lambda: gs.Threshold(), ValueError, "Threshold: give exactly one of threshold"),
        (lambda: gs.MiCRO(0.1, exchange="shared"), ValueError, "MiCRO: exchange must be one of 'union', 'gather'"),
        (lambda: gs.SAGE(0.1, initial_threshold=-1), ValueError, "SAGE: initial_threshold must be a finite number > 0"),
        (lambda: gs.SIDCo(0.1, first_ratio=1.5), ValueError, "first_ratio must be in (0, 1), got 1.5; for example"),
        (lambda: gs.SIDCo(0.1, iratio="0.2"), TypeError, "SIDCo: iratio must be a number, got '0.2' (str)"),
        (
            lambda: gs.SIDCo(0.1, stages=3, iratio=0.5),  # was accepted and ignored
            ValueError,
            "SIDCo: iratio=0.5 is the per-stage ratio of stages=0 only, but stages=3, which would ignore it; give",
        ),
        (lambda: gs.SIDCo(0.1, stages=-4), ValueError, "SIDCo: stages must be >= -3, got -4; for example stages=-1"),
        # the fits' quantile 1 - density (/ 2) is 1 in float64: the first backward failed with "normal_quantile: p
        # must be in (0, 1), got 1" (Gaussian-k) or gamma_p_inverse's (SIDCo-GP), naming no option
        (
            lambda: gs.GaussianK(1e-17, variant="sidco"),
            ValueError,
            "GaussianK: density must be above 1.11e-16 (2**-53), got 1e-17: its normal fit's quantile 1 - density / 2",
        ),
        (
            lambda: gs.SIDCo(5e-17, fit="gamma_gpareto", reference=True),
            ValueError,
            'SIDCo: density must be above 5.55e-17 (2**-54), got 5e-17: fit="gamma_gpareto"\'s gamma quantile',
        ),
        (lambda: gs.SparDL(0.1, teams=0), ValueError, "SparDL: teams must be >= 1, got 0; for example teams=1"),
        (lambda: gs.RandomK(0.1, seed=-1), ValueError, "RandomK: seed must be >= 0, got -1"),
        # beyond the C++ types (uint64_t seed, int stages and teams): refused here, not at the first step by pybind11
        (lambda: gs.DGC(0.1, seed=2**64), ValueError, "DGC: seed must be at most 18446744073709551615, got 184467"),
        (lambda: gs.SIDCo(0.1, stages=2**31), ValueError, "SIDCo: stages must be at most 2147483647, got 2147483648"),
        (
            lambda: gs.SparDL(0.1, teams=2**40),
            ValueError,
            "SparDL: teams must be at most 2147483647, got 1099511627776",
        ),
        (
            lambda: gs.TopK(0.1, error_feedback=np.True_),
            TypeError,
            "(numpy.bool",  # numpy says "bool" (2.x) or "bool_" (1.x)
        ),
        (lambda: gs.methods.core_method("powersgd", density=0.1), ValueError, "name must be a sparse method, got"),
        # a truthy string loaded another rank's residuals, or reset the statistics
        (
            lambda: gs.TopK(0.1).load_state_dict({}, any_rank="no"),
            TypeError,
            "TopK.load_state_dict: any_rank must be True or False, got 'no' (str)",
        ),
        (lambda: gs.TopK(0.1).stats(reset="no"), TypeError, "TopK.stats: reset must be True or False, got 'no' (str)"),
        (
            lambda: gs.reshard({"all_ranks": True, "ranks": [{}]}, 2.0),
            TypeError,
            "gradsparse.reshard: world_size must be an integer >= 1, got 2.0 (float); for example world_size=dist.",
        ),
        (lambda: gs.reshard({"all_ranks": True, "ranks": [{}]}, 0), ValueError, "reshard: world_size must be >= 1"),
        (lambda: gs.set_num_threads(-3), ValueError, "gradsparse.set_num_threads: threads must be >= 0, got -3"),
        (lambda: gs.set_num_threads(True), TypeError, "set_num_threads: threads must be an integer >= 0, got True"),
    ],
)
def test_bad_options_raise_naming_option_value_and_fix(make, error, message):
    with pytest.raises(error) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: gs.GaussianK(d, variant="spardl"),
        lambda d: gs.GaussianK(d, variant="sidco", reference=True),
        lambda d: gs.SIDCo(d / 2, fit="gamma_gpareto"),
    ],
)
def test_the_least_density_a_fit_takes_trains(make):
    """The least density GaussianK and SIDCo-GP take (just above 2**-53, 2**-54) reduces its steps."""
    state = make(math.nextafter(2.0**-53, 1.0))
    _train(_hooked(state), 3)
    total, bucket = state.stats()["total"], state.stats()["buckets"][0]  # one bucket
    assert total["steps"] == 3 and total["dense_steps"] == 0
    # every sparse step selects (k = 1 of 387 elements) above a finite threshold: the fit gave one
    assert total["selected"] >= 3 and math.isfinite(bucket["threshold"]) and bucket["threshold"] > 0, bucket


def test_a_method_is_declared_once():
    """The declaration gives the signature, the docstring's Args, config() and the C++ object."""
    import inspect

    params = inspect.signature(gs.SIDCo).parameters
    assert list(params) == ["density", "fit", "stages", "first_ratio", "iratio", "exchange", "options"]
    assert params["density"].default is inspect.Parameter.empty
    assert params["stages"].kind is inspect.Parameter.KEYWORD_ONLY and params["stages"].default == -1
    assert "        stages: -1, -2, -3: the adaptive modes" in gs.SIDCo.__doc__
    state = gs.SIDCo(0.05, fit="gpareto", reference=True)
    assert state.config()["fit"] == "gpareto" and state.config()["first_ratio"] == 0.25
    assert {o.name for o in gs.SIDCo.OPTIONS} <= set(state.config())
    method = gs.methods.core_method("sidco", density=0.05, stages=2)
    assert method.name == "sidco" and method.stages == 2
    sage = gs.methods.core_method("SAGE", [3, 5], density=0.5, sampling="per_tensor")
    assert sage.name == "sage"


def test_a_state_is_created_before_the_process_group_and_set_up_after():
    """As Lightning's DDPStrategy(ddp_comm_state=...) does: the state exists before
    init_process_group; set-up before it says what to do; after it, the state trains."""
    code = """
import torch, torch.distributed as dist, torch.nn as nn
import gradsparse as gs
from gradsparse import simulate
from gradsparse.testing.distributed import free_port
state = gs.TopK(density=0.1)
try:
    state.setup()
except RuntimeError as e:
    print("before:", e)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
ddp.register_comm_hook(state, gs.hook)  # plain registration: set-up at the first backward
ddp(torch.randn(2, 8)).sum().backward()
print("after:", state.step, state.stats()["total"]["selected"])
state.close()
dist.destroy_process_group()  # once in a CI run, an exit with the group alive aborted in teardown
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (
        "before: TopK.setup: torch.distributed is not initialized; call torch.distributed.init_process_group()"
        in out.stdout
    )
    assert "after: 1 3" in out.stdout  # 10% of 36 elements


def test_hook_rejects_a_foreign_state_through_its_future_and_leaves_ddp_whole():
    """gradsparse.hook given something that is no state (register_comm_hook(None, gs.hook))
    raised inside DDP's hook call: the error was clear, but DDP's reducer was left half-way and
    the next backward died in a PyTorch internal assert. It is raised once DDP has ended the step,
    as the state's own errors are, so every backward raises it (outside a backward the future
    carries it)."""
    with pytest.raises(RuntimeError, match="state must be a gradsparse state"):
        gs.hook(object(), None).wait()
    ddp = DDP(_model())
    ddp.register_comm_hook(None, gs.hook)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"gradsparse.hook: state must be a gradsparse state .* got None"):
            _train(ddp, 1)


def _train(ddp, steps, seed=0, momentum=0.0, switch_at=None):
    """SGD at this momentum; from step ``switch_at`` on, a fresh SGD without it."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        if step == switch_at:
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        loss = nn.functional.cross_entropy(ddp(x.to(next(ddp.parameters()).dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _hooked(state, weights_of=None):
    """A DDP model of _model() with the state's hook registered (and another model's weights)."""
    ddp = DDP(_model())
    if weights_of is not None:
        ddp.module.load_state_dict(weights_of.module.state_dict())
    gs.register(ddp, state)
    return ddp


def test_stats_report_density_bytes_and_warmup():
    state = gs.TopK(density=0.1, warmup_steps=2)
    ddp = _hooked(state)
    _train(ddp, 6)
    stats = state.stats()
    total = stats["total"]
    n = sum(p.numel() for p in ddp.parameters())
    assert total["steps"] == 6 and total["dense_steps"] == 2 and total["skipped_steps"] == 0
    assert total["elements"] == 6 * n
    assert total["selected"] == 4 * gs._C.target_count(0.1, n)  # one bucket
    assert total["density"] == pytest.approx(math.floor(0.1 * n) / n)
    assert total["elements_sent"] == 2 * n + total["selected"]
    assert total["bytes_sent"] == 0  # one rank moves nothing
    assert set(stats["buckets"]) == {0}
    assert state.step == 6
    assert state.stats(reset=True)["total"]["steps"] == 6
    assert state.stats()["total"]["steps"] == 0


@pytest.mark.parametrize(
    "make", [lambda: gs.TopK(density=0.1, nonfinite="skip"), lambda: gs.MiCRO(density=0.1, nonfinite="skip")]
)
def test_a_skipped_step_counts_in_no_density(make):
    """A step skipped for a NaN applies nothing (its selection goes back to the residual): its
    pairs counted in density but its elements wrote no union, so at one rank density and
    union_density parted, and MiCRO's achieved_density fell below what the applied steps hit."""
    state = make()
    ddp = _hooked(state)
    n = sum(p.numel() for p in ddp.parameters())
    torch.manual_seed(0)
    for step in range(4):
        x = torch.randn(16, 8)
        if step == 2:
            x[0, 0] = math.nan
        ddp(x).sum().backward()
        ddp.zero_grad()
    total = state.stats()["total"]
    assert total["steps"] == 4 and total["skipped_steps"] == 1
    assert total["sparse_elements"] == 3 * n
    assert total["elements_sent"] == total["selected"] == total["union"] > 0  # one rank writes what it sends
    assert total["density"] == total["union_density"] == total["achieved_density"]
    if isinstance(state, gs.TopK):
        assert total["density"] == pytest.approx(math.floor(0.1 * n) / n)


@pytest.mark.parametrize("nonfinite", ["skip", "propagate"])
def test_a_bucket_that_skips_every_step_warns_once_that_it_stopped_training(nonfinite):
    """A NaN that every step's gradient carries (here from the input) makes every step skip the
    bucket: its parameters stop training, which the skipping policies said nowhere but in the
    statistics. The state warns at the SKIPS_BEFORE_WARNING-th skip in a row, once; a good step
    starts the count again."""
    from gradsparse.state import SKIPS_BEFORE_WARNING

    state = gs.TopK(density=0.1, nonfinite=nonfinite)
    ddp = _hooked(state)

    def steps(count, nan):
        for _ in range(count):
            x = torch.randn(16, 8)
            if nan:
                x[0, 0] = math.nan
            ddp(x).sum().backward()
            ddp.zero_grad()

    def warnings_of(count, nan):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps(count, nan)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    assert warnings_of(SKIPS_BEFORE_WARNING - 1, nan=True) == []
    assert warnings_of(1, nan=False) == []  # a good step: the count starts again
    assert warnings_of(SKIPS_BEFORE_WARNING - 1, nan=True) == []
    (message,) = warnings_of(SKIPS_BEFORE_WARNING + 5, nan=True)  # the 100th in a row, and no more after it
    assert f"bucket 0 skipped its update on every rank in each of the last {SKIPS_BEFORE_WARNING} steps" in message
    assert f"nonfinite={nonfinite!r}" in message and 'nonfinite="raise"' in message
    assert state.stats()["total"]["skipped_steps"] == 3 * SKIPS_BEFORE_WARNING + 3


def test_state_dict_round_trip_restores_residuals_by_name():
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    _train(ddp, 3)
    sd = state.state_dict()
    names = {name for name, _ in ddp.module.named_parameters()}
    assert set(sd["residuals"]) == names
    assert (
        sd["step"] == 3
        and sd["class"] == "TopK"
        and sd["config"] == {"density": 0.05, "exchange": "gather", "error_feedback": True, "momentum": 0.0}
    )
    assert any(t.abs().sum() > 0 for t in sd["residuals"].values())
    saved = {k: v.clone() for k, v in sd["residuals"].items()}

    state2 = gs.TopK(density=0.05)
    ddp2 = _hooked(state2, weights_of=ddp)
    state2.load_state_dict(sd)
    assert state2.step == 3
    _train(ddp2, 1, seed=5)  # the residuals are put back when the buckets are first seen
    # Replaying the same step on the original state must give the same residuals.
    _train(ddp, 1, seed=5)
    for name, value in state.state_dict()["residuals"].items():
        assert torch.equal(value, state2.state_dict()["residuals"][name]), name
    assert not all(torch.equal(saved[k], v) for k, v in state2.state_dict()["residuals"].items())


def test_load_state_dict_rejects_another_method_or_config():
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    _train(ddp, 1)
    sd = state.state_dict()
    with pytest.raises(ValueError, match=r"saved with other options \(density=0.05 saved, 0.1 here\); create TopK"):
        gs.TopK(density=0.1).load_state_dict(sd)
    with pytest.raises(ValueError, match="saved by TopK"):
        gs.Threshold(threshold=0.1).load_state_dict(sd)
    with pytest.raises(ValueError, match="not a gradsparse state dict"):
        gs.TopK(density=0.05).load_state_dict({"version": 99})


def test_a_state_dict_saved_before_an_option_existed_loads_with_its_default():
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    _train(ddp, 1)
    sd = state.state_dict()
    sd["config"] = {"density": 0.05}  # as gradsparse saved TopK before it had `exchange` (and named momentum)
    fresh = gs.TopK(density=0.05)
    fresh.load_state_dict(sd)
    assert fresh.step == 1
    with pytest.raises(ValueError, match="exchange='gather' saved, 'reduce_scatter' here"):
        gs.TopK(density=0.05, exchange="reduce_scatter").load_state_dict(sd)
    gs.TopK(density=0.05, momentum=0.9).load_state_dict(sd)  # an older state dict's momentum is not known


def test_a_state_dict_with_an_option_of_a_later_version_names_it_and_the_fix():
    """An option this version does not know was refused as 'saved with other options (... None
    here); create TopK with the saved options', which no TopK of this version can be."""
    sd = _saved()
    sd["config"] = dict(sd["config"], overlap=True)  # as a later gradsparse might save
    with pytest.raises(ValueError) as refused:
        gs.TopK(density=0.05).load_state_dict(sd)
    message = str(refused.value)
    assert "comes from a later gradsparse version, with option overlap=True" in message, message
    assert "upgrade gradsparse" in message and "del sd['config']['overlap']" in message, message
    del sd["config"]["overlap"]
    fresh = gs.TopK(density=0.05)
    _hooked(fresh)
    fresh.load_state_dict(sd)
    assert fresh.step == 2


def test_repr_and_config():
    state = gs.Threshold(threshold=0.5, warmup_steps=3)
    assert repr(state).startswith(
        "Threshold(threshold=0.5, density=None, exchange='gather', warmup_steps=3, error_feedback=True"
    )
    assert state.config()["nonfinite"] == "raise"


@pytest.mark.parametrize(
    "backend,threads", [("mpi", 1), ("cpu:mpi,cuda:nccl", 1), ("gloo", 0), ("cpu:gloo,cuda:nccl", 0), ("nccl", 0)]
)
def test_transport_mpi_counts_the_thread_of_torchs_mpi_process_group(backend, threads):
    """transport="mpi" counted only gradsparse's own engines among the threads that call MPI:
    beside torch.distributed's MPI process group (which initialises MPI at MPI_THREAD_SERIALIZED
    and calls MPI from its worker thread) its engine was admitted. The engine now counts that
    worker wherever the default group's backend, alone or for a device, is "mpi"
    (tests/distributed/test_exchanges.py: the refusal it makes under MPI_THREAD_SERIALIZED)."""
    from gradsparse.state import _torch_mpi_threads

    assert _torch_mpi_threads(backend) == threads


def test_without_error_feedback_no_residual_is_kept():
    state = gs.TopK(density=0.05, error_feedback=False)
    ddp = _hooked(state)
    _train(ddp, 2)
    assert state.state_dict()["residuals"] == {}


def test_paused_hands_buckets_back_untouched_and_changes_nothing():
    state = gs.TopK(density=0.1)
    ddp = _hooked(state)
    _train(ddp, 2)
    before = state.state_dict()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with state.paused():
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    # one rank: the unreduced bucket is the local gradient itself, not a top-k selection of it
    local = [p.grad.clone() for p in ddp.parameters()]
    assert all(g.count_nonzero() > 0.5 * g.numel() for g in local if g.numel() > 32)
    after = state.state_dict()
    assert after["step"] == before["step"] == 2
    for name, value in before["residuals"].items():
        assert torch.equal(value, after["residuals"][name]), name
    _train(ddp, 1)  # and the hook works again after the block
    assert state.step == 3


def test_a_nested_paused_block_leaves_the_state_paused_until_the_outer_block_ends():
    """paused() inside paused() (a helper that pauses, called in a paused iteration): leaving the
    inner block unpaused the state, so the rest of the outer block's backward was reduced, and
    counted as a step, its residuals changed."""
    state = gs.TopK(density=0.1)
    ddp = _hooked(state)
    _train(ddp, 2)
    before = state.state_dict()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with state.paused():
        with state.paused():
            pass
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    after = state.state_dict()
    assert after["step"] == before["step"] == 2
    for name, value in before["residuals"].items():
        assert torch.equal(value, after["residuals"][name]), name
    _train(ddp, 1)  # and the hook works again after the outer block
    assert state.step == 3


def test_achieved_density_is_global_for_one_target_methods():
    state = gs.MiCRO(density=0.1)
    ddp = _hooked(state)
    _train(ddp, 4)
    total = state.stats()["total"]
    assert total["achieved_density"] == total["union_density"] > 0  # MiCRO: one target for all ranks
    topk = gs.TopK(density=0.1)
    ddp2 = _hooked(topk)
    _train(ddp2, 4)
    assert topk.stats()["total"]["achieved_density"] == topk.stats()["total"]["density"]


def test_method_state_follows_its_parameters_into_another_bucket_index():
    """load_state_dict gives each bucket the method state saved for the same parameter names,
    whatever index the bucket has now (DDP may number its buckets differently after a restart)."""
    state = gs.MiCRO(density=0.1)
    ddp = _hooked(state)
    _train(ddp, 3)
    sd = state.state_dict()
    assert set(sd["layout"][0]) == {name for name, _ in ddp.module.named_parameters()}
    moved = dict(sd, methods=[None] * 7 + sd["methods"], layout=[[]] * 7 + sd["layout"])  # saved as bucket 7
    state2 = gs.MiCRO(density=0.1)
    ddp2 = _hooked(state2, weights_of=ddp)
    state2.load_state_dict(moved)
    _train(ddp2, 1, seed=5)
    _train(ddp, 1, seed=5)
    assert state2.state_dict()["methods"][0] == state.state_dict()["methods"][0]


def _fail_second_submit(monkeypatch, state, message):
    """The second bucket the state hands to its engine from now on raises RuntimeError(message)."""
    submit, calls = state._submit, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(message)
        return submit(*args, **kwargs)

    monkeypatch.setattr(state, "_submit", second_fails)


def test_a_method_state_that_a_failed_rebuild_step_left_parked_is_saved(monkeypatch):
    """DDP's rebuild keeps Chain's bucket 0 and swaps the other two: the step parks both their
    method states, and each new bucket takes its own. When the step fails at the first of them,
    the other waits parked until the next step. A state dict taken in between held its residual
    but not its method state, so a run resumed from it restarted that bucket's method (MiCRO's
    threshold and step) where the run that went on kept it."""

    def chain():
        return DDP(Chain(), bucket_cap_mb_list=[0.003] * 3)  # one parameter per bucket

    def backward(model, steps, seed=0):
        torch.manual_seed(seed)
        for _ in range(steps):
            model.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()

    state = gs.MiCRO(density=0.1)
    ddp = chain()
    gs.register(ddp, state)
    backward(ddp, 1)
    assert state.state_dict()["layout"] == [["head.weight"], ["a.weight"], ["b.weight"]]
    _fail_second_submit(monkeypatch, state, "the rebuilt bucket 1 failed")
    with pytest.raises(RuntimeError, match="the rebuilt bucket 1 failed"):
        backward(ddp, 1)
    monkeypatch.undo()
    sd = copy.deepcopy(state.state_dict())
    assert sd["layout"] == [["head.weight"], ["b.weight"]]
    (parked,) = sd["parked_methods"]
    assert parked["names"] == ["a.weight"] and parked["loss_scale"] == 1.0 and parked["state"]["step"] == 1
    resumed = gs.MiCRO(density=0.1)
    resumed_ddp = chain()
    resumed_ddp.module.load_state_dict(ddp.module.state_dict())
    gs.register(resumed_ddp, resumed)
    resumed.load_state_dict(sd)
    for model in (ddp, resumed_ddp):
        backward(model, 2, seed=3)
    assert resumed.state_dict()["methods"] == state.state_dict()["methods"]
    assert resumed.state_dict()["parked_methods"] == []


# Registration and checkpoints: each wrong step gets an error that says what to do instead ---------


def test_register_rejects_a_model_that_is_not_ddp_and_a_second_registration():
    state = gs.TopK(density=0.1)
    with pytest.raises(
        TypeError,
        match=r"model must be a DistributedDataParallel .* got Sequential; .*after accelerator.prepare\(model\), "
        r"which wraps it only when several processes run \(torchrun, or accelerate launch --multi_gpu "
        r"--num_processes N, which on CPUs too starts N\)",
    ):
        gs.register(_model(), state)
    ddp = _hooked(state)
    with pytest.raises(ValueError, match="already registered on this model; register it once"):
        gs.register(ddp, state)
    with pytest.raises(ValueError, match=r"already registered on another model; .* create one state per model"):
        gs.register(DDP(_model()), state)
    _train(ddp, 2)
    residuals = {k: v.clone() for k, v in state.state_dict()["residuals"].items()}
    rewrapped = DDP(ddp.module)  # the same parameters in a new DDP (Lightning's second fit()): allowed
    gs.register(rewrapped, state)
    assert all(torch.equal(v, state.state_dict()["residuals"][k]) for k, v in residuals.items())
    _train(rewrapped, 1)
    assert state.step == 3


def test_a_state_in_use_refuses_to_be_pickled_naming_state_dict_and_a_fresh_one_is_copied():
    """Pickled after its set-up, a state failed on its ProcessGroup ("cannot pickle ...
    ProcessGroup"), naming nothing of gradsparse; a fresh one (mp.spawn's arguments) still copies."""
    fresh = copy.deepcopy(gs.TopK(density=0.1, momentum=0.9))
    assert fresh.config()["momentum"] == 0.9
    assert fresh in gs.state._LIVE_STATES  # its engine is stopped at exit, as every state's
    _train(_hooked(fresh), 2)  # the copy trains
    assert fresh.step == 2
    for state in (fresh, gs.TopK(density=0.1).setup()):
        for copy_it in (copy.deepcopy, lambda s: torch.save(s, io.BytesIO())):
            with pytest.raises(
                TypeError,
                match=r"TopK: a state that is set up or registered cannot be pickled or copied .* Save "
                r"state.state_dict\(\) and load it with load_state_dict into a new TopK .* "
                r"gradsparse.TopK\(\*\*state.config\(\), process_group=state.process_group\)",
            ):
                copy_it(state)
    # A DDP carrying the hook holds the state: the message says what to copy instead.
    ddp = _hooked(gs.TopK(density=0.1))
    for copy_it in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"copy or save the module inside instead, copy.deepcopy\(model.module\)"):
            copy_it(ddp)
    copy.deepcopy(ddp.module)


def test_a_state_taken_over_after_a_change_of_memory_format_trains_on_as_before():
    """DDP's bucket views follow a parameter's strides, so a residual holds its parameter's elements
    in its memory order. A model converted from channels_last to contiguous between two DDP
    wrappers applied each held value to another element (4e-3 off after 3 steps): its buckets
    are now assembled anew, each piece moved into its parameter's new order."""
    from tests.distributed.workers import SmallCNN

    data = [(torch.randn(4, 3, 6, 6), torch.randint(0, 6, (4,))) for _ in range(6)]

    def run(switch_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = SmallCNN().to(memory_format=torch.channels_last)
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = gs.register(ddp, gs.TopK(density=0.1, momentum=0.9))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step, (x, y) in enumerate(data):
            if step == switch_at:
                assert set(state.state_dict()["strides"]) == {"c1.weight", "c2.weight"}
                model.to(memory_format=torch.contiguous_format)
                ddp = DDP(model, bucket_cap_mb=0.001)
                gs.register(ddp, state)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        assert state.state_dict()["strides"] == (
            {} if switch_at else {"c1.weight": [27, 1, 9, 3], "c2.weight": [36, 1, 12, 4]}
        )
        return params_of(model)

    for switched, straight in zip(run(3), run(None), strict=True):
        torch.testing.assert_close(switched, straight, rtol=1e-5, atol=1e-6)  # convolutions round differently


@pytest.mark.parametrize("then,now", [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_a_parked_piece_is_moved_into_its_parameters_memory_order(then, now):
    from gradsparse.buckets import BucketTable, memory_order

    formats = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
    values = torch.arange(2.0 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    held, param = values.contiguous(memory_format=formats[then]), values.contiguous(memory_format=formats[now])
    in_memory = held.as_strided((held.numel(),), (1,))  # as a bucket view of it holds it
    table = BucketTable()
    table.park({"residual": {"w": in_memory}}, [], 1.0, {"w": memory_order(held)} if memory_order(held) else {})
    bucket = table.add(0, ["w"], [list(param.shape)], [memory_order(param)], lambda: None, param)
    assert torch.equal(bucket.residual, param.as_strided((param.numel(),), (1,)))
    assert table.strides() == ({"w": list(param.stride())} if now == "channels_last" else {})


@pytest.mark.parametrize("then,now", [("gaps", "contiguous"), ("contiguous", "gaps")])
def test_a_parameter_with_gaps_is_row_major_in_its_bucket(then, now):
    """DDP's bucket view of a parameter whose elements are not dense in memory (a slice with gaps)
    is row-major, whatever its strides: such a parameter's strides were taken for its residual's
    order, and a model whose parameter changed between one and the other under a new DDP failed
    (setStorage out of bounds) or took its residual from the wrong elements."""

    def layout(weight: torch.Tensor, how: str) -> torch.Tensor:
        return torch.empty(weight.shape[0], 2 * weight.shape[1])[:, ::2].copy_(weight) if how == "gaps" else weight

    data = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(6)]

    def run(switch_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        model.weight.data = layout(model.weight.data.contiguous(), then)
        ddp = DDP(model)
        state = gs.register(ddp, gs.TopK(density=0.3, momentum=0.9))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(data):
            if step == switch_at:
                model.weight.data = layout(model.weight.data.contiguous(), now)
                ddp = DDP(model)
                gs.register(ddp, state)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        assert state.state_dict()["strides"] == {}
        return params_of(model)

    for switched, straight in zip(run(3), run(None), strict=True):
        torch.testing.assert_close(switched, straight)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_state_follows_its_model_into_a_new_ddp_after_a_conversion_or_a_new_layer(change):
    """Between two DDP wrappers the model was converted to bfloat16, or its last layer replaced by
    one of another shape under the same names. The state kept its bucket as it was, and every later
    step failed ("bucket is BFloat16 but residual is Float", "bucket has 453 elements but residual
    has 387"). Now it goes on as a new state loaded with its state dict would: its residuals
    converted, those of the replaced layer's parameters of another size dropped."""

    def changed(ddp):
        if change == "dtype":
            ddp.module.to(torch.bfloat16)
        else:
            torch.manual_seed(2)
            ddp.module[2] = nn.Linear(32, 5)
        return DDP(ddp.module)

    runs = []
    for reload in (False, True):
        state = gs.TopK(density=0.1)
        ddp = _hooked(state)
        _train(ddp, 3)
        ddp = changed(ddp)
        if reload:  # a new state, given what the state dict holds for the parameters as they are now
            saved = state.state_dict()
            sizes = {n: p.numel() for n, p in ddp.module.named_parameters()}
            kept = {n: r for n, r in saved["residuals"].items() if r.numel() == sizes[n]}
            state = gs.TopK(density=0.1)
            state.load_state_dict({**saved, **with_checksums(kept, {})})
        gs.register(ddp, state)
        _train(ddp, 3, seed=1)
        runs.append((params_of(ddp.module), state.state_dict()["residuals"], state.step))
    (params, residuals, step), (params_reloaded, residuals_reloaded, _) = runs
    assert step == 6
    assert all(torch.equal(a, b) for a, b in zip(params, params_reloaded, strict=True))
    assert residuals.keys() == residuals_reloaded.keys()
    for name, residual in residuals.items():
        assert residual.dtype == next(ddp.parameters()).dtype
        assert torch.equal(residual, residuals_reloaded[name]), name


def test_a_state_used_in_a_process_forked_after_its_set_up_says_to_create_it_there():
    """The engine thread runs in the process that set the state up: a forked child's step would
    wait for ever on a queue nothing reads. The step raises, naming the fix (the process is taken
    for a forked one by the pid the state recorded)."""
    state = gs.TopK(density=0.1)
    ddp = DDP(_model())
    gs.register(ddp, state)
    _train(ddp, 1)
    state._pid = -1  # as in a child: not this process
    with pytest.raises(RuntimeError, match=r"was set up in process -1, and this process .* was forked from it"):
        _train(ddp, 1)
    state._pid = None
    state.close()


def test_one_state_hooked_on_two_models_raises():
    state = gs.TopK(density=0.1)
    first, second = DDP(_model()), DDP(_model())
    first.register_comm_hook(state, gs.hook)  # plain registration: the state learns its parameters in step 1
    second.register_comm_hook(state, gs.hook)
    _train(first, 1)
    # raised from backward(), as it was raised, once DDP has ended the step
    with pytest.raises(ValueError, match="gradsparse: this TopK state is registered on more than one"):
        _train(second, 1)
    _train(first, 1)  # the first model trains on
    with pytest.raises(ValueError, match=r"already registered on another model; .* create one state per model"):
        gs.register(DDP(second.module), state)  # nor does register take the second model
    assert state.step == 2


@pytest.mark.parametrize("change", ["a layer replaced", "a layer unfrozen"])
def test_a_state_hooked_on_a_new_ddp_of_its_changed_model_names_register_which_takes_it_over(change):
    """Hooked with model.register_comm_hook, a state knows its model by the parameters of its first
    step. Under a new DDP over the same module, with a layer replaced or unfrozen, its steps were
    refused as those of a second model, and so was gradsparse.register(new_ddp, state). The hook
    cannot tell the same module from another; the refusal says so and names register, which takes
    the state over: the new DDP's module holds parameters the state reduced."""
    state = gs.TopK(density=0.1)
    model = _model()
    if change == "a layer unfrozen":
        model[0].requires_grad_(False)
    ddp = DDP(model)
    ddp.register_comm_hook(state, gs.hook)
    _train(ddp, 2)
    if change == "a layer replaced":
        model[2] = nn.Linear(32, 5)
    else:
        model[0].requires_grad_(True)
    ddp = DDP(model)
    ddp.register_comm_hook(state, gs.hook)
    with pytest.raises(ValueError, match=r"a layer replaced or unfrozen since.* gradsparse.register\(new_ddp, state\)"):
        _train(ddp, 1)
    ddp = DDP(model)
    gs.register(ddp, state)
    _train(ddp, 2)
    assert state.step == 4
    assert set(state.state_dict()["residuals"]) == {n for n, p in model.named_parameters()}


def test_a_hooked_state_taken_over_by_register_keeps_what_it_held_under_the_parameters_names():
    """Hooked with model.register_comm_hook, a state holds its residuals, velocities, method
    states and statistics under placeholder names (by parameter identity). gradsparse.register on a
    new DDP of the model took the state over and dropped all of it at its first step, whose buckets
    came under the parameters' names. It now moves them to the names: a state dict saved right
    after carries them, the run goes on bit for bit as that of a state registered from the start,
    and a registration that fails leaves the placeholder names under which the hook goes on."""
    hooked, registered = (gs.GaussianK(density=0.1, momentum=0.5) for _ in range(2))
    ddp, reference = DDP(_model()), _hooked(registered)
    ddp.register_comm_hook(hooked, gs.hook)
    _train(ddp, 2)
    with pytest.raises(ValueError, match="already has a communication hook"):
        gs.register(ddp, hooked)
    _train(ddp, 1, seed=1)
    _train(reference, 2)
    _train(reference, 1, seed=1)
    ddp = DDP(ddp.module)
    gs.register(ddp, hooked)
    sd, expected = hooked.state_dict(), registered.state_dict()
    for key in ("residuals", "velocities"):
        assert sd[key].keys() == expected[key].keys() == {n for n, _ in ddp.module.named_parameters()}, key
        for name, t in sd[key].items():
            assert torch.equal(t, expected[key][name]), (key, name)
    assert sd["methods"] == expected["methods"] and sd["layout"] == expected["layout"]
    steps = [[(e["names"], e["counters"]["steps"]) for e in d["stats"]] for d in (sd, expected)]  # times differ
    assert steps[0] == steps[1]
    _train(ddp, 2, seed=2)
    _train(reference, 2, seed=2)
    assert hooked.stats()["total"]["steps"] == 5
    for a, b in zip(params_of(ddp.module), params_of(reference.module), strict=True):
        assert torch.equal(a, b)


def test_residuals_cannot_be_saved_without_parameter_names():
    state = gs.TopK(density=0.1)
    ddp = DDP(_model())
    ddp.register_comm_hook(state, gs.hook)
    _train(ddp, 1)  # training works with plain registration
    with pytest.raises(ValueError, match=r"register it with gradsparse.register\(ddp_model, state\) instead"):
        state.state_dict()


def _flip_one_byte(sd):
    damaged = sd["residuals"]["2.weight"].clone()
    damaged.view(torch.uint8)[5] ^= 0x10
    return dict(sd, residuals={**sd["residuals"], "2.weight": damaged})


class _FailingEngine:
    """Stands in for a state's engine whose submit raises, as an error inside the hook's work."""

    def submit(self, *args):
        raise RuntimeError("an error inside the hook's work")


def test_an_error_in_the_hook_leaves_the_model_usable():
    """The hook's error reaches backward() with its type and message, DDP finishes its step, and
    after the cause is fixed the next step trains (a synchronous raise inside DDP's hook call
    broke every later step with a PyTorch internal assert); state_dict() works throughout, and
    the failed step changed no residual."""
    state = gs.TopK(density=0.1)
    ddp = DDP(_model(), bucket_cap_mb=0.0005)  # several buckets: the failing one is not the last
    gs.register(ddp, state)
    _train(ddp, 2)
    before = {k: v.clone() for k, v in state.state_dict()["residuals"].items()}
    engine = state._engine

    state._engine = _FailingEngine()
    with pytest.raises(RuntimeError, match="an error inside the hook's work"):
        _train(ddp, 1)
    assert state.step == 2  # the failed step is not counted
    after = state.state_dict()["residuals"]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    state._engine = engine  # the cause, fixed
    _train(ddp, 2)
    assert state.step == 4


def test_a_hook_that_returns_no_future_or_raises_fails_the_step_and_leaves_the_model_usable():
    """A hook given to gradsparse.register that forgets to return gradsparse.hook's future (a
    timing wrapper, say) crashed the process inside DDP (a segfault); one that raises broke DDP's
    reducer for every later step. Both now fail the step's backward() with the cause, and the
    next step trains once the hook is fixed."""
    broken = {"on": True}

    def timed(state, bucket):
        future = gs.hook(state, bucket)
        if broken["on"] == "raise":
            raise RuntimeError("the timer failed")
        return None if broken["on"] else future

    state = gs.TopK(density=0.1)
    ddp = DDP(_model())
    gs.register(ddp, state, hook=timed)
    with pytest.raises(
        TypeError, match=r"the hook timed returned None \(NoneType\), not a future; return gradsparse\.hook"
    ):
        _train(ddp, 1)
    broken["on"] = "raise"
    with pytest.raises(RuntimeError, match="the timer failed"):
        _train(ddp, 1)
    broken["on"] = False
    _train(ddp, 2)
    assert state.stats()["total"]["steps"] >= 2


class _ClosedGroup(dist.ProcessGroup):
    """Rank 0 of 2 whose collectives fail as they are posted, as a backend reports a connection
    its peer closed; counts the collectives posted."""

    def __init__(self):
        super().__init__(0, 2)
        self.posted = 0

    def getBackendName(self):
        return "closed"

    def _fail(self, *args):
        self.posted += 1
        raise RuntimeError("the connection to rank 1 is closed")

    allgather = allreduce = send = recv = _fail


def test_a_collective_that_fails_when_posted_stops_the_engine():
    """The engine stops at a failed collective, so that the next bucket does not issue collectives
    the other ranks are not in step with. A failure raised while posting the collective (not in
    its wait) did not count as one: the next bucket posted its own, and the error lacked what
    failed where. The selection goes back to the residual."""
    group = _ClosedGroup()
    engine = gs._C.Engine(group, 5.0)
    grads = [torch.randn(100), torch.randn(100)]
    residuals = [torch.zeros(100), torch.zeros(100)]
    futures = [
        engine.submit(g, r, gs._C.TopK(0.1, "gather"), False, "raise", f"bucket {i}", gs._C.ReduceReport())
        for i, (g, r) in enumerate(zip(grads, residuals, strict=True))
    ]
    errors = []
    for future in futures:
        with pytest.raises(RuntimeError) as info:
            future.wait()
        errors.append(str(info.value))
    engine.shutdown()
    assert "allgather of" in errors[0] and "on rank 0 of 2 (closed process group) failed" in errors[0], errors[0]
    assert "the connection to rank 1 is closed" in errors[0] and "A peer may have stopped" in errors[0]
    assert "bucket 1 was not reduced because an earlier bucket failed: bucket 0: allgather of" in errors[1], errors[1]
    assert group.posted == 1
    assert torch.equal(residuals[0], grads[0])  # bucket 0's selection went back to its residual


def test_an_error_in_the_first_step_after_a_load_reaches_backward_and_the_next_step_works():
    """The first step after load_state_dict is held and reduced in the saved layout; a NaN there
    fails that step like any other (nonfinite="raise"), and the step after it trains."""
    sd = _saved()
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    state.load_state_dict(sd)
    x = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match=r"rank\(s\) 0 saw .*NaN/Inf") as info:
        nn.functional.cross_entropy(ddp(x) * math.nan, torch.zeros(16, dtype=torch.long)).backward()
    assert "Unable to cast" not in str(info.value)  # an error, not an object DDP failed to read as a tensor
    _train(ddp, 1)
    assert state.step == 4  # the failed step ran its exchange (every rank saw the NaN), and counts
    assert all(bool(torch.isfinite(t).all()) for t in state.state_dict()["residuals"].values())


@pytest.mark.parametrize("where", ["methods", "parked_methods"])
@pytest.mark.parametrize("change", [dict(step=math.nan), dict(step=2.5), dict(k_prev=-3)])
def test_a_method_state_the_method_refuses_is_refused_at_load_and_the_state_stays_as_it_was(change, where):
    """It was refused in the first backward after the load, on the damaged rank only, inside
    DDP's callback error; now load_state_dict raises it, naming the entry, and training goes on.
    Alike for a method state saved while it waited for its bucket (parked_methods)."""
    saving = gs.MiCRO(density=0.1)
    _train(_hooked(saving), 3)
    sd = saving.state_dict()
    state = gs.MiCRO(density=0.1)
    ddp = _hooked(state)
    bad = dict(sd["methods"][0], **change)
    if where == "methods":
        damaged, entry = dict(sd, methods=[bad]), r"methods\[0\]"
    else:
        names = sd["layout"][0]
        damaged = dict(sd, parked_methods=[{"names": names, "state": bad, "loss_scale": 1.0}])
        entry = r"parked_methods\[0\]\['state'\]"
    (name,) = change
    with pytest.raises(ValueError, match=rf"{entry} is refused by the method: method state: '{name}' is "):
        state.load_state_dict(damaged)
    assert state.step == 0
    _train(ddp, 1)
    state.load_state_dict(sd)  # an intact one loads after the refusal
    _train(ddp, 1)
    assert state.step == 4 and state.state_dict()["methods"][0]["step"] == 4


def _bucketed(cap_mb, weights_of=None):
    """A DDP model of _model() in buckets of ``cap_mb`` (from its second step on; its first has one)."""
    ddp = DDP(_model(), bucket_cap_mb=cap_mb)
    if weights_of is not None:
        ddp.module.load_state_dict(weights_of.module.state_dict())
    return ddp


def test_a_saved_bucket_that_fails_in_the_first_step_after_a_load_delivers_those_before_it(monkeypatch):
    """The first step after a load reduces in the saved layout. When a saved bucket failed after
    earlier ones had been handed to the engine, those were reduced (their residuals moved on) but
    never copied into DDP's buckets, which went back with the local gradients. Now the step raises
    as at any bucket: the saved buckets before the failed one reach DDP's buckets reduced, the
    rest keep their residuals, and the next step trains on."""
    saving = gs.TopK(density=0.05)
    ddp = _bucketed(0.0005)  # saved layout: [2.bias, 2.weight, 0.bias], [0.weight]
    gs.register(ddp, saving)
    _train(ddp, 2)
    sd = copy.deepcopy(saving.state_dict())
    assert sd["layout"] == [["2.bias", "2.weight", "0.bias"], ["0.weight"]]
    state = gs.TopK(density=0.05)
    resumed = _bucketed(0.0003)  # DDP's buckets by then: [2.bias, 2.weight], [0.bias, 0.weight]
    gs.register(resumed, state)
    _train(resumed, 2, seed=4)
    resumed.module.load_state_dict(ddp.module.state_dict())
    state.load_state_dict(sd)
    _fail_second_submit(monkeypatch, state, "the second saved bucket failed")
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for model in (ddp, resumed):
        model.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="the second saved bucket failed"):
        nn.functional.cross_entropy(resumed(x), y).backward()
    reduced, got = dict(ddp.module.named_parameters()), dict(resumed.module.named_parameters())
    for name in ("2.bias", "2.weight"):  # DDP's first bucket, reduced in the saved bucket 0
        assert torch.equal(got[name].grad, reduced[name].grad), name
    monkeypatch.undo()
    assert state.step == 2
    residuals = state.state_dict()["residuals"]
    for name in ("2.bias", "2.weight", "0.bias"):  # moved on once, as in the uninterrupted run
        assert torch.equal(residuals[name], saving.state_dict()["residuals"][name]), name
    assert torch.equal(residuals["0.weight"], sd["residuals"]["0.weight"])  # not reduced: kept
    _train(resumed, 1)
    assert state.step == 3


def test_a_first_step_after_a_load_that_fails_before_any_bucket_leaves_the_saved_layout_for_the_next(
    monkeypatch,
):
    """When the first saved bucket fails, nothing was reduced: the next step is still the first
    after the load and runs the saved layout, so the resumed run still repeats the uninterrupted
    one bit for bit (it ran DDP's own layout)."""
    saving = gs.TopK(density=0.05)
    ddp = _bucketed(0.0005)
    gs.register(ddp, saving)
    _train(ddp, 2)
    sd = copy.deepcopy(saving.state_dict())
    state = gs.TopK(density=0.05)
    resumed = _bucketed(0.0005, weights_of=ddp)  # its first step in one bucket, the saved run's in two
    gs.register(resumed, state)
    state.load_state_dict(sd)

    def fails(*args, **kwargs):
        raise RuntimeError("the first saved bucket failed")

    monkeypatch.setattr(state, "_submit", fails)
    with pytest.raises(RuntimeError, match="the first saved bucket failed"):
        _train(resumed, 1, seed=3)
    monkeypatch.undo()
    assert state.step == 2 and state.state_dict()["layout"] == sd["layout"]
    _train(resumed, 2, seed=5)
    _train(ddp, 2, seed=5)
    for name, value in saving.state_dict()["residuals"].items():
        assert torch.equal(state.state_dict()["residuals"][name], value), name
    for a, b in zip(resumed.parameters(), ddp.parameters(), strict=True):
        assert torch.equal(a, b)


def test_buckets_held_by_a_backward_that_stopped_half_way_are_not_reduced_again():
    """The first step after a load holds DDP's buckets until the last one. A backward that
    stopped after the first bucket (an error in the user's code) left it held, and the next
    step, under a new DDP wrapper, reduced it with its own buckets: the stopped step's gradient
    went into the residuals, and the residuals it shared a name with were counted twice."""
    state = gs.TopK(density=0.05)
    ddp = _bucketed(0.0003)  # from the second step on: [2.bias, 2.weight], [0.bias, 0.weight]
    gs.register(ddp, state)
    _train(ddp, 2)
    sd = copy.deepcopy(dict(state.state_dict(), layout=[], methods=[]))  # as gs.reshard gives it
    reference = gs.TopK(density=0.05)
    clean = _bucketed(0.0003, weights_of=ddp)
    gs.register(clean, reference)
    reference.load_state_dict(sd)
    state.load_state_dict(sd)

    def stop(_):
        raise RuntimeError("an error in the user's backward")

    hook = ddp.module[0].weight.register_hook(stop)  # after DDP's first bucket was held
    with pytest.raises(RuntimeError, match="an error in the user's backward"):
        _train(ddp, 1, seed=3)
    hook.remove()
    module = ddp.module
    del ddp  # DDP refuses a step after a stopped backward: the model is wrapped anew
    gc.collect()
    again = DDP(module, bucket_cap_mb=0.0003)
    gs.register(again, state)
    _train(again, 1)
    _train(clean, 1)
    assert state.step == reference.step == 3
    for name, value in reference.state_dict()["residuals"].items():
        assert torch.equal(state.state_dict()["residuals"][name], value), name
    for a, b in zip(again.parameters(), clean.parameters(), strict=True):
        assert torch.equal(a, b)


def test_spardl_teams_must_divide_the_world_size():
    with pytest.raises(ValueError, match=r"SparDL: teams=3 does not divide the world size 1; .* choose teams among 1"):
        gs.register(DDP(_model()), gs.SparDL(density=0.1, teams=3))


def test_check_world_size_refuses_before_any_process_group():
    gs.SparDL(density=0.1, teams=3).check_world_size(6)  # fits: no error
    gs.TopK(density=0.1).check_world_size(7)
    with pytest.raises(ValueError, match=r"SparDL: teams=3 does not divide the world size 4; .* among 1, 2, 4"):
        gs.SparDL(density=0.1, teams=3).check_world_size(4)
    for bad in (0, 2.0, True, "4"):
        with pytest.raises(ValueError, match=r"TopK.check_world_size: world_size must be an integer >= 1 .*, got "):
            gs.TopK(density=0.1).check_world_size(bad)


def _train_scaled(ddp, batches, scaler=None):
    """SGD over ``batches``, the loss scaled by ``scaler`` when one is given."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches:
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _batches(steps):
    torch.manual_seed(0)
    return [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(steps)]


def test_a_state_saved_under_a_loss_scale_resumes_without_one():
    """The state dict records the loss scale its residuals are in (set_scaler); loaded into a
    state that follows no scaler, they move back to scale 1 at its first step: two steps under a
    GradScaler and two after the load end where four steps without loss scaling end, to the bit."""
    batches = _batches(4)
    plain = _hooked(gs.TopK(density=0.05))
    _train_scaled(plain, batches)
    state = gs.TopK(density=0.05, nonfinite="propagate")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1)
    scaled = _hooked(state.set_scaler(scaler))
    _train_scaled(scaled, batches[:2], scaler)
    saved = copy.deepcopy(state.state_dict())
    assert saved["loss_scale"] == 2.0**7  # the second step's gradients were scaled by 2**7
    resumed = gs.TopK(density=0.05)
    ddp = _hooked(resumed, weights_of=scaled)
    resumed.load_state_dict(saved)
    _train_scaled(ddp, batches[2:])
    assert resumed.state_dict()["loss_scale"] == 1.0
    for got, want in zip(ddp.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got, want)


def test_the_dense_states_velocity_follows_the_loss_scale_and_a_scaler_can_be_dropped():
    """The Dense state with momentum correction is momentum SGD: its velocity is gradient in the
    loss scale, and follows it (the scale doubles at every step here), so training under a
    GradScaler ends where training without one ends, to the bit; after set_scaler(None) the
    velocity moves back to scale 1 at the next step."""
    batches = _batches(6)
    plain = _hooked(gs.Dense(momentum=0.9))
    _train_scaled(plain, batches)
    state = gs.Dense(momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**3, growth_interval=1)
    scaled = _hooked(state.set_scaler(scaler))
    _train_scaled(scaled, batches[:4], scaler)
    assert state.state_dict()["loss_scale"] == 2.0**6
    state.set_scaler(None)
    _train_scaled(scaled, batches[4:])
    assert state.state_dict()["loss_scale"] == 1.0
    for got, want in zip(scaled.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got, want)


def test_set_scaler_refuses_the_grad_scaler_class_itself():
    """set_scaler(torch.amp.GradScaler), the class, not an instance: its get_scale is callable, so
    it was taken, and the first backward failed inside the hook with "get_scale() missing 1
    required positional argument: 'self'", naming neither set_scaler nor the fix."""
    state = gs.TopK(density=0.1, nonfinite="propagate")
    with pytest.raises(
        TypeError, match=r"TopK.set_scaler: scaler must be .* got the class GradScaler itself; create one"
    ):
        state.set_scaler(torch.amp.GradScaler)
    assert state.set_scaler(torch.amp.GradScaler("cpu")) is state


class _Overflowing(nn.Module):
    """Two linear layers in DDP buckets of their own (bucket_cap_mb below); with ``overflow`` set,
    the first layer's gradients get an Inf, the second's stay finite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.l0, self.l2 = nn.Linear(8, 32), nn.Linear(32, 3)
        self.overflow = False

    def forward(self, x):
        h = torch.relu(self.l0(x))
        if self.overflow:
            h.register_hook(lambda g: g.index_fill(1, torch.tensor([0], device=g.device), math.inf))
        return self.l2(h)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
@pytest.mark.parametrize(
    "make",
    [
        lambda: gs.TopK(density=0.1, nonfinite="propagate"),
        lambda: gs.TopK(density=0.1, exchange="reduce_scatter", nonfinite="propagate"),
        lambda: gs.MiCRO(density=0.1, nonfinite="propagate"),
        lambda: gs.SparDL(density=0.1, nonfinite="propagate"),
    ],
    ids=["topk", "topk-reduce-scatter", "micro", "spardl"],
)
def test_a_step_that_overflows_in_one_bucket_takes_back_what_the_other_buckets_sent(make, device):
    """nonfinite="propagate" under a GradScaler: an overflow in one bucket makes the scaler skip
    the whole step, so what the other buckets sent is applied nowhere. They take it back: their
    residuals hold residual + gradient after the step, to the bit, as the skipped bucket's do
    (ruling 5), and their statistics count the step as skipped. What they sent was lost before.
    On a GPU each bucket's job runs on a stream of its own, and the take-back at the step's last
    bucket reads the others' residuals and messages after their jobs."""
    net = _Overflowing().to(device)
    ddp = DDP(net, bucket_cap_mb=0.0003)
    state = gs.register(ddp, make())
    scaler = torch.amp.GradScaler(device, init_scale=2.0**4, growth_interval=1000)
    state.set_scaler(scaler)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(5)]
    _train_scaled(ddp, batches[:4], scaler)  # residuals hold gradient of earlier steps
    assert [sorted(names) for names in state.state_dict()["layout"]] == [
        ["l2.bias", "l2.weight"],
        ["l0.bias", "l0.weight"],
    ]
    before = {name: t.clone() for name, t in state.state_dict()["residuals"].items()}
    weights = [p.detach().clone() for p in net.parameters()]
    x, y = batches[4]
    twin = copy.deepcopy(net)  # the same step's own gradient of the finite layer
    (nn.functional.cross_entropy(twin(x), y) * scaler.get_scale()).backward()
    net.overflow = True
    _train_scaled(ddp, [(x, y)], scaler)
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters(), strict=True)), "the scaler stepped"
    after = state.state_dict()["residuals"]
    for name in ("l2.weight", "l2.bias"):
        gradient = twin.get_parameter(name).grad.reshape(-1).to(before[name].device)
        assert torch.equal(after[name], before[name] + gradient), name
    buckets = state.stats()["buckets"]
    assert buckets[0]["skipped_steps"] == 1 and buckets[1]["skipped_steps"] == 1, buckets


class _Scale:
    """A loss scaler as set_scaler reads one (get_scale()), set by hand."""

    def __init__(self, scale):
        self.scale = scale

    def get_scale(self):
        return self.scale


def test_a_float16_residual_that_cannot_follow_the_scale_up_skips_the_step_instead_of_overflowing():
    """A float16 bucket (FSDP2 with reduce_dtype=float16, say) whose residual holds more than half
    of float16's range when the scaler doubles its scale: the residual cannot follow (x 2 would
    be Inf, and Inf never comes back down, so every later step came back NaN). The step is skipped
    instead, handed back as NaN, so the scaler backs off, and the residual keeps what it held; at
    the old scale training goes on."""

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.zeros(100, dtype=torch.float16))

        def forward(self, c):
            return (self.p.float() * c).sum()

    c = torch.full((100,), 8.0)
    c[0] = 60.0  # element 0 is sent at every step (k = 1); the others pile up in the residual
    model = Half()
    ddp = DDP(model)
    scaler = _Scale(2.0**9)
    state = gs.register(ddp, gs.TopK(density=0.01, nonfinite="propagate").set_scaler(scaler))

    def step():
        model.p.grad = None
        (ddp(c) * scaler.get_scale()).backward()
        return model.p.grad, state.state_dict()["residuals"]["p"].clone()

    for _ in range(9):
        grad, residual = step()
        assert torch.isfinite(grad).all()
    assert float(residual.abs().max()) > 65504 / 2
    scaler.scale = 2.0**10
    grad, after = step()
    assert torch.isnan(grad).all()
    assert torch.equal(after, residual) and state.state_dict()["loss_scale"] == 2.0**9
    scaler.scale = 2.0**9  # the scaler backed off
    grad, after = step()
    assert torch.isfinite(grad).all() and torch.isfinite(after).all()
    want = residual + c.to(torch.float16) * 2**9
    sent = after != want  # the one element the step sent, zero in the residual
    assert int(sent.sum()) == 1 and float(after[sent]) == 0.0


def _saved(steps=2):
    state = gs.TopK(density=0.05)
    _train(_hooked(state), steps)
    return state.state_dict()


def _with_counters(sd, **counters):
    """``sd`` with these counters in its first bucket's statistics."""
    first, *rest = sd["stats"]
    return dict(sd, stats=[dict(first, counters={**first["counters"], **counters}), *rest])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda sd: dict(sd, rank=1), "holds rank 1's residuals but this is rank 0; .* any_rank=True loads it anyway"),
        (
            lambda sd: dict(sd, world_size=3),
            r"saved at world size 3 but this run has 1 ranks; resume with 3 ranks, or .* gradsparse.reshard\(saved, 1\)",
        ),
        (
            lambda sd: dict(sd, residuals={f"_orig_mod.{k}": v for k, v in sd["residuals"].items()}),
            r"name no parameter of the model: _orig_mod.0.bias.* They carry wrapper prefixes \(_orig_mod.\)",
        ),
        (
            lambda sd: dict(sd, residuals={**sd["residuals"], "0.weight": torch.zeros(3)}, checksums={}),
            "the residual of 0.weight holds 3 elements but the parameter has 256",
        ),
        (
            lambda sd: dict(sd, residuals={**sd["residuals"], "0.bias": torch.full((32,), math.nan)}, checksums={}),
            "the residual of 0.bias holds NaN or Inf; .* load a checkpoint from before the divergence",
        ),
        (_flip_one_byte, "the residual of 2.weight does not match its checksum: the state dict was damaged"),
        (lambda sd: dict(sd, loss_scale=0.0), "the state dict's loss_scale should be a positive finite number"),
        (lambda sd: dict(sd, loss_scale=math.nan), "the state dict's loss_scale should be a positive finite number"),
        (lambda sd: dict(sd, loss_scale="1024"), "the state dict's loss_scale should be a positive finite number"),
        (lambda sd: {"residuals": {}}, "not a gradsparse state dict"),
        (  # was a KeyError: 'residuals'
            lambda sd: {k: v for k, v in sd.items() if k not in ("residuals", "stats")},
            r"TopK.load_state_dict: the state dict lacks residuals, stats \(it should hold class, config, step, rank, ",
        ),
        (
            lambda sd: {
                "version": 2,
                "all_ranks": True,
                "class": "TopK",
                "config": sd["config"],
                "world_size": 1,
                "ranks": [{k: v for k, v in sd.items() if k != "layout"}],
            },
            r"rank 0's part of the state dict lacks layout \(it should hold .*\): it was cut short or changed",
        ),
        # entries of the wrong type failed with Python's own errors (some half-way through the load)
        (lambda sd: dict(sd, step="two"), r"the state dict's step should be an integer >= 0, got 'two' \(str\)"),
        # compared as they were: "rank 0's residuals but this is rank 0", "saved at world size 1 but this run has 1"
        (lambda sd: dict(sd, rank="0"), r"the state dict's rank should be an integer >= 0, got '0' \(str\)"),
        (lambda sd: dict(sd, world_size=1.0), r"the state dict's world_size should be an integer >= 1, got 1.0"),
        (lambda sd: dict(sd, config=None), "the state dict's config should be a dict of options, got None"),
        (lambda sd: dict(sd, layout=None), "the state dict's layout should be a list of parameter-name lists by"),
        (
            lambda sd: dict(sd, residuals={k: v.numpy() for k, v in sd["residuals"].items()}, checksums={}),
            r"the state dict's residuals\['2.bias'\] should be a floating-point tensor, got .*numpy.ndarray.*: it was",
        ),
        (  # bool and complex residuals were cast into the bucket without a word (complex dropping its imaginary part)
            lambda sd: dict(sd, residuals={k: v.to(torch.complex64) for k, v in sd["residuals"].items()}, checksums={}),
            r"residuals\['2.bias'\] should be a floating-point tensor, got a tensor of torch.complex64, shape \[3\]",
        ),
        (
            lambda sd: dict(sd, residuals={k: v > 0 for k, v in sd["residuals"].items()}, checksums={}),
            r"residuals\['2.bias'\] should be a floating-point tensor, got a tensor of torch.bool, shape \[3\]",
        ),
        (
            lambda sd: _with_counters(sd, counter_of_a_later_version=1),
            r"the state dict's stats\[0\]\['counters'\] holds counter_of_a_later_version, which gradsparse does not "
            r"keep .* drop the statistics \(sd\['stats'\] = \[\]\) to resume without them",
        ),
        (
            lambda sd: dict(sd, stats=[{"names": "0.weight", "counters": {}}]),
            r"the state dict's stats should be a list of statistics by bucket: dicts of names \(its parameters'\) and "
            r"counters, got",
        ),
        (lambda sd: dict(sd, link=5), r"the state dict's link should be None or the pair \(alpha, beta\)"),
        (  # it failed at the first step, with pybind11's "incompatible function arguments", on this rank only
            lambda sd: dict(sd, methods=[{"threshold": "0.1"}]),
            r"the state dict's methods\[0\]\['threshold'\] should be a number \(a method state maps names to "
            r"numbers\), got '0.1'",
        ),
        (lambda sd: dict(sd, exchanges={0: "ring"}), "the state dict's exchanges should be None or the exchange by"),
        (lambda sd: dict(sd, parked_methods={}), "the state dict's parked_methods should be a list of dicts of names"),
        (
            lambda sd: dict(sd, parked_methods=[{"names": "0.weight", "state": {}, "loss_scale": 1.0}]),
            r"the state dict's parked_methods\[0\]\['names'\] should be a list of parameter names, got '0.weight'",
        ),
        (
            lambda sd: dict(sd, parked_methods=[{"index": 0, "state": {"k_prev": "3"}, "loss_scale": 1.0}]),
            r"parked_methods\[0\]\['state'\]\['k_prev'\] should be a number",
        ),
        (
            lambda sd: dict(sd, parked_methods=[{"index": 0, "state": {}, "loss_scale": 0}]),
            r"parked_methods\[0\]\['loss_scale'\] should be a positive finite number",
        ),
        # refused neither: a counter of another type failed later, in stats(); an index of True loaded as bucket 1
        (
            lambda sd: _with_counters(sd, steps="x"),
            r"the state dict's stats\[0\]\['counters'\]\['steps'\] should be an integer \(a counter of statistics\), "
            r"got 'x' \(str\): it was changed after it was saved; load what State.state_dict\(\)",
        ),
        (
            lambda sd: _with_counters(sd, select_seconds=None),
            r"the state dict's stats\[0\]\['counters'\]\['select_seconds'\] should be a number \(a counter of "
            r"statistics\), got None",
        ),
        (  # by bucket index, as saved before they were kept by name
            lambda sd: dict(sd, stats={0: dict(sd["stats"][0]["counters"], steps="x")}),
            r"the state dict's stats\[0\]\['steps'\] should be an integer \(a counter of statistics\), got 'x'",
        ),
        (
            lambda sd: dict(sd, parked_methods=[{"index": True, "state": {}, "loss_scale": 1.0}]),
            r"the state dict's parked_methods\[0\]\['index'\] should be a bucket index \(an integer >= 0\), got True",
        ),
        # names of residuals and checksums that are no strings failed in Python's words ("'int' object has no
        # attribute 'startswith'", "sequence item 0: expected str instance, int found")
        (
            lambda sd: dict(sd, residuals={**sd["residuals"], 0: torch.zeros(3)}),
            r"the state dict's names in residuals should be parameter names \(strings\), got 0 \(int\): it was changed",
        ),
        (
            lambda sd: dict(sd, checksums={**sd["checksums"], 5: 1}),
            r"the state dict's names in checksums should be parameter names \(strings\), got 5 \(int\): it was changed",
        ),
        (  # failed in torch's words: "Tensor.item() cannot be called on meta tensors"
            lambda sd: dict(sd, residuals={k: v.to("meta") for k, v in sd["residuals"].items()}, checksums={}),
            r"the state dict's residuals\['2.bias'\] should be a floating-point tensor that holds its values, got a "
            r"tensor of torch.float32, shape \[3\], on the meta device: .* load what State.state_dict\(\)",
        ),
    ],
)
def test_a_wrong_state_dict_is_refused_with_the_fix(change, message):
    sd = change(_saved())
    state = gs.TopK(density=0.05)
    _hooked(state)
    with pytest.raises(ValueError, match=message):
        state.load_state_dict(sd)


@pytest.mark.parametrize("link", [(math.nan, 8e-10), (5e-6, -8e-10), (math.inf, 8e-10)])
def test_a_state_dict_whose_link_is_no_pair_of_finite_seconds_is_refused(link):
    """exchange="auto" prices each bucket's exchanges on the loaded link (alpha, beta). One with a
    NaN was loaded, and made every modelled time NaN, so that every bucket took gather-and-add;
    a negative one made the plan with more bytes the faster; both without a word."""
    sd = dict(_saved(), link=link)
    state = gs.TopK(density=0.05)
    _hooked(state)
    with pytest.raises(
        ValueError,
        match=r"the state dict's link should be None or the pair \(alpha, beta\) of seconds that set-up measured "
        r"\(finite, >= 0\), got",
    ):
        state.load_state_dict(sd)


def test_bucket_indices_as_text_load_in_the_exchanges_as_in_the_stats():
    """A state dict through JSON holds its bucket indices as text: the stats loaded so, the
    exchanges that exchange="auto" decided were refused as changed after saving. Each decision
    is kept by the parameters of its bucket in the saved layout; an index the layout names no
    bucket for (one bucket here) is dropped."""
    sd = dict(_saved(), exchanges={"0": "reduce_scatter", "1": "gather"})
    sd["stats"] = {"0": sd["stats"][0]["counters"]}  # one bucket, by index: as saved before they were kept by name
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(sd)
    assert state._new_trial(0, state._saved_exchanges).chosen == {frozenset(sd["layout"][0]): "reduce_scatter"}
    assert state.stats()["buckets"][0]["steps"] == state.stats()["total"]["steps"] == 2


def _in_buckets(bucket_cap_mb, weights_of=None):
    """A TopK state on _model() in a DDP of this bucket_cap_mb (and another model's weights)."""
    state = gs.TopK(density=0.1)
    ddp = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    if weights_of is not None:
        ddp.module.load_state_dict(weights_of.module.state_dict())
    gs.register(ddp, state)
    return state, ddp


def _counted(state):
    """Each bucket's elements and steps by index, and the total steps and elements."""
    stats = state.stats()
    buckets = {i: (b["numel"], b["steps"]) for i, b in stats["buckets"].items()}
    return buckets, stats["total"]["steps"], stats["total"]["numel"], stats["total"]["elements"]


def test_stats_keep_the_buckets_of_ddps_first_step_apart_from_the_rebuilt_ones():
    """DDP reduces its first step in one bucket of _model()'s 387 elements (its first bucket's own
    size cap) and rebuilds after it into buckets of 131 and 256 elements (bucket_cap_mb=0.0005).
    Kept by index, the first step counted in bucket 0 of the rebuilt layout: 3 steps, where its
    parameters were reduced in 2. Each bucket counts its own parameters' steps; the first step's
    bucket counts in the total (its steps, elements and bytes) and is saved by its parameters."""
    state, ddp = _in_buckets(0.0005)
    _train(ddp, 3)
    layout = state.state_dict()["layout"]
    assert [sorted(names) for names in layout] == [["0.bias", "2.bias", "2.weight"], ["0.weight"]]
    assert _counted(state) == ({0: (131, 2), 1: (256, 2)}, 3, 387, 3 * 387)
    saved = {tuple(entry["names"]): entry["counters"]["steps"] for entry in state.state_dict()["stats"]}
    assert saved == {
        ("0.bias", "2.bias", "2.weight"): 2,
        ("0.weight",): 2,
        ("0.bias", "0.weight", "2.bias", "2.weight"): 1,
    }


@pytest.mark.parametrize("earlier", [False, True], ids=["by-name", "by-index"])
def test_stats_follow_the_parameters_of_each_bucket_into_another_layout_after_a_resume(earlier):
    """Saved in buckets of 131 and 256 elements, resumed with another bucket_cap_mb, whose DDP
    rebuilds into buckets of 99 and 288 after the first resumed step (reduced in the saved
    layout). Kept by index, each rebuilt bucket counted on from the saved bucket of its index:
    stats()["buckets"] gave {0: 99 elements in 6 steps, 1: 288 in 5}, after 5 and 6 steps of
    other parameters, and a total of 643 elements. Each bucket now counts its own parameters'
    steps, and the total every step once. A state dict of an earlier gradsparse (``earlier``)
    holds its statistics by bucket index: they load as those of the parameters its layout names
    there."""
    state, ddp = _in_buckets(0.0005)
    _train(ddp, 3)
    sd = state.state_dict()
    if earlier:
        by_names = {frozenset(entry["names"]): entry["counters"] for entry in sd["stats"]}
        sd = dict(sd, stats={str(i): by_names[frozenset(names)] for i, names in enumerate(sd["layout"])})
    resumed, ddp = _in_buckets(0.0003, weights_of=ddp)
    resumed.load_state_dict(sd)
    assert _counted(resumed)[0] == {0: (131, 2), 1: (256, 2)}
    _train(ddp, 3, seed=1)
    assert [sorted(names) for names in resumed.state_dict()["layout"]] == [
        ["2.bias", "2.weight"],
        ["0.bias", "0.weight"],
    ]
    # the earlier state dict's statistics lack the first step's bucket, which it had counted in bucket 0
    assert _counted(resumed) == ({0: (99, 2), 1: (288, 2)}, 5 if earlier else 6, 387, (5 if earlier else 6) * 387)


def test_stats_by_index_of_a_state_dict_resharded_by_an_earlier_gradsparse_are_kept_in_the_total():
    """gradsparse.reshard of an earlier gradsparse kept rank 0's statistics by bucket index and
    emptied the layout they are read through: every bucket's counters were dropped at the load
    (stats()["total"]["steps"] 2 -> 0). Each is kept under a name of its index, counted in the
    total and saved again."""
    state, ddp = _in_buckets(0.0005)
    _train(ddp, 3)
    sd = state.state_dict()
    by_names = {frozenset(entry["names"]): entry["counters"] for entry in sd["stats"]}
    by_index = {i: by_names[frozenset(names)] for i, names in enumerate(sd["layout"])}  # the rebuilt buckets'
    resumed, _ = _in_buckets(0.0005, weights_of=ddp)
    resumed.load_state_dict(dict(sd, stats=by_index, layout=[], methods=[]))  # as that reshard gave it
    total = resumed.stats()["total"]
    assert (total["steps"], total["elements"]) == (2, by_index[0]["elements"] + by_index[1]["elements"]) == (2, 2 * 387)
    saved = resumed.state_dict()["stats"]
    assert saved == [
        {"names": ["<bucket 0>"], "counters": by_index[0]},
        {"names": ["<bucket 1>"], "counters": by_index[1]},
    ]


def test_reshard_conserves_the_pending_gradient_mass():
    """Two ranks' residuals (two runs on different data stand in for them) resharded to one rank:
    it holds their mean, (1/1) e' = (1/2) (e_0 + e_1); method states and exchange="auto"'s
    decision restart."""
    first, second = _saved(steps=2), _saved(steps=3)
    first = dict(first, exchanges={0: "reduce_scatter"})  # as a trial at 2 ranks would have decided
    second = dict(second, rank=1, step=2)
    saved = {"version": 2, "all_ranks": True, "class": "TopK", "config": first["config"], "world_size": 2,
             "ranks": [dict(first, world_size=2), dict(second, world_size=2)]}  # fmt: skip
    one = gs.reshard(saved, 1)
    assert gs.reshard(saved, np.int64(1))["world_size"] == 1  # numpy's integers were refused as not integers
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(one)
    loaded = state.state_dict()
    assert loaded["methods"] == [] and loaded["world_size"] == 1
    assert one["ranks"][0]["exchanges"] is None
    for name, value in loaded["residuals"].items():
        expected = (first["residuals"][name].double() + second["residuals"][name].double()) / 2
        torch.testing.assert_close(value, expected.float(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="must hold every rank's residuals"):
        gs.reshard(first, 1)


def test_all_ranks_refuses_what_is_no_state_and_an_each_node_that_is_no_bool():
    with pytest.raises(TypeError, match=r"gradsparse.AllRanks: state must be a gradsparse state .* got dict"):
        gs.AllRanks({})
    with pytest.raises(TypeError, match=r"gradsparse.AllRanks: each_node must be True or False, got 'yes'"):
        gs.AllRanks(gs.TopK(density=0.05), each_node="yes")


@pytest.mark.parametrize("through", ["state", "all_ranks"])
def test_the_copy_of_an_all_ranks_state_dict_that_another_rank_returned_is_refused_naming_the_fix(through):
    """AllRanks(state).state_dict() returns every rank's residuals on rank 0 and a copy without
    them elsewhere. Loaded through state.load_state_dict, that copy was called cut short or
    changed after the save ("holds NoneType ranks' state dicts"), which names neither cause nor fix."""
    saving = gs.TopK(density=0.05)
    _train(_hooked(saving), 2)
    copy_elsewhere = dict(gs.AllRanks(saving).state_dict(), ranks=None)  # what ranks other than 0 get
    state = gs.TopK(density=0.05)
    _hooked(state)
    load = state.load_state_dict if through == "state" else gs.AllRanks(state).load_state_dict
    with pytest.raises(
        ValueError,
        match=r"TopK.load_state_dict: this state dict of gradsparse.AllRanks was returned on a rank other than 0, "
        r"which holds no residuals: save the one rank 0 returned, and load that file on every rank \(for a "
        r"checkpointer that writes on each node, wrap the state in gradsparse.AllRanks\(state, each_node=True\)\)",
    ):
        load(copy_elsewhere)


def test_another_ranks_state_dict_loads_only_when_asked():
    sd = dict(_saved(), rank=1)
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(sd, any_rank=True)
    assert state.step == 2


def test_a_state_dict_saved_right_after_loading_another_ranks_names_this_rank():
    """Between load_state_dict and the next step, state_dict() returned the loaded state dict as
    it was, naming the rank that saved it: after a load with any_rank=True, a checkpoint taken
    then was refused on resume as another rank's."""
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(dict(_saved(), rank=1), any_rank=True)
    again = state.state_dict()
    assert again["rank"] == 0
    resumed = gs.TopK(density=0.05)
    _hooked(resumed)
    resumed.load_state_dict(again)
    assert resumed.step == 2


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda part: part.update({"class": "MiCRO"}),
            r"TopK.load_state_dict: rank 0's part of the state dict of gradsparse.AllRanks was saved by MiCRO, but "
            r"the state dict's class is TopK: .* load the file gradsparse.AllRanks\(state\).state_dict\(\) returned",
        ),
        (
            lambda part: part["config"].update(density=0.5),
            r"TopK.load_state_dict: rank 0's part of the state dict of gradsparse.AllRanks was saved with "
            r"density=0.5, but the state dict's config holds density=0.05: .* load the file gradsparse.AllRanks",
        ),
        (
            lambda part: part.update(config=None),
            r"TopK.load_state_dict \(rank 0's part\): the state dict's config should be a dict of options, got None",
        ),
    ],
)
def test_an_all_ranks_state_dict_whose_part_names_another_method_or_options_is_refused(change, message):
    """Of an AllRanks state dict only the class and config at its top were compared with the
    state's: a rank's part saved by MiCRO, or with density=0.5, loaded into TopK(density=0.05)
    without a word."""
    saving = gs.TopK(density=0.05)
    _train(_hooked(saving), 2)
    saved = copy.deepcopy(gs.AllRanks(saving).state_dict())
    change(saved["ranks"][0])
    state = gs.TopK(density=0.05)
    _hooked(state)
    with pytest.raises(ValueError, match=message):
        state.load_state_dict(saved)
    assert state.step == 0


def test_a_state_dict_saved_right_after_loading_an_all_ranks_one_records_the_momentum_set_in_its_config():
    """The momentum changed on purpose, as load_state_dict's refusal says (sd['config']['momentum']),
    in an AllRanks state dict: until the next step, state_dict() returned the rank's part, which
    recorded the saved momentum, so a checkpoint taken then was refused by the state it came from."""
    saving, _ = _saved_with_momentum()
    saved = copy.deepcopy(gs.AllRanks(saving).state_dict())
    saved["config"]["momentum"] = 0.0
    plain = gs.TopK(density=0.05)
    _hooked(plain)
    plain.load_state_dict(saved)
    again = plain.state_dict()
    assert again["config"]["momentum"] == 0.0
    resumed = gs.TopK(density=0.05)
    _hooked(resumed)
    resumed.load_state_dict(again)
    assert resumed.step == 3


def test_state_dict_right_after_load_returns_what_was_loaded():
    sd = _saved()
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(sd)
    again = state.state_dict()
    assert again["step"] == 2 and set(again["residuals"]) == set(sd["residuals"])
    for name, value in sd["residuals"].items():
        assert torch.equal(again["residuals"][name], value), name


def test_a_state_dict_loaded_before_registration_is_checked_at_registration():
    sd = _saved()
    sd["residuals"] = {f"module.{k}": v for k, v in sd["residuals"].items()}
    state = gs.TopK(density=0.05)
    state.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"They carry wrapper prefixes \(module.\)"):
        gs.register(DDP(_model()), state)


def test_a_refused_registration_can_be_retried_after_the_fix():
    """gs.register refused a state dict whose names carry a prefix; the state stayed bound to
    the model without its hook, so after loading the fixed state dict the retry was refused as
    a second registration and the model trained without sparsification."""
    sd = _saved()
    state = gs.TopK(density=0.05)
    state.load_state_dict(dict(sd, residuals={f"module.{k}": v for k, v in sd["residuals"].items()}))
    ddp = DDP(_model())
    with pytest.raises(ValueError, match=r"They carry wrapper prefixes \(module.\)"):
        gs.register(ddp, state)
    state.load_state_dict(sd)
    gs.register(ddp, state)
    _train(ddp, 1)
    assert state.step == 3  # the hook ran: the saved step 2, then one more


def test_a_state_dropped_without_close_gives_its_group_back_at_the_next_set_up():
    """Each state's own process group (three threads and five sockets on Gloo) stayed until the
    job ended when the state was dropped without close(): a search over hyperparameters in one
    process ran out of file descriptors. The next set-up now gives dropped states' groups back."""

    groups = dist.distributed_c10d._world.pg_map
    gc.collect()
    ddp = DDP(_model())
    state = gs.register(ddp, gs.TopK(density=0.05))  # gives back those of states earlier tests dropped
    held = len(groups)  # the job's and this state's
    state.close()
    for _ in range(4):
        ddp = DDP(_model())
        gs.register(ddp, gs.TopK(density=0.05))
        _train(ddp, 1)
        del ddp
        gc.collect()
    ddp = DDP(_model())
    state = gs.register(ddp, gs.TopK(density=0.05))
    assert len(groups) == held  # this state's own, and none of the four dropped ones
    state.close()
    assert len(groups) == held - 1


@pytest.mark.parametrize("builtin", [False, True])
def test_registering_on_a_model_that_has_a_hook_names_the_hook_and_the_fix(builtin):
    """DDP takes one communication hook per model; its own refusal ("can only be called once")
    said nothing of gradsparse. The state stays free for another model, and the refusing DDP holds
    nothing of it: the state was set up first (an engine thread and a process group) and DDP kept
    it in its list of hooks before its reducer refused it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = DDP(_model())
    if builtin:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    else:
        ddp.register_comm_hook(None, allreduce_hook)
    state = gs.TopK(density=0.05)
    with pytest.raises(ValueError, match=r"already has a communication hook.*wrapped anew"):
        gs.register(ddp, state)
    assert all(held is not state for _, held in ddp._comm_hooks)
    assert (state._engine is not None) == builtin  # set up only where the hook was DDP's own reducer's
    fresh = DDP(_model())
    gs.register(fresh, state)
    _train(fresh, 1)
    assert state.step == 1


def test_version_1_state_dicts_load_without_wrapper_prefixes():
    sd = _saved()
    v1 = dict(
        sd,
        version=1,
        residuals={f"_orig_mod.{k}": v for k, v in sd["residuals"].items()},
        layout={0: [f"_orig_mod.{n}" for n in sd["layout"][0]]},
        methods={0: sd["methods"][0]},
    )
    state = gs.TopK(density=0.05)
    _hooked(state)
    state.load_state_dict(v1)
    assert set(state.state_dict()["residuals"]) == set(sd["residuals"])


def test_a_version_1_state_dict_keeps_the_models_own_module_prefix():
    """Version 1 named residuals from inside DDP, where a leading ``module.`` is the user's own
    submodule; the conversion stripped it as if it were DDP's, so a model that keeps its layers in
    ``self.module`` could not load its version 1 checkpoint (its names named no parameter)."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = _model()

        def forward(self, x):
            return self.module(x)

    state = gs.TopK(density=0.05)
    ddp = DDP(Holder())
    gs.register(ddp, state)
    _train(ddp, 2)
    sd = copy.deepcopy(state.state_dict())
    assert all(name.startswith("module.") for name in sd["residuals"])
    v1 = dict(sd, version=1, layout=dict(enumerate(sd["layout"])), methods=dict(enumerate(sd["methods"])))
    fresh = gs.TopK(density=0.05)
    gs.register(DDP(Holder()), fresh)
    fresh.load_state_dict(v1)
    loaded = fresh.state_dict()
    assert loaded["layout"] == sd["layout"]
    for name, value in sd["residuals"].items():
        assert torch.equal(loaded["residuals"][name], value), name


def test_a_state_dict_loaded_before_the_process_group_is_checked_at_set_up(tmp_path):
    """Lightning restores callbacks before it wraps the model: a state may be loaded before
    init_process_group. The rank checks then run in setup(), and the residuals come back."""
    sd = _saved()
    torch.save(sd, tmp_path / "own.pt")
    torch.save(dict(sd, rank=1), tmp_path / "other.pt")
    code = f"""
import torch, torch.distributed as dist, torch.nn as nn
import gradsparse as gs
from gradsparse import simulate
from gradsparse.testing.distributed import free_port
own, other = gs.TopK(density=0.05), gs.TopK(density=0.05)
own.load_state_dict(torch.load({str(tmp_path / "own.pt")!r}))
other.load_state_dict(torch.load({str(tmp_path / "other.pt")!r}))
print("before:", own.state_dict()["step"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
try:
    other.setup()
except ValueError as e:
    print("other:", e)
torch.manual_seed(1)
ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
gs.register(ddp, own)
ddp(torch.randn(16, 8)).sum().backward()
print("after:", own.step, sorted(own.state_dict()["residuals"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "before: 2" in out.stdout
    assert "other: TopK.load_state_dict: the state dict holds rank 1's residuals but this is rank 0" in out.stdout
    assert f"after: 3 {sorted(sd['residuals'])}" in out.stdout


def test_an_all_ranks_state_dict_loaded_before_the_process_group_saves_as_this_ranks(tmp_path):
    """A state given gradsparse.AllRanks' state dict before init_process_group kept it whole until
    set-up: AllRanks(state).state_dict() taken after init_process_group but before the first step
    nested it, one AllRanks state dict per rank, and that file could not be loaded again; and
    state.step read 0 (stats() empty) while state_dict() said step 2. Once the process group
    exists, the load takes this rank's part, as a load then would."""
    state = gs.TopK(density=0.05)
    _train(_hooked(state), 2)
    torch.save(gs.AllRanks(state).state_dict(), tmp_path / "all.pt")
    code = f"""
import torch, torch.distributed as dist, torch.nn as nn
import gradsparse as gs
from gradsparse import simulate
from gradsparse.testing.distributed import free_port
state = gs.TopK(density=0.05)
state.load_state_dict(torch.load({str(tmp_path / "all.pt")!r}))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
print("read:", state.step, state.stats()["total"]["steps"])
again = gs.AllRanks(state).state_dict()
print("saved:", sorted(again["ranks"][0]))
torch.manual_seed(1)
fresh = gs.TopK(density=0.05)
gs.register(nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))), fresh)
fresh.load_state_dict(again)
print("loaded:", fresh.step)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "read: 2 2" in out.stdout
    assert "'residuals'" in out.stdout and "'all_ranks'" not in out.stdout, out.stdout
    assert "loaded: 2" in out.stdout


# ----------------------------------------------------------------------------------------------
# Momentum correction


def test_momentum_in_a_dense_state_is_momentum_sgd():
    hooked, plain = _hooked(gs.Dense(momentum=0.9)), DDP(_model())
    _train(hooked, 6, momentum=0.0)
    _train(plain, 6, momentum=0.9)
    for a, b in zip(hooked.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_momentum_correction_at_density_one_is_momentum_sgd_in_warmup_and_plain_sgd_after():
    """Warm-up steps and the first sparse step apply momentum (u = 0.9 u + g, all of it sent);
    from then on every velocity restarts from zero, since the previous step emptied the whole
    residual (momentum factor masking): plain SGD."""
    hooked, plain = _hooked(gs.TopK(density=1.0, momentum=0.9, warmup_steps=2)), DDP(_model())
    _train(hooked, 6, momentum=0.0)
    _train(plain, 6, momentum=0.9, switch_at=3)
    for a, b in zip(hooked.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def _saved_with_momentum(steps=3, seed=0):
    state = gs.TopK(density=0.05, momentum=0.9)
    ddp = _hooked(state)
    _train(ddp, steps, momentum=0.0, seed=seed)
    return state, ddp


def test_velocities_are_saved_by_name_and_resume_exactly():
    state, ddp = _saved_with_momentum()
    sd = copy.deepcopy(state.state_dict())  # the live tensors move on with the training below
    names = {name for name, _ in ddp.module.named_parameters()}
    assert set(sd["velocities"]) == set(sd["velocity_checksums"]) == names
    assert all(t.abs().sum() > 0 for t in sd["velocities"].values())
    resumed = gs.TopK(density=0.05, momentum=0.9)
    ddp2 = _hooked(resumed, weights_of=ddp)
    resumed.load_state_dict(sd)
    _train(ddp2, 2, momentum=0.0, seed=5)
    _train(ddp, 2, momentum=0.0, seed=5)
    for kind in ("residuals", "velocities"):
        for name, value in state.state_dict()[kind].items():
            assert torch.equal(value, resumed.state_dict()[kind][name]), (kind, name)
    # Another momentum is refused on load, naming it; changed on purpose in the state dict's
    # config, it loads and the saved velocities are dropped.
    plain = gs.TopK(density=0.05)
    ddp3 = _hooked(plain, weights_of=ddp)
    with pytest.raises(ValueError, match=r"momentum=0\.9 saved, 0\.0 here.*config\['momentum'\]"):
        plain.load_state_dict(sd)
    plain.load_state_dict(dict(sd, config=dict(sd["config"], momentum=0.0)))
    _train(ddp3, 1)
    assert plain.state_dict()["velocities"] == {}
    with pytest.raises(ValueError, match=r"error_feedback=True saved, False here"):
        gs.TopK(density=0.05, error_feedback=False).load_state_dict(dict(sd, config=dict(sd["config"], momentum=0.0)))


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda sd: dict(
                sd, velocities={**sd["velocities"], "0.bias": torch.full((32,), math.inf)}, velocity_checksums={}
            ),
            "the velocity of 0.bias holds NaN or Inf",
        ),
        (
            lambda sd: dict(sd, velocities={**sd["velocities"], "0.weight": torch.zeros(3)}, velocity_checksums={}),
            "the velocity of 0.weight holds 3 elements but the parameter has 256",
        ),
        (
            lambda sd: dict(sd, velocities={**sd["velocities"], "2.weight": -sd["velocities"]["2.weight"]}),
            "the velocity of 2.weight does not match its checksum",
        ),
    ],
)
def test_a_damaged_velocity_is_refused(change, message):
    state, _ = _saved_with_momentum()
    fresh = gs.TopK(density=0.05, momentum=0.9)
    _hooked(fresh)
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict(change(state.state_dict()))


def _all_ranks_of(first: dict, second: dict) -> dict:
    """An AllRanks state dict of two ranks, of two runs' state dicts (on different data)."""
    return {"version": 2, "all_ranks": True, "class": first["class"], "config": first["config"], "world_size": 2,
            "ranks": [dict(first, world_size=2), dict(second, rank=1, world_size=2)]}  # fmt: skip


def test_reshard_averages_the_velocities_the_next_step_uses():
    """Momentum factor masking restarts a rank's velocity where its residual is zero (the
    positions its last step sent) at its next step. Averaged as saved, the velocities that rank
    would have dropped were carried into the mean, where the mean residual is not zero and
    nothing masks them: the next step added momentum the saved ranks never would (test_checkpoints
    has the distributed run). Each rank's is now masked by its own residual first; a state that
    took no sparse step yet (warm-up) holds no residual, and its velocities are averaged as they are."""
    first, second = _saved_with_momentum(seed=0)[0].state_dict(), _saved_with_momentum(seed=1)[0].state_dict()
    saved = _all_ranks_of(first, second)
    one = gs.reshard(saved, 1)["ranks"][0]
    masked = 0
    for name, value in one["velocities"].items():
        live = [sd["velocities"][name].double() * (sd["residuals"][name] != 0) for sd in (first, second)]
        masked += sum(
            int(((sd["residuals"][name] == 0) & (sd["velocities"][name] != 0)).sum()) for sd in (first, second)
        )
        torch.testing.assert_close(value, ((live[0] + live[1]) / 2).float(), rtol=0, atol=1e-7)
    assert masked > 0  # the case at hand: velocities where a residual was emptied
    state = gs.TopK(density=0.05, momentum=0.9)
    _hooked(state)
    state.load_state_dict(gs.reshard(saved, 1))  # checksums match

    warming = []
    for seed in (0, 1):
        state = gs.TopK(density=0.05, momentum=0.9, warmup_steps=5)
        _train(_hooked(state), 3, seed=seed)
        warming.append(state.state_dict())
    assert warming[0]["residuals"] == {} and warming[0]["velocities"]
    one = gs.reshard(_all_ranks_of(*warming), 1)["ranks"][0]
    for name, value in one["velocities"].items():
        expected = (warming[0]["velocities"][name].double() + warming[1]["velocities"][name].double()) / 2
        torch.testing.assert_close(value, expected.float(), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "change",
    [
        lambda sd: _with_counters(sd, counter_of_a_later_version=1),
        lambda sd: dict(sd, methods=[0.5]),  # a method state that is no mapping
    ],
)
def test_a_state_dict_that_fails_to_load_leaves_the_state_as_it_was(change):
    """A state dict refused part-way through the load (by statistics or a method state this
    state cannot read) changed the step and dropped the residuals before it raised: the state
    went on from the refused checkpoint's step, without its own residuals. Now it is left as it
    was."""
    sd = change(_saved(steps=2))
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    _train(ddp, 3, seed=7)
    before = state.state_dict()
    before_residuals = {name: t.clone() for name, t in before["residuals"].items()}
    with pytest.raises((TypeError, ValueError)):
        state.load_state_dict(sd)
    after = state.state_dict()
    assert state.step == 3 and after["step"] == 3 and after["layout"] == before["layout"]
    assert after["stats"] == before["stats"]
    for name, value in before_residuals.items():
        assert torch.equal(after["residuals"][name], value), name


def test_a_state_dict_kept_in_memory_while_training_went_on_is_refused_with_the_fix():
    """state_dict() holds the live residuals: one kept in memory to return to later has changed
    by then, and its checksums no longer match. The refusal spoke only of a corrupt or partly
    written file; it now names the live tensors and the deep copy that keeps a snapshot."""
    state = gs.TopK(density=0.05)
    ddp = _hooked(state)
    _train(ddp, 2)
    kept, snapshot = state.state_dict(), copy.deepcopy(state.state_dict())
    _train(ddp, 1, seed=3)
    with pytest.raises(ValueError, match=r"kept in memory while training went on .* copy\.deepcopy\(state\.state_dict"):
        state.load_state_dict(kept)
    state.load_state_dict(snapshot)
    assert state.step == 2


def test_an_fsdp_group_refused_for_its_size_does_not_count_the_next_step_early():
    """gradsparse.fsdp hands each parameter group's flat gradient to _reduce_flat. A group refused
    for its size was recorded as reduced all the same, so at the next step its first group read
    as a second reduction and counted a step there: that step ran past warm-up and ended as
    step 2."""
    state = gs.TopK(density=0.5, warmup_steps=1).setup()
    state._bind_sharded(nn.Linear(1, 1), {"a": (8, torch.float32), "b": (4, torch.float32)})
    with pytest.raises(RuntimeError, match="module 'a' hands over 6 gradient elements where its parameters"):
        state._reduce_flat(0, "a", torch.ones(6), 2)
    assert state.step == 0
    state._reduce_flat(0, "a", torch.ones(8), 2).wait()
    state._reduce_flat(1, "b", torch.ones(4), 2).wait()
    assert state.step == 1
    assert state.stats()["total"]["dense_steps"] == 1  # the warm-up step, in both groups


# ----------------------------------------------------------------------------------------------
# DDP's first iteration with static_graph=True: every bucket handed over as bucket 0, none last


class _TwoDtypes(nn.Module):
    """A float32 layer and a bfloat16 one: DDP's first iteration has a bucket per dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 3).to(torch.bfloat16)

    def forward(self, x):
        return self.b(self.a(x).relu().to(torch.bfloat16)).float()


def test_a_failed_first_step_of_a_static_graph_does_not_skip_the_next():
    """A bucket that failed in DDP's first static-graph iteration marked the rest of the step to go
    back untouched until a bucket said is_last(), which none does in that iteration: the whole
    second step went back unreduced and uncounted, without an error (each rank would have kept
    its own gradient)."""
    state = gs.TopK(density=0.1)
    ddp = DDP(_TwoDtypes(), static_graph=True)
    gs.register(ddp, state)
    engine = state._engine

    state._engine = _FailingEngine()
    with pytest.raises(RuntimeError, match="an error inside the hook's work"):
        _train(ddp, 1)
    state._engine = engine  # the cause, fixed
    assert state.step == 0
    _train(ddp, 1)
    assert state.step == 1  # the second step was reduced
    assert state.stats()["total"]["steps"] == 1
    _train(ddp, 2)
    assert state.step == 3


def test_a_state_registered_with_register_comm_hook_counts_the_first_step_of_a_static_graph():
    """A state registered with model.register_comm_hook does not know its model's parameters
    before its first step ends, so in DDP's first static-graph iteration (no bucket is the last)
    the step never ended: it went uncounted (warm-up ran a step late) and the parameters were
    learned a step late. The hook ends that step when the backward ends."""
    state = gs.TopK(density=0.1, warmup_steps=1)
    ddp = DDP(_TwoDtypes(), static_graph=True)
    ddp.register_comm_hook(state, gs.hook)
    _train(ddp, 1)
    assert state.step == 1
    _train(ddp, 2)
    assert state.step == 3
    assert state.stats()["total"]["dense_steps"] == 1  # the warm-up step only


def test_a_new_ddp_whose_bucket_0_is_disjoint_from_a_stopped_backwards_is_a_new_step():
    """After a backward that stopped half-way, the next bucket 0 of a new DDP wrapper (here over
    the same module with a layer frozen) held none of the stopped step's parameters, and was read
    as the second bucket of DDP's first static-graph iteration though the model has no static
    graph: it was reduced as bucket 1, and the frozen layer's residual stayed in the table."""
    state = gs.TopK(density=0.05)
    ddp = _bucketed(0.0003)  # from the second step on: [2.bias, 2.weight], [0.bias, 0.weight]
    gs.register(ddp, state)
    _train(ddp, 2)

    def stop(_):
        raise RuntimeError("an error in the user's backward")

    hook = ddp.module[0].weight.register_hook(stop)  # after DDP's first bucket was handed over
    with pytest.raises(RuntimeError, match="an error in the user's backward"):
        _train(ddp, 1, seed=3)
    hook.remove()
    module = ddp.module
    del ddp
    gc.collect()
    module[2].requires_grad_(False)
    again = DDP(module, bucket_cap_mb=0.0003)  # one bucket: [0.weight, 0.bias]
    gs.register(again, state)
    _train(again, 1)
    assert state.step == 3
    assert state.state_dict()["layout"] == [["0.weight", "0.bias"]]
    assert sorted(state.state_dict()["residuals"]) == ["0.bias", "0.weight"]


def test_exchange_auto_plans_a_half_precision_bucket_with_its_two_byte_values():
    # gradsparse.simulate's model at 4 ranks, 1M elements, density 0.01 on its default link: the
    # reduce-scatter for float32 values, gather-and-add for float16 and bfloat16 ones, which send
    # half the bytes per pair
    state = gs.GaussianK(density=0.01, exchange="auto")
    state._world_size, state._link = 4, simulate.DEFAULT_LINK  # what set-up measures on 4 ranks
    picked = {
        dtype: state._make_method([1_000_000], torch.empty(0, dtype=dtype).element_size()).exchange
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    }
    expected = {
        exchange: gs.GaussianK(density=0.01, exchange=exchange)._make_method([1_000_000]).exchange
        for exchange in ("reduce_scatter", "gather")
    }
    assert expected["reduce_scatter"] != expected["gather"]
    assert picked == {
        torch.float32: expected["reduce_scatter"],
        torch.float16: expected["gather"],
        torch.bfloat16: expected["gather"],
    }


def test_sage_from_a_huge_initial_threshold_trains_under_a_grad_scaler():
    """SAGE's first threshold is its initial_threshold times the loss scale: 1e308 x 2^16 was Inf,
    which the reference mode's load_state refused when DDP rebuilt its buckets after the first
    step and the state took back the bucket's method state ("'threshold' is inf at step 1"), so
    training stopped at its second step. Now every threshold stays finite, and after the first
    step each is the one of training without loss scaling (λ saturated at the largest float32,
    method-spec 4.7) times the scale, where it saturated at the largest float32 in scaled units."""
    batches = _batches(4)
    plain = gs.SAGE(density=0.05, reference=True, initial_threshold=1e308)
    _train_scaled(_hooked(plain), batches)
    state = gs.SAGE(density=0.05, reference=True, initial_threshold=1e308, nonfinite="propagate")
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    _train_scaled(_hooked(state.set_scaler(scaler)), batches, scaler)
    saved = state.state_dict()
    assert saved["loss_scale"] == 2.0**19  # 2^16 at the first step, doubled after each
    thresholds = [method["threshold"] for method in saved["methods"]]
    assert thresholds == [method["threshold"] * 2.0**19 for method in plain.state_dict()["methods"]], thresholds


def test_a_refused_set_up_gives_its_group_back():
    """A set-up refused after the state's own group was made (a world size the method cannot run
    at here; alike for disagreeing ranks, another MPI numbering) kept that group, three threads and
    five sockets on Gloo, for each try."""
    groups = dist.distributed_c10d._world.pg_map
    gc.collect()
    gs.register(DDP(_model()), gs.TopK(density=0.05)).close()  # gives back those of states earlier tests dropped
    held = len(groups)
    for _ in range(3):
        with pytest.raises(ValueError, match="SparDL: teams=3 does not divide the world size 1"):
            gs.register(DDP(_model()), gs.SparDL(density=0.1, teams=3))
    assert len(groups) == held
