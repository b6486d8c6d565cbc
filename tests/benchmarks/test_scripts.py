"""The benchmark scripts run end to end at tiny sizes and print complete, sane tables (their
figures are measured by hand on quiet machines and recorded in docs/benchmarks.md; here only
that every script still works and reports every method)."""

import math
import os
import re

import pytest
import torch

from benchmarks import (
    allgatherv,
    allocator,
    cluster,
    density,
    link,
    overlap,
    seed_models,
    select,
    step_ratio,
    threshold_moves,
)
from benchmarks.utils import markdown_table
from gradsparse.methods import core_method
from tests.refusals import assert_refused, never

DRIFT_METHODS = ("TopK", "SAGE", "MiCRO", "ExDyna", "SIDCo exp")


def numbers(text: str, row_start: str) -> list[float]:
    """The numeric cells of the first table row starting with ``row_start``."""
    for line in text.splitlines():
        if line.startswith(f"| {row_start} |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            # benchmarks/utils.py writes 1000 and more with thousands separators ("1,234")
            numeric = [c for c in cells if re.fullmatch(r"-?[\d,.]+(e[-+]?\d+)?%?", c)]
            return [float(c.replace(",", "").rstrip("%")) for c in numeric]
    raise AssertionError(f"no row starting with {row_start!r} in:\n{text}")


def test_select_reports_every_method(tmp_path):
    text = select.main(["--sizes", "2e4", "--densities", "0.01", "--repeat", "1", "--methods", "--rounds", "2",
                        "--warmup", "4", "--steps", str(tmp_path / "steps.csv"),
                        "--output", str(tmp_path / "select.md")])  # fmt: skip
    assert (tmp_path / "select.md").read_text() == text
    header, *lines = (tmp_path / "steps.csv").read_text().splitlines()
    assert header == "N,density,method,round,add ms,select ms"
    steps: dict[str, list[tuple[int, float, float]]] = {}
    for line in lines:
        n, density, name, r, add, sel = line.split(",")
        assert (n, density) == ("20000", "0.01")
        steps.setdefault(name, []).append((int(r), float(add), float(sel)))
    for name, timed in steps.items():  # the row's steps, one a round, and its medians are theirs
        assert [r for r, _, _ in timed] == [1, 2], name
        _density, select_ms, add_ms, _ratio, _first = numbers(text, f"0.02M | 0.01 | {name}")
        assert select_ms == pytest.approx(sum(s for _, _, s in timed) / 2, rel=0.01, abs=1e-3), name
        assert add_ms == pytest.approx(sum(a for _, a, _ in timed) / 2, rel=0.01, abs=1e-3), name
    _density, achieved, *times = numbers(text, "0.02M")  # the size cell is not a number
    assert achieved == pytest.approx(0.01, rel=0.05)
    assert all(t > 0 and math.isfinite(t) for t in times)
    for name in ("TopK", "RandomK", "GaussianK spardl", "DGC", "RedSync", "SAGE", "MiCRO", "ExDyna", "SIDCo exp"):
        assert f"| {name} |" in text, name
    assert "| SparDL |" not in text  # selects inside its exchange: no separate step
    _density, select_ms, add_ms, ratio, first = numbers(text, "0.02M | 0.01 | DGC")
    assert select_ms > 0 and add_ms > 0
    assert ratio == pytest.approx(select_ms / add_ms, rel=0.02)  # against the add timed beside it (3 digits each)
    assert first > 0 and math.isfinite(first)  # steps 3 and 4, apart
    assert "| steps 3-4 / add |" in text
    assert " |\n\nMedians of 1 steps" in text  # a paragraph: right below the table it renders as one more row


def test_select_methods_live_through_every_round_on_changing_gradients(monkeypatch):
    """Each method is made once and steps on through the rounds, as in training, each step on
    another gradient."""
    made = []

    def sage(_rank):
        made.append(core_method("sage", density=0.01))
        return made[-1]

    monkeypatch.setattr(select, "chosen_methods", lambda density, only: {"SAGE": sage})
    rows = select.method_rows(20_000, 0.01, repeat=2, rounds=3, warmup=5)
    assert len(made) == 2  # one asked for its exchange, one timed
    assert made[1].state()["step"] == 5 + 3 * 2
    assert made[0].state()["step"] == 0
    assert len(rows) == 1 and rows[0][2] == "SAGE"
    draws = [torch.ones(3), torch.full((3,), 2.0)]
    gradients = [select.step_gradient(draws, step) for step in range(400)]
    assert all(g is not draws[0] and g is not draws[1] for g in gradients)  # the reduce writes into it
    scales = [float(g[0] / draws[step % 2][0]) for step, g in enumerate(gradients)]
    assert all(torch.equal(g, torch.full((3,), float(g[0]))) for g in gradients)  # each draw, scaled whole
    assert select.step_gradient(draws, 7).equal(gradients[7])  # the same at every run
    logs = torch.tensor(scales).log()
    assert float(logs.std()) == pytest.approx(select.SCALE_SPREAD, rel=0.15)
    assert float((logs[1:] - logs[:-1]).abs().median()) > 0.03  # no two steps alike


def test_threshold_moves_reports_both_streams(tmp_path):
    text = threshold_moves.main(["--steps", "60", "--size", "2e4", "--output", str(tmp_path / "moves.md")])
    for name, count in (("cnn", 9), ("select", 9)):  # the cnn's first 50 steps left out, 10 steps of each
        moves, median, mean, p90 = numbers(text, name)
        assert moves == count, name
        assert 0 < median <= p90 and mean > 0, name
    assert threshold_moves.moves([1.0, 2.0, 1.0]) == pytest.approx([math.log(2), math.log(2)])
    with pytest.raises(SystemExit):
        threshold_moves.main(["--steps", "10", "--output", str(tmp_path / "x.md")])


def test_threshold_moves_refuses_a_density_whose_threshold_reaches_the_gradients_zeros(capsys, monkeypatch):
    """--density 0.7 ended in a ZeroDivisionError: 13% of the CNN's gradient is exactly zero."""
    monkeypatch.setattr(density, "cnn_stream", never("a gradient stream was drawn"))
    message = "--density must be in (0, 0.5] (a sparsifier's: the CNN's gradient is 13% zeros), got 0.7"
    assert_refused(threshold_moves.main, ["--density", "0.7", "--output", "unused.md"], message, capsys)


def test_threshold_moves_refuses_a_size_that_is_no_whole_number(capsys, monkeypatch):
    """--size 2000.5 was cut to 2000 elements without a word."""
    monkeypatch.setattr(density, "cnn_stream", never("a gradient stream was drawn"))
    message = "--size must be a whole number of elements, at least 1000 (for example 2e6), got 2000.5"
    assert_refused(threshold_moves.main, ["--size", "2000.5", "--output", "unused.md"], message, capsys)


def test_a_bare_report_name_goes_under_runs_not_over_the_committed_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = select.main(["--sizes", "2e4", "--densities", "0.01", "--repeat", "1", "--output", "select.md"])
    assert (tmp_path / "runs" / "benchmarks" / "select.md").read_text() == text
    assert [p.name for p in tmp_path.rglob("*.md")] == ["select.md"]


def test_select_times_momentum_correction_beside_the_chosen_methods(tmp_path):
    text = select.main(["--sizes", "2e4", "--densities", "0.01", "--repeat", "1", "--methods", "--only", "TopK,DGC",
                        "--momentum", "0.9", "--output", str(tmp_path / "select.md")])  # fmt: skip
    for name in ("TopK", "TopK + momentum 0.9", "DGC", "DGC + momentum 0.9"):
        _density, select_ms, add_ms, _ratio, _first = numbers(text, f"0.02M | 0.01 | {name}")
        assert select_ms > 0 and add_ms > 0, name
    assert "| RandomK |" not in text
    with pytest.raises(SystemExit, match="--only: unknown method"):
        select.main(["--sizes", "2e4", "--methods", "--only", "topk", "--output", str(tmp_path / "x.md")])


def test_select_reads_only_as_density_reads_its_methods():
    """--only "TopK, DGC" was refused as "unknown method(s)  DGC", DGC among the choices it
    listed, and "--only TopK,,DGC" as "unknown method(s) ;": benchmarks.density's --methods
    ignores the spaces around a name and the empty ones."""
    assert list(select.chosen_methods(0.01, "TopK, DGC")) == ["TopK", "DGC"]
    assert list(select.chosen_methods(0.01, "TopK,,DGC,")) == ["TopK", "DGC"]
    assert list(select.chosen_methods(0.01, " , ")) == list(density.methods(0.01))


TABLE_ONLY = "--rounds, --momentum, --warmup, --dtype, --steps and --only apply to the --methods table; add --methods"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # ValueError, kthvalue's or statistics' tracebacks, or torch's list of device types
        (["--sizes", "1e6,big"], "--sizes: 'big' is no whole number of elements (at least 1); write e.g. 1e6,25e6"),
        (["--sizes", "0"], "--sizes: '0' is no whole number of elements (at least 1)"),
        (["--sizes", "1.5"], "--sizes: '1.5' is no whole number of elements (at least 1)"),  # timed 1 element
        (["--densities", "0.01,2"], "--densities: '2' is no density in (0, 1]; write e.g. 0.01,0.001"),
        (["--repeat", "0"], "--repeat must be at least 1, got 0"),
        (["--rounds", "0", "--methods"], "--rounds must be at least 1, got 0"),
        (["--threads", "-2"], "--threads must be at least 0, got -2"),
        # gradsparse.set_num_threads' ValueError, once torch had taken 5000 threads (100000: a segfault)
        (["--threads", "5000"], "--threads 5000: more than 4096, the most gradsparse's CPU kernels take; give a count"),
        (["--momentum", "1.5", "--methods"], "--momentum must be in [0, 1) (0: none), got 1.5"),
        (["--device", "tpu"], "--device: 'tpu' is neither cpu nor cuda (cuda:N for another GPU)"),
        # refused only once the first table had been timed
        (["--methods", "--only", "topk"], "--only: unknown method(s) topk; choose from TopK"),
        # the options of the methods' table, ignored without a word where it was not asked for
        (["--momentum", "0.9"], TABLE_ONLY),
        (["--rounds", "3"], TABLE_ONLY),
        (["--only", "TopK"], TABLE_ONLY),
        (["--warmup", "5"], TABLE_ONLY),
        (["--dtype", "bfloat16"], TABLE_ONLY),
        (["--steps", "steps.csv"], TABLE_ONLY),
        (["--dtype", "int8", "--methods"], "argument --dtype: invalid choice: 'int8'"),
        (
            ["--methods", "--dtype", "float16", "--device", "cuda"],
            "--dtype and --steps apply to the CPU's --methods table",
        ),
        (["--warmup", "-1", "--methods"], "--warmup must be at least 0, got -1"),
        # an empty table, and exit status 0
        (["--methods", "--only", "TopK,SparDL"], "--only SparDL: selects block by block inside its exchange"),
        # the steps written, then the report over them
        (["--methods", "--steps", "unused.md"], "--steps unused.md and --output unused.md name one file"),
    ],
)
def test_select_refuses_bad_values_before_timing_anything(argv, message, capsys, monkeypatch):
    def timed(*args, **kwargs):
        raise AssertionError("something was timed before the arguments were checked")

    monkeypatch.setattr(select, "measure", timed)
    with pytest.raises(SystemExit) as info:
        select.main([*argv, "--output", "unused.md"])
    assert info.value.code != 0
    assert message in capsys.readouterr().err + str(info.value.code)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_method_rows_time_sixteen_bit_buckets(dtype):
    """--dtype: the methods' steps on buckets of that dtype, against an add of that dtype."""
    rows = select.method_rows(200_000, 0.01, 2, only="TopK,RedSync", warmup=3, dtype=dtype)
    assert [row[2] for row in rows] == ["TopK", "RedSync"]
    for _n, _density, name, select_ms, add_ms, ratio, _first in rows:
        assert select_ms > 0 and add_ms > 0 and ratio == pytest.approx(select_ms / add_ms, rel=1e-9), name


