"""gradsparse.fsdp: sparse reduce-scatters with error feedback in FSDP2 (fully_shard), on 2 and 4
Gloo ranks on the CPU. The worker functions are module level, so the ranks can import them by name."""

import gc
import json
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import gradsparse as gs
from gradsparse.testing import run_distributed
from tests.distributed import workers

pytestmark = pytest.mark.distributed

WORLD_SIZES = [2, 4]


def sharded_model(
    world_size: int,
    seed: int = 3,
    reduce_dtype: torch.dtype | None = None,
    per_layer: bool = True,
    frozen: bool = False,
) -> nn.Module:
    """workers.make_model with each Linear and the root under fully_shard (the root holds no
    parameters of its own; the last layer's 6 rows are padded to 8 on 4 ranks), or with
    ``per_layer=False`` the root alone (one reduce-scatter per step, a third of the time). With
    ``frozen``, as in fine-tuning: the first Linear frozen (FSDP never reduces its module) and
    the second's bias."""
    model = workers.make_model(seed)
    if frozen:
        model[0].requires_grad_(False)
        model[2].bias.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world_size,))
    return shard(model, mesh, MixedPrecisionPolicy(reduce_dtype=reduce_dtype), per_layer)


def shard(model: nn.Sequential, mesh=None, policy=None, per_layer: bool = True) -> nn.Sequential:
    """Each Linear of ``model`` (unless not ``per_layer``) and then ``model`` under fully_shard."""
    policy = policy or MixedPrecisionPolicy()
    for layer in model if per_layer else ():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


# Density 1 against FSDP's own reduce-scatter ------------------------------------------------------


def full_density_vs_plain(rank: int, world_size: int, reduce_dtype: torch.dtype | None) -> tuple[list, list]:
    data = workers.teacher_data(rank, 12)
    sparse = sharded_model(world_size, reduce_dtype=reduce_dtype)
    state = gs.fsdp.sparsify(sparse, gs.TopK(density=1.0))
    workers.fit(sparse, data)
    assert state.step == 12, state.step
    plain = sharded_model(world_size, reduce_dtype=reduce_dtype)
    workers.fit(plain, data)
    return full_params(sparse), full_params(plain)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_density_one_equals_fsdp(world_size, reduce_dtype):
    """Top-k at density 1 sends every element: the parameters after 12 steps match FSDP's own
    reduce-scatter (up to the rounding of a sum taken in another order)."""
    tol = 1e-5 if reduce_dtype is None else 2e-2
    for sparse, plain in run_distributed(full_density_vs_plain, world_size, reduce_dtype, timeout=300):
        for a, b in zip(sparse, plain, strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def accumulate(model: nn.Module, data, per_step: int = 3) -> None:
    """SGD over ``data`` with ``per_step`` micro-batches a step, FSDP's gradient synchronization
    off for all but the last (gradient accumulation)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for start in range(0, len(data), per_step):
        opt.zero_grad()
        for i, (x, y) in enumerate(data[start : start + per_step]):
            model.set_requires_gradient_sync(i == per_step - 1)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def accumulated_vs_plain(rank: int, world_size: int) -> tuple[int, list, list]:
    data = workers.teacher_data(rank, 12)
    sparse = sharded_model(world_size)
    state = gs.fsdp.sparsify(sparse, gs.TopK(density=1.0))
    accumulate(sparse, data)
    plain = sharded_model(world_size)
    accumulate(plain, data)
    return state.step, full_params(sparse), full_params(plain)


def test_gradient_accumulation_without_sync_equals_fsdp():
    """Micro-batches under set_requires_gradient_sync(False) reduce nothing; the last one's
    reduce-scatter carries the accumulated gradient: one step of the state per optimizer step,
    and at density 1 the parameters FSDP's own reduce-scatter gives."""
    for steps, sparse, plain in run_distributed(accumulated_vs_plain, 2, timeout=300):
        assert steps == 4
        for a, b in zip(sparse, plain, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# Error feedback conserves the gradient mass --------------------------------------------------------


def recorded_steps(rank: int, world_size: int, reduce_dtype: torch.dtype | None, frozen: bool = False) -> list[dict]:
    """Records, at every reduce-scatter: the flat gradient, the residual before and after, and
    this rank's output shard."""
    model = sharded_model(world_size, reduce_dtype=reduce_dtype, frozen=frozen)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    records = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule) or not module._get_fsdp_state()._fsdp_param_groups:
            continue
        group = module._get_fsdp_state()._fsdp_param_groups[0]
        inner = group._reduce_scatter_comm

        def recording(output_tensor, input_tensor, group, op, async_op=False, inner=inner, name=name):
            index = inner._index
            entry = state._table.buckets.get(index)
            before = torch.zeros_like(input_tensor) if entry is None or entry.residual is None else entry.residual
            record = {"name": name, "step": state.step, "grad": input_tensor.clone(), "before": before.clone()}
            inner(output_tensor, input_tensor, group, op, async_op)
            record["after"] = state._table.buckets[index].residual.clone()
            record["output"] = output_tensor.clone()
            records.append(record)

        recording.allocate = inner.allocate
        module.set_custom_reduce_scatter(recording)
    workers.fit(model, workers.teacher_data(rank, 6))
    assert state.step == 6, state.step  # a module FSDP never reduces must not hold the steps back
    return records


@pytest.mark.parametrize(
    "world_size,reduce_dtype,frozen",
    [(w, d, False) for w in WORLD_SIZES for d in (None, torch.bfloat16)] + [(2, None, True)],
    ids=lambda v: {None: "float32", torch.bfloat16: "bfloat16", True: "frozen", False: "all-trained"}.get(v, str(v)),
)
def test_gradient_mass_is_conserved_every_step(world_size, reduce_dtype, frozen):
    """For every group and step: sum over ranks of (residual + gradient) = sum over ranks of the new
    residual + P x the averaged gradient FSDP received (its shards, in rank order), and the
    residuals hold what was not sent (most of the gradient at density 0.05). With frozen
    parameters: a frozen module is no group, and a frozen bias takes no place in its group's
    flat gradient."""
    logs = run_distributed(recorded_steps, world_size, reduce_dtype, frozen, timeout=300)
    tol = 1e-5 if reduce_dtype is None else 3e-2
    assert len({len(log) for log in logs}) == 1 and len(logs[0]) == 6 * (2 if frozen else 3)
    for calls in zip(*logs, strict=True):
        assert len({(c["name"], c["step"]) for c in calls}) == 1
        assert calls[0]["after"].dtype == (reduce_dtype or torch.float32)
        before = sum(c["before"].double() + c["grad"].double() for c in calls)
        average = torch.cat([c["output"].double() for c in calls])
        after = sum(c["after"].double() for c in calls)
        torch.testing.assert_close(after + world_size * average, before, atol=tol, rtol=tol)
        assert after.abs().sum() > 0.5 * before.abs().sum()


# Bytes: pairs go to the owners of their shard only ----------------------------------------------------


def traffic(rank: int, world_size: int) -> dict:
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 3))
    return state.stats()["total"]


