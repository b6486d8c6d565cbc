"""Checkpoints of gradsparse states on 2 Gloo ranks: exact resume with no extra iteration, each rank
restoring its own residuals."""

import json

import pytest
import torch

from gradsparse.checkpoint import checksum
from gradsparse.testing import run_distributed
from tests.distributed import workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("method", sorted(workers.RESUME_METHODS))
def test_resume_is_exact_without_a_settle_iteration(tmp_path, method):
    """Stopped after 4 steps and resumed in a new DDP (which starts in its first-step bucket layout,
    not the saved run's), the parameters after 8 steps equal an uninterrupted run's, bit for bit."""
    results = run_distributed(workers.resume_exactly, 2, method, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        # the case at hand: DDP hands the resumed run's first step over in another layout
        assert r["first_step_buckets"] != r["saved_layout"], f"rank {rank}: the layouts coincide"
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {method} resumed differs from straight by {(a - b).abs().max()}"
    # residuals are per rank: the two ranks saved different ones
    assert results[0]["residual_norms"] != results[1]["residual_norms"]


def test_resume_is_exact_with_a_static_graph(tmp_path):
    """With static_graph=True a new DDP reduces two steps in its first layout, not one: the second
    step after the load was reduced there, where the uninterrupted run had rebuilt its buckets."""
    results = run_distributed(workers.resume_exactly, 2, "topk", str(tmp_path / "ckpt"), True, timeout=300)
    for rank, r in enumerate(results):
        assert r["first_step_buckets"] != r["saved_layout"], f"rank {rank}: the layouts coincide"
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: resumed differs from straight by {(a - b).abs().max()}"


def test_a_channels_last_checkpoint_resumes_exactly_and_into_a_contiguous_model(tmp_path):
    """A residual holds its parameter's elements in the parameter's memory order (DDP's bucket views
    follow its strides). Loaded for a model in another memory format, each value landed on another
    element without a word (the resumed run differed from the uninterrupted one by 4e-3 after 3
    steps); the state dict now records the order (``strides``) and the load moves the residuals
    into the model's."""
    for rank, r in enumerate(run_distributed(workers.channels_last_resume, 2, str(tmp_path / "ckpt"), timeout=120)):
        assert set(r["strides"]) == {"c1.weight", "c2.weight"}
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: resumed differs from straight by {(a - b).abs().max()}"
        for case in ("contiguous", "contiguous, registered after the load"):
            for a, b in zip(r["straight"], r[case], strict=True):
                # Convolutions in another memory format round differently (about 1e-8 here)
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {case}")


def _all_ranks(*residuals):
    """An AllRanks state dict of len(residuals) ranks, each holding {name: tensor}, as saved."""
    from gradsparse.checkpoint import with_checksums

    size = len(residuals)
    ranks = [
        {"version": 2, "class": "TopK", "config": {"density": 0.1}, "step": 4, "rank": rank, "world_size": size,
         **with_checksums(held, {}), "methods": [None], "layout": [sorted(held)], "stats": {}}
        for rank, held in enumerate(residuals)
    ]  # fmt: skip
    return {"version": 2, "all_ranks": True, "class": "TopK", "config": {"density": 0.1}, "world_size": size,
            "ranks": ranks}  # fmt: skip


def test_reshard_averages_residuals_saved_in_other_loss_scales_in_the_smallest():
    """Residuals are in the loss scale their state dict records (State.set_scaler): rank 1's,
    saved in scale 8, count as an eighth of their values in rank 0's scale 2 (the mean of 1 and
    3 at scale 1, so 2 and 6 at scale 2; rank 1's 24 at scale 8 is 6 at scale 2). The mean is in
    the smallest scale: in rank 0's, a float16 rank 1 at a quarter of rank 0's scale would have
    moved 60000 up to 240000, past float16's 65504, and the resharded state dict held Inf."""
    import gradsparse as gs

    saved = _all_ranks({"w": torch.full((6,), 2.0)}, {"w": torch.full((6,), 24.0)})
    saved["ranks"][0]["loss_scale"], saved["ranks"][1]["loss_scale"] = 2.0, 8.0
    one = gs.reshard(saved, 1)["ranks"][0]
    assert one["loss_scale"] == 2.0 and torch.equal(one["residuals"]["w"], torch.full((6,), 4.0))

    half = torch.float16
    saved = _all_ranks({"w": torch.full((6,), 24.0, dtype=half)}, {"w": torch.full((6,), 60000.0, dtype=half)})
    saved["ranks"][0]["loss_scale"], saved["ranks"][1]["loss_scale"] = 8.0, 2.0
    two = gs.reshard(saved, 2)["ranks"]
    for rank in two:  # (24 / 4 + 60000) / 2 = 30003 at scale 2, 30000 in float16
        assert rank["loss_scale"] == 2.0 and torch.equal(rank["residuals"]["w"], torch.full((6,), 30000.0, dtype=half))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        # a byte changed after the save: resharding gave the mean new, matching checksums
        (lambda sd: sd["ranks"][1]["residuals"]["w"].view(torch.uint8)[0].add_(1), "residual of w does not match its"),
        # a rank's residual cut out of the file (its checksum left): the mean took it for zeros
        (lambda sd: sd["ranks"][1]["residuals"].pop("w"), "lacks the residual of w"),
        # a rank cut out of the file: the mean divided by the ranks left
        (lambda sd: sd["ranks"].pop(), "holds 1 ranks' state dicts but was saved at world size 2"),
        (lambda sd: sd["ranks"][0].pop("residuals"), "rank 0's part of the state dict lacks residuals"),
        # these two ended in Python's "argument of type 'NoneType' is not iterable" and torch.stack's error
        (lambda sd: sd["ranks"].__setitem__(1, None), r"rank 1's part of the state dict is None \(NoneType\), no dict"),
        (
            lambda sd: sd["ranks"][1].update(residuals={"w": torch.ones(5)}, checksums={"w": checksum(torch.ones(5))}),
            r"the ranks' residuals of w differ in size \(5, 6 elements\): the state dict's ranks were saved from "
            "different models",
        ),
        # these were averaged as they were, as a load at the saved world size would not take them:
        # files of two checkpoints (the new ranks went on from rank 0's step, with residuals of both),
        (
            lambda sd: sd["ranks"][1].update(step=3),
            r"the ranks' state dicts are of different steps \(rank 0: 4, rank 1: 3\)",
        ),
        # rank 0's twice (rank 1's mass lost), and another run's rank
        (lambda sd: sd["ranks"][1].update(rank=0), "holds rank 0's residuals in the place of rank 1's"),
        (lambda sd: sd["ranks"][1].update(config={"density": 0.2}), "rank 1's part .* was saved with density=0.2"),
        (lambda sd: sd["ranks"][1].update(fsdp=1), "the state dict's fsdp should be True or False"),
    ],
)
def test_reshard_refuses_a_damaged_rank_instead_of_averaging_it(damage, message):
    import gradsparse as gs

    saved = _all_ranks({"w": torch.ones(6)}, {"w": torch.full((6,), 3.0)})
    assert torch.equal(gs.reshard(saved, 1)["ranks"][0]["residuals"]["w"], torch.full((6,), 2.0))
    damage(saved)
    with pytest.raises(ValueError, match=rf"gradsparse.reshard: .*{message}.*"):
        gs.reshard(saved, 1)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("byte", r"\(rank 1's part\): .*residual of .* does not match its"),
        ("method", r"\(rank 1's part\): the state dict's methods\[0\] is refused by the method"),
        ("size", r"\(rank 1's part\): the residual of .* holds 3 elements but the parameter has"),
    ],
)
def test_an_all_ranks_state_dict_with_a_damaged_part_is_refused_on_every_rank(damage, message):
    """Every rank holds the whole AllRanks state dict, so every rank checks every part: a part
    damaged after the save is refused on every rank, naming that part, and leaves each rank's state
    as it was. Checked on its own rank only, it was refused there alone, and the others went on to
    wait for that rank in their first step until the state's timeout; so were the names and sizes
    of a part loaded before the state was registered, checked at registration."""
    import re

    for rank, (error, moved) in enumerate(
        run_distributed(workers.all_ranks_with_a_damaged_part, 2, damage, timeout=120)
    ):
        assert error is not None and re.search(message, error), f"rank {rank}: {error}"
        assert moved in (0.0, None), f"rank {rank}: the refused load moved the residuals by {moved}"