def test_engine_rows_time_every_chosen_method_through_a_one_rank_group():
    """The GPU table's harness (--methods --device cuda), run over a one-rank Gloo group here."""
    rows = select.engine_method_rows(20_000, 0.01, 1, "cpu", "TopK,SparDL")
    assert [row[2] for row in rows] == ["dense", "TopK", "SparDL"]  # SparDL's step includes its selection
    for _n, _density, name, step_ms, add_ms, ratio in rows:
        assert step_ms > 0 and add_ms > 0 and math.isfinite(step_ms), name
        assert ratio == pytest.approx(step_ms / add_ms, rel=1e-9), name


def test_density_reports_errors_and_imbalance(tmp_path):
    text = density.main(["--steps", "60", "--world-size", "2", "--densities", "0.01", "--streams", "drift",
                         "--methods", ",".join(DRIFT_METHODS), "--imbalance-steps", "20",
                         "--output", str(tmp_path / "density.md")])  # fmt: skip
    for name in DRIFT_METHODS:
        mean, p95 = numbers(text, name)[1:3]
        assert 0 <= mean <= p95, (name, mean, p95)
    for name in ("MiCRO", "ExDyna"):  # the mean factor of their adaptive band
        assert 1.05 <= numbers(text, name)[3] <= 1.25, name
    assert numbers(text, "TopK")[1:] == [0.0, 0.0]  # exact top-k hits its count every step, and has no band
    imbalance = text.split("## Load imbalance")[1]  # at the densities asked for (it took 0.01 and 0.001)
    assert "| 0.01 |" in imbalance and "| 0.001 |" not in imbalance