def test_per_rank_k_methods_send_each_pair_to_its_owner_only():
    """At 4 ranks, Top-k's pairs travel once, to the owner of their shard: a rank receives about
    the pairs the others selected in its shard (k (P - 1) / P on average, plus counts and padding),
    where gather-and-add would deliver it every rank's k pairs."""
    world_size = 4
    pair_bytes = 4 + 4  # uint32 index, float32 value
    for rank, s in enumerate(run_distributed(traffic, world_size, timeout=300)):
        every_pair = s["selected_all"] * pair_bytes  # what gather-and-add hands every rank
        overhead = s["steps"] * 3 * (world_size - 1) * (8 + 4 * (world_size + 1))  # per group: padding, counts
        assert 0 < s["bytes_received"] <= every_pair / world_size * 1.5 + overhead, (rank, s)


# Every method trains ---------------------------------------------------------------------------------


def train_every_method(rank: int, world_size: int, steps: int, names: list[str] | None = None) -> dict[str, float]:
    """Trains each method on the model as one FSDP unit: how a method learns does not depend on
    how the model is cut into units (the tests above cover several), and each step costs a third."""
    data = workers.teacher_data(rank, steps)
    out = {}
    for name, make in workers.TRAINING_METHODS.items():
        if (name == "spardl_teams" and world_size % 2) or (names is not None and name not in names):
            continue
        model = sharded_model(world_size, per_layer=False)
        state = make()
        if state is not None:
            gs.fsdp.sparsify(model, state)
        losses = workers.fit(model, data)
        out[name] = sum(losses[-10:]) / 10
        if state is not None:
            assert state.stats()["total"]["steps"] == steps == state.step
            state.close()
    return out


def test_every_method_trains_close_to_dense():
    """Every method trains the FSDP model on the same data as FSDP's own reduce-scatter, by the
    criterion of the DDP test (tests/distributed/test_ddp.py)."""
    workers.assert_every_method_trains(run_distributed(train_every_method, 2, 150, timeout=500))


def test_every_exchange_trains_at_four_ranks():
    """At 4 ranks, one method per way of reducing under FSDP: the sparse reduce-scatter (Top-k, and
    MiCRO's exclusive gather, one owner per rank), the union exchange (ExDyna), shared indices
    (Random-block), SparDL's own exchange (two teams), against FSDP's own reduce-scatter."""
    names = ["dense", "topk", "micro_gather", "exdyna", "randomblock", "spardl_teams"]
    workers.assert_every_method_trains(run_distributed(train_every_method, 4, 150, names, timeout=500))


# Checkpoints through torch.distributed.checkpoint ------------------------------------------------------


DCP_METHODS = {**workers.TRAINING_METHODS, "dgc_momentum": lambda: gs.DGC(density=0.05, momentum=0.9)}


def resume_through_dcp(rank: int, world_size: int, path: str, method: str) -> dict:
    data = workers.teacher_data(rank, 8)

    def setup():
        model = sharded_model(world_size)
        state = gs.fsdp.sparsify(model, DCP_METHODS[method]())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        return model, state, opt

    model, state, opt = setup()
    workers.fit(model, data[:4], opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    residual_norms = [float(e.residual.norm()) for _, e in sorted(state._table.buckets.items())]
    velocities = [e.velocity is not None for _, e in sorted(state._table.buckets.items())]
    workers.fit(model, data[4:], opt)
    straight = full_params(model)
    straight_methods = [e.method.state() for _, e in sorted(state._table.buckets.items())]
    state.close()

    model, state, opt = setup()  # a fresh process's view: no step taken, no residual yet
    msd, osd = get_state_dict(model, opt)
    saved = {"model": msd, "optim": osd, "gradsparse": gs.fsdp.ShardedState(state)}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    assert state.step == 4, state.step
    workers.fit(model, data[4:], opt)
    methods = [e.method.state() for _, e in sorted(state._table.buckets.items())]
    return {
        "straight": straight,
        "resumed": full_params(model),
        "residual_norms": residual_norms,
        "velocities": velocities,
        "methods": (straight_methods, methods),
    }


@pytest.mark.parametrize("method", ["topk", "exdyna", "dgc", "dgc_momentum"])
def test_dcp_checkpoint_resumes_exactly(tmp_path, method):
    """Saved after 4 steps with dcp.save (model, optimizer, gradsparse.fsdp.ShardedState) and loaded
    into a new model and state, 4 more steps give the parameters of the uninterrupted run, bit for
    bit: each rank got its own residuals and method states back."""
    results = run_distributed(resume_through_dcp, 2, str(tmp_path / "ckpt"), method, timeout=300)
    for rank, r in enumerate(results):
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {method} resumed differs by {(a - b).abs().max()}"
        straight_methods, methods = r["methods"]
        assert methods == straight_methods, f"rank {rank}: method states differ"
        if method == "exdyna":  # its partition layout is part of its state from the first step
            assert all("blocks.0" in m for m in methods)
        assert all(r["velocities"]) == (method == "dgc_momentum") and any(r["velocities"]) == all(r["velocities"])
    assert results[0]["residual_norms"] != results[1]["residual_norms"]  # per-rank residuals


class SkipMiddle(nn.Sequential):
    """workers.make_model's layers, the middle Linear (and its ReLU) left out while ``skip``."""

    skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self):
            if not (self.skip and i in (2, 3)):
                x = layer(x)
        return x


def steps_past_a_skipped_module_through_dcp(rank: int, world_size: int, path: str, after_a_load: bool) -> dict:
    """4 steps, the last without the middle module (FSDP reduces nothing for it), saved with
    dcp.save, 2 more; then the same 2 in a new model and state loaded from the save. With
    ``after_a_load`` the step without it is the first of a process that loaded the 3 steps before."""
    data = workers.teacher_data(rank, 6)

    def setup():
        torch.manual_seed(3)
        model = shard(SkipMiddle(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 6)))
        state = gs.fsdp.sparsify(model, gs.ExDyna(density=0.05))
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)

    def save(model, state, opt, checkpoint):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=checkpoint)

    def load(checkpoint):
        model, state, opt = setup()
        msd, osd = get_state_dict(model, opt)
        saved = {"model": msd, "optim": osd, "gradsparse": gs.fsdp.ShardedState(state)}
        dcp.load(saved, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        return model, state, opt

    model, state, opt = setup()
    workers.fit(model, data[:3], opt)
    if after_a_load:
        save(model, state, opt, path + "-3")
        state.close()
        model, state, opt = load(path + "-3")
    model.skip = True
    workers.fit(model, data[3:4], opt)
    model.skip = False
    save(model, state, opt, path)
    workers.fit(model, data[4:], opt)
    straight, straight_step, straight_methods = full_params(model), state.step, state.state_dict()["methods"]
    state.close()

    model, state, opt = load(path)
    loaded_step = state.step
    workers.fit(model, data[4:], opt)
    return {
        "straight": straight,
        "resumed": full_params(model),
        "steps": (loaded_step, straight_step, state.step),
        "methods": (straight_methods, state.state_dict()["methods"]),
    }


@pytest.mark.parametrize("after_a_load", [False, True], ids=["in_a_run", "first_after_a_load"])
def test_dcp_checkpoint_after_a_step_that_left_a_module_out_resumes_its_step_count(tmp_path, after_a_load):
    """A step in which a module reduced nothing is counted once the next step reduces a module
    again. Saved between the two, the checkpoint held the step count without it, so the resumed
    run stayed a step behind for good (one more dense step within warmup_steps). Now it holds all
    4 steps, and the resumed run counts 6 after 2 more, as the uninterrupted one does, with the
    same parameters and method states. When that step was the first after a load, the checkpoint
    held what had been loaded (3 steps, the residuals before it), and the method state that the
    left-out module had not yet taken was lost."""
    results = run_distributed(
        steps_past_a_skipped_module_through_dcp, 2, str(tmp_path / "c"), after_a_load, timeout=300
    )
    for rank, r in enumerate(results):
        assert r["steps"] == (4, 6, 6), f"rank {rank}: steps loaded, straight, resumed {r['steps']}"
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: resumed differs by {(a - b).abs().max()}"
        straight_methods, methods = r["methods"]
        assert methods == straight_methods, f"rank {rank}: method states differ"


def auto_link_through_dcp(rank: int, world_size: int, path: str) -> tuple:
    """exchange="auto" picks each module's exchange from the link measured at set-up; a stand-in
    link (a measurement never repeats exactly) is saved, and what a fresh state holds after the load."""
    data = workers.teacher_data(rank, 2)
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.1, exchange="auto"))
    state._link = (1.5e-3, 2.5e-9)
    workers.fit(model, data)
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    state.close()
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.1, exchange="auto"))
    measured = fresh._link  # sparsify set it up
    saved = {"gradsparse": gs.fsdp.ShardedState(fresh)}
    dcp.load(saved, checkpoint_id=path)
    return measured, fresh._link


