"""Multi-process tests on Gloo: DDP with the gradsparse hook on 2 and 4 local processes.

(a) Top-k at density 1.0 trains exactly like DDP without a hook; (b) Top-k with error feedback
equals a plain PyTorch re-statement computed from every rank's gradients; (c) gradient mass is
conserved at every step; (d) bad configurations raise on every rank and nothing hangs.
"""

import math

import pytest
import torch

from gradsparse.testing import run_distributed
from tests.distributed import workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD_SIZES = [2, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_topk_density_one_equals_ddp_without_hook(world_size):
    results = run_distributed(workers.topk_full_density_vs_no_hook, world_size)
    for hooked, plain in results:
        for h, p in zip(hooked, plain, strict=True):
            # Both average the same gradients; only the summation order of the all-reduce differs
            # (exact for 2 ranks), so the difference after 20 steps is float32 rounding.
            torch.testing.assert_close(h, p, rtol=1e-5, atol=1e-6)
    for hooked, _ in results[1:]:  # every replica holds the same parameters
        for a, b in zip(results[0][0], hooked, strict=True):
            assert torch.equal(a, b)


def _reference_topk(logs: list[list[dict]], density: float, momentum: float = 0.0):
    """Re-computes every bucket of every step from all ranks' recorded gradients, and checks
    the library's outputs, residuals (and velocities) and the conservation of gradient mass."""
    world_size = len(logs)
    residual = [dict() for _ in range(world_size)]  # per rank: parameter name -> residual
    velocity = [dict() for _ in range(world_size)]  # per rank: parameter name -> velocity
    steps = len(logs[0])
    assert all(len(log) == steps for log in logs)
    for call in range(steps):
        records = [log[call] for log in logs]
        names, numels = records[0]["names"], records[0]["numels"]
        n = sum(numels)
        expected = torch.zeros(n)
        mass_before = torch.zeros(n, dtype=torch.float64)
        new_residuals = []
        for r, rec in enumerate(records):
            assert rec["names"] == names and rec["step"] == records[0]["step"]
            old = torch.cat([residual[r].get(name, torch.zeros(k)) for name, k in zip(names, numels, strict=True)])
            grad = rec["grad"]
            if momentum:  # the velocity restarts where the previous step emptied the residual
                u = torch.cat([velocity[r].get(name, torch.zeros(k)) for name, k in zip(names, numels, strict=True)])
                if rec["step"] > 0:
                    u = torch.where(old == 0, 0.0, u)
                grad = momentum * u + grad
                assert torch.equal(torch.cat([rec["velocity"][name] for name in names]), grad), f"rank {r}: velocity"
                velocity[r].update(zip(names, grad.split(numels), strict=True))
            a = old + grad
            mass_before += old.double() + grad.double()
            k = max(1, math.floor(density * n))
            order = torch.sort(a.abs(), descending=True, stable=True).indices[:k]
            chosen = torch.sort(order).values
            expected[chosen] = expected[chosen] + a[chosen] / world_size  # ranks added in rank order
            new = a.clone()
            new[chosen] = 0
            new_residuals.append(new)
            residual[r].update(zip(names, new.split(numels), strict=True))
        for r, rec in enumerate(records):
            assert torch.equal(rec["out"], expected), f"rank {r}, call {call}: output differs from the re-statement"
            got = torch.cat([rec["residual"][name] for name in names])
            assert torch.equal(got, new_residuals[r]), f"rank {r}, call {call}: residual differs"
        # (c) sum over ranks of (P * update + new residual) == sum of (grad + old residual)
        mass_after = world_size * records[0]["out"].double() + sum(x.double() for x in new_residuals)
        torch.testing.assert_close(mass_after, mass_before, rtol=1e-6, atol=1e-6)
    return steps


@pytest.mark.parametrize("static_graph", [False, True])
def test_a_gradient_accumulation_under_no_sync_equals_ddp_without_hook(static_graph):
    """The hook sees the gradient accumulated under no_sync() once per optimizer step: at density
    1.0 the same as DDP without a hook, and the state counts the synchronised steps only."""
    for hooked, plain, steps in run_distributed(workers.accumulation_full_density_vs_no_hook, 2, static_graph):
        assert steps == 4
        for h, p in zip(hooked, plain, strict=True):
            assert torch.equal(h, p)


@pytest.mark.parametrize("density", [1.0, 0.1])
def test_a_find_unused_parameters_with_a_head_unused_every_other_step(density):
    """DDP hands the unused head's bucket over with zero gradients: at density 1.0 the result is
    DDP's without a hook; sparse, the replicas stay equal and every parameter moved."""
    results = run_distributed(workers.unused_parameters_vs_no_hook, 2, density)
    for hooked, plain, initial in results:
        for h, p, first, other in zip(hooked, plain, initial, results[0][0], strict=True):
            assert torch.equal(h, other)
            assert torch.equal(h, p) if density == 1.0 else not torch.equal(h, first)


def test_a_taken_back_step_leaves_the_residual_of_a_parameter_unused_on_this_rank_alone():
    """nonfinite="propagate": when a step overflows in one bucket, the others take back what they
    sent. With find_unused_parameters=True a parameter unused on this rank sits the step out (its
    residual set aside and put back after it), yet the union exchange writes the positions other
    ranks chose in it: taking those back wrote the step's zeros over the residual put back."""
    for rank, (before, after, unused) in enumerate(
        run_distributed(workers.propagated_overflow_with_a_head_unused_here, 2)
    ):
        for name in unused:
            assert before[name].abs().sum() > 0, f"rank {rank}: {name} holds no residual to lose"
            assert torch.equal(after[name], before[name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("nonfinite", ["propagate", "raise", "skip"])
def test_a_float16_sum_that_rounds_past_the_range_aborts_the_step(nonfinite):
    """Every rank's float16 gradient is 65504 in half of the elements. Random-k's shared all-reduce
    divides by P first, but Gloo rounds each partial sum of the quotients to float16, and at 10
    ranks they pass 65504: the bucket handed back Inf from finite inputs with the residuals
    emptied. Under "propagate" the state took the step back (a float16 sparse bucket's output
    counts, as a skipped bucket does); under "raise" and "skip" the Inf reached the gradient and
    the step's whole gradient was lost. Every rank reads the same sums, so every rank now aborts
    the step as for a NaN: "raise" names the overflow and the fix, "skip" hands back zeros,
    "propagate" NaN, and the residuals keep residual + gradient. Top-k's gather adds the ranks'
    values / P in float32 sums, rounded once, and hands back 65504 (added one by one in float16,
    they made Inf from 10 ranks on)."""
    for rank, r in enumerate(
        run_distributed(workers.float16_sum_past_the_range, 10, "randomk", nonfinite, timeout=300)
    ):
        if nonfinite == "raise":
            assert "the float16 sum of every rank's residual + gradient / P (all finite) overflowed" in r["error"], r
            assert "Use float32 buckets or a lower loss scale" in r["error"], r["error"]
        else:
            handed_back = [math.nan if nonfinite == "propagate" else 0.0] * 8
            assert r["grad"] == pytest.approx(handed_back, nan_ok=True), f"rank {rank}: {r['grad']}"
        assert r["residual"] == [65504.0] * 4 + [1.0] * 4, f"rank {rank}: {r['residual']}"
        assert r["steps"] == ((0, 0) if nonfinite == "raise" else (1, 1)), f"rank {rank}: {r['steps']}"
    for rank, r in enumerate(run_distributed(workers.float16_sum_past_the_range, 10, "topk", nonfinite, timeout=300)):
        assert r["grad"] == [65504.0] * 4 + [1.0] * 4, f"rank {rank}: {r['grad']}"
        assert r["residual"] == [0.0] * 8, f"rank {rank}: {r['residual']}"
        assert r["steps"] == (1, 0), f"rank {rank}: {r['steps']}"


@pytest.mark.parametrize("bound", [True, False])
def test_an_overflow_in_the_first_static_graph_step_is_taken_back_by_every_bucket(bound):
    """nonfinite="propagate": DDP's first static-graph step marks no bucket as the last, and a
    state registered with model.register_comm_hook alone ends that step when the backward ends;
    its buckets never took back what they sent when another bucket overflowed (the float32
    bucket's step stayed counted as applied)."""
    for rank, r in enumerate(run_distributed(workers.first_static_graph_step_overflowed, 2, bound, timeout=120)):
        assert r["step"] == 1, f"rank {rank}: {r}"
        assert {i: (b["steps"], b["skipped_steps"]) for i, b in r["buckets"].items()} == {0: (1, 1), 1: (1, 1)}, r


def test_an_overflow_after_a_backward_that_stopped_takes_back_only_its_own_step():
    """nonfinite="propagate" keeps a record of the step's buckets until its last one. A backward
    that stopped in autograd before its last bucket left that record behind, and the next step
    that overflowed took its buckets back as well (each counted as skipped a second time, and
    its taken pairs written back over the residual where the layout was the same)."""
    for rank, r in enumerate(run_distributed(workers.overflow_after_a_backward_that_stopped, 2, timeout=120)):
        assert r["step"] == 2, f"rank {rank}: {r}"
        assert r["buckets"] and all(b["skipped_steps"] == 1 for b in r["buckets"].values()), f"rank {rank}: {r}"


def test_a_state_follows_its_model_into_a_new_ddp_after_parameters_are_frozen_or_unfrozen():
    """Unfreezing a layer (or freezing one) needs a new DDP; registering the state there was
    refused as "registered on another model". At density 1.0 the three phases train as DDP without
    a hook; sparse, the residuals are those of the parameters trained in the last phase."""
    full = run_distributed(workers.frozen_then_unfrozen, 2, 1.0)
    plain = run_distributed(workers.frozen_then_unfrozen, 2, None)
    sparse = run_distributed(workers.frozen_then_unfrozen, 2, 0.1)
    for (hooked, steps, _), (reference, _, _) in zip(full, plain, strict=True):
        assert steps == 9
        for h, p in zip(hooked, reference, strict=True):
            assert torch.equal(h, p)
    for params, steps, names in sparse:
        assert steps == 9 and names == ["2.bias", "2.weight", "4.bias", "4.weight"]
        for a, b in zip(params, sparse[0][0], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["topk", "exdyna"])
@pytest.mark.parametrize("static_graph", [False, True])
def test_a_state_moved_to_a_new_ddp_continues_as_the_old_one_would_have(method, static_graph):
    """Lightning's second fit() wraps the module in a new DDP, whose first step comes in a fresh
    DDP's bucket layout; the state reduced it in that layout, so the continued run differed from the
    uninterrupted one (by 1.6e-3 for Top-k, 4.2e-3 for ExDyna after 8 steps)."""
    straight = run_distributed(workers.rewrapped_continues, 2, method, None, static_graph)
    rewrapped = run_distributed(workers.rewrapped_continues, 2, method, 4, static_graph)
    for rank, (a, b) in enumerate(zip(straight, rewrapped, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"rank {rank}: differs by {(x - y).abs().max()}"


@pytest.mark.parametrize("case", ["rebuild", "hooked", "unused", "accumulation", "static"])
def test_c_what_ddp_applies_and_the_residuals_hold_every_gradient(case):
    """(c) through DDP's own paths, as the parameters see it: the ranks' mean gradient handed to
    the hook equals the gradient DDP applied plus the ranks' mean residual, summed over the steps.
    "rebuild": DDP's rebuild keeps bucket 0 and swaps the others (bucket 0's residual must not be
    parked after it was reduced); "hooked": the state hooked with model.register_comm_hook, which
    names its residuals by parameter identity, taken over by gradsparse.register on a new DDP
    (the residuals, held under placeholder names, were dropped at the new DDP's first step, whose
    buckets came under the parameters' names); "unused": find_unused_parameters=True, where DDP drops the
    average of a parameter no rank used (its residual must not be sent); "accumulation": the same
    with two batches a step, the first under no_sync(), and the gradients in DDP's buckets
    (gradient_as_bucket_view=True): the hook reduces each step once, and the state counts it once;
    "static": a head left with a residual and unused under static_graph=True, where DDP drops its
    average as under find_unused_parameters=True (its residual was sent, and lost)."""
    results = run_distributed(workers.mass_applied, 2, case)
    assert sorted({step for step, _ in results[0][3]}) == list(range(6))
    applied = results[0][1]
    for name in applied:
        handed = sum(r[0][name] for r in results) / 2
        kept = sum(r[2][name] for r in results) / 2
        torch.testing.assert_close(applied[name] + kept, handed, rtol=0, atol=1e-6, msg=name)
    layouts = [[names for step, names in results[0][3] if step == s] for s in (0, 1)]
    if case in ("rebuild", "hooked"):
        assert layouts == [[["head.weight"], ["a.weight"], ["b.weight"]], [["head.weight"], ["b.weight"], ["a.weight"]]]
    else:  # the step's unused head (even at step 0, odd at step 1) travels in a bucket of zeros
        assert all(len(step) >= 3 for step in layouts)


def test_static_graph_with_a_bucket_per_dtype_counts_the_first_step_and_resumes_without_hanging():
    """DDP's first iteration with static_graph=True reduces every bucket at the end of backward and
    hands each over as bucket 0, none as the last. With float32 and bfloat16 parameters (two
    buckets) that step went uncounted, and the first step after a load held its buckets for a last
    one that never came: backward hung."""
    results = run_distributed(workers.static_graph_mixed_dtypes_resume, 2, timeout=60)
    for r in results:
        assert r["steps"] == (3, 6)
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)


def test_sub_groups_with_unused_parameters():
    """Two pairs, each training on its own sub-group with find_unused_parameters=True: no
    collective of the state meets DDP's own on the pair's group (they did, and timed out)."""
    results = run_distributed(workers.sub_group_unused_parameters, 4)
    for pair in (results[:2], results[2:]):
        for a, b in zip(pair[0], pair[1], strict=True):
            assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(results[0], results[2], strict=True))


def test_ranks_in_different_numbers_of_groups_make_the_states_groups():
    results = run_distributed(workers.groups_of_other_ranks, 4, "sub_group", timeout=120)
    assert [r.get("step") for r in results] == [None, 1, 1, 1]
    results = run_distributed(workers.groups_of_other_ranks, 4, "each_node", timeout=120)
    assert [r["holds"] for r in results] == [True, False, True, False]


@pytest.mark.parametrize("method", sorted(workers.SUB_GROUP_METHODS))
def test_each_sub_group_trains_as_a_world_of_its_own(method):
    """Two pairs of a world of 4, each training its own model on its own DDP group with a method
    of each exchange family (gather-and-add, MiCRO's partitions, SparDL's reduce-scatter): each
    pair's parameters and residuals equal those of the same pair run as a world of 2, bit for bit."""
    four = run_distributed(workers.sub_group_training, 4, method, (0, 1), timeout=300)
    for pair, seed in enumerate((0, 1)):
        two = run_distributed(workers.sub_group_training, 2, method, (seed,), timeout=300)
        for rank, (alone, (params, residuals)) in enumerate(zip(two, four[2 * pair :], strict=False)):
            assert residuals and residuals.keys() == alone[1].keys(), f"pair {pair}, rank {rank}"
            for name, t in residuals.items():
                assert torch.equal(t, alone[1][name]), f"pair {pair}, rank {rank}: the residual of {name} differs"
            for a, b in zip(params, alone[0], strict=True):
                assert torch.equal(a, b), (
                    f"pair {pair}, rank {rank}: differs from a world of 2 by {(a - b).abs().max()}"
                )
    assert not torch.equal(four[0][0][0], four[2][0][0])  # the pairs trained apart


def test_spardl_teams_conserve_the_mass_of_a_parameter_unused_on_some_ranks():
    """A parameter unused on a rank sits the step out there (its residual held as zeros, put back
    after). With two teams SparDL leaves a team's sum in an owner's residual at an index another
    team's owner took, in a held piece too; putting the held piece back over it lost that sum
    (errors of about 1 in 19 of 48 such runs), now it is added."""
    for rank, errors in enumerate(run_distributed(workers.spardl_teams_with_a_parameter_unused_on_some_ranks, 4)):
        assert max(errors) < 1e-5, f"rank {rank}: mass lost or made, per step {errors}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("density,momentum", [(0.01, 0.0), (0.2, 0.0), (0.2, 0.9)])
def test_b_c_topk_matches_restatement_and_conserves_mass(world_size, density, momentum):
    """With momentum correction the mass conserved is the velocities': the gradient in the
    identity becomes the rank's velocity, u = momentum * u + gradient."""
    logs = run_distributed(workers.recorded_topk, world_size, density, momentum)
    calls = _reference_topk(logs, density, momentum)
    steps = {rec["step"] for rec in logs[0]}
    assert steps == set(range(workers.STEPS))
    assert calls > workers.STEPS  # several buckets per step, across DDP's bucket rebuild


@pytest.mark.parametrize(
    "case,world_size,error,message",
    [
        ("density_everywhere", 2, "ValueError", "density must be in (0, 1], got 2.0"),
        ("nan_density", 2, "ValueError", "density must be in (0, 1], got nan"),
        ("negative_threshold", 2, "ValueError", "threshold must be a finite number >= 0, got -0.5"),
        ("unknown_option", 2, "TypeError", "unknown option(s) warmup"),
        ("options_differ", 2, "ValueError", "different configurations"),
        ("versions_differ", 2, "ValueError", "rank 1: gradsparse 0.0.1 (wire version "),
        ("float64_bucket", 2, "TypeError", "gradsparse: bucket 0 holds torch.float64 gradients"),
        ("group_mismatch", 4, "ValueError", "process_group=<the group passed to DistributedDataParallel>"),
        ("buckets_differ", 2, "ValueError", "give every rank the same bucket_cap_mb"),
        ("skip_unused_buckets", 2, "ValueError", "built with skip_all_reduce_unused_params=True"),
    ],
)
def test_d_bad_configuration_raises_on_every_rank(case, world_size, error, message):
    outcomes = run_distributed(workers.bad_configuration, world_size, case, timeout=120)
    for rank, (kind, text) in enumerate(outcomes):
        assert kind == error, f"rank {rank}: {kind}: {text}"
        assert message in text, f"rank {rank}: {text}"


@pytest.mark.parametrize("case", ["density_on_rank_1", "missing_on_rank_1"])
def test_d_a_state_rejected_or_missing_on_one_rank_fails_the_others_within_the_timeout(case):
    """Rank 1's options raise there at construction, or rank 1 makes no state; rank 0 does not wait
    for rank 1 forever in the set-up (it would wait the default group's 30 minutes, and the run's
    120 s limit would fail the test) but fails after the state's timeout (5 s), saying why."""
    outcomes = run_distributed(workers.bad_configuration, 2, case, timeout=120)
    if case == "density_on_rank_1":
        assert outcomes[1][0] == "ValueError" and "TopK: density must be in (0, 1], got -1.0" in outcomes[1][1]
    else:
        assert outcomes[1] == ("ok", "")
    kind, text = outcomes[0]
    assert kind == "RuntimeError", text
    assert "not every rank of the process group [0, 1] reached the set-up" in text
    assert "Create the state with the same options on every rank" in text
    assert "a rank that raised before it (a load_state_dict refused there) never arrives" in text
    # the other way to get here: a rank outside a sub-group made with local synchronization
    assert "use_local_synchronization=True) returns None on the ranks outside ranks" in text


# warmup_steps=4: the NaN comes in a dense warm-up step, which passed it on whatever the policy
@pytest.mark.parametrize("warmup_steps", [0, 4])
def test_nonfinite_gradient_raises_on_every_rank(warmup_steps):
    outcomes = run_distributed(workers.nonfinite_gradient, 2, "raise", 0.0, warmup_steps)
    for (kind, text), _ in outcomes:
        assert kind == "RuntimeError"
        assert "rank(s) 1 saw" in text and "NaN/Inf" in text and 'nonfinite="skip"' in text


@pytest.mark.parametrize("hook", ["state", "user"])
def test_a_step_that_raised_under_find_unused_parameters_leaves_the_next_steps_working(hook):
    """A bucket's error went to DDP as a failed future, at which DDP's end of step raised before it
    reset its record of the parameters used: under find_unused_parameters=True the next step, which
    leaves a head unused, failed ("gradient which is undefined, but still allreduced"), and every
    step after it ("Expected to have finished reduction in the prior iteration"). The error is now
    raised once DDP has ended the step: it fails that step alone, on every rank (a NaN on rank 1
    under nonfinite="raise", or a user's hook that raised), and training goes on."""
    results = run_distributed(workers.a_raised_step_under_unused_parameters, 2, hook, timeout=120)
    for rank, (steps, params) in enumerate(results):
        expected = "rank(s) 1 saw" if hook == "state" else "ValueError: the user's hook raised"
        assert expected in steps[0] and steps[1:] == ["ok"] * 5, f"rank {rank}: {steps}"
        for mine, other in zip(params, results[0][1], strict=True):
            assert torch.equal(mine, other) and bool(mine.isfinite().all())


def test_a_closed_state_gives_back_its_process_group():
    """Each state runs its exchanges on a process group of its own, which close() left to the job's
    destroy_process_group(): three threads and five sockets per state on Gloo (a Trainer with
    model_init makes a state per train())."""
    for first, last in run_distributed(workers.states_created_and_closed, 2, 6, timeout=120):
        assert first == last, (first, last)


def test_a_forked_child_closes_and_drops_a_state_without_crashing():
    """In a process forked after a state's set-up the engine thread is not there: close() and the
    engine's destructor joined it (a segfault, or std::terminate once the child had run threads of
    its own). They now leave it alone (test_state: a step there says what to do)."""
    for code, said in run_distributed(workers.a_forked_child_leaves_the_parents_engine, 2, timeout=120):
        assert (code, said) == (0, "ok")


@pytest.mark.parametrize("warmup_steps", [0, 4])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nonfinite_gradient_skip_policy_skips_on_every_rank(momentum, warmup_steps):
    """With momentum correction too: the velocity keeps its old value where the gradient is not
    finite, so nothing non-finite stays behind."""
    outcomes = run_distributed(workers.nonfinite_gradient, 2, "skip", momentum, warmup_steps)
    for (kind, text), (skipped, finite, velocities) in outcomes:
        assert kind == "ok", text
        assert skipped == 1 and finite
        assert velocities == (6 if momentum else 0)  # every parameter's


@pytest.mark.parametrize(
    "method,momentum", [("topk", 0.0), ("topk", 0.9), ("micro", 0.0), ("micro", 0.9), ("threshold", 0.0)]
)
def test_loss_scaled_training_equals_training_without_loss_scaling(method, momentum):
    """Under a GradScaler whose scale changes at every step, the state moves its residuals,
    velocities and method thresholds to each step's scale, so training ends with the very
    parameters of the same training without loss scaling (the factors are powers of two), also
    when resumed from a state dict into a fresh scaler at another scale. The NaN of step 4 reaches
    the scaler on every rank (nonfinite="propagate"): it skips that step and halves its scale."""
    for out in run_distributed(workers.loss_scaled_training, 2, method, momentum):
        assert out["scales"][:6] == [2.0**5, 2.0**6, 2.0**7, 2.0**8, 2.0**7, 2.0**8]
        assert out["saved_scale"] == 2.0**9  # the scale of step 7's gradients
        for name in ("scaled", "resumed"):
            for got, want in zip(out[name], out["plain"], strict=True):
                assert torch.equal(got, want), name


def test_dense_state_equals_ddp_without_hook():
    for hooked, plain, stats in run_distributed(workers.dense_state_matches_no_hook, 2):
        for h, p in zip(hooked, plain, strict=True):
            assert torch.equal(h, p)  # two ranks: the same two-term sums
        assert stats["dense_steps"] == workers.STEPS and stats["bytes_ratio"] == 1.0


def test_checkpoint_resume_is_exact(tmp_path):
    for straight, resumed in run_distributed(workers.checkpoint_resume, 2, str(tmp_path / "ckpt")):
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world_size,method", [(2, "topk"), (3, "topk"), (3, "sage")])
def test_auto_times_both_exchanges_then_keeps_the_faster_on_every_rank_and_across_a_resume(
    tmp_path, world_size, method
):
    results = run_distributed(workers.auto_exchange, world_size, str(tmp_path / "ckpt"), method)
    workers.check_auto_exchange(results, method)


@pytest.mark.parametrize("method", sorted(workers.UNEVEN_METHODS))
def test_uneven_inputs_under_ddp_join(method):
    """Ranks with 6, 9 and 12 batches inside DDP's join(): nothing hangs, every rank counts the
    12 steps (a rank that ran out takes part in the others' exchanges, with zero gradients),
    the replicas end equal (DDP's final sync), and a rank that ran out keeps sending what its
    residual holds, so the residual shrinks while it waits."""
    results = run_distributed(workers.uneven_inputs, 3, method)
    for r in results:
        assert r["steps"] == 12
        for a, b in zip(results[0]["params"], r["params"], strict=True):
            assert torch.equal(a, b)
    for r in results[:2]:  # ranks 0 and 1 ran out before the end
        assert r["at_end"] < r["at_join"], r


def test_every_method_trains_close_to_dense():
    """Each method trains the same small model on the same data as dense DDP."""
    workers.assert_every_method_trains(run_distributed(workers.train_every_method, 2, 150, timeout=250))


@pytest.mark.parametrize("static_graph,nan_step", [(True, None), (False, 3)], ids=["rebuilt", "skipped"])
def test_auto_times_every_bucket_again_where_a_rebuild_or_a_skipped_step_spoiled_its_times(static_graph, nan_step):
    """DDP rebuilds its buckets after the second step with static_graph=True, inside the trial,
    and a step skipped for a NaN leaves every bucket without one of its times: every bucket of
    the final layout is still timed on both exchanges, and decided by its times."""
    results = run_distributed(workers.auto_exchange_timed_again, 2, static_graph, nan_step)
    buckets = sorted(results[0]["steps"][-1])
    assert len(buckets) > 1
    for r in results:
        assert (r["steps"], r["chosen"]) == (results[0]["steps"], results[0]["chosen"])  # every rank alike
        assert sorted(r["trial"]) == buckets  # every bucket timed on every rank
        for b in buckets:
            means = r["trial"][b]
            assert r["chosen"][b] == ("gather" if means["gather"] <= means["reduce_scatter"] else "reduce_scatter")


@pytest.mark.parametrize(
    ("bucket_cap_mb", "static_graph"), [(0.001, False), (1.0, False), (0.001, True)], ids=["more", "fewer", "static"]
)
def test_auto_keeps_a_saved_decision_for_the_same_parameters_and_times_other_buckets_after_a_resume(
    bucket_cap_mb, static_graph
):
    """A decision of exchange="auto" resumed in another bucket layout (another bucket_cap_mb: three
    buckets or one where two were saved; static_graph=True rebuilds a step later). The resumed
    step(s) in the saved layout keep it; after DDP's rebuild, a bucket of the same parameters as a
    saved one keeps its decision, and every other bucket is timed on both exchanges from the next
    step and decided by its times. Keyed by bucket index, the rebuilt buckets took the decisions
    of the saved buckets at their index (or none) and were never timed."""
    results = run_distributed(workers.auto_exchange_in_another_layout, 2, bucket_cap_mb, static_graph)
    for r in results[1:]:
        assert (r["steps"], r["chosen"], r["trial"]) == (results[0]["steps"], results[0]["chosen"], results[0]["trial"])
    r = results[0]
    names = {"gather": "fixed-size gather", "reduce_scatter": "reduce-scatter + all-gather"}
    saved = {tuple(b) for b in r["saved_layout"]}
    rebuilt = 2 if static_graph else 1  # the first resumed step in DDP's rebuilt layout
    for step in r["steps"][:rebuilt]:
        assert set(step) == saved and set(step.values()) == {names["reduce_scatter"]}
    layout = [tuple(b) for b in r["layout"]]
    kept = [i for i, b in enumerate(layout) if b in saved]
    timed = [i for i, b in enumerate(layout) if b not in saved]
    assert len(layout) != len(saved) and timed and kept == ([2] if bucket_cap_mb < 0.004 else [])
    assert all(set(step) == set(layout) for step in r["steps"][rebuilt:])
    alternation = [names[("gather", "reduce_scatter")[t % 2]] for t in range(6)]
    for i in kept:
        assert r["chosen"][i] == "reduce_scatter"
        assert all(step[layout[i]] == names["reduce_scatter"] for step in r["steps"][rebuilt:])
    assert sorted(r["trial"]) == timed and sorted(r["chosen"]) == list(range(len(layout)))
    for i in timed:
        assert [step[layout[i]] for step in r["steps"][rebuilt + 1 : rebuilt + 7]] == alternation
        means = r["trial"][i]
        assert r["chosen"][i] == ("gather" if means["gather"] <= means["reduce_scatter"] else "reduce_scatter")
        assert all(step[layout[i]] == names[r["chosen"][i]] for step in r["steps"][rebuilt + 7 :])


def test_auto_keeps_the_decision_of_a_hooked_state_that_register_takes_over():
    """A state hooked with model.register_comm_hook keeps exchange="auto"'s trial by its buckets'
    parameters, which it names by identity. gradsparse.register on a new DDP of the model names
    them: the decision went with the placeholder names (none saved, none reported, and each
    bucket ran the model's pick). The trial now follows the names."""
    names = {"gather": "fixed-size gather", "reduce_scatter": "reduce-scatter + all-gather"}
    for r in run_distributed(workers.auto_exchange_taken_over, 2):
        assert r["before"] and r["after"] == r["before"]
        assert sorted(r["chosen"]) == sorted(r["before"]) == sorted(r["used"])
        assert all(r["used"][b] == names[r["chosen"][b]] for b in r["used"])


def test_a_step_after_a_backward_that_stopped_past_a_failed_bucket_is_reduced():
    """A bucket that fails in gradsparse makes the rest of its step go back unreduced until the
    step's last bucket. A backward that then stopped in autograd before that bucket left the flag
    set, and the next step (in a new DDP over the same state) went back unreduced whole: every rank
    applied its own gradient, and the replicas drifted apart. Now a new step's first bucket clears
    it, and the ranks' parameters stay equal."""
    ranks = run_distributed(workers.step_after_a_backward_that_stopped, 2, timeout=120)
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert torch.equal(a, b), f"the ranks' parameters differ by {(a - b).abs().max()}"


@pytest.mark.parametrize(
    ("how", "options"),
    [
        ("ignored", {"static_graph": True}),
        ("unfrozen_since", {"static_graph": True}),
        ("frozen_since", {"static_graph": True}),
        ("frozen_since", {"find_unused_parameters": True}),
    ],
)
def test_the_state_reduces_the_parameters_ddp_reduces(how, options):
    """The state learns at registration which parameters DDP reduces. DDP's first static-graph
    step hands its buckets over at the end of backward, none as the last: the state ends the step
    at the bucket that completes those parameters. It counted a parameter DDP was told to ignore,
    or one unfrozen after DDP was built, so that step never ended (not counted, and after a load its
    held buckets were never let go); a parameter frozen after DDP was built, which DDP still
    reduces, made its bucket look like another model's ("registered on more than one model")."""
    for rank, steps in enumerate(
        run_distributed(workers.steps_where_ddp_and_requires_grad_disagree, 2, how, options, timeout=120)
    ):
        assert steps == [1, 2, 3], f"rank {rank}: steps {steps}"


@pytest.mark.parametrize("method", ["TopK", "MiCRO"])
def test_sparse_embedding_gradients_are_reduced_as_their_dense_form_and_resume_exactly(method, tmp_path):
    """nn.EmbeddingBag(sparse=True): DDP hands its gradient over as a sparse tensor (refused as a
    bucket of strides [0, 0] before); it is sparsified as its dense form and handed back sparse."""
    results = run_distributed(workers.sparse_embedding_gradients, 2, method, str(tmp_path / "sparse.pt"))
    for result in results:
        assert result["layouts"] == [torch.sparse_coo] * 8
        assert result["residual"] > 0  # the table's residual held something at the checkpoint
        for sparse, dense in zip(result[True], result[False], strict=True):
            torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)
        for resumed, straight in zip(result["resumed"], result[True], strict=True):
            assert torch.equal(resumed, straight)
    for a, b in zip(results[0][True], results[1][True], strict=True):
        assert torch.equal(a, b)