def test_density_errors_are_against_the_count_the_methods_aim_at():
    """The error was |achieved / density - 1|, but every method aims at k = max(1, floor(density *
    n)) elements: exact Top-k read 1.0 at 500 elements and 0.001 (k = 1 against 0.5), and 0.0025
    on the CNN stream's 80,202 (80 against 80.202)."""
    stream = density.drift_stream(density.WARMUP + 5, 1, n=500)
    for name in ("TopK", "RandomK"):
        mean, p95, _ = density.density_errors(stream, 0.001, 1, name, density.methods(0.001)[name])
        assert (mean, p95) == (0.0, 0.0), name
    assert density.target_fraction(0.001, 80_202) == 80 / 80_202
    assert density.target_fraction(0.001, 80_202, "DGC reference") == 81 / 80_202  # DGC's k = ceil(density n)


@pytest.mark.parametrize(("flag", "value"), [("--steps", "50"), ("--imbalance-steps", "10")])
def test_density_refuses_too_few_steps_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        density.main([flag, value, "--output", "unused.md"])
    assert f"{flag} {value}: the first" in capsys.readouterr().err


def test_the_cnn_stream_without_fashion_mnist_is_refused_before_any_work(capsys, monkeypatch):
    """Without the dataset, density computed its drift table and then ended in a traceback whose
    hint was a --data-dir it does not take; threshold_moves ended alike."""
    from examples.cnn import data

    monkeypatch.setattr(data, "FASHION_MNIST_DIR", "/nonexistent/fashion-mnist")
    monkeypatch.setattr(density, "drift_stream", never("a gradient stream was drawn"))
    found = "--streams cnn trains the CNN on Fashion-MNIST, not found: /nonexistent/fashion-mnist/train-images"
    assert_refused(density.main, ["--steps", "60", "--no-imbalance", "--output", "unused.md"], found, capsys)
    assert_refused(density.main, ["--steps", "60", "--output", "unused.md"], "or leave that stream out: --streams drift",
                   capsys)  # fmt: skip
    assert_refused(threshold_moves.main, ["--output", "unused.md"], "apt-get install dataset-fashion-mnist", capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # an IndexError deep in the run
        (["--world-size", "0"], "--world-size must be at least 1 (thread ranks), got 0"),
        # a ValueError traceback, or the first method's own refusal after the stream was drawn
        (["--densities", "0.01,abc"], "--densities: 'abc' is no density in (0, 1]; write e.g. 0.01,0.001"),
        (["--densities", "0.01,0"], "--densities: '0' is no density in (0, 1]"),
        (
            ["--drift-size", "nan"],
            "--drift-size must be a whole number of elements, at least 1 (for example 200000), got nan",
        ),
        (
            ["--drift-size", "1.5"],
            "--drift-size must be a whole number of elements, at least 1 (for example 200000), got 1.5",
        ),
        (["--drift-layers", "0"], "--drift-layers must be from 1 to --drift-size (200000), got 0"),
        (
            ["--drift-size", "100", "--drift-layers", "101"],
            "--drift-layers must be from 1 to --drift-size (100), got 101",
        ),
        # an unknown stream ran the CNN's under that name; an unknown method left an empty table
        (["--streams", "drift,resnet"], "--streams: unknown stream 'resnet'; choose from drift, cnn"),
        (["--methods", "TopK,topk"], "--methods: unknown method 'topk'; choose from TopK, RandomK"),
        # measured twice, reported twice
        (["--methods", "TopK,DGC,TopK"], "--methods: TopK given twice; name each method once"),
    ],
)
def test_density_refuses_bad_values_before_drawing_a_stream(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(density, "drift_stream", never("a gradient stream was drawn"))
    monkeypatch.setattr(density, "cnn_stream", never("a gradient stream was drawn"))
    assert_refused(density.main, [*argv, "--steps", "60", "--no-imbalance", "--output", "unused.md"], message, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # statistics' "no median for empty data" once every rank had trained every method
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--width", "0"], "--width must be at least 1, got 0"),
        (["--world-size", "0"], "--world-size must be at least 1, got 0"),
        (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be more than 0 (DDP's bucket_cap_mb, in MB), got 0.0"),
        # a KeyError or the state's refusal in every spawned worker, after the methods before it had run
        (["--methods", "dense,top-k"], "--methods: unknown method 'top-k'; choose from dense, topk"),
        # one report row per entry: the second's figures were shown for both
        (["--methods", "dense,exdyna,exdyna@gather,exdyna"], "--methods: exdyna given twice; name each method once"),
        (["--density", "2"], "--methods topk --density 2.0: TopK: density must be in (0, 1], got 2.0"),
        (["--methods", "exdyna@all"], "--methods exdyna@all --density 0.01: ExDyna: exchange must be one of"),
    ],
)
def test_overlap_refuses_bad_values_before_starting_the_ranks(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(overlap, "run_distributed", never("the ranks were started"))
    monkeypatch.delenv("RANK", raising=False)
    assert_refused(overlap.main, [*argv, "--output", "unused.md"], message, capsys)


@pytest.mark.distributed
def test_overlap_times_every_mode(tmp_path):
    overlap.main(["--world-size", "2", "--methods", "dense,topk,micro@gather", "--steps", "2", "--width", "64",
                  "--depth", "3", "--bucket-cap-mb", "0.01", "--output", str(tmp_path / "overlap.md")])  # fmt: skip
    text = (tmp_path / "overlap.md").read_text()
    assert "buckets of 0.01 MB" in text.splitlines()[0]
    for method in ("dense", "topk", "micro@gather"):
        buckets, compute, exchange, serial, overlapped = numbers(text, method)[:5]
        assert buckets >= 3 and compute > 0 and overlapped > 0  # 10 KB buckets: a bucket for each 16 KB weight
        # Each printed to 3 digits (half a unit of the third digit: 0.5% at most, also where noise
        # makes the exchange, serial - compute, negative)
        rounding = 0.005 * (abs(compute) + abs(exchange) + abs(serial))
        assert serial == pytest.approx(compute + exchange, rel=0.01, abs=0.01 + rounding)
        feedback = numbers(text, method)[5]
        to_compute, to_dense, feedback_to_compute = numbers(text, method)[-3:]
        assert to_compute == pytest.approx(overlapped / compute, rel=0.02)
        assert to_dense == pytest.approx(overlapped / numbers(text, "dense")[4], rel=0.02)
        assert feedback > 0 and feedback_to_compute == pytest.approx(feedback / compute, rel=0.02)


def test_overlap_writes_a_dash_where_noise_leaves_no_exchange_to_hide(tmp_path, monkeypatch):
    # serial <= compute: the exchange measured at or below zero has no share hidden (was "nan%");
    # without dense in the run there is no ratio to it (was "nan")
    timings = {"buckets": 1, "compute": 0.010, "feedback": 0.001, "serial": 0.009, "overlapped": 0.010}
    monkeypatch.setattr(overlap, "run_distributed", lambda *args, **kwargs: [{"topk": timings}] * 2)
    monkeypatch.delenv("RANK", raising=False)
    overlap.main(["--world-size", "2", "--methods", "topk", "--output", str(tmp_path / "overlap.md")])
    row = next(line for line in (tmp_path / "overlap.md").read_text().splitlines() if line.startswith("| topk"))
    assert "nan" not in row and row.split("|")[9].strip() == "-"


def allgatherv_figures(rank: int, world_size: int) -> dict:
    from benchmarks import allgatherv

    return allgatherv.time_collectives([7, 3000], calls=2)


def test_allgatherv_times_three_ways_that_deliver_every_block():
    from gradsparse.testing import run_distributed

    for figures in run_distributed(allgatherv_figures, 3):
        assert sorted(figures) == [7, 3000]
        for best in figures.values():
            assert sorted(best) == ["all_gather", "all_to_all", "ring"]
            assert all(ms > 0 and math.isfinite(ms) for ms in best.values())


_no_process_group = never("the process group was joined")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # statistics' "no median for empty data" once compute had been timed
        (["--repeat", "0"], "--repeat must be at least 1, got 0"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),  # torch's RuntimeError
        # 100000: torch.set_num_threads' segfault
        (
            ["--threads", "100000"],
            "--threads 100000: more than 4096, the most gradsparse's CPU kernels take; give a count up to 4096\n",
        ),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # an empty batch timed
    ],
)
def test_step_ratio_refuses_bad_values_before_joining_the_process_group(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(step_ratio.dist, "init_process_group", _no_process_group)
    assert_refused(step_ratio.main, argv, message, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # int()'s ValueError, torch.randint's error, or a ZeroDivisionError, after the rendezvous
        (["--sizes", "2000,2k"], "--sizes: '2k' is no block size in bytes (at least 1); write e.g. 2000,20000"),
        (["--sizes", "-5"], "--sizes: '-5' is no block size in bytes (at least 1)"),
        (["--sizes", "2000.5"], "--sizes: '2000.5' is no block size in bytes (at least 1)"),
        (["--calls", "0"], "--calls must be at least 1, got 0"),
    ],
)
def test_allgatherv_refuses_bad_values_before_joining_the_process_group(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(allgatherv.dist, "init_process_group", _no_process_group)
    assert_refused(allgatherv.main, argv, message, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # the workers' driver refused these once the cluster had been made; the report named only
        # the model's exit status
        (["--methods", "dense,top-k"], "--methods: unknown method 'top-k'; choose from dense, "),
        (["--methods", "dense,topk,topk"], "--methods: topk given twice; name each method once"),
    ],
)
def test_seed_models_refuses_bad_methods_before_the_cluster(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(seed_models.cluster, "session", never("the cluster was set up"))
    assert_refused(seed_models.main, argv, message, capsys)


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_seed_models_refuses_a_step_count_below_one_before_the_cluster(steps, capsys, monkeypatch):
    """--steps 0 became the driver's --max-steps 0, no limit: every epoch of each seed preset."""
    monkeypatch.setattr(seed_models.cluster, "session", never("the cluster was set up"))
    assert_refused(seed_models.main, ["--steps", steps], f"--steps must be at least 1, got {steps}", capsys)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # a negative delay emulated none at all; NaN reached netem, whose refusal read as a missing module
        ({"delay_ms": -5.0}, "--delay must be a finite number of ms >= 0 (0: none), got -5.0"),
        ({"delay_ms": math.nan}, "--delay must be a finite number of ms >= 0 (0: none), got nan"),
        # handed to tc, once the namespaces and links had been made
        ({"burst": -1}, "--burst must be a number of bytes >= 0 (0: 2 ms at --rate), got -1"),
        ({"rate": "0mbit"}, "--rate must be above 0, got '0mbit'"),
    ],
)
def test_the_emulated_cluster_refuses_bad_link_settings_before_making_anything(options, message):
    """Cluster() only names what it will make: this needs no root."""
    settings = {"hosts": 2, "rate": "50mbit", **options}
    with pytest.raises(cluster.ClusterError) as info:
        cluster.Cluster(**settings)
    assert message in str(info.value)