def test_dcp_checkpoint_keeps_the_link_exchange_auto_picks_from(tmp_path):
    # as State.state_dict() does for DDP: a resumed run picks its modules' exchanges as the saved run did
    for measured, loaded in run_distributed(auto_link_through_dcp, 2, str(tmp_path / "ckpt"), timeout=300):
        assert measured != (1.5e-3, 2.5e-9)
        assert tuple(loaded) == (1.5e-3, 2.5e-9)


def reshard_of_all_ranks(rank: int, world_size: int, path: str) -> list[str]:
    """gs.reshard of gs.AllRanks' state dict of an FSDP state after 2 steps, and of one loaded
    through DCP (whose state dict is the loaded one until the next step), to 1 and to 4 ranks:
    what each raised (on rank 0, which receives AllRanks' state dict). Then what loading the rank's
    own state dict, marked as saved at 4 ranks, raised on every rank."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.1))
    workers.fit(model, workers.teacher_data(rank, 2))
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    saved = [gs.AllRanks(state).state_dict()]
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.1))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    saved.append(gs.AllRanks(fresh).state_dict())
    errors = []
    for all_ranks in saved if rank == 0 else []:
        for new_world_size in (1, 4):
            try:
                gs.reshard(all_ranks, new_world_size)
                errors.append("resharded")
            except ValueError as e:
                errors.append(str(e))
    try:
        fresh.load_state_dict(dict(state.state_dict(), world_size=4))
        errors.append("loaded")
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_reshard_refuses_an_fsdp_state_naming_why(tmp_path):
    """An FSDP state's residual is a module's flat gradient in P padded shards, each holding its
    part of every parameter: its order and padding depend on the world size. gs.reshard averaged
    them as DDP residuals: at 1 rank the state dict loaded without a word (the mass in the wrong
    places), at 4 it was refused as "saved from another model". It is now refused, saying why."""
    results = run_distributed(reshard_of_all_ranks, 2, str(tmp_path / "ckpt"), timeout=300)
    errors = results[0][:4]
    assert len(errors) == 4
    for error in errors:
        assert "gradsparse.reshard: the state dict is of a state under FSDP" in error, error
        assert "no resharded form. Resume at 2 ranks" in error, error
    # Loaded at another world size, the error sent the user to gs.reshard, which refuses these.
    for rank_errors in results:
        error = rank_errors[-1]
        assert "saved at world size 4 but this run has 2 ranks, and it is of a state under FSDP" in error, error
        assert "Resume at 4 ranks, or load no gradsparse state at 2" in error and "reshard(" not in error, error


def auto_exchanges_under_fsdp(rank: int, world_size: int) -> tuple:
    """exchange="auto" under FSDP, three steps: stats()' entries, and each module's exchange."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.1, exchange="auto"))
    workers.fit(model, workers.teacher_data(rank, 3))
    stats = state.stats()
    return sorted(stats), [b["exchange"] for b in stats["buckets"].values()]


def test_exchange_auto_under_fsdp_reports_no_trial_that_never_decides():
    """FSDP's reduce-scatters are not timed, so exchange="auto"'s trial never ran there, yet one
    was made at set-up: stats()["exchange_trial"] read None ("while its trial alternates") for the
    whole run. Each module keeps the cost model's pick, which stats() names per bucket."""
    for rank, (entries, exchanges) in enumerate(run_distributed(auto_exchanges_under_fsdp, 2, timeout=120)):
        assert entries == ["buckets", "total"], f"rank {rank}: {entries}"
        assert len(exchanges) == 3 and all(exchanges), f"rank {rank}: {exchanges}"


class _FixedScaler:
    """A stand-in GradScaler whose scale stays at 32."""

    def get_scale(self) -> float:
        return 32.0