def test_all_ranks_called_on_rank_0_alone_fails_within_the_timeout_naming_the_fix(tmp_path):
    """AllRanks(state).state_dict() is collective; called on rank 0 alone (the usual `if rank ==
    0: torch.save(...)`), rank 0 waited for the other ranks without bound, then failed with Gloo's
    'Connection closed by peer' once one exited. It now fails within the state's timeout, saying
    that every rank must call it and how to save."""
    error = run_distributed(workers.all_ranks_on_rank_0_alone, 2, str(tmp_path / "done"), timeout=180)[0]
    assert error is not None and error != "returned"
    assert "gradsparse.AllRanks.state_dict is collective" in error, error
    assert "Call it on every rank, and save on rank 0" in error, error
    assert "Lightning's trainer.save_checkpoint, Accelerate's save_state) is called on every rank too" in error
    assert "Connection closed by peer" not in error, error


def test_all_ranks_on_each_node_gives_every_nodes_first_process_every_rank():
    """AllRanks(state, each_node=True), for checkpointers that write on each node: the first
    process of each node (LOCAL_RANK 0; here ranks 0 and 2 of 3) holds every rank's part, the same
    as rank 0's, at every save; the others hold none. Without LOCAL_RANK, or with rank 0 not its
    node's first, it is refused on every rank."""
    results = run_distributed(workers.all_ranks_on_each_node, 3, ["0", "1", "0"], timeout=120)
    assert results[1] == [None, None], results[1]
    for saves in (results[0], results[2]):
        for ranks in saves:
            assert len(ranks) == 3 and [part["rank"] for part in ranks] == [0, 1, 2], ranks
            for part, first in zip(ranks, results[0][0], strict=True):
                for name, residual in part["residuals"].items():
                    assert torch.equal(residual, first["residuals"][name]), name
    for local_ranks, shown in ((["1", "0", "0"], "['1', '0', '0']"), (["0", None, "0"], "['0', None, '0']")):
        for rank, error in enumerate(run_distributed(workers.all_ranks_on_each_node, 3, local_ranks, timeout=120)):
            assert isinstance(error, str) and f"the ranks have LOCAL_RANK {shown}" in error, f"rank {rank}: {error}"
            assert "use each_node=False and a shared file system" in error, error


