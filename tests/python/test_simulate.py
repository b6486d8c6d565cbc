"""The traffic model of ``python -m gradsparse.simulate`` against the bytes ThreadTransport counts:
every exchange, every world size from 1 to 16, byte for byte and collective for collective."""

import math
import subprocess
import sys

import pytest
import torch

import gradsparse
from gradsparse import _C, simulate
from gradsparse.exchange_trial import ROUNDS, STEPS_EACH, ExchangeTrial
from gradsparse.methods import core_method
from gradsparse.testing.thread_ranks import run_steps

NUMEL = 1237  # not a multiple of any world size above 1 (except 1237 itself)
DENSITY = 0.05
STEPS = 3


def stream(world_size: int, steps: int = STEPS, numel: int = NUMEL) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + world_size)
    return [[torch.randn(numel, generator=gen) for _ in range(world_size)] for _ in range(steps)]


def check(steps, plan_of) -> None:
    """plan_of(t, r, step) -> the collectives rank r issued at step t, by the model."""
    world_size = len(steps[0])
    for t, ranks in enumerate(steps):
        for r, step in enumerate(ranks):
            plan = plan_of(t, r, step)
            assert step.bytes_sent == sum(c.bytes_sent(world_size) for c in plan), (t, r, plan)
            assert step.collectives == len(plan), (t, r, plan)


WORLD_SIZES = list(range(1, 17))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dense(world_size):
    steps = run_steps(world_size, lambda r: None, stream(world_size, 1))
    check(steps, lambda t, r, s: simulate.dense(NUMEL))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_topk_fixed_size_gather(world_size):
    steps = run_steps(world_size, lambda r: core_method("topk", density=DENSITY), stream(world_size))
    k = math.floor(DENSITY * NUMEL)
    check(steps, lambda t, r, s: simulate.fixed_gather(k, NUMEL))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_and_add_with_counts(world_size):
    steps = run_steps(world_size, lambda r: core_method("threshold", threshold=1.6), stream(world_size))
    assert len({c for s in steps for c in s[0].counts}) > 1  # ranks send different counts: no padding counted
    check(steps, lambda t, r, s: simulate.gather_and_add(s.counts, NUMEL, rank=r))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shared_indices(world_size):
    steps = run_steps(world_size, lambda r: core_method("randomk", density=DENSITY), stream(world_size))
    k = math.floor(DENSITY * NUMEL)
    check(steps, lambda t, r, s: simulate.shared_indices(k))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reference", [False, True])
def test_union_allreduce(world_size, reference):
    steps = run_steps(
        world_size,
        lambda r: core_method("micro", density=DENSITY, exchange="union", reference=reference),
        stream(world_size),
    )

    def plan(t, r, s):
        exchange = simulate.union_allreduce(s.counts, s.union_size, NUMEL, rank=r)
        return exchange if reference else simulate.band_agreement(exchange, world_size, NUMEL, first_step=t == 0)

    check(steps, plan)