def loss_scale_through_dcp(rank: int, world_size: int, path: str) -> tuple:
    """Residuals in loss scale 32 (set_scaler), saved; what a fresh state takes from the load:
    the scale, and residuals that are those saved (in that scale)."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.1, nonfinite="propagate").set_scaler(_FixedScaler()))
    workers.fit(model, workers.teacher_data(rank, 2))
    saved = {n: t.clone() for n, t in sorted(state.state_dict()["residuals"].items())}
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    state.close()
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.1, nonfinite="propagate"))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    loaded = [t for _, t in sorted(fresh.state_dict()["residuals"].items())]
    return fresh._table.scale, list(saved.values()), loaded


def test_dcp_checkpoint_keeps_the_loss_scale_of_the_residuals(tmp_path):
    for scale, saved, loaded in run_distributed(loss_scale_through_dcp, 2, str(tmp_path / "ckpt"), timeout=300):
        assert scale == 32.0
        for a, b in zip(saved, loaded, strict=True):
            assert torch.equal(a, b)


def residuals_through_dcp(rank: int, path: str, setup) -> tuple[list, list]:
    """``setup()`` gives a sharded model and its state: each rank's residuals after two steps,
    saved with dcp.save, and what the state of a second ``setup()`` holds after dcp.load (a
    resumed process: that state has reduced nothing yet)."""
    model, state = setup()
    workers.fit(model, workers.teacher_data(rank, 2))
    saved = [t.clone() for _, t in sorted(state.state_dict()["residuals"].items())]
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    _, fresh = setup()
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    return saved, [t for _, t in sorted(fresh.state_dict()["residuals"].items())]


def hsdp_residuals_through_dcp(rank: int, world_size: int, path: str) -> tuple[list, list]:
    """HSDP on 2 x 2 ranks (replicate x shard), the state on the shard group: each rank's residuals
    before dcp.save, and what a fresh state holds after dcp.load."""

    def setup():
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        model = shard(workers.make_model(3), mesh)
        return model, gs.fsdp.sparsify(model, gs.TopK(density=0.1, process_group=mesh.get_group("shard")))

    return residuals_through_dcp(rank, path, setup)


def test_dcp_checkpoint_gives_every_hsdp_replica_its_own_residuals(tmp_path):
    """Ranks of different replicas hold the same shard of the model, but residuals of their own."""
    results = run_distributed(hsdp_residuals_through_dcp, 4, str(tmp_path / "ckpt"), timeout=300)
    assert any(not torch.equal(a, b) for a, b in zip(results[0][0], results[2][0], strict=True))  # replicas differ
    for rank, (saved, loaded) in enumerate(results):
        for a, b in zip(saved, loaded, strict=True):
            assert torch.equal(a, b), f"rank {rank}: the loaded residual differs by {(a - b).abs().max()}"


#: FSDP takes a parameter's grad_dtype, and a param_dtype_override_fn, from torch 2.15 on (before, a
#: grad_dtype other than the reduce dtype fails FSDP's own assignment of the reduced gradient).
FSDP_GRAD_DTYPE = pytest.mark.skipif(
    not hasattr(MixedPrecisionPolicy, "param_dtype_override_fn"), reason="FSDP's grad_dtype: torch 2.15 on"
)


def norms_keep_their_dtype(param: nn.Parameter) -> torch.dtype | None:
    """A param_dtype_override_fn (torch 2.15): the 1-D parameters (a LayerNorm's) stay float32."""
    return param.dtype if param.ndim == 1 else None


def float32_grad_dtype(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad_dtype = torch.float32


def mixed_precision_through_dcp(rank: int, world_size: int, path: str, case: dict) -> tuple[list, list]:
    """Each rank's residuals after two steps under the mixed-precision policy of ``case``, and what
    a fresh state (which has reduced nothing yet) holds after dcp.load. ``case`` may name the
    model's dtype, a LayerNorm model under one fully_shard ("norm"), and a grad_dtype (torch
    2.15) given to the parameters before fully_shard ("grad_dtype") or to the sharded ones
    ("sharded_grad_dtype"), and a change made to the model after sparsify ("later")."""
    policy = MixedPrecisionPolicy(**case["policy"])

    def setup():
        if case.get("norm"):
            torch.manual_seed(3)
            model = nn.Sequential(
                nn.Linear(16, 48, bias=False), nn.LayerNorm(48), nn.ReLU(), nn.Linear(48, 6, bias=False)
            )
        else:
            model = workers.make_model(3, case.get("dtype", torch.float32))
        for param in model.parameters() if "grad_dtype" in case else ():
            param.grad_dtype = case["grad_dtype"]
        shard(model, init_device_mesh("cpu", (world_size,)), policy, per_layer=not case.get("norm"))
        for param in model.parameters() if "sharded_grad_dtype" in case else ():  # the sharded ones
            param.grad_dtype = case["sharded_grad_dtype"]
        state = gs.fsdp.sparsify(model, gs.TopK(density=0.1))
        if "later" in case:  # changed after sparsify, before the first forward
            case["later"](model)
        return model, state

    return residuals_through_dcp(rank, path, setup)


@pytest.mark.parametrize(
    "case",
    [
        {"policy": {"param_dtype": torch.bfloat16}},
        {"policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}},
        pytest.param(
            {"policy": {"param_dtype": torch.bfloat16}, "dtype": torch.bfloat16, "sharded_grad_dtype": torch.float32},
            marks=FSDP_GRAD_DTYPE,
        ),
        pytest.param(
            {
                "policy": {"param_dtype": torch.bfloat16, "param_dtype_override_fn": norms_keep_their_dtype},
                "norm": True,
                "grad_dtype": None,
            },
            marks=FSDP_GRAD_DTYPE,
        ),
        {"policy": {}, "dtype": torch.bfloat16, "later": nn.Module.float},
        pytest.param(
            {"policy": {"param_dtype": torch.bfloat16}, "dtype": torch.bfloat16, "later": float32_grad_dtype},
            marks=FSDP_GRAD_DTYPE,
        ),
    ],
    ids=[
        "bfloat16_params",
        "bfloat16_params_float32_reduce",
        "bfloat16_model_float32_grad_dtype",
        "float32_norms_grad_dtype_none",
        "bfloat16_model_made_float32_after_sparsify",
        "float32_grad_dtype_after_sparsify",
    ],
)
def test_dcp_checkpoint_under_mixed_precision_loads_the_residuals_exactly(tmp_path, case):
    """A fresh state learns its residuals' dtype from FSDP's policy, where DCP reads the saved
    ones into it. With param_dtype=bfloat16 and no reduce_dtype, torch 2.15 reduces in float32
    (the parameters' own dtype) where earlier torches reduced in bfloat16: taken for bfloat16 on
    2.15, the float32 residuals came back rounded to bfloat16 without a word. So they did on
    2.15 for a bfloat16 model whose parameters were given grad_dtype=float32 once sharded (FSDP
    takes it at its first forward, gradsparse took the one fully_shard found), and for float32
    norms (param_dtype_override_fn) with grad_dtype=None, whose float32 gradients FSDP promotes
    their group to (gradsparse took every parameter for the first one's param_dtype). And so
    they did for a change of the model's dtype or grad_dtype after sparsify, which FSDP follows
    (gradsparse took the dtype sparsify found)."""
    for rank, (saved, loaded) in enumerate(run_distributed(mixed_precision_through_dcp, 2, str(tmp_path), case)):
        for a, b in zip(saved, loaded, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: saved {a.dtype}, loaded {b.dtype}"


class IndexedStatsShardedState(gs.fsdp.ShardedState):
    """ShardedState as gradsparse saved it before the statistics were kept by the names of each
    bucket's parameters: each rank's block holds them by bucket index (the i-th module sparsified)."""

    def _methods_blob(self, saved: dict, layout: list[list[str]]) -> torch.Tensor:
        by_names = {frozenset(entry["names"]): entry["counters"] for entry in saved["stats"]}
        stats = {i: by_names[frozenset(names)] for i, names in enumerate(layout) if frozenset(names) in by_names}
        return super()._methods_blob(dict(saved, stats=stats), layout)


def statistics_through_dcp(rank: int, world_size: int, path: str) -> dict:
    """Each rank's statistics (state_dict()["stats"] and stats()' buckets, as JSON: NaN compares
    equal to itself; the totals add seconds in the order the buckets were counted) saved after 3 steps, and what dcp.load gives back to the same state after 2 more steps,
    to a fresh process's state (also from a checkpoint that holds them by bucket index), and to a
    state with counters from a checkpoint saved before the first step."""

    def as_json(state) -> str:
        stats = sorted(state.state_dict()["stats"], key=lambda entry: entry["names"])
        return json.dumps([stats, state.stats()["buckets"]], sort_keys=True)

    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 3))
    saved = as_json(state)
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    workers.fit(model, workers.teacher_data(rank + 10, 2))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    same_state = as_json(state)
    state.close()
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.05))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    fresh_process = as_json(fresh)
    dcp.save({"gradsparse": IndexedStatsShardedState(fresh)}, checkpoint_id=path + "-by-index")
    by_index = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.05))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(by_index)}, checkpoint_id=path + "-by-index")
    model = sharded_model(world_size)
    early = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    dcp.save({"gradsparse": gs.fsdp.ShardedState(early)}, checkpoint_id=path + "-step0")
    workers.fit(model, workers.teacher_data(rank, 1))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(early)}, checkpoint_id=path + "-step0")
    return {
        "saved": saved,
        "same_state": same_state,
        "fresh": fresh_process,
        "by_index": as_json(by_index),
        "step0": early.state_dict()["stats"],
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dcp_checkpoint_gives_every_rank_its_own_statistics(tmp_path, world_size):
    """Statistics differ by rank (the seconds, and the pairs of per-rank methods), as residuals do:
    each rank gets its own back, in a fresh process too (which names no counters before the load),
    each module's by its name (a checkpoint that holds them by bucket index: through its layout),
    and a checkpoint saved before the first step loads into a state that has counters (none after)."""
    results = run_distributed(statistics_through_dcp, world_size, str(tmp_path / "ckpt"), timeout=300)
    assert len({r["saved"] for r in results}) == world_size  # the ranks' statistics differ
    for rank, r in enumerate(results):
        saved, buckets = json.loads(r["saved"])
        modules = {name for entry in saved for name in entry["names"]}
        assert len(saved) == len(buckets) == len(modules) > 1
        assert all(entry["counters"]["steps"] == 3 and len(entry["names"]) == 1 for entry in saved)
        assert r["same_state"] == r["saved"], f"rank {rank}: the reloaded state holds other statistics"
        assert r["fresh"] == r["saved"], f"rank {rank}: the fresh process holds other statistics"
        assert r["by_index"] == r["saved"], f"rank {rank}: statistics by bucket index loaded otherwise"
        assert r["step0"] == []


class EarlierShardedState(gs.fsdp.ShardedState):
    """ShardedState as gradsparse saved it before per-rank statistics: the "methods" entry (of the
    same size) holds each rank's method states alone, as a JSON list, and "stats" one copy of the
    statistics, of which DCP kept one rank's; no link of exchange="auto" and no loss scale (entries
    of their own from 2026-11-30 to 2026-12-01 made DCP refuse such checkpoints: "Missing key in
    checkpoint state_dict: gradsparse.link"); the options as entries of their own, one per option."""

    def state_dict(self) -> dict:
        sd = {k: v for k, v in super().state_dict().items() if k not in ("link", "loss_scale")}
        saved = self.state.state_dict()
        text = json.dumps(saved["methods"]).encode()
        blob = torch.zeros(sd["methods"].to_local().numel(), dtype=torch.uint8)
        blob[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        return {**sd, "config": saved["config"], "methods": self._per_rank(blob), "stats": saved["stats"]}


def earlier_checkpoint_through_dcp(rank: int, world_size: int, path: str) -> dict:
    """An ExDyna state (its method state holds its partition layout) saved in the earlier layout
    after 3 steps, loaded into a fresh process's state and into the saved state after one more step."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.ExDyna(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 3))
    saved = state.state_dict()
    saved["residuals"] = {name: t.clone() for name, t in saved["residuals"].items()}  # the live ones move on
    dcp.save({"gradsparse": EarlierShardedState(state)}, checkpoint_id=path)
    workers.fit(model, workers.teacher_data(rank + 10, 1))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    reloaded = state.state_dict()
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.ExDyna(density=0.05))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    return {"saved": saved, "reloaded": reloaded, "fresh": fresh.state_dict()}


def test_dcp_checkpoint_of_the_earlier_layout_loads_without_statistics(tmp_path):
    """Checkpoints saved before the statistics joined the per-rank entry still load: residuals,
    method states and step as saved, and no statistics (they held one rank's, or none)."""
    results = run_distributed(earlier_checkpoint_through_dcp, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        saved = r["saved"]
        assert saved["stats"] and saved["methods"] and any(saved["methods"])
        for key in ("reloaded", "fresh"):
            loaded = r[key]
            assert loaded["step"] == 3 and loaded["stats"] == [], f"rank {rank}, {key}"
            assert loaded["methods"] == saved["methods"], f"rank {rank}, {key}: method states differ"
            assert sorted(loaded["residuals"]) == sorted(saved["residuals"])
            for name, residual in saved["residuals"].items():
                assert torch.equal(loaded["residuals"][name], residual), f"rank {rank}, {key}: residual {name}"


def other_method_through_dcp(rank: int, world_size: int, path: str) -> str:
    """A TopK checkpoint loaded into a MiCRO state: what dcp.load raises."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    other = gs.fsdp.sparsify(sharded_model(world_size), gs.MiCRO(density=0.05, exchange="gather"))
    try:
        dcp.load({"gradsparse": gs.fsdp.ShardedState(other)}, checkpoint_id=path)
    except Exception as e:  # DCP wraps what a rank raised in a CheckpointException
        return str(e)
    return "loaded"


def test_dcp_checkpoint_of_another_method_is_refused_naming_both(tmp_path):
    """The options were entries of their own, one per option: DCP refused a checkpoint whose
    method has other options with "Missing key in checkpoint state_dict: gradsparse.config.seed"
    before the state could say what differs (and would have refused every checkpoint of an
    earlier gradsparse once an option was added)."""
    for text in run_distributed(other_method_through_dcp, 2, str(tmp_path / "ckpt"), timeout=300):
        assert "MiCRO.load_state_dict: the state dict was saved by TopK({'density': 0.05" in text, text


def overfull_block_through_dcp(rank: int, world_size: int, path: str) -> tuple[list, dict, list, int]:
    """Statistics too large for the per-rank block (an exchange name of 5000 characters on rank 1):
    the warnings of dcp.save, and a fresh state's statistics, method states and step after dcp.load."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.ExDyna(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    if rank == 1:
        next(iter(state._metrics.buckets.values())).exchange = "x" * 5000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"gradsparse": gs.fsdp.ShardedState(state)}, checkpoint_id=path)
    fresh = gs.fsdp.sparsify(sharded_model(world_size), gs.ExDyna(density=0.05))
    dcp.load({"gradsparse": gs.fsdp.ShardedState(fresh)}, checkpoint_id=path)
    loaded = fresh.state_dict()
    warned = [str(w.message) for w in caught if "gradsparse" in str(w.message)]
    return warned, loaded["stats"], loaded["methods"] == state.state_dict()["methods"], loaded["step"]


def test_dcp_checkpoint_leaves_out_statistics_over_the_block_with_a_warning(tmp_path):
    """A rank whose method states and statistics overflow its block saves its method states alone
    and says so; it loads with no statistics, the other rank with its own."""
    results = run_distributed(overfull_block_through_dcp, 2, str(tmp_path / "ckpt"), timeout=300)
    (warned0, stats0, methods0, step0), (warned1, stats1, methods1, step1) = results
    assert warned0 == [] and stats0 and stats0[0]["counters"]["steps"] == 2
    assert len(warned1) == 1 and "rank 1's method states and statistics" in warned1[0] and stats1 == []
    assert methods0 and methods1 and step0 == step1 == 2


# Non-finite gradients ----------------------------------------------------------------------------------


def nonfinite_gradient(rank: int, world_size: int, policy: str) -> tuple[list, int, int, list, list]:
    """5 steps, a NaN loss on rank 1 at step 3; an error is caught and the loop goes on, and a
    step whose gradients this rank got back with NaN/Inf is not applied (as a GradScaler does):
    the outcomes, skipped steps, steps, whether each residual is finite, and those steps."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.1, nonfinite=policy))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes, nonfinite_steps = [], []
    for step, (x, y) in enumerate(workers.teacher_data(rank, 5)):
        loss = nn.functional.cross_entropy(model(x), y)
        if (step, rank) == (2, 1):
            loss = loss * float("nan")
        opt.zero_grad()
        outcome = workers._outcome(loss.backward)
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]  # none after a raise
        nonfinite = not all(bool(g.isfinite().all()) for g in grads)
        if nonfinite:
            nonfinite_steps.append(step)
        if outcome[0] == "ok" and not nonfinite:
            opt.step()
        outcomes.append(outcome)
    residuals = [bool(torch.isfinite(e.residual).all()) for e in state._table.buckets.values()]
    return outcomes, state.stats()["total"]["skipped_steps"], state.step, residuals, nonfinite_steps


@pytest.mark.parametrize("policy", ["raise", "skip", "propagate"])
def test_nonfinite_gradient_applies_the_policy_on_every_rank(policy):
    """A NaN on rank 1 at step 3: with "raise" every rank raises an error naming a module and the
    rank, and once it is caught the steps after it reduce every module again (the failed step not
    counted); with "skip" every rank skips that step and trains on; with "propagate" too, and
    every rank's gradients of that step are NaN (as a GradScaler needs them). Each way the
    residuals stay finite (the non-finite elements keep their old residual)."""
    for outcomes, skipped, steps, finite, nonfinite in run_distributed(nonfinite_gradient, 2, policy, timeout=120):
        assert all(finite)
        if policy == "raise":
            kind, text = outcomes[2]
            assert kind == "RuntimeError" and "module '" in text and "rank(s) 1 saw" in text, text
            assert outcomes[:2] + outcomes[3:] == [("ok", "")] * 4 and steps == 4, (outcomes, steps)
        else:
            assert outcomes == [("ok", "")] * 5 and skipped == 1, (outcomes, skipped)
            assert nonfinite == ([2] if policy == "propagate" else []), nonfinite


def test_sharded_state_of_something_else_names_what_to_pass():
    with pytest.raises(
        TypeError, match=r"got object; pass the state that gradsparse.register or gradsparse.fsdp.sparsify"
    ):
        gs.fsdp.ShardedState(object())
    with pytest.raises(
        TypeError,
        match=r"serves no model .*gradsparse.register\(ddp_model, state\) .*gradsparse.fsdp.sparsify\(model, state\)",
    ):
        gs.fsdp.ShardedState(gs.TopK(density=0.05))


def sharded_state_of_a_freed_model(rank: int, world_size: int) -> list[str]:
    """A DDP state whose model is freed: ShardedState refuses it when made, and at a save when it
    was made before the model went (the messages)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    said = []
    for made_before in (False, True):
        ddp = DDP(workers.make_model())
        state = gs.register(ddp, gs.TopK(density=0.05))
        sharded = gs.ShardedState(state) if made_before else None
        del ddp
        gc.collect()  # the DDP and model, referenced by nothing else now
        try:
            sharded.state_dict() if made_before else gs.ShardedState(state)
        except (TypeError, RuntimeError) as e:
            said.append(f"{type(e).__name__}: {e}")
        state.close()
    return said


def test_sharded_state_of_a_freed_model_names_the_fix():
    said = run_distributed(sharded_state_of_a_freed_model, 1, timeout=120)[0]
    fix = "registered on no longer exists; register the state on the model being checkpointed"
    assert len(said) == 2 and said[0].startswith("TypeError") and said[1].startswith("RuntimeError"), said
    assert all(f"the model the TopK state was {fix} (gradsparse.register(ddp_model, state))" in s for s in said), said


def a_paused_step(rank: int, world_size: int, reduce_dtype: torch.dtype | None = None) -> dict:
    """2 steps, then a backward inside state.paused(), then 1 more step."""
    data = workers.teacher_data(rank, 4)
    model = sharded_model(world_size, reduce_dtype=reduce_dtype)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, data[:2])
    before = {name: t.clone() for name, t in state.state_dict()["residuals"].items()}
    x, y = data[2]
    local = workers.make_model(3)  # the same weights, unsharded: this rank's own gradient
    local.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
    nn.functional.cross_entropy(local(x), y).backward()
    model.zero_grad()
    with state.paused():
        nn.functional.cross_entropy(model(x), y).backward()
    shards = {n: p.grad.to_local() for n, p in model.named_parameters()}
    own = {n: p.grad.chunk(world_size)[rank] for n, p in local.named_parameters()}
    after = state.state_dict()["residuals"]  # views of the live residuals
    kept = all(torch.equal(t, after[name]) for name, t in before.items())
    step = state.step
    workers.fit(model, data[3:])
    return {
        "step": (step, state.step),
        "residuals_kept": kept,
        "gradient_unreduced": all(
            torch.allclose(shards[n], own[n], atol=1e-6 if reduce_dtype is None else 1e-3, rtol=1e-3) for n in own
        ),
    }


@pytest.mark.parametrize("reduce_dtype", [None, torch.float16], ids=["float32", "float16"])
def test_paused_hands_each_rank_its_own_gradient_back_and_changes_nothing(reduce_dtype):
    """State.paused() under FSDP: no selection, no communication, no step counted; each rank's shard
    is its own gradient, unreduced (as DDP's buckets come back). It used to reduce and count the
    step as any other. In float16, where FSDP asks for a sum and divides it by the world size
    itself, the shard came back divided by the world size."""
    for rank, r in enumerate(run_distributed(a_paused_step, 2, reduce_dtype, timeout=120)):
        assert r == {"step": (2, 3), "residuals_kept": True, "gradient_unreduced": True}, f"rank {rank}: {r}"


def sparsified_on_one_rank(rank: int, world_size: int) -> tuple[list[str], int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = sharded_model(world_size)
        state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], state.step


def test_sparsify_on_one_rank_says_that_fsdp_reduces_nothing_there():
    """FSDP calls no reduce-scatter on one rank, so the state never sees a gradient (step 0, no
    residual): silent until now, where the same state under DDP sparsifies."""
    ((messages, step),) = run_distributed(sparsified_on_one_rank, 1, timeout=120)
    assert step == 0
    assert any(
        "FSDP reduce-scatters nothing on one rank" in m and "gradsparse.register(ddp_model" in m for m in messages
    )


# Bad input: a clear error on every rank --------------------------------------------------------------


def bad_input(rank: int, world_size: int, case: str) -> tuple[str, str]:
    def attempt():
        if case == "divide_factor":
            model = sharded_model(world_size)
            gs.fsdp.sparsify(model, gs.TopK(density=0.05))
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(3.0)
            workers.fit(model, workers.teacher_data(rank, 1))
        elif case == "options_differ":
            gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.05 if rank == 0 else 0.1))
        elif case == "dense":
            gs.fsdp.sparsify(sharded_model(world_size), gs.Dense())
        elif case == "no_fsdp":
            gs.fsdp.sparsify(workers.make_model(), gs.TopK(density=0.05))
        elif case == "two_models":
            state = gs.fsdp.sparsify(sharded_model(world_size), gs.TopK(density=0.05))
            gs.fsdp.sparsify(sharded_model(world_size), state)
        elif case == "unused_parameter":  # trained, but no gradient: FSDP hands over less than the layout
            model = workers.make_model()
            model[2].register_parameter("spare", nn.Parameter(torch.zeros(5)))
            shard(model)
            gs.fsdp.sparsify(model, gs.TopK(density=0.05))
            workers.fit(model, workers.teacher_data(rank, 1))
        elif case == "unused_parameter_later":  # a gradient at the first step, none at the second
            torch.manual_seed(3)
            model = shard(nn.Sequential(nn.Linear(16, 48), nn.ReLU(), SpareLinear(48, 48), nn.ReLU(), nn.Linear(48, 6)))
            gs.fsdp.sparsify(model, gs.TopK(density=0.05))
            workers.fit(model, workers.teacher_data(rank, 1))
            model[2].use_spare = False
            workers.fit(model, workers.teacher_data(rank, 1))
        elif case in ("unfrozen_module", "unfrozen_bias"):  # unfrozen after sparsify (model[0] wholly frozen)
            model = sharded_model(world_size, frozen=True)
            gs.fsdp.sparsify(model, gs.TopK(density=0.05))
            workers.fit(model, workers.teacher_data(rank, 1))
            (model[0] if case == "unfrozen_module" else model[2].bias).requires_grad_(True)
            workers.fit(model, workers.teacher_data(rank, 1))
        elif case == "state_class":
            gs.fsdp.sparsify(sharded_model(world_size), gs.TopK)
        elif case == "register_on_fsdp":  # told to wrap the sharded model in DDP
            gs.register(sharded_model(world_size), gs.TopK(density=0.05))
        elif case == "swapped":
            gs.fsdp.sparsify(gs.TopK(density=0.05), sharded_model(world_size))
        elif case == "several_meshes":  # biases on a mesh of their own: two parameter groups in one module
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
            from torch.distributed.tensor import Shard

            mesh = init_device_mesh("cpu", (world_size,))
            other = FSDPMeshInfo(
                DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu"), shard_mesh_dim=0
            )
            model = workers.make_model()
            fully_shard(
                model,
                mesh=mesh,
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.dim() == 1 else None,
            )
            gs.fsdp.sparsify(model, gs.TopK(density=0.05))
        dist.barrier()

    return workers._outcome(attempt)