def cells(line: str) -> list[str]:
    """A markdown table line's cells, split at the pipes that are not escaped."""
    return re.split(r"(?<!\\)\|", line.strip().strip("|"))


def test_report_tables_escape_a_pipe_inside_a_cell(tmp_path):
    """density's header "mean |d/target - 1|" went out with bare pipes: 7 header cells over a
    delimiter row of 5, a table that markdown does not render, its p95 under "d/target - 1"."""
    assert markdown_table(["a |x|", "b"], [["p|q", 1.0]]).splitlines()[0] == "| a \\|x\\| | b |"
    text = density.main(["--steps", "51", "--world-size", "1", "--densities", "0.01", "--streams", "drift",
                         "--drift-size", "2000", "--methods", "TopK", "--no-imbalance",
                         "--output", str(tmp_path / "density.md")])  # fmt: skip
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 3
    assert [len(cells(line)) for line in table] == [5, 5, 5]
    assert cells(table[0])[2].strip() == "mean \\|d/target - 1\\|"


def test_report_tables_write_values_just_below_1000_in_full():
    """.3g rounds 999.5 to 999.99 up to "1e+03", where every other value from 1000 on reads
    "1,000"; a torch.topk of 999.7 ms went into the report as 1e+03."""
    table = markdown_table(["ms"], [[999.7], [-999.5], [999.4], [1234.0]])
    assert [cells(line)[0].strip() for line in table.splitlines()[2:]] == ["1,000", "-1,000", "999", "1,234"]