def sampled(steps, t: int, r: int) -> bool:
    """Whether MiCRO's or ExDyna's step t samples on rank r: the first step, and a step after one
    that left no estimate (csrc/core/method/partitioned.cpp, select_default)."""
    estimate = steps[t - 1][r].state["estimate"] if t > 0 else math.nan
    return t == 0 or not (math.isfinite(estimate) and estimate > 0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("method,exchange", [("micro", "union"), ("exdyna", "gather")])
def test_partitioned_steps_sample_again_where_the_step_before_left_no_estimate(world_size, method, exchange):
    """Buckets of a few elements: the band counts leave no estimate at some steps, and the next
    step samples again (one more 2838-bin all-reduce), which the model, documented to sample at
    the first step only, counted short (MiCRO, 5 ranks, 1 element: 39,885 bytes sent at step 2,
    3,559 modelled)."""
    resampled = 0
    for numel in (1, 2, 3, 5, 17):
        steps = run_steps(
            world_size, lambda r: core_method(method, density=0.5, exchange=exchange), stream(world_size, 4, numel)
        )
        resampled += sum(sampled(steps, t, r) for t in range(1, 4) for r in range(world_size))

        def plan(t, r, s, numel=numel, steps=steps):
            if exchange == "union":
                plan = simulate.union_allreduce(s.counts, s.union_size, numel, rank=r)
            else:
                plan = simulate.exclusive_gather(s.counts, numel, rank=r)
            return simulate.band_agreement(plan, world_size, numel, first_step=sampled(steps, t, r))

        check(steps, plan)
    assert resampled > 0  # the case this test is for


def test_band_agreement_folds_where_it_sends_no_more_bytes():
    """The two tests above cover both forms: folded up to 4 ranks, apart from 5 (4-byte counts)."""
    assert [simulate.band_agreement_folded(p, NUMEL) for p in WORLD_SIZES] == [p <= 4 for p in WORLD_SIZES]
    # 8-byte counts (buckets of 2^32 elements or more): folded at 2 ranks only
    assert [simulate.band_agreement_folded(p, 2**32) for p in (2, 3)] == [True, False]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exclusive_gather(world_size):
    steps = run_steps(
        world_size, lambda r: core_method("exdyna", density=DENSITY, exchange="gather"), stream(world_size)
    )
    check(
        steps,
        lambda t, r, s: simulate.band_agreement(
            simulate.exclusive_gather(s.counts, NUMEL, rank=r), world_size, NUMEL, first_step=t == 0
        ),
    )


SHARDED = 1680  # 2^4 * 3 * 5 * 7: equal shards for most world sizes


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if SHARDED % w == 0])
def test_sparse_reduce_scatter(world_size):
    steps = run_steps(
        world_size,
        lambda r: core_method("topk", density=DENSITY),
        stream(world_size, numel=SHARDED),
        shard_only=True,
    )
    shard = SHARDED // world_size

    def plan(t, r, s):
        counts = [[int((rank.indices // shard == o).sum()) for o in range(world_size)] for rank in steps[t]]
        return simulate.sparse_reduce_scatter(counts, SHARDED, rank=r)

    check(steps, plan)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("method", ["topk", "dgc"])
def test_reduce_scatter_allgather(world_size, method):
    steps = run_steps(
        world_size, lambda r: core_method(method, density=DENSITY, exchange="reduce_scatter"), stream(world_size)
    )
    chunk = -(-NUMEL // world_size)

    def plan(t, r, s):
        ranks = steps[t]
        parts = [[int((rank.indices // chunk == o).sum()) for o in range(world_size)] for rank in ranks]
        support = s.output.nonzero().flatten()  # every kept index (a sum of random values is never 0)
        kept = [int((support // chunk == o).sum()) for o in range(world_size)]
        return simulate.reduce_scatter_allgather(
            parts[r], [parts[q][r] for q in range(world_size)], kept, NUMEL, rank=r
        )

    check(steps, plan)


def method_at_scale(name: str, world_size: int, numel: int):
    """The C++ method object of method ``name`` (exchange="auto" where it has that option, every
    other option at its default), as a state made at ``world_size`` ranks on the default link
    builds it for a bucket of ``numel`` elements."""
    cls = gradsparse.METHODS[name]
    auto = any(o.name == "exchange" and "auto" in o.flag["choices"] for o in cls.OPTIONS)
    state = cls(density=0.001, **({"exchange": "auto"} if auto else {}))
    state._world_size, state._link = world_size, simulate.DEFAULT_LINK
    return state._make_method([numel])


@pytest.mark.parametrize("world_size", [64, 512, 1024])
@pytest.mark.parametrize("name", [n for n in gradsparse.METHODS if n != "dense"])
def test_no_method_sends_more_than_6k_per_rank_at_scale(name, world_size):
    """At 25M elements and density 0.001, every method (with exchange="auto" where it has that
    option: those that select k per rank, whose default gather-and-add grows with P) sends at
    most 6 k (P - 1) / P elements (4 bytes each) per rank."""
    numel, density = 25_000_000, 0.001
    k = math.floor(density * numel)
    method = method_at_scale(name, world_size, numel)
    split = simulate.even_split(k, world_size)
    plans = {
        "fixed-size gather": lambda: simulate.fixed_gather(k, numel),
        "gather-and-add": lambda: simulate.gather_and_add([k] * world_size, numel),
        "reduce-scatter + all-gather": lambda: simulate.even_plan(world_size, numel, k),
        "union + all-reduce": lambda: simulate.band_agreement(
            simulate.union_allreduce(split, k, numel), world_size, numel
        ),
        "shared indices": lambda: simulate.shared_indices(k),
        "SparDL": lambda: simulate.spardl(world_size, 0, numel, density),
    }
    sent = sum(c.bytes_sent(world_size) for c in plans[method.exchange]())
    assert sent / 4 <= 6 * k * (world_size - 1) / world_size, (method.exchange, sent)


def test_auto_picks_gather_and_add_at_small_scale_and_reduce_scatter_at_large_scale():
    assert simulate.faster_exchange(4, 80_000, 0.01, (1e-3, 1.6e-7), fixed=True) == "gather"
    assert simulate.faster_exchange(1024, 25_000_000, 0.001) == "reduce_scatter"
    assert simulate.faster_exchange(1, 25_000_000, 0.001) == "gather"
    # Before set-up (one rank known, no link): gather-and-add, which the restatements test.
    assert gradsparse.TopK(density=0.01, exchange="auto")._make_method([1000]).exchange == "fixed-size gather"


def test_auto_plans_half_precision_buckets_with_their_two_byte_values():
    """The model priced every bucket's values at 4 bytes. A float16 or bfloat16 bucket sends
    2-byte values in both exchanges, while reduce-scatter + all-gather's histogram stays float64,
    so at 4 ranks (1M elements, density 0.01, counts exchanged) gather-and-add is the faster for
    it where reduce-scatter + all-gather is for float32; the bytes are the library's (thread
    ranks on float16 gradients send what the model counts with value_bytes=2)."""
    assert simulate.faster_exchange(4, 1_000_000, 0.01) == "reduce_scatter"
    assert simulate.faster_exchange(4, 1_000_000, 0.01, value_bytes=2) == "gather"
    assert simulate.faster_exchange(6, 1_000_000, 0.01, fixed=True) == "reduce_scatter"
    assert simulate.faster_exchange(6, 1_000_000, 0.01, fixed=True, value_bytes=2) == "gather"
    half = [[g.half() for g in ranks] for ranks in stream(4, 1)]
    steps = run_steps(4, lambda r: core_method("topk", density=DENSITY), half)
    k = math.floor(DENSITY * NUMEL)
    check(steps, lambda t, r, s: simulate.fixed_gather(k, NUMEL, value_bytes=2))


@pytest.mark.parametrize(
    "argument,value,message",
    [
        # a NaN made every plan's time NaN, and every pick gather-and-add (here the model's pick is
        # reduce-scatter + all-gather); a negative beta made the plan with more bytes the faster
        ("link", (float("nan"), 8e-10), r"link must be the pair \(alpha, beta\) of finite numbers >= 0 .*got \(nan, "),
        ("link", (5e-6, -8e-10), r"link must be the pair .*got \(5e-06, -8e-10\); measure it with .*measure_link"),
        ("link", (5e-6, math.inf), r"link must be the pair .*got \(5e-06, inf\)"),
        # math.floor's "cannot convert float NaN to integer"; outside (0, 1] planned as k = 1 or k > numel
        ("density", math.nan, r"density must be a number in \(0, 1\], got nan; for example 0.001"),
        ("density", -0.01, r"density must be a number in \(0, 1\], got -0.01"),
        ("density", 2.0, r"density must be a number in \(0, 1\], got 2.0"),
        # planned as one rank ("gather") without a word
        ("world_size", 0, r"world_size must be an integer >= 1 \(the number of ranks\), got 0; for example"),
        ("numel", -5, r"numel must be an integer >= 0 \(the bucket's elements\), got -5"),
    ],
)
def test_faster_exchange_refuses_what_it_cannot_plan_naming_the_argument(argument, value, message):
    """faster_exchange (docs/architecture.md: exchange="auto"'s first pick) took any link,
    density and world size: a NaN or negative link or a density outside (0, 1] gave a pick, or a
    bare Python error, instead of an error naming the argument."""
    arguments = {"world_size": 4, "numel": 10_000_000, "density": 0.01, "link": simulate.DEFAULT_LINK}
    assert simulate.faster_exchange(**arguments) == "reduce_scatter"
    with pytest.raises(ValueError, match=f"gradsparse.simulate.faster_exchange: {message}"):
        simulate.faster_exchange(**dict(arguments, **{argument: value}))


def test_the_exchange_trial_alternates_then_keeps_the_faster_where_every_rank_timed_it():
    a, b, c = (frozenset({name}) for name in ("a.weight", "b.weight", "c.weight"))  # buckets by parameter names
    trial = ExchangeTrial(first_sparse_step=2)  # warm-up until step 2: timed from step 3
    assert [trial.exchange_at(a, step) for step in range(2, 10)] == [None] + ["gather", "reduce_scatter"] * 3 + [None]
    assert not trial.due(8) and trial.due(9)
    for t in range(3):
        trial.record(a, "gather", 0.010 + t)  # medians: 1.010 and 1.020
        trial.record(a, "reduce_scatter", 0.020 + t)
        trial.record(b, "gather", 0.030)
        trial.record(b, "reduce_scatter", 0.005)
    trial.record(c, "gather", 0.001)  # bucket c lacks times (a skipped step): it is timed again
    mine = trial.medians([a, b, c])
    assert mine.tolist() == pytest.approx([1.010, 1.020, 0, 0.030, 0.005, 0, 0, 0, 1])
    other_rank = mine.clone()
    other_rank[[0, 1]] = torch.tensor([3.0, 1.0])  # another rank timed bucket a the other way round
    trial.decide((mine + other_rank) / 2, [a, b, c], step=9)
    assert trial.chosen == {a: "reduce_scatter", b: "reduce_scatter"} and not trial.decided
    assert trial.means[a] == pytest.approx({"gather": 2.005, "reduce_scatter": 1.010})
    # the second round, from step 9: bucket c alternates, the decided buckets keep their exchange
    assert [trial.exchange_at(c, step) for step in range(9, 16)] == ["gather", "reduce_scatter"] * 3 + [None]
    assert trial.exchange_at(a, 10) == "reduce_scatter" and not trial.timed(a) and trial.timed(c)
    assert not trial.due(14) and trial.due(15)
    for _ in range(ROUNDS - 1):  # every round misses a time of bucket c: after the last, the trial ends
        trial.decide(trial.medians([a, b, c]), [a, b, c], step=15)
    assert trial.decided and trial.rounds == ROUNDS and c not in trial.chosen
    assert trial.exchange_at(a, 20) == "reduce_scatter" and trial.exchange_at(c, 20) is None
    again = ExchangeTrial(first_sparse_step=0)  # a bucket timed completely in the second round
    again.decide(again.medians([a]), [a], step=7)
    for _ in range(STEPS_EACH):
        again.record(a, "gather", 0.2)
        again.record(a, "reduce_scatter", 0.1)
    again.decide(again.medians([a]), [a], step=13)
    assert again.decided and again.chosen == {a: "reduce_scatter"} and again.rounds == 2
    resumed = ExchangeTrial(first_sparse_step=30, chosen={b: "gather"})  # a loaded decision (Loaded.exchanges)
    assert resumed.decided and resumed.exchange_at(b, 31) == "gather" and resumed.exchange_at(a, 31) is None


def test_every_exchange_of_the_library_has_a_model():
    assert list(simulate.EXCHANGES) == _C.exchanges()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_spardl_one_team(world_size):
    steps = run_steps(world_size, lambda r: core_method("spardl", density=DENSITY), stream(world_size))
    check(steps, lambda t, r, s: simulate.spardl(world_size, r, NUMEL, DENSITY))


@pytest.mark.parametrize("world_size,teams", [(2, 1), (3, 1), (5, 1), (4, 2), (6, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_spardl_half_precision_buckets(world_size, teams, dtype):
    """A float16 step ends with an all-gather of each rank's count of the sums it cannot hold
    (docs/methods.md); the model left it out, (P - 1) x 8 bytes and one collective short."""
    grads = [[g.to(dtype) for g in ranks] for ranks in stream(world_size, 1)]
    steps = run_steps(world_size, lambda r: core_method("spardl", density=DENSITY, teams=teams), grads)
    float16 = dtype == torch.float16
    check(
        steps,
        lambda t, r, s: simulate.spardl(
            world_size, r, NUMEL, DENSITY, teams=teams, final_counts=s.counts[: world_size // teams],
            value_bytes=2, float16=float16,
        ),
    )  # fmt: skip


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel,density", [(1, 0.5), (5, 1.0), (17, 1.0), (40, 0.5)])
def test_spardl_blocks_of_unequal_lists(world_size, numel, density):
    """Buckets of fewer elements than ranks, or density 1 over blocks of unequal lengths (the last
    short, some empty): the lists of a rank's blocks differ in size, so the model must send and
    receive the blocks the library does at every step of the Spar-Reduce-Scatter. It read the
    schedule's tuples in another order than it wrote them, and sent block rank + j where the
    library sends block rank + gap + j (2 ranks, 1 element: rank 0 modelled at 128 bytes, sent 112)."""
    steps = run_steps(world_size, lambda r: core_method("spardl", density=density), stream(world_size, numel=numel))
    check(steps, lambda t, r, s: simulate.spardl(world_size, r, numel, density))


@pytest.mark.parametrize("world_size,teams", [(2, 2), (4, 2), (6, 3), (8, 2), (8, 4), (12, 3), (16, 4), (16, 16)])
def test_spardl_teams(world_size, teams):
    steps = run_steps(world_size, lambda r: core_method("spardl", density=DENSITY, teams=teams), stream(world_size, 4))
    team_size = world_size // teams

    def plan(t, r, s):
        h = None if t == 0 else int(steps[t - 1][r].state["h"])  # top-h in use at step t
        return simulate.spardl(world_size, r, NUMEL, DENSITY, teams=teams, h=h, final_counts=s.counts[:team_size])

    check(steps, plan)


@pytest.mark.parametrize("teams", [3, 16, 0])
def test_spardl_refuses_teams_that_do_not_divide_the_world_size(teams):
    """SparDL's ranks form teams of equal size. At 8 ranks, teams=3 was planned as 3 teams of 2
    ranks (two ranks left out of every round) without a word, and teams=16 or 0 ended in a
    ZeroDivisionError; the library refuses such teams (SparDL.check_world_size)."""
    with pytest.raises(ValueError, match=rf"spardl: teams={teams} does not divide the world size 8; .* 1, 2, 4, 8$"):
        simulate.spardl(8, 0, NUMEL, DENSITY, teams=teams)


def test_scale_table_runs_and_orders_exchanges(capsys):
    assert simulate.main(["--world-size", "8,1024", "--params", "25e6", "--density", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "SparDL (teams=1)" in out and "dense all-reduce" in out
    plans = simulate.exchanges_at_scale(1024, 25_000_000, 0.001)
    sent = {name: sum(c.bytes_sent(1024) for c in plan) for name, plan in plans.items()}
    # gather-and-add grows with P: at 1024 ranks it moves about as much as the dense all-reduce
    assert sent["fixed-size gather (Top-k)"] > 0.9 * sent["dense all-reduce"]
    assert sent["SparDL (teams=1)"] < 0.01 * sent["dense all-reduce"]
    # No padding on the wire: every exchange with a closed-form payload bound is within 1.1x of it
    # (compact control words, counts and padding are the rest), even where a rank's block is a few
    # dozen pairs: the partitioned exchanges and reduce-scatter + all-gather at P >= 512 (k / P =
    # 49 or 24 pairs per part, sent bare; docs/benchmarks.md).
    for p in (8, 64, 512, 1024):
        plans = simulate.exchanges_at_scale(p, 25_000_000, 0.001)
        for name, minimum in simulate.minimum_bytes(p, 25_000_000, 0.001).items():
            sent = sum(c.bytes_sent(p) for c in plans[name])
            assert minimum <= sent <= 1.1 * minimum, (p, name, sent, minimum)


@pytest.mark.parametrize(
    "text,value",
    [("10Gbit", 1.25e9), ("100Mbit", 12.5e6), ("1.25GB/s", 1.25e9), ("25gbps", 25e9 / 8), ("10Gbit/s", 1.25e9)],
)
def test_bandwidth_units(text, value):
    assert simulate.parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text,value", [("5us", 5e-6), ("2ms", 2e-3), ("1e-6", 1e-6), ("0.5s", 0.5)])
def test_latency_units(text, value):
    assert simulate.parse_latency(text) == pytest.approx(value)


def test_bad_arguments_name_the_argument():
    with pytest.raises(SystemExit):
        simulate.main(["--bandwidth", "fast"])
    with pytest.raises(ValueError, match="--bandwidth: cannot read 'fast'"):
        simulate.parse_bandwidth("fast")


@pytest.mark.parametrize(
    "argv,message",
    [
        # these gave a ZeroDivisionError, ValueError or OverflowError traceback, or printed negative or inf times
        (["--bandwidth", "0"], "--bandwidth: '0' is not a finite bandwidth above 0; write for example 10Gbit"),
        (["--bandwidth=-5Gbit"], "--bandwidth: '-5Gbit' is not a finite bandwidth above 0"),
        (["--bandwidth", "1e999Gbit"], "--bandwidth: '1e999Gbit' is not a finite bandwidth above 0"),
        (["--latency=-1us"], "--latency: '-1us' is not a finite latency >= 0; write for example 5us"),
        (["--latency", "1e999"], "--latency: '1e999' is not a finite latency >= 0"),
        (["--latency", "1.2.3us"], "--latency: '1.2.3us' is not a finite latency >= 0"),
        (["--params", "nan"], "--params must be a whole number of elements, at least 1 (for example 25e6), got nan"),
        (["--params", "inf"], "--params must be a whole number of elements, at least 1 (for example 25e6), got inf"),
        (["--params", "1.9"], "--params must be a whole number of elements, at least 1 (for example 25e6), got 1.9"),
        # every plan listed its P - 1 rounds: 10^8 ranks took gigabytes and minutes before any row
        (["--world-size", "8,100000000"], "--world-size: at most 1,048,576 ranks, got 100,000,000; the model lists"),
        # SparDL's row was left out without a word
        (["--world-size", "8,12", "--teams", "8"], "--teams 8 does not divide the world size(s) 12: SparDL's ranks"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        simulate.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_plot_into_a_missing_folder_is_refused_before_the_table(tmp_path, capsys):
    """savefig's FileNotFoundError came after the whole table had been printed."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "no-such-folder" / "simulate.png"
    with pytest.raises(SystemExit) as info:
        simulate.main(["--world-size", "4", "--plot", str(png)])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert f"--plot {png}: the folder {png.parent} does not exist; create it or write the PNG elsewhere" in err
    assert out == ""


@pytest.mark.parametrize("name", ["simulate.txt", "simulate"])
def test_a_plot_whose_name_is_no_png_is_refused_before_the_table(tmp_path, capsys, name):
    """savefig took the format from the name: 'x.txt' failed after the table (matplotlib's 'Format
    txt is not supported'), and 'results' was written as results.png while the run said 'plot
    written to results'."""
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as info:
        simulate.main(["--world-size", "4", "--plot", str(tmp_path / name)])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert f"--plot {tmp_path / name}: the plot is a PNG; give a file name ending in .png" in err
    assert out == ""


def test_measure_link_at_one_rank_says_there_is_no_link():
    """Its fit divides by P - 1: at one rank (python -m benchmarks.link under torchrun
    --nproc-per-node=1) it ended in a ZeroDivisionError."""
    import torch.distributed as dist

    from gradsparse.testing.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="measure_link: the group has 1 rank, where no byte crosses a link"):
            simulate.measure_link()
    finally:
        dist.destroy_process_group()


def test_the_command_runs_without_runpys_warning():
    """gradsparse's import loaded gradsparse.simulate (state.py imported it), so ``python -m
    gradsparse.simulate`` began with runpy's RuntimeWarning that the module was already imported."""
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "gradsparse.simulate", "--world-size", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "RuntimeWarning" not in run.stderr
    assert "dense all-reduce" in run.stdout


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_no_exchange_sends_less_than_its_minimum_past_two_to_the_32_elements(world_size):
    """Reduce-scatter + all-gather's parts are indexed within their shard (4 bytes where the bucket
    needs 8): its bound counts them so, and stays a lower bound."""
    numel = 5 * 10**9
    plans, minimum = (
        simulate.exchanges_at_scale(world_size, numel, 0.001),
        simulate.minimum_bytes(world_size, numel, 0.001),
    )
    for name, bound in minimum.items():
        assert sum(c.bytes_sent(world_size) for c in plans[name]) >= bound, name


def test_a_plot_leaves_out_one_rank_where_every_time_is_zero(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):
        simulate.main(["--world-size", "1", "--plot", str(tmp_path / "one.png")])
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "one.png").exists()


def test_measure_link_measures_the_gpus_link_under_torchs_default_group(monkeypatch):
    """torch's default group on a machine with GPUs is "cpu:gloo,cuda:nccl": its CUDA gradients go
    through NCCL, but measure_link timed CPU tensors there, Gloo's link over TCP."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        assert simulate._link_device(backend) == torch.device("cuda", 1), backend
    for backend in ("gloo", "mpi", "cpu:gloo,cuda:gloo"):
        assert simulate._link_device(backend) is None, backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert simulate._link_device("cpu:gloo,cuda:nccl") is None