@pytest.mark.parametrize(
    "case,error,message",
    [
        ("divide_factor", "ValueError", "cannot honour"),
        ("options_differ", "ValueError", "different configurations"),
        ("no_fsdp", "TypeError", "holds no FSDP module"),
        ("dense", "TypeError", "leave the model as fully_shard made it"),
        ("two_models", "ValueError", "already serves a model"),
        ("several_meshes", "ValueError", "holds 2 parameter groups"),
        ("unused_parameter", "RuntimeError", "some of them got no gradient in this backward"),
        ("unused_parameter_later", "RuntimeError", "module '2' hands over 2352 gradient elements where its"),
        (  # FSDP reduced it dense, without a residual or a word
            "unfrozen_module",
            "RuntimeError",
            "module '0' hands over 816 gradient elements where its parameters that required gradients at "
            "gradsparse.fsdp.sparsify held 0 (padded): a parameter was unfrozen since",
        ),
        (  # "some of them got no gradient", the wrong cause and fix
            "unfrozen_bias",
            "RuntimeError",
            "module '2' hands over 2352 gradient elements where its parameters that required gradients at "
            "gradsparse.fsdp.sparsify held 2304 (padded): a parameter was unfrozen since",
        ),
        ("state_class", "TypeError", "got the class gradsparse.TopK itself; create one with its options"),
        ("register_on_fsdp", "TypeError", "which calls no DDP communication hook; use gradsparse.fsdp.sparsify"),
        ("swapped", "TypeError", "the arguments are swapped; the model comes first, gradsparse.fsdp.sparsify(model"),
    ],
)
def test_bad_input_raises_on_every_rank(case, error, message):
    outcomes = run_distributed(bad_input, 2, case, timeout=120)
    for rank, (kind, text) in enumerate(outcomes):
        assert kind == error and message in text, f"rank {rank}: {kind}: {text}"