def test_select_refuses_a_gpu_that_is_not_there_before_timing_anything(capsys, monkeypatch):
    """--device cuda on a machine without a GPU (or a gradsparse built without CUDA) ended in
    torch's "Torch not compiled with CUDA enabled" traceback, and cuda:N past the last GPU in
    "invalid device ordinal", both from inside the first timing."""
    monkeypatch.setattr(select, "measure", never("something was timed"))
    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: False)
    assert_refused(select.main, ["--device", "cuda", "--output", "unused.md"], "--device cuda: no GPU here", capsys)
    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(select.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(select.gs, "built_with_cuda", lambda: True)
    for device in ("cuda:2", "cuda:x"):
        message = f"--device {device}: no such GPU; give cuda:0 to cuda:1"
        assert_refused(select.main, ["--device", device, "--output", "unused.md"], message, capsys)


def test_select_times_the_gpu_that_device_names(tmp_path, monkeypatch):
    """With --device cuda:1 the tensors went to GPU 1, but torch.cuda.synchronize() waited on the
    current GPU, 0, so the timings ended before GPU 1's kernels did, and the header named GPU 0."""
    current = [0]
    ran_on = []
    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(select.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(select.gs, "built_with_cuda", lambda: True)
    monkeypatch.setattr(select.torch.cuda, "set_device", lambda d: current.__setitem__(0, torch.device(d).index))
    monkeypatch.setattr(select.torch.cuda, "get_device_name", lambda d=None: f"GPU {current[0] if d is None else d}")

    def measure(n, density, repeat, device):
        ran_on.append((device, current[0]))  # what an argument-less synchronize() would wait on
        return [f"{n / 1e6:g}M", density, *[1.0] * 10]

    monkeypatch.setattr(select, "measure", measure)
    text = select.main(["--device", "cuda:1", "--sizes", "2e4", "--densities", "0.01",
                        "--output", str(tmp_path / "select.md")])  # fmt: skip
    assert ran_on == [("cuda:1", 1)]
    assert text.startswith("# Selection cost (float32, GPU 1,")


@pytest.mark.parametrize(
    ("main", "argv", "env", "message"),
    [
        # torch's env:// ValueError traceback about RANK; link.py also took no --help
        (link.main, [], {}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: benchmarks.link runs one rank"),
        (link.main, [], {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         "WORLD_SIZE=1: benchmarks.link needs at least 2 ranks; start it with torchrun --standalone "
         "--nproc-per-node=2 -m benchmarks.link"),  # measure_link's ValueError traceback, the group left open
        (step_ratio.main, [], {}, "not set: benchmarks.step_ratio runs one rank per process; start it with torchrun"),
        # torch's traceback about WORLD_SIZE (without RANK overlap starts its own ranks)
        (overlap.main, ["--output", "unused.md"], {"RANK": "0"},
         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: benchmarks.overlap runs one rank per process"),
        (allgatherv.main, [], {}, "not set: benchmarks.allgatherv runs one rank per process; start it with torchrun"),
    ],
)  # fmt: skip
def test_launched_benchmarks_refuse_a_run_outside_a_launcher(main, argv, env, message, capsys, monkeypatch):
    """link, step_ratio and allgatherv join the group by env:// rendezvous: run as `python -m
    benchmarks.link` (the heading of its section in docs/benchmarks.md) they ended in torch's
    traceback about RANK, and link on one rank in measure_link's."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(link.dist, "init_process_group", _no_process_group)
    assert_refused(main, argv, message, capsys)


def test_link_prints_its_help_without_joining_a_group(capsys, monkeypatch):
    """`python -m benchmarks.link --help` tried the rendezvous and ended in a traceback."""
    monkeypatch.setattr(link.dist, "init_process_group", _no_process_group)
    with pytest.raises(SystemExit) as info:
        link.main(["--help"])
    assert info.value.code == 0
    assert "measure_link" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ("", "--models '': no model; give some of resnet20, vgg16, lstm, ncf"),  # a cluster made for nothing
        (",", "--models ',': no model"),
        ("lstm,ncf,lstm", "--models: lstm given twice; name each model once"),  # trained twice, reported twice
    ],
)
def test_seed_models_refuses_no_model_or_one_twice_before_the_cluster(models, message, capsys, monkeypatch):
    """--models "" set up the emulated cluster, ran nothing and wrote no report; a model named
    twice trained twice into the same run folders and had two sections in the report."""
    monkeypatch.setattr(seed_models.cluster, "session", never("the cluster was set up"))
    assert_refused(seed_models.main, ["--models", models, "--methods", "dense,topk"], message, capsys)


@pytest.mark.parametrize(
    ("main", "argv", "work", "flag", "example"),
    [
        (select.main, ["--sizes", "2e4"], (select, "measure"), "--output", "select.md"),
        (select.main, ["--methods", "--output", "select.md"], (select, "measure"), "--steps", "steps.csv"),
        (density.main, ["--no-imbalance"], (density, "drift_stream"), "--output", "density.md"),
        (seed_models.main, [], (seed_models.cluster, "session"), "--report", "seed-models.md"),
        (overlap.main, [], (overlap, "run_distributed"), "--output", "overlap.md"),
        (threshold_moves.main, [], (density, "cnn_stream"), "--output", "threshold_moves.md"),
    ],
)
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(
    main, argv, work, flag, example, tmp_path, capsys, monkeypatch
):
    """write_result opened the report once the whole run was over: a folder (an empty name is
    runs/benchmarks/ itself) ended in IsADirectoryError, a path under a file in makedirs'
    FileExistsError, and the run's figures were lost (seed_models: after the first model trained)."""
    monkeypatch.setattr(*work, never("the run started"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "runs" / "benchmarks").mkdir(parents=True)  # where select's bare --output select.md goes
    for name, message in (
        (str(tmp_path), f"{flag} '{tmp_path}': {tmp_path} is a folder; give the file to write, for example "
                        f"{flag} {tmp_path / example}"),
        ("", f"{flag} '': runs/benchmarks/ is a folder; give the file to write, for example {flag} {example}"),
        (str(tmp_path / "a-file" / "report"), f"{flag} {tmp_path}/a-file/report: cannot write "
                                              f"{tmp_path}/a-file/report: {tmp_path}/a-file is a file, not a folder"),
    ):  # fmt: skip
        if name == "" and flag == "--steps":  # no CSV asked for
            continue
        assert_refused(main, [*argv, flag, name], message, capsys)
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path))  # may not write in tmp_path
    name = str(tmp_path / "new" / "report")
    message = f"{flag} {name}: cannot write {name}: {tmp_path} is not writable by this user; give a path in a folder"
    assert_refused(main, [*argv, flag, name], message, capsys)


def test_allocator_runs_each_setting_in_a_process_of_its_own():
    """Plain DDP steps with glibc's defaults and after keep_freed_memory(), in fresh processes:
    each row has its median faults and time, and the kept setting's median step took no faults."""
    text = allocator.main(["--width", "1024", "--depth", "2", "--steps", "7", "--rounds", "1"])
    defaults, kept = numbers(text, "1 | glibc defaults"), numbers(text, "1 | keep_freed_memory()")
    _round, _faults, defaults_ms = defaults
    _round, kept_faults, kept_ms = kept
    assert defaults_ms > 0 and kept_ms > 0
    assert kept_faults < 50  # the median step's: its 4 MiB blocks come from the kept heap


@pytest.mark.parametrize("flag", ["--width", "--steps", "--rounds"])
def test_allocator_refuses_bad_values_before_starting_a_process(flag, capsys, monkeypatch):
    monkeypatch.setattr(allocator, "run_setting", never("a step process was started"))
    assert_refused(allocator.main, [flag, "0"], f"{flag} must be at least 1, got 0", capsys)