# torch.distributed.checkpoint under DDP -----------------------------------------------------------


@pytest.mark.parametrize("method", ["topk", "topk_momentum", "micro", "exdyna"])
def test_dcp_checkpoint_of_a_ddp_state_resumes_exactly(tmp_path, method):
    """dcp.save({"model", "optim", "gradsparse": gs.ShardedState(state)}) of a state registered on
    a DistributedDataParallel after 4 steps, dcp.load into a new model, DDP and state, 4 more steps:
    the parameters of the uninterrupted run, bit for bit, and each rank's own residuals,
    velocities, method states, step and statistics back. ShardedState refused a DDP state ("sparsifies
    no FSDP model"), and the plain state kept one rank's residuals."""
    results = run_distributed(workers.resume_exactly_through_dcp, 2, method, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {method} resumed differs from straight by {(a - b).abs().max()}"
        held, restored = r["held"], r["restored"]
        assert held["step"] == restored["step"] == 4
        assert held["methods"] == restored["methods"], f"rank {rank}: method states differ"
        same_stats = json.dumps(held["stats"], sort_keys=True) == json.dumps(restored["stats"], sort_keys=True)
        assert same_stats, f"rank {rank}: {held['stats']} saved, {restored['stats']} loaded"  # NaN thresholds
        assert held["stats"] and held["residuals"], f"rank {rank}: nothing to compare"
        for kind in ("residuals", "velocities"):
            assert held[kind].keys() == restored[kind].keys(), f"rank {rank}: {kind}"
            for name, t in held[kind].items():
                assert torch.equal(t, restored[kind][name]), f"rank {rank}: the {kind[:-1]} of {name} differs"
        assert bool(held["velocities"]) == (method == "topk_momentum")
    # the ranks' residuals differ: each got its own back, not one rank's
    a, b = (r["restored"]["residuals"] for r in results)
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_dcp_checkpoint_of_a_ddp_state_refuses_another_world_size(tmp_path):
    """Saved at 2 ranks, loaded at 1: refused by DCP's planner on the residuals' size (2 blocks
    saved, 1 here), before anything is loaded; the state stays at step 0."""
    path = str(tmp_path / "ckpt")
    run_distributed(workers.dcp_save_at, 2, "micro", path, timeout=300)
    [(error, step)] = run_distributed(workers.dcp_load_at, 1, "micro", path, timeout=300)
    assert error is not None and "Size mismatch" in error and "gradsparse.residuals." in error, error
    assert step == 0


@pytest.mark.parametrize("wrap", ["state", "all_ranks"])
def test_plain_state_handed_to_dcp_is_refused_naming_sharded_state(tmp_path, wrap):
    """The plain state handed to dcp.save on 2 ranks: DCP saved one rank's residuals for both (the
    other's gradient mass lost), and dcp.load then failed in DCP's words ("Missing key in
    checkpoint state_dict: gs.methods"). gs.AllRanks(state) there: dcp.save wrote rank 0's parts
    of every rank and none of the others, and dcp.load failed in DCP's words or with AllRanks'
    advice for rank 0's file. Both now refuse, naming gradsparse.ShardedState; the state dict
    saved with torch.save still loads."""
    results = run_distributed(workers.plain_state_through_dcp, 2, str(tmp_path / "c"), wrap)
    for rank, (saved, loaded) in enumerate(results):
        for call, error in (("dcp.save", saved), ("dcp.load", loaded)):
            assert error is not None and "gradsparse.ShardedState(state)" in error, f"rank {rank}, {call}: {error}"
            assert "Missing key" not in error, f"rank {rank}, {call}: {error}"
            if wrap == "all_ranks":
                assert "was handed gradsparse.AllRanks(state), on 2 ranks" in error, f"rank {rank}, {call}: {error}"


# DDP on data-parallel sub-groups --------------------------------------------------------------------


@pytest.mark.parametrize(("method", "same_model"), [("topk", True), ("micro", True), ("spardl", True), ("topk", False)])
def test_sub_groups_each_save_and_restore_their_own(tmp_path, method, same_model):
    """Two DDP groups of 2 in a world of 4, the second a step ahead (and, without same_model, on
    another model: a pipeline stage), saved every way and loaded into new states: each rank gets
    its own residuals, method states and step back. A rank's file loads on its pair alone
    (collective there); gs.AllRanks gathers each pair's to the pair's first rank, and gs.reshard of
    it gives both the mean. gs.ShardedState through a dcp over every rank gave every rank one
    pair's step (saved once), and through a dcp over each pair (process_group=) DCP refused the
    plan: its blocks were laid out over the default group."""
    results = run_distributed(workers.sub_group_checkpoints, 4, method, str(tmp_path / "ckpt"), same_model, timeout=300)
    ways = {"all_ranks", "resharded", "dcp_of_the_pair"} | ({"dcp"} if same_model else set())
    for rank, r in enumerate(results):
        held, restored = r["held"], r["restored"]
        assert r["received"] == (rank % 2 == 0), f"rank {rank}"
        assert held["step"] == 4 + rank // 2 and held["residuals"], f"rank {rank}"
        assert restored.keys() == ways | ({"own_file"} if rank < 2 else set()), f"rank {rank}"
        mate = results[rank ^ 1]["held"]["residuals"]  # the other rank of its pair
        for way, got in restored.items():
            assert got["step"] == held["step"], f"rank {rank}, {way}: step {got['step']}, saved at {held['step']}"
            assert got["residuals"].keys() == held["residuals"].keys(), f"rank {rank}, {way}"
            for name, t in held["residuals"].items():
                expected = ((t.double() + mate[name].double()) / 2).float() if way == "resharded" else t
                assert torch.equal(got["residuals"][name], expected), f"rank {rank}, {way}: {name} differs"
            if way != "resharded":  # which restarts the method states
                assert got["methods"] == held["methods"], f"rank {rank}, {way}: method states differ"
    # every rank saved residuals of its own
    first = results[0]["held"]["residuals"]
    for r in results[1:] if same_model else results[1:2]:
        assert any(not torch.equal(t, r["held"]["residuals"][name]) for name, t in first.items())


# A part refused on one rank is refused on every rank -----------------------------------------------


_REASONS = {
    "byte": "does not match its checksum",
    "nan": "holds NaN or Inf",
    "size": "holds 3 elements but the parameter has",
    "method": "the state dict was saved by TopK",
}


@pytest.mark.parametrize(
    ("damage", "when"),
    [
        *((damage, "after") for damage in _REASONS),
        ("size", "before_register"),
        *((damage, "before_init") for damage in ("byte", "nan", "size")),
    ],
)
def test_a_damaged_per_rank_file_is_refused_on_every_rank(tmp_path, damage, when):
    """Each rank loads its own file (the README's way), rank 1's damaged after the save. Refused on
    rank 1 alone, the other ranks went on to train and waited for rank 1 in their first step until
    the state's timeout (60 s here; 30 minutes by default, or for ever under some backends). Every
    rank now refuses it at once (at the load, or at the set-up that register runs), rank 1 with its
    own error and the others naming rank 1 and why, and no rank's state took it. A load before
    set-up that rank 1 refuses at the load itself is the exception (another method's state dict;
    after init_process_group, all but "size", whose names are checked at register): rank 1 raises
    there, and the others fail at set-up after the state's timeout, naming load_state_dict
    (test_ddp's test_d_a_state_rejected_or_missing_on_one_rank_fails_the_others_within_the_timeout)."""
    reason = _REASONS[damage]
    results = run_distributed(workers.a_damaged_per_rank_file, 2, str(tmp_path / "gs"), damage, when, timeout=120)
    (error0, elapsed0, moved0), (error1, _, moved1) = results
    assert error1 is not None and reason in error1, error1
    assert error0 is not None and "rank 1 was refused there" in error0 and reason in error0, error0
    assert "So it is refused on every rank" in error0, error0
    assert elapsed0 < 20, f"rank 0 failed after {elapsed0:.1f} s, near the state's timeout (60 s): {error0}"
    assert moved0 == moved1 == 0.0, "a refused load was loaded"


@pytest.mark.parametrize("when", ["after", "before_register", "before_init"])
def test_per_rank_files_of_different_steps_are_refused_on_every_rank(tmp_path, when):
    """Rank 1 loads its file of the step before the others' (a save stopped before it reached rank 1,
    or files of two checkpoints): each file is intact, so every rank loaded its own and trained on
    with residuals and method states of different steps, without a word. Every rank now refuses
    them, naming each rank's step, and no rank's state took them: a load between
    init_process_group and register, put in place at once, is undone there (it stayed loaded, and
    a second register of the same state trained on it)."""
    results = run_distributed(workers.a_damaged_per_rank_file, 2, str(tmp_path / "gs"), "step", when, timeout=120)
    for rank, (error, elapsed, moved) in enumerate(results):
        assert error is not None and "the ranks' state dicts are of different steps (rank 0: 2, rank 1: 1)" in error, (
            rank,
            error,
        )
        assert "Load one checkpoint on every rank (each rank its own file of it, or the same AllRanks" in error, error
        assert elapsed < 20, f"rank {rank} failed after {elapsed:.1f} s, near the state's timeout (60 s): {error}"
        assert moved == 0.0, f"rank {rank}: a refused load was loaded"


@pytest.mark.parametrize("then", ["trains", "reloads"])
def test_auto_starts_alike_on_every_rank_after_a_load_refused_at_set_up(tmp_path, then):
    """exchange="auto", rank 0 alone loading its file before register: set-up started the trial
    and measured the link before its agreement refused the load, and the refusal's undo put rank
    0's trial and link back to None. Rank 1, which had loaded no link, measured it alone (a
    collective) and waited for rank 0 until the state's timeout; had it not, the ranks went on to
    run different exchanges in one step (Gloo's abort), and a correct load afterwards never took
    its saved decision. The refusal now comes at once on both ranks, both then time the same
    exchanges at every step, and a reload runs the saved decision from its first step."""
    results = run_distributed(workers.auto_after_a_load_on_one_rank, 2, str(tmp_path / "gs"), then, timeout=180)
    for rank, r in enumerate(results):
        assert "the ranks' state dicts are of different steps (rank 0: 9, rank 1: 0)" in r["error"], (rank, r["error"])
        assert r["elapsed"] < 20, f"rank {rank} was refused after {r['elapsed']:.1f} s, near the state's timeout (60 s)"
    assert results[0]["used"] == results[1]["used"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"], strict=True))
    names = {"gather": "fixed-size gather", "reduce_scatter": "reduce-scatter + all-gather"}
    if then == "reloads":  # the saved decision at every step
        decided = {bucket: names[exchange] for bucket, exchange in results[0]["saved"].items()}
        assert results[0]["used"] == [decided] * 8
    else:  # a new trial: the two exchanges in turns from the second step
        assert {names["reduce_scatter"]} in [set(step.values()) for step in results[0]["used"][1:7]]


@pytest.mark.parametrize(("damage", "reason"), [("nan", "holds NaN or Inf"), ("blob", "JSONDecodeError")])
def test_a_damaged_sharded_part_is_refused_on_every_rank(tmp_path, damage, reason):
    """dcp.load of gs.ShardedState, rank 1's block damaged: DCP calls each rank's load_state_dict
    after its own collectives, so rank 1's refusal stayed on rank 1, and rank 0 went on to wait in
    its first step until the state's timeout. Every rank now refuses it at once, naming rank 1."""
    results = run_distributed(workers.a_damaged_sharded_part, 2, str(tmp_path / "ckpt"), damage, timeout=300)
    (error0, elapsed0, step0), (error1, _, step1) = results
    assert error1 is not None and reason in error1, error1
    assert error0 is not None and "rank 1 was refused there" in error0 and reason in error0, error0
    assert elapsed0 < 20, f"rank 0 failed after {elapsed0:.1f} s, near the state's timeout (60 s): {error0}"
    assert step0 == step1 == 0, "a refused load was loaded"


@pytest.mark.parametrize("other", ["sleeps", "trains"])
def test_load_after_set_up_on_one_rank_alone_fails_within_the_timeout_naming_the_fix(other, tmp_path):
    """After set-up load_state_dict is collective (so that a state dict refused on one rank is
    refused on every rank): called on rank 0 alone, it fails after the state's timeout (2 s),
    saying that every rank loads its own and how, rather than waiting without bound. While rank 1
    trained, the agreement (then an all-gather on the exchanges' own group) met rank 1's exchange
    there, and Gloo aborted rank 0's process. Once rank 1 woke, a load on both ranks (the fix the
    error names) waited on an agreement rank 0 had already counted, and timed out in its turn."""
    (error, elapsed, again), peer = run_distributed(
        workers.load_on_rank_0_alone, 2, other, str(tmp_path / "done"), timeout=180
    )
    assert error is not None and "after set-up, loading is collective: every rank of the process group [0, 1]" in error
    assert "Call state.load_state_dict(torch.load(" in error, error
    assert elapsed < 10, f"rank 0 waited {elapsed:.1f} s"
    if other == "trains":  # its exchange waited for rank 0 as long
        assert peer[0] is not None and "gradsparse" in peer[0] and peer[1] < 10, peer
    else:  # rank 1 never called it; the load on both ranks then works
        assert again is None and peer[0] is None and peer[2] is None, (again, peer)


@pytest.mark.parametrize(
    "options",
    [{"density": 0.05}, {"density": 0.05, "momentum": 0.9}, {"density": 0.05, "exchange": "auto"}],
    ids=["topk", "momentum", "auto"],
)
def test_reshard_conserves_the_pending_gradient_mass_of_a_trained_run(tmp_path, options):
    """Top-k trained 3 steps on 2 ranks, saved with gs.AllRanks, then one step of zero gradients:
    each rank sends from what it held, so the gradient applied plus the ranks' mean residual after
    it is the pending mass (with momentum, plus the momentum times the ranks' mean velocity).
    Resharded to 1 and to 4 ranks, the step after the load gives the same sum as the 2 ranks
    going on: the mean of the residuals, and of the velocities, conserves both."""
    path = str(tmp_path / "all_ranks.pt")
    two = run_distributed(workers.resharded_mass, 2, path, options, True, timeout=300)

    def mass(results: list[dict]) -> torch.Tensor:
        return results[0]["applied"] + sum(r["residual"] for r in results) / len(results)

    expected = mass(two)
    assert expected.abs().max() > 1e-3  # something was pending
    for world_size in (1, 4):
        results = run_distributed(workers.resharded_mass, world_size, path, options, False, timeout=300)
        for r in results:  # every rank applied the same average
            assert torch.equal(r["applied"], results[0]["applied"])
        torch.testing.assert_close(mass(results), expected, rtol=0, atol=1e-6, msg=f"at {world_size} ranks")
        if world_size > 1:  # priced on the link this run measured, not the one of the 2 ranks'
            for measured, after in (r["link"] for r in results):
                assert after == measured, (measured, after, two[0]["link"])