def unfrozen_since_the_save(rank: int, world_size: int, case: str) -> tuple[str, bool, int]:
    """Saved per rank with model[0] and model[2]'s bias frozen, loaded into the model with model[0]
    ("module") or the bias ("bias") trainable; where it is refused, loaded again with module 2's
    residual deleted as the refusal says (it then starts from zero); then a step. Returns the
    refusal ("" where none), whether the residuals came back as saved, and the step after it."""
    model = sharded_model(world_size, frozen=True)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    saved = state.state_dict()
    state.close()
    model = sharded_model(world_size, frozen=True)
    (model[0] if case == "module" else model[2].bias).requires_grad_(True)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    refused = workers._outcome(lambda: state.load_state_dict(saved))[1]
    if refused:
        del saved["residuals"]["2"], saved["checksums"]["2"]
        state.load_state_dict(saved)
    loaded = state.state_dict()["residuals"]
    kept = set(loaded) == set(saved["residuals"]) and all(
        torch.equal(loaded[n], t) for n, t in saved["residuals"].items()
    )
    workers.fit(model, workers.teacher_data(rank, 1))
    return refused, kept, state.step


@pytest.mark.parametrize("case", ["module", "bias"])
def test_staged_fine_tuning_resumes_from_per_rank_files(case):
    """Under FSDP a module's residual covers its trainable parameters together. A module that
    trains now and did not at the save (model[0]) loads and starts from zero. A module partly
    unfrozen since (model[2]'s bias) is refused: the per-rank load said "the state dict was saved
    from another model"; it now says why and how to start that module's residual from zero, which
    then loads and trains."""
    for rank, (refused, kept, step) in enumerate(run_distributed(unfrozen_since_the_save, 2, case, timeout=120)):
        if case == "module":
            assert refused == "", f"rank {rank}: {refused}"
        else:
            assert "the residual of module '2' holds 2304 elements but the module's parameters that require " in refused
            assert "del sd['residuals']['2'], sd['checksums']['2'] before loading" in refused, f"rank {rank}: {refused}"
        assert kept and step == 3, f"rank {rank}: the residuals kept: {kept}; step {step}"


def sparsify_retried_after_a_refused_state_dict(rank: int, world_size: int) -> tuple[str, str, int]:
    """A fresh state given a state dict of other names (refused at sparsify), then its own, and
    sparsified again."""
    model = sharded_model(world_size)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    saved = state.state_dict()
    state.close()
    fresh, model = gs.TopK(density=0.05), sharded_model(world_size)
    fresh.load_state_dict(dict(saved, residuals={f"layers.{n}": t for n, t in saved["residuals"].items()}))
    refused = workers._outcome(lambda: gs.fsdp.sparsify(model, fresh))
    fresh.load_state_dict(saved)
    retried = workers._outcome(lambda: gs.fsdp.sparsify(model, fresh))
    workers.fit(model, workers.teacher_data(rank, 1))
    return refused[1], retried[1], fresh.step


def test_sparsify_that_refused_a_state_dict_leaves_the_state_free_for_a_retry():
    """A sparsify refused by the state dict loaded before it left the state bound to the model:
    once given the right state dict, the retry was refused as "already serves a model"."""
    for rank, (refused, retried, step) in enumerate(
        run_distributed(sparsify_retried_after_a_refused_state_dict, 2, timeout=120)
    ):
        assert "residual(s) name no parameter of the model: layers." in refused, f"rank {rank}: {refused}"
        assert retried == "" and step == 3, f"rank {rank}: {retried} (step {step})"


def sparsified_again_after_unfreezing(rank: int, world_size: int) -> tuple[bool, int, int, str]:
    """One step with model[0] frozen; then model[0] unfrozen, a backward that raises for it, and
    the model sparsified with a new state, as that error advises; two steps, and the first state
    dropped."""
    model = sharded_model(world_size, frozen=True)
    first = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 1))
    model[0].requires_grad_(True)
    outcome = workers._outcome(lambda: workers.fit(model, workers.teacher_data(rank, 1)))
    second = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    workers.fit(model, workers.teacher_data(rank, 2))
    dropped = weakref.ref(first)
    del first
    gc.collect()
    return dropped() is None, second.step, len(second.state_dict()["residuals"]), outcome[1]


def test_sparsifying_a_model_again_lets_the_earlier_state_go():
    """Each gradsparse.fsdp.sparsify left a forward pre-hook on the model that held its state: a
    model sparsified again with a new state (after unfreezing a parameter, as the error for it
    advises) kept every earlier state alive, with its residuals (a full flat gradient per module)
    and its engine thread, for as long as the model lived. The new state still recovers FSDP from
    the backward that raised for the unfrozen module, and reduces every step after it."""
    for rank, (released, steps, residuals, error) in enumerate(
        run_distributed(sparsified_again_after_unfreezing, 2, timeout=120)
    ):
        assert "a parameter was unfrozen since" in error, f"rank {rank}: {error}"
        assert released, f"rank {rank}: the first state is still held by the model"
        assert steps == 2 and residuals == 3, (rank, steps, residuals)


# A backward that raised in the reduce-scatter --------------------------------------------------------


class SpareLinear(nn.Linear):
    """A Linear with a parameter of 5 elements that gets a (zero) gradient only while ``use_spare``."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.spare = nn.Parameter(torch.zeros(5))
        self.use_spare = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.spare.sum() * 0 if self.use_spare else out


def train_past_a_failed_backward(rank: int, world_size: int, layer: int, recovery: str) -> tuple[list, int, list]:
    """5 steps; the Linear at ``layer`` is a SpareLinear whose spare parameter gets no gradient at
    step 3, which gradsparse refuses (its module hands over fewer elements than its layout).
    ``recovery``: "catch" (the error caught, the loop goes on), "reset" (and FSDP's
    reset_iter_state() on the root, as torch documents), or "skip" (no step 3 at all)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 6))
    spare = SpareLinear(*model[layer].weight.shape[::-1])
    spare.load_state_dict(model[layer].state_dict(), strict=False)
    model[layer] = spare
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)
    state = gs.fsdp.sparsify(model, gs.TopK(density=0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    outcomes = []
    for step, (x, y) in enumerate(workers.teacher_data(rank, 5)):
        if step == 2 and recovery == "skip":
            continue
        spare.use_spare = step != 2
        opt.zero_grad()
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except Exception as error:  # the test asserts on it
            outcomes.append(f"{type(error).__name__}: {error}")
            if recovery == "reset":
                model.reset_iter_state()
            continue
        opt.step()
        outcomes.append("ok")
    # the optimizer's (sharded) parameters: what the steps trained
    return outcomes, state.step, [p.full_tensor().detach() for p in opt.param_groups[0]["params"]]


@pytest.mark.parametrize("layer", [4, 2], ids=["first-reduced", "after-one-reduced"])
def test_training_goes_on_reducing_after_a_backward_that_raised_in_gradsparse(layer):
    """An error caught at step 3 (a trained parameter without a gradient, refused) leaves FSDP in the
    middle of that backward, where it reduces nothing more; gradsparse resets it at the next
    forward: the steps after it reduce and train exactly as after FSDP's own reset_iter_state(),
    the failed step is not counted, and when the failure came before any module was reduced,
    the run equals one without that batch, bit for bit."""
    runs = {
        r: run_distributed(train_past_a_failed_backward, 2, layer, r, timeout=180) for r in ("catch", "reset", "skip")
    }
    for rank in range(2):
        caught, reset, skipped = (runs[r][rank] for r in ("catch", "reset", "skip"))
        for outcomes, steps, _ in (caught, reset):
            assert "got no gradient in this backward" in outcomes[2], outcomes[2]
            assert outcomes[:2] + outcomes[3:] == ["ok"] * 4, outcomes
            assert steps == 4, steps
        for a, b in zip(caught[2], reset[2], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the caught run differs from the reset one by {(a - b).abs().max()}"
        if layer == 4:  # the first module to reduce: nothing of step 3 went anywhere
            for a, b in zip(caught[2], skipped[2], strict=True):
                assert torch.equal(a, b), f"rank {rank}: differs from the run without step 3 by {(a - b).abs().max()}"


def failed_backward_under_an_outer_root(rank: int, world_size: int) -> tuple[list, int]:
    """gradsparse.fsdp.sparsify given a submodule, the root FSDP module around it: step 2 fails (a
    parameter without a gradient), the user resets the root only after step 4."""
    torch.manual_seed(3)
    inner = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), SpareLinear(48, 6))
    outer = nn.Sequential(inner)
    for module in inner:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(outer)
    state = gs.fsdp.sparsify(inner, gs.TopK(density=0.05))
    opt = torch.optim.SGD(outer.parameters(), lr=0.1)
    outcomes = []
    for step, (x, y) in enumerate(workers.teacher_data(rank, 6)):
        inner[2].use_spare = step != 1
        opt.zero_grad()
        try:
            nn.functional.cross_entropy(outer(x), y).backward()
        except Exception as error:  # the test asserts on it
            outcomes.append(str(error))
            if step == 3:
                outer.reset_iter_state()
            continue
        opt.step()
        outcomes.append("ok")
    return outcomes, state.step


def test_a_failed_backward_under_a_root_outside_the_sparsified_model_raises_until_that_root_is_reset():
    """gradsparse cannot reset a root FSDP module outside the model it was given: every step after
    the failure raises on every rank, naming the failed module and the fix, until the caller
    resets the root; then training goes on reducing."""
    for outcomes, steps in run_distributed(failed_backward_under_an_outer_root, 2, timeout=120):
        assert outcomes[0] == "ok" and outcomes[4:] == ["ok", "ok"], outcomes
        for text in outcomes[2:4]:
            assert "an earlier backward raised in the reduce-scatter of module '2'" in text, text
            assert "reset_iter_state()" in text and "last checkpoint" in text, text
        assert steps == 3, steps
