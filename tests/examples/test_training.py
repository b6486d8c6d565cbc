"""The examples train for real with 2 Gloo workers (torchrun and mpirun) on the offline data:
every method runs a few steps; metrics CSV, TensorBoard logs, checkpoints and the plot appear;
a run stopped and resumed ends with exactly the parameters of an uninterrupted run."""

import argparse
import csv
import glob
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import gradsparse as gs
from examples import driver
from gradsparse.testing import free_port, run_distributed
from tests.refusals import assert_refused, never
from tests.subprocesses import ROOT, environment

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

EVERY_METHOD = ",".join(driver.METHODS)  # dense, torch's hooks and every gradsparse method
# Tiny settings per task, on the data that installs offline (evaluation on part of the test data:
# it would take most of a 3-step run's time). The LSTM's epoch is 8 steps (2,000
# tokens, 2 workers x 4 columns of 250 tokens, 30-token windows), so that the resumed run of
# test_resume_is_exact stops inside an epoch and then crosses into the next.
TASKS = {
    "cnn": ["--preset", "demo", "--batch-size", "32", "--test-samples", "2000"],
    "lstm": ["--preset", "kjv-small", "--emb", "32", "--hidden", "32", "--batch-size", "4", "--train-tokens", "2000",
             "--eval-tokens", "2000"],
    "ncf": ["--preset", "ml100k", "--factors", "8", "--layers", "16,8", "--batch-size", "64"],
}  # fmt: skip


def start(command: list[str], args: list[str], timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    env = environment(OMP_NUM_THREADS="1", **env)
    return subprocess.run([*command, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def launch(command: list[str], args: list[str], timeout: float = 900) -> str:
    done = start(command, args, timeout)
    assert done.returncode == 0, f"{' '.join(command + args)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def torchrun(task: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        f"examples.{task}",
    ]


def mpirun(task: str) -> list[str]:
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is required (scripts/setup.sh installs OpenMPI)")
    return [
        "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
        "-x", f"MASTER_PORT={free_port()}", sys.executable, "-m", f"examples.{task}",
    ]  # fmt: skip


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def every_method_run(tmp_path_factory):
    """``run(launcher, task)``: the output folder and printout of 3 steps of every method, launched
    once per module (test_plot_draws_every_run plots the CNN's)."""
    runs = {}

    def run(launcher: str, task: str):
        if (launcher, task) not in runs:
            out = tmp_path_factory.mktemp(f"{launcher}-{task}")
            command = torchrun(task) if launcher == "torchrun" else mpirun(task)
            printed = launch(command, [*TASKS[task], "--method", EVERY_METHOD, "--max-steps", "3", "--out", str(out),
                                       "--no-progress"])  # fmt: skip
            runs[launcher, task] = out, printed
        return runs[launcher, task]

    return run


# Every task under torchrun; under mpirun one task (NCF) here, and the CNN in tests/examples/
# test_launch.py: what mpirun changes (gradsparse.launch's mapping of OpenMPI's variables) is the
# same for every task and method.
@pytest.mark.parametrize(("launcher", "task"), [*(("torchrun", task) for task in sorted(TASKS)), ("mpirun", "ncf")])
def test_every_method_trains(every_method_run, launcher, task):
    tmp_path, out = every_method_run(launcher, task)
    for method in EVERY_METHOD.split(","):
        folder = tmp_path / method
        steps = read_csv(folder / "steps.csv")
        assert [int(r["step"]) for r in steps] == [1, 2, 3], method
        assert all(math.isfinite(float(r["loss"])) and float(r["bytes_sent"]) > 0 for r in steps), method
        epochs = read_csv(folder / "epochs.csv")
        assert len(epochs) == 1 and math.isfinite(float(epochs[0]["loss"])), method
        # An epoch's bytes are the mean a rank sent (MiCRO's and ExDyna's ranks send different counts).
        own = [torch.load(folder / f"checkpoint-rank{r}.pt", weights_only=False)["bytes_total"] for r in (0, 1)]
        assert float(epochs[0]["bytes_sent"]) == float(epochs[0]["bytes_total"]) == sum(own) / 2, (method, own)
        assert glob.glob(str(folder / "tb" / "events.out.tfevents.*")), method
        assert (folder / "checkpoint-rank0.pt").exists() and (folder / "checkpoint-rank1.pt").exists()
        assert f"[{method:>9}]" in out
        if method not in ("dense", "powersgd", "fp16"):  # sparse: about the density of the bytes
            assert float(steps[-1]["density"]) < 0.5, (method, steps[-1])


def final_state(folder) -> tuple[dict, dict]:
    state = torch.load(folder / "checkpoint-rank1.pt", weights_only=False)
    return state["model"], state["communication"]


def assert_same(a, b, where="") -> None:
    if hasattr(a, "get_state"):  # a numpy random generator (PowerSGD's)
        assert_same(a.get_state(), b.get_state(), where)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            if k == "link" and where.endswith("/gradsparse"):
                # A measurement of the network (exchange="auto"): a resumed run reuses the one it
                # saved, the straight run made its own; both chose the same exchanges here.
                continue
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("task", sorted(TASKS))
def test_resume_is_exact(tmp_path, task):
    """Stopped after 4 steps and resumed to 9 equals 9 steps straight: parameters, optimizer,
    gradsparse state (residuals, method state), the task's state (the LSTM's carried hidden
    state and data position) and the random number generator, bit for bit. Resuming with another
    --seed or learning rate, or with another method or task, is refused on every rank, naming both, and
    leaves the saved run as it was; options that do not shape the training (its length, checkpointing) may change. The
    refusal is the driver's, the same for every task, so one task checks it."""
    args = [*TASKS[task], "--method", "topk,micro,sidco,powersgd", "--no-progress"]
    saved = tmp_path / "resumed"
    launch(torchrun(task), [*args, "--max-steps", "4", "--out", str(saved)])
    if task == "cnn":
        config = (saved / "topk" / "config.json").read_text()
        refused = start(torchrun(task), [*args, "--max-steps", "9", "--out", str(saved), "--seed", "1", "--lr", "0.5"])
        assert refused.returncode != 0
        said = refused.stdout + refused.stderr
        assert said.count("--seed 0 in the checkpoint, 1 now") == 2 and said.count(", 0.5 now") == 2, said[-3000:]
        assert (saved / "topk" / "config.json").read_text() == config
        other = [*TASKS[task], "--method", "micro", "--no-progress", "--max-steps", "9", "--out", str(saved / "topk")]
        refused = start(torchrun(task), other)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and said.count("the checkpoint is for topk on 2 workers") == 2, said[-3000:]
        assert (saved / "topk" / "config.json").read_text() == config
        # another task in the same folder: named as such (it was refused for a list of differing options)
        other = [*TASKS["lstm"], "--method", "topk", "--no-progress", "--max-steps", "9", "--out", str(saved / "topk")]
        refused = start(torchrun("lstm"), other)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and said.count("(smallcnn on fashion-mnist), this run is topk on 2") == 2, said
        assert (saved / "topk" / "config.json").read_text() == config
        # on another network (the emulated cluster's workers are told theirs): its times would mix the two
        refused = start(torchrun(task), [*args, "--max-steps", "9", "--out", str(saved)], GRADSPARSE_CLUSTER="2x50mbit")
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0, said[-3000:]
        assert (
            said.count("trained on loopback (every worker on this machine), this run is on emulated cluster 2x50mbit")
            == 2
        )
        assert (saved / "topk" / "config.json").read_text() == config
        assert torch.load(saved / "topk" / "checkpoint-rank0.pt", weights_only=False)["step"] == 4
    out = launch(torchrun(task), [*args, "--max-steps", "9", "--out", str(saved), "--checkpoint-every", "3"])
    assert "resuming from step 4" in out
    launch(torchrun(task), [*args, "--max-steps", "9", "--out", str(tmp_path / "straight")])
    for method in ("topk", "micro", "sidco", "powersgd"):
        resumed = torch.load(tmp_path / "resumed" / method / "checkpoint-rank1.pt", weights_only=False)
        straight = torch.load(tmp_path / "straight" / method / "checkpoint-rank1.pt", weights_only=False)
        assert resumed["step"] == straight["step"] == 9
        for key in ("model", "optimizer", "communication", "task", "rng"):
            assert_same(resumed[key], straight[key], f"{method}: {key}")
        steps = read_csv(tmp_path / "resumed" / method / "steps.csv")
        assert [int(r["step"]) for r in steps] == list(range(1, 10))


def test_amp_fp16_trains_under_a_grad_scaler_and_resumes_exactly(tmp_path):
    """--amp fp16: the CNN's forward pass in float16, the loss scaled by a GradScaler, which the
    gradsparse states follow (nonfinite="propagate"). Stopped after 4 steps and resumed to 9, it
    ends with the parameters, optimizer, gradsparse state and scaler of 9 steps straight, bit for
    bit; the state's residuals are in the scale of the last step's gradients."""
    methods = ("dense", "topk", "micro")
    args = [*TASKS["cnn"], "--amp", "fp16", "--method", ",".join(methods), "--no-progress"]
    launch(torchrun("cnn"), [*args, "--max-steps", "4", "--out", str(tmp_path / "resumed")])
    out = launch(torchrun("cnn"), [*args, "--max-steps", "9", "--out", str(tmp_path / "resumed")])
    assert "resuming from step 4" in out
    launch(torchrun("cnn"), [*args, "--max-steps", "9", "--out", str(tmp_path / "straight")])
    for method in methods:
        resumed = torch.load(tmp_path / "resumed" / method / "checkpoint-rank1.pt", weights_only=False)
        straight = torch.load(tmp_path / "straight" / method / "checkpoint-rank1.pt", weights_only=False)
        for key in ("model", "optimizer", "communication", "scaler", "task", "rng"):
            assert_same(resumed[key], straight[key], f"{method}: {key}")
        scale = straight["scaler"]["scale"]
        assert math.log2(scale).is_integer(), scale
        steps = read_csv(tmp_path / "straight" / method / "steps.csv")
        assert math.isfinite(float(steps[-1]["loss"])), steps[-1]
        if method != "dense":
            state = straight["communication"]["gradsparse"]
            # the scale of step 9's gradients: the scaler's now, or twice it if that step overflowed
            assert state["loss_scale"] in (scale, 2 * scale), (method, state["loss_scale"], scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_run_on_a_gpu_resumes_exactly(tmp_path):
    """The checkpoint is loaded onto the training device, and with it the random number generators'
    states, which torch.set_rng_state takes on the CPU only: every resume on a GPU ended in
    "RNG state must be a torch.ByteTensor". Two workers sharing the GPU over Gloo, stopped after 2
    steps and resumed to 3, end with the random states of 3 steps straight."""
    args = [*TASKS["cnn"], "--backend", "gloo", "--method", "dense,topk", "--no-progress"]
    launch(torchrun("cnn"), [*args, "--max-steps", "2", "--out", str(tmp_path / "resumed")])
    out = launch(torchrun("cnn"), [*args, "--max-steps", "3", "--out", str(tmp_path / "resumed")])
    assert out.count("resuming from step 2") == 2, out[-2000:]
    launch(torchrun("cnn"), [*args, "--max-steps", "3", "--out", str(tmp_path / "straight")])
    for method in ("dense", "topk"):
        resumed = torch.load(tmp_path / "resumed" / method / "checkpoint-rank1.pt", weights_only=False)
        straight = torch.load(tmp_path / "straight" / method / "checkpoint-rank1.pt", weights_only=False)
        assert resumed["step"] == straight["step"] == 3
        for key in ("rng", "cuda_rng"):  # (cuDNN's convolutions need not repeat the parameters bit for bit)
            assert_same(resumed[key], straight[key], f"{method}: {key}")


@pytest.mark.parametrize("task", ["cnn", "lstm"])
def test_fsdp_trains_and_resumes_exactly(tmp_path, task):
    """--fsdp: the CNN (momentum: the optimizer holds sharded state) and the LSTM (its LSTM one FSDP
    unit, the tied embedding and decoder in the root's) train with FSDP's own reduce-scatter and with sparse methods (Top-k through the sparse
    reduce-scatter, ExDyna through its whole exchange); stopped after 4 steps and resumed to 9, it
    ends with the parameters, optimizer and gradsparse state of 9 steps straight, bit for bit."""
    methods = ("dense", "topk", "exdyna")
    args = [*TASKS[task], "--fsdp", "--method", ",".join(methods), "--no-progress"]
    launch(torchrun(task), [*args, "--max-steps", "4", "--out", str(tmp_path / "resumed")])
    out = launch(torchrun(task), [*args, "--max-steps", "9", "--out", str(tmp_path / "resumed")])
    assert "resuming from step 4" in out
    launch(torchrun(task), [*args, "--max-steps", "9", "--out", str(tmp_path / "straight")])
    for method in methods:
        resumed = torch.load(tmp_path / "resumed" / method / "checkpoint-rank1.pt", weights_only=False)
        straight = torch.load(tmp_path / "straight" / method / "checkpoint-rank1.pt", weights_only=False)
        for key in ("model", "optimizer", "communication", "task", "rng"):
            assert_same(resumed[key], straight[key], f"{method}: {key}")
        steps = read_csv(tmp_path / "straight" / method / "steps.csv")
        assert all(math.isfinite(float(r["loss"])) and float(r["bytes_sent"]) > 0 for r in steps), method
        if method != "dense":
            assert float(steps[-1]["density"]) < 0.5, (method, steps[-1])
            residuals = straight["communication"]["gradsparse"]["residuals"]
            assert task != "lstm" or set(residuals) == {"(root)", "lstm"}, set(residuals)
            assert residuals and all(r.abs().sum() > 0 for r in residuals.values()), method
        if task == "cnn":
            assert straight["optimizer"]["state"], "momentum buffers"


def test_plot_draws_every_run(tmp_path, every_method_run, monkeypatch):
    from matplotlib.figure import Figure

    from examples import plot

    saved = []  # the figure plot.main writes
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: (saved.append(figure), save(figure, *a, **k))[1])
    png = plot.main([str(every_method_run("torchrun", "cnn")[0]), "--out", str(tmp_path / "cmp.png")])
    assert os.path.getsize(png) > 10_000
    (figure,) = saved
    for axes in figure.axes:  # one line per run, against time and against traffic
        assert sorted(line.get_label() for line in axes.get_lines()) == sorted(EVERY_METHOD.split(","))
        assert all(len(line.get_xdata()) == 1 for line in axes.get_lines())  # its one epoch


def test_synthetic_data_measures_steps_without_evaluation_or_checkpoints(tmp_path):
    """--synthetic-data: random inputs of CIFAR-10's shapes for a seed's model; quality is not
    evaluated, no checkpoint is written and the summary compares step time and traffic."""
    out = launch(torchrun("cnn"), ["--preset", "spardl-resnet20-cifar10", "--synthetic-data", "--method", "dense,topk",
                                   "--max-steps", "3", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert "resnet20 on synthetic cifar10: 2 workers (gloo), 272,474 parameters" in out
    lines = out[out.index("per step and worker") :].splitlines()
    assert lines[2].split()[0] == "dense" and lines[3].split()[0] == "topk", out[-2000:]
    assert float(lines[3].split()[-1].rstrip("x")) == pytest.approx(0.02, rel=0.1)  # density 0.01, index + value
    for method in ("dense", "topk"):
        assert not glob.glob(str(tmp_path / method / "checkpoint-*"))
        (epoch,) = read_csv(tmp_path / method / "epochs.csv")
        assert math.isnan(float(epoch["accuracy"])) and math.isfinite(float(epoch["loss"]))
        assert len(read_csv(tmp_path / method / "steps.csv")) == 3


# The two DDP checks below run in a new process (gradsparse.testing.run_distributed, one
# rank): a process group and DDP's reducer never live in the pytest process, and the run is
# bounded by a timeout even where a collective blocks inside C++.


def _bucket_counts(rank: int, world: int) -> dict[str, int]:
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.driver import ddp_options

    buckets = {}
    for method in ("dense", "powersgd"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1000))  # 8 MB: two buckets by default
        ddp = DDP(model, **ddp_options(method, model))
        for _ in range(2):  # DDP rebuilds its buckets at the second iteration
            ddp(torch.randn(2, 1000)).sum().backward()
        buckets[method] = len(ddp.reducer._get_zeros_like_grad_buckets())
    return buckets


def test_the_trainer_example_trains_dense_and_topk_and_reports_both(tmp_path):
    """examples.gpt, the Hugging Face Trainer example, runs under torchrun as its docstring says and
    sends what its methods send."""
    out = launch(torchrun("gpt"), ["--method", "dense,topk", "--max-steps", "4", "--out", str(tmp_path)], timeout=500)
    summary = re.findall(r"^ +(\w+) +([0-9.]+) +[0-9.]+s +([0-9.]+)$", out, flags=re.MULTILINE)
    rows = {method: (float(perplexity), float(sent)) for method, perplexity, sent in summary}
    assert set(rows) == {"dense", "topk"}, out[-2000:]
    assert all(perplexity > 1 for perplexity, _ in rows.values()), rows
    # Top-k at density 0.01 over gather-and-add: 2 ranks x 1% of the pairs (index and value) against
    # a ring all-reduce's whole gradient, about 2% of dense's bytes.
    assert 0 < rows["topk"][1] < 0.05 * rows["dense"][1], rows


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # a traceback once dense had trained in full, at Top-k's turn
        (["--method", "dense,topk", "--density", "0"], "--method topk: TopK: density must be in (0, 1], got 0.0"),
        (["--max-steps", "-1"], "argument --max-steps: -1 is not positive"),  # transformers' warmup_steps = -1
        (["--batch-size", "0"], "argument --batch-size: 0 is not positive"),  # a DataLoader's traceback
        (["--max-steps", "0"], "argument --max-steps: 0 is not positive"),  # a step at learning rate 0
        (["--method", "topk,topk"], "--method: topk given twice"),  # one output folder, written twice
    ],
)
def test_the_trainer_examples_bad_flags_are_refused_before_its_data_loads(argv, message, capsys, monkeypatch):
    from examples.gpt import __main__ as gpt

    monkeypatch.setattr(gpt.data, "load", never("the corpus was loaded"))
    assert_refused(gpt.main, argv, message, capsys)


@pytest.mark.parametrize(("variable", "rank"), [(None, None), ("RANK", "0"), ("RANK", "1"), ("OMPI_COMM_WORLD_RANK", "2"),
                                              ("SLURM_PROCID", "3")])  # fmt: skip
def test_a_refused_command_line_prints_its_usage_on_the_first_rank_only(variable, rank, capsys, monkeypatch):
    """Every rank refuses a bad flag with the line that names it; the 24 lines of usage come
    from the first rank (or a run without a launcher) alone, not once per rank."""
    from examples.cnn.__main__ import main

    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, rank)
    with pytest.raises(SystemExit) as info:
        main(["--epochs", "-1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "error: argument --epochs: -1 is not positive" in err
    assert ("usage:" in err) == (rank in (None, "0")), err


def test_powersgd_gets_one_bucket_off_nccl():
    """torch's PowerSGD hook issues chained all-reduces from future callbacks; on Gloo several
    buckets let ranks order them differently (a 4-worker LSTM run aborted with a size mismatch),
    so the driver gives PowerSGD one bucket there. Checked after DDP's bucket rebuild."""
    assert run_distributed(_bucket_counts, 1, timeout=300) == [{"dense": 2, "powersgd": 1}]


def test_powersgd_keeps_ddps_buckets_under_the_nccl_backends_group(monkeypatch):
    """--backend nccl joins the group "cpu:gloo,cuda:nccl" (the driver's CPU bookkeeping on Gloo),
    whose dist.get_backend() is that string, not "nccl": PowerSGD got the one bucket meant for
    Gloo and MPI on NCCL too, where its gradients (CUDA tensors) go through NCCL."""
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 1000))
    monkeypatch.setattr(driver.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert driver.ddp_options("powersgd", model) == {}
    assert driver.ddp_options("powersgd", model, 5.0) == {"bucket_cap_mb": 5.0}
    monkeypatch.setattr(driver.dist, "get_backend", lambda group=None: "gloo")
    assert driver.ddp_options("powersgd", model)["bucket_cap_mb"] > 7.6  # the whole model's 7.6 MiB


def _ncf_tables_per_bucket(rank: int, world: int) -> list[list[str]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.driver import ddp_options
    from examples.ncf.__main__ import PRESETS
    from examples.ncf.model import NeuMF

    preset = PRESETS["ml100k"]
    model = NeuMF(943, 1682, preset["factors"], tuple(int(x) for x in preset["layers"].split(",")), 0.0)
    ddp = DDP(model, **ddp_options("topk", model, preset["bucket_cap_mb"]))
    names = {id(p): n for n, p in model.named_parameters()}
    buckets: dict[int, list[str]] = {}

    def hook(_, bucket):
        buckets[bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    users, items = torch.randint(943, (64,)), torch.randint(1682, (64,))
    for _ in range(2):  # DDP rebuilds its buckets at the second iteration
        ddp(users, items).sum().backward()
    tables = [n for n in names.values() if n.startswith(("gmf_", "mlp_"))]
    return [[t for t in tables if t in held] for held in buckets.values()]


def test_the_ncf_recipe_gives_every_embedding_table_its_own_bucket():
    """A selection over one bucket holding NeuMF's GMF and MLP tables never picks the GMF ones
    (their gradients are far smaller); the ml100k preset's bucket size keeps them apart."""
    (holding,) = run_distributed(_ncf_tables_per_bucket, 1, timeout=300)
    assert sorted(len(h) for h in holding if h) == [1, 1, 1, 1], holding


def _cnn_parser():
    import argparse

    from examples.cnn import __main__ as cnn

    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    cnn.add_task_arguments(parser.add_argument_group("task"))
    return parser


def _cnn_args(argv: list[str]):
    """The CNN's arguments as its main() sees them: parsed, then the preset filled in."""
    from examples.cnn import __main__ as cnn

    parser = _cnn_parser()
    args = parser.parse_args(argv)
    driver.apply_preset(parser, args, cnn.PRESETS, argv)
    return args


def test_momentum_correction_moves_sgds_momentum_into_gradsparse_methods():
    parser = _cnn_parser()  # no preset filled in
    args = parser.parse_args(["--momentum", "0.8", "--momentum-correction"])
    assert driver.gradsparse_options("dgc", args)["momentum"] == 0.8
    assert driver.gradsparse_options("dense", args)["momentum"] == 0.8  # gradsparse's Dense: momentum SGD
    assert driver.optimizer_args("dgc", args).momentum == 0.0
    assert driver.optimizer_args("fp16", args).momentum == 0.8  # torch's hooks keep it in the optimizer
    # dense with --fsdp is FSDP's own reduce-scatter, no gradsparse state: the optimizer keeps the
    # momentum (it trained without any, the CNN's main job with --fsdp included)
    fsdp = parser.parse_args(["--momentum", "0.8", "--momentum-correction", "--fsdp"])
    assert driver.optimizer_args("dense", fsdp).momentum == 0.8
    assert driver.optimizer_args("topk", fsdp).momentum == 0.0
    plain = parser.parse_args(["--momentum", "0.8"])
    assert "momentum" not in driver.gradsparse_options("dgc", plain)
    assert driver.optimizer_args("dgc", plain).momentum == 0.8


def test_the_cnn_main_job_preset_fills_in_what_the_command_line_leaves_out():
    """A CNN run without --preset is the main job: the demo with momentum correction and the rate's
    drop before the last epoch; the command line wins, a switch's --no- form included; another
    preset replaces it; --list-presets prints each preset as flags that parse back to it."""
    from examples.cnn import __main__ as cnn

    main_job = _cnn_args([])
    assert (main_job.preset, main_job.epochs, main_job.lr_milestones, main_job.momentum_correction) == (
        "main-job",
        4,
        "3",
        True,
    )
    assert _cnn_args(["--no-momentum-correction", "--epochs", "2"]).momentum_correction is False
    # abbreviations, as argparse reads them (the preset's values replaced them)
    assert _cnn_args(["--epoch", "1"]).epochs == 1 and _cnn_args(["--epochs=2"]).epochs == 2
    assert _cnn_args(["--no-momentum-c"]).momentum_correction is False
    assert _cnn_args(["--preset", "demo", "--meth", "topk"]).method == "topk"
    demo = _cnn_args(["--preset", "demo"])
    assert (demo.epochs, demo.lr_milestones, demo.momentum_correction) == (4, "", False)
    for name, settings in cnn.PRESETS.items():
        flags = " ".join(driver.preset_flag(k, v) for k, v in settings.items()).split()
        parsed = _cnn_args(["--preset", "sidco-resnet20-cifar10", *flags])  # the flags win over a preset
        assert {k: getattr(parsed, k) for k in settings} == settings, name


def _assert_refused_before_the_process_group(module, argv: list[str], message: str, capsys) -> None:
    """The driver, with a task module's arguments and presets, exits with argparse's code 2 and
    ``message`` on stderr before it builds the task (and so before the process group)."""

    def run(argv):
        driver.main(
            never("the task was built"), "", argv, add_task_arguments=module.add_task_arguments, presets=module.PRESETS
        )

    assert_refused(run, argv, message, capsys)


@pytest.mark.parametrize(
    "argv,message",
    [
        # a method's bad option was a traceback at its turn, after the methods before it had trained
        (["--method", "dense,topk", "--density", "2"], "--method topk: TopK: density must be in (0, 1], got 2.0"),
        (["--method", "spardl", "--teams", "0"], "--method spardl: SparDL: teams must be >= 1, got 0"),
        # argparse's float and str let these through to the optimizer or the learning-rate schedule
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--momentum", "1.5"], "--momentum must be a finite number >= 0 and < 1, got 1.5"),
        (["--lr-milestones", "3,x"], "--lr-milestones: 'x' is no epoch; write epochs separated by commas"),
        # every step was at or past it: the rate dropped x0.1 from the first step
        (["--lr-milestones=-2,5"], "--lr-milestones: -2 is not after the start of training; give epochs > 0"),
        (["--bucket-cap-mb", "-1"], "--bucket-cap-mb must be a finite number > 0, got -1.0"),
        # a method given twice trained twice in one run folder, the second resuming the first's
        # finished checkpoint (or, with --fresh, overwriting it); no method at all trained nothing
        (["--method", "dense,topk,dense"], "--method: dense given twice; each method trains once, in its run folder"),
        (["--method", ","], "--method: no method in ','; give one, or several separated by commas"),
        # torch's hooks need DDP: refused at their turn, after the methods before them had trained
        (
            ["--fsdp", "--method", "dense,powersgd"],
            "--method powersgd is a DDP hook of torch's; with --fsdp use dense or a gradsparse method",
        ),
        # FSDP builds no DDP buckets: the size was ignored without a word
        (["--fsdp", "--bucket-cap-mb", "5"], "--bucket-cap-mb 5.0 sizes DDP's buckets, and --fsdp builds none"),
        # it overflowed the data order's 64-bit arithmetic mid-run
        (["--seed", "200000000000000"], "argument --seed: 200000000000000 is outside 0 to 4294967295"),
        # an option of no method of the job: the run trained without it, without a word
        (["--method", "topk", "--fit", "gpareto"], "--fit is an option of sidco, and --method topk trains none of"),
        (["--method", "dense,fp16", "--density", "0.02"], "--density is an option of topk, threshold, randomk"),
        (["--method", "dense,topk", "--threshold", "0.1"], "--threshold is an option of threshold, and --method"),
    ],
)
def test_bad_flags_are_refused_before_the_process_group(argv, message, capsys):
    from examples.cnn import __main__ as cnn

    _assert_refused_before_the_process_group(cnn, argv, message, capsys)


def test_a_presets_bucket_size_does_not_refuse_fsdp():
    """--bucket-cap-mb with --fsdp is refused where the command line gives it, not where a preset
    does (NCF's default preset sets one per embedding table)."""
    from examples.ncf import __main__ as ncf

    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    ncf.add_task_arguments(parser.add_argument_group("task"))
    for argv in (["--fsdp"], ["--fsdp", "--preset", "ml100k"]):
        args = parser.parse_args(argv)
        driver.apply_preset(parser, args, ncf.PRESETS, argv)
        driver.check_arguments(parser, args, ["dense"], argv)  # no SystemExit
    assert args.bucket_cap_mb == ncf.PRESETS["ml100k"]["bucket_cap_mb"]


@pytest.mark.parametrize(
    "task,argv,message",
    [
        # once the data was loaded and the process group joined: int()'s, float()'s, Adam's and the
        # model's ValueErrors, or dropout's RuntimeError at the first forward (NaN)
        ("ncf", ["--layers", "64,x"], "argument --layers: '64,x': give sizes of at least 1 separated by commas"),
        ("ncf", ["--layers", "63,16"], "the first even (the two MLP embeddings side by side)"),
        ("ncf", ["--adam-betas", "0.9;0.999"], "argument --adam-betas: '0.9;0.999': give two numbers in [0, 1)"),
        ("ncf", ["--adam-betas", "1.5,0.9"], "argument --adam-betas: '1.5,0.9': give two numbers in [0, 1)"),
        ("ncf", ["--adam-eps", "-1"], "argument --adam-eps: '-1' is not a finite number >= 0: give for example 1e-8"),
        (
            "ncf",
            ["--dropout", "nan"],
            "argument --dropout: 'nan' is not a finite number >= 0 and < 1: give for example 0.2 (0: none)",
        ),
        ("lstm", ["--dropout", "1.5"], "argument --dropout: '1.5' is not a finite number >= 0 and < 1"),
        ("lstm", ["--dropout", "x"], "argument --dropout: 'x' is not a finite number >= 0 and < 1"),
    ],
)
def test_bad_task_flags_are_refused_before_the_process_group(task, argv, message, capsys):
    import importlib

    _assert_refused_before_the_process_group(
        importlib.import_module(f"examples.{task}.__main__"), argv, message, capsys
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--momentum-correction", "--momentum-correction moves SGD's momentum into the method, but this task trains"),
        ("--momentum=0.5", "--momentum is SGD's, but this task trains with Adam; drop the flag"),  # was ignored
    ],
)
def test_momentum_flags_are_refused_for_a_task_without_sgd_before_its_data_loads(capsys, monkeypatch, flag, message):
    """NCF trains with Adam: --momentum-correction was refused once every rank had joined the
    process group and loaded the ratings (minutes for MovieLens-20M), and --momentum was recorded
    in the run's config and ignored. The task's optimizer_class names its optimizer: argparse
    refuses both before either, on every rank."""
    from examples.ncf import __main__ as ncf

    monkeypatch.setattr(ncf.Recommendation, "__init__", never("the data was loaded"))
    monkeypatch.setattr(driver, "init_distributed", never("the process group was joined"))
    assert_refused(ncf.main, [flag], message, capsys)


def _checked_cnn_args(argv: list[str]) -> argparse.Namespace:
    """The CNN's arguments as the driver reads and checks them."""
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    args = parser.parse_args(argv)
    driver.check_arguments(parser, args, args.method.split(","), argv)
    return args


def test_threshold_takes_the_density_where_only_the_density_is_given():
    """--method threshold --density 0.05 trained at the fixed threshold 1e-3 (82% of the LSTM's
    gradients), the density ignored: Threshold(density=...) was out of the driver's reach."""

    def chosen(argv: list[str]) -> dict:
        options = driver.gradsparse_options("threshold", _checked_cnn_args(argv))
        gs.Threshold(**options)  # exactly one of the two
        return {k: options[k] for k in ("threshold", "density") if k in options}

    assert chosen(["--method", "dense,threshold", "--density", "0.05"]) == {"density": 0.05}
    assert chosen(["--method", "threshold", "--threshold", "0.01", "--density", "0.05"]) == {"threshold": 0.01}
    assert chosen(["--method", "threshold"]) == {"threshold": 1e-3}


def test_a_resume_compares_only_the_options_its_method_takes():
    """Resuming dense with --exchange gather or another --density (options of the job's other
    methods) was refused for options dense never read; a change of an option the method takes
    still is."""
    saved = _checked_cnn_args(["--method", "dense,topk"])
    now = _checked_cnn_args(["--method", "dense,micro", "--exchange", "gather", "--density", "0.02"])
    assert driver.changed_options(driver.run_options(saved, "dense"), driver.run_options(now, "dense")) == []
    changed = driver.changed_options(driver.run_options(saved, "topk"), driver.run_options(now, "topk"))
    assert changed == ["--density 0.01 in the checkpoint, 0.02 now", "--exchange None in the checkpoint, 'gather' now"]


def test_an_out_laid_out_for_another_number_of_methods_is_refused(tmp_path):
    """A job of one method writes into --out itself, one of several into <out>/<method>: a Top-k
    job given the folder of a dense,topk job started Top-k afresh beside its earlier run (not
    resuming it), and examples.plot then read the folder as that one run."""
    (tmp_path / "job" / "topk").mkdir(parents=True)
    (tmp_path / "job" / "topk" / "epochs.csv").write_text("epoch\n")
    assert driver.other_layout(str(tmp_path / "job"), ["dense", "topk"]) is None
    said = driver.other_layout(str(tmp_path / "job"), ["topk"])
    assert f"give --out {tmp_path / 'job' / 'topk'} (it resumes that folder's run)" in said, said
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "checkpoint-rank0.pt").write_bytes(b"")
    assert driver.other_layout(str(tmp_path / "one"), ["topk"]) is None
    assert "holds the run of a job of one method" in driver.other_layout(str(tmp_path / "one"), ["dense", "topk"])


def test_the_reported_accuracy_is_rank_0s_model_when_batchnorm_statistics_differ_by_rank(tmp_path):
    """After a step each rank's BatchNorm holds running statistics of its own batches (DDP sends
    rank 0's at the next forward), and each rank scored its share of the test images with its own:
    the reported accuracy was a mix of two models, neither of them the one saved. It is now rank
    0's model's, the saved one, scored here on one process (rank 1 scores images 1000 to 1999)."""
    from examples.cnn import data, models

    args = ["--model", "resnet20", "--method", "dense", "--epochs", "1", "--max-steps", "10", "--test-samples", "2000"]
    launch(torchrun("cnn"), [*args, "--batch-size", "16", "--no-progress", "--out", str(tmp_path)])
    _, _, x_test, y_test = data.fashion_mnist(None)
    right = []  # per rank's saved model: whether it classifies each of the 2000 images right
    for rank in (0, 1):
        model = models.build("resnet20", 1, 10, 28)
        saved = torch.load(tmp_path / f"checkpoint-rank{rank}.pt", weights_only=False)["model"]
        model.load_state_dict({k.removeprefix("module."): v for k, v in saved.items()})
        with torch.no_grad():
            right.append(model.eval()(x_test[:2000]).argmax(1) == y_test[:2000])
    assert (right[0][1000:] != right[1][1000:]).any()  # the ranks' models score some images apart
    (row,) = read_csv(tmp_path / "epochs.csv")
    assert float(row["accuracy"]) == int(right[0].sum()) / 2000, (row["accuracy"], int(right[0].sum()))


def test_a_missing_dataset_is_said_once_without_a_traceback(tmp_path):
    """Data that is not there (CIFAR-10 cannot be downloaded here) ended every rank in a
    traceback around the loader's message; now rank 0 says it and every rank exits."""
    args = ["--dataset", "cifar10", "--model", "resnet20", "--data-dir", str(tmp_path / "none"), "--max-steps", "1"]
    refused = start(torchrun("cnn"), [*args, "--no-progress", "--out", str(tmp_path / "out")])
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert said.count("cifar10: no cifar-10-batches-py or cifar-10-batches-bin folder under") == 1, said[-3000:]
    assert "FileNotFoundError" not in said and "examples/driver.py" not in said, said[-3000:]


def summary_table(printed: str) -> list[str]:
    """The summary's target line and table (from "target ..." to the blank line after it)."""
    lines = printed.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("target "))
    return lines[first : lines.index("", first)]


def test_a_resumed_runs_summary_reads_the_epochs_trained_before_it(tmp_path):
    """The summary of a run stopped and resumed takes every epoch since the run began: the resumed
    process knew only its own, so a run stopped after its first epoch measured time to target from
    the second alone, and running a finished experiment again printed an empty summary (every
    method resumed at its end, with no row). Stopped inside the second epoch, resumed to the end,
    then run once more: the last two print the same summary, of both methods."""
    args = [*TASKS["lstm"], "--method", "dense,topk", "--epochs", "2", "--no-progress", "--out", str(tmp_path)]
    launch(torchrun("lstm"), [*args, "--max-steps", "12"])
    finished = summary_table(launch(torchrun("lstm"), args))
    again = launch(torchrun("lstm"), args)
    assert again.count("already trained, to step 16") == 2 and "pass --fresh to train it again" in again, again[-2000:]
    assert [line.split()[0] for line in finished[2:]] == ["dense", "topk"], finished
    assert summary_table(again) == finished, again[-2000:]
    dense = read_csv(tmp_path / "dense" / "epochs.csv")
    assert [row["epoch"] for row in dense] == ["1", "1.5", "2"]
    target = float(dense[-1]["perplexity"]) * 1.05
    first = next(row for row in dense if row["epoch"] != "1.5" and float(row["perplexity"]) <= target)
    assert finished[2].split()[3] == f"{float(first['elapsed_seconds']):.1f}s", (finished, dense)


def test_an_out_folder_that_cannot_be_written_is_refused_before_any_method_trains(tmp_path):
    """--out, or a method's folder under it, that is an existing file ended the run in
    os.makedirs' FileExistsError on rank 0 (and Gloo's "connection closed" on the others): for
    <out>/topk after dense had trained. Refused once, before any method trains, naming the file."""
    (tmp_path / "topk").write_text("not a folder")
    args = [*TASKS["lstm"], "--method", "dense,topk", "--max-steps", "2", "--no-progress", "--out", str(tmp_path)]
    refused = start(torchrun("lstm"), args)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert said.count(f"cannot write the run folder {tmp_path / 'topk'}: {tmp_path / 'topk'} is a file") == 1, said
    assert "FileExistsError" not in said and not (tmp_path / "dense" / "steps.csv").exists(), said[-3000:]


def test_every_rank_makes_its_run_folders_and_clears_its_checkpoints(tmp_path, monkeypatch, capsys):
    """Each rank writes its own checkpoint, and nodes without a shared filesystem see only their
    own folders: rank 0 alone made them (the other nodes' ranks failed at their first checkpoint)
    and cleared --fresh's checkpoints (the other nodes resumed theirs). Here as rank 1 of 2, with
    rank 0's verdict gathered beside its own; a reason rank 1 alone meets stops both, and rank 0
    prints it."""
    monkeypatch.setattr(driver.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [None, mine]))
    monkeypatch.setattr(driver.dist, "barrier", lambda: None)
    folders = [str(tmp_path / "out" / m) for m in ("dense", "topk")]
    args = argparse.Namespace(fresh=True, synthetic_data=False)
    driver.ready_folders(str(tmp_path / "out"), folders, args, rank=1, world=2)
    assert all(os.path.isdir(folder) for folder in folders)
    saved = tmp_path / "out" / "topk" / "checkpoint-rank1.pt"
    saved.write_bytes(b"saved")
    driver.ready_folders(str(tmp_path / "out"), folders, args, rank=1, world=2)
    assert not saved.exists()
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(driver.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, mine]))
    with pytest.raises(SystemExit):
        driver.ready_folders(str(tmp_path / "file"), [str(tmp_path / "file" / "topk")], args, rank=0, world=2)
    assert capsys.readouterr().err.count("cannot write the run folder") == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        # SparDL's teams must divide the world size, known once the process group exists
        (
            ["--method", "dense,spardl", "--teams", "3"],
            "--method spardl: SparDL: teams=3 does not divide the world size 2; the ranks form teams of equal size",
        ),
        # the exchanges on MPI_COMM_WORLD, which torchrun does not make
        pytest.param(
            ["--method", "topk", "--transport", "mpi"],
            '--method topk: TopK: transport="mpi" runs on MPI_COMM_WORLD (here rank 0 of 1) but torch.distributed '
            "has rank 0 of 2; the two differ on 2 of the 2 ranks",
            marks=pytest.mark.skipif(not gs._C.mpi_available(), reason="this build has no MPI"),
        ),
    ],
    ids=["teams", "mpi-under-torchrun"],
)
def test_an_option_that_does_not_fit_the_launch_is_refused_on_every_rank_without_a_traceback(tmp_path, argv, message):
    """Options that only the process group can check ended every rank in a traceback at the
    method's turn, after the methods before it had trained (--teams 3 on 2 workers), or at its
    registration (--transport mpi under torchrun). Refused on every rank with the state's own
    message: the world size before any method trains, the transport where it is registered."""
    args = [*TASKS["lstm"], *argv, "--max-steps", "2", "--no-progress"]
    refused = start(torchrun("lstm"), [*args, "--out", str(tmp_path)])
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert message in said, said[-3000:]
    assert "ValueError" not in said and "examples/driver.py" not in said, said[-3000:]  # no worker's traceback


def test_a_run_resumed_from_an_earlier_checkpoint_records_each_step_once(tmp_path):
    """A process that stopped after its last checkpoint (killed, Ctrl-C, a crash) had written the
    steps after it to steps.csv; the resumed run trains them again and appended them a second time
    (steps 1-6, then 5-9). Here the process that went on to step 6 is replaced by its checkpoint
    at step 4 (as if it died at step 6 before saving), and a row cut short is left at the end: the
    resumed run's files hold each step once, the epochs' rows up to the resume and after, and so
    do its TensorBoard events (the steps past the checkpoint were shown twice)."""
    args = [*TASKS["lstm"], "--method", "topk", "--no-progress", "--out", str(tmp_path)]
    launch(torchrun("lstm"), [*args, "--max-steps", "4"])
    kept = {rank: (tmp_path / f"checkpoint-rank{rank}.pt").read_bytes() for rank in (0, 1)}
    launch(torchrun("lstm"), [*args, "--max-steps", "6"])
    for rank, saved in kept.items():
        (tmp_path / f"checkpoint-rank{rank}.pt").write_bytes(saved)
    with open(tmp_path / "steps.csv", "a") as f:
        f.write("7,1,6.1")  # no line end: the process stopped while writing it
    out = launch(torchrun("lstm"), [*args, "--max-steps", "9"])
    assert "resuming from step 4" in out
    assert [int(r["step"]) for r in read_csv(tmp_path / "steps.csv")] == list(range(1, 10))
    assert [r["epoch"] for r in read_csv(tmp_path / "epochs.csv")] == ["0.5", "1", "1.125"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 10))
    # the epochs' rows at their steps: the stop at step 6 hidden, epochs 0.5 and 1.125 not at 0 and 1
    assert [e.step for e in events.Scalars("epoch/loss")] == [4, 8, 9]
    assert [e.value for e in events.Scalars("epoch/epoch")] == [0.5, 1, 1.125]


RANK_1_DIES_SAVING = """
import os
import sys

from examples import driver
from examples.lstm.__main__ import main

save = driver.Run.save
step = int(os.environ["DIE_SAVING_STEP"])


def dying(self):
    if self.rank == 1 and self.step == step:  # stopped before its file: rank 0's holds the step
        os._exit(1)
    save(self)


driver.Run.save = dying
main()
"""


def test_a_process_stopped_while_the_ranks_saved_resumes_from_the_save_before_on_every_rank(tmp_path):
    """Each rank replaces its own checkpoint: a process stopped while the ranks saved (rank 0's file
    at step 6, rank 1's still at step 4) left checkpoints of different steps, which were refused
    (they had made the resumed ranks train different numbers of steps, and hang), so the run could
    only start over. Each rank now keeps the checkpoint before its latest, and every rank resumes
    from step 4, ending where a run that never stopped ends; also when the resumed run is stopped
    in the same save again (rank 0's stale step-6 file had pushed out its step 4). A stop in the
    run's first save, which left rank 1 no file, was refused as a change of the number of workers;
    the run now starts over. Checkpoints without a common step, and a rank without any beside a
    rank with two saves, are still refused on every rank, naming why."""
    script = tmp_path / "dies.py"
    script.write_text(RANK_1_DIES_SAVING)
    straight = tmp_path / "straight"
    args = [*TASKS["lstm"], "--method", "topk", "--no-progress", "--checkpoint-every", "2", "--max-steps", "12"]
    dies = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    launch(torchrun("lstm"), [*args, "--out", str(straight)])

    def latest(out, rank):
        return torch.load(out / f"checkpoint-rank{rank}.pt", weights_only=False)

    def ends_as_straight(out):
        for rank in (0, 1):
            resumed, whole = latest(out, rank), latest(straight, rank)
            assert resumed["step"] == whole["step"] == 12
            for name, tensor in whole["model"].items():
                assert torch.equal(resumed["model"][name], tensor), f"rank {rank}: {name}"
        assert [int(r["step"]) for r in read_csv(out / "steps.csv")] == list(range(1, 13))

    out = tmp_path / "twice"
    for _ in range(2):  # stopped in the save of step 6, then again after resuming from step 4
        assert start(dies, [*args, "--out", str(out)], DIE_SAVING_STEP="6").returncode != 0
        assert [latest(out, r)["step"] for r in (0, 1)] == [6, 4]
    assert "resuming from step 4" in launch(torchrun("lstm"), [*args, "--out", str(out)])
    ends_as_straight(out)

    first = tmp_path / "first"
    assert start(dies, [*args, "--out", str(first)], DIE_SAVING_STEP="2").returncode != 0
    assert latest(first, 0)["step"] == 2 and not (first / "checkpoint-rank1.pt").exists()
    assert "had saved the run's first checkpoint when its process stopped: starting over" in launch(
        torchrun("lstm"), [*args, "--out", str(first)]
    )
    ends_as_straight(first)

    # rank 1's files both of step 12, rank 0's both of the save before: no step in common
    (out / "checkpoint-rank1.pt.previous").write_bytes((out / "checkpoint-rank1.pt").read_bytes())
    (out / "checkpoint-rank0.pt").write_bytes((out / "checkpoint-rank0.pt.previous").read_bytes())
    before = latest(out, 0)["step"]
    refused = start(torchrun("lstm"), [*args, "--out", str(out), "--max-steps", "14"], timeout=120)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert said.count("checkpoints are of different steps") == 2 and f"from {before} to 12" in said, said[-3000:]
    # rank 1's files gone, rank 0 with two saves: not a stop in the first save
    for name in ("checkpoint-rank1.pt", "checkpoint-rank1.pt.previous"):
        (first / name).unlink()
    refused = start(torchrun("lstm"), [*args, "--out", str(first), "--max-steps", "14"], timeout=120)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "only 1 of 2 ranks have a checkpoint (this rank has none)" in said, said[-3000:]
    assert (first / "checkpoint-rank0.pt").exists()


DIES_AFTER_STEP_5 = """
import os

from examples import driver
from examples.lstm.__main__ import main

one_step = driver.Run._one_step


def dying(self, *args, **kwargs):
    if self.step == 5:  # killed: no file is closed, no buffer written
        os._exit(1)
    one_step(self, *args, **kwargs)


driver.Run._one_step = dying
main()
"""


def test_a_process_killed_after_a_checkpoint_leaves_the_rows_up_to_it(tmp_path):
    """steps.csv reached the disk only at the end of an epoch (and when the run closed its files):
    a process killed after a --checkpoint-every checkpoint inside an epoch had left none of the
    epoch's rows, and the run resumed from that checkpoint lacked them (steps 4-9 of 1-9). Every
    checkpoint now writes the rows up to it first: killed after step 5, with a checkpoint at step
    3, the file holds steps 1-3, and the resumed run steps 1-9."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_AFTER_STEP_5)
    out = tmp_path / "run"
    args = [*TASKS["lstm"], "--method", "topk", "--no-progress", "--out", str(out), "--checkpoint-every", "3"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    killed = start(command, [*args, "--max-steps", "9"])
    assert killed.returncode != 0
    assert torch.load(out / "checkpoint-rank0.pt", weights_only=False)["step"] == 3
    assert [int(r["step"]) for r in read_csv(out / "steps.csv")] == [1, 2, 3]
    printed = launch(torchrun("lstm"), [*args, "--max-steps", "9"])
    assert "resuming from step 3" in printed
    assert [int(r["step"]) for r in read_csv(out / "steps.csv")] == list(range(1, 10))


def test_fresh_deletes_the_checkpoints_of_the_run_it_starts_over(tmp_path):
    """--fresh left the folder's checkpoints until its own first one replaced them: a --fresh run
    that wrote none (stopped early, or --synthetic-data, which never checkpoints) let the next run
    resume the old run, appending to the new run's metrics. A --synthetic-data run without --fresh
    into a folder holding checkpoints is refused, and leaves the saved run as it was."""
    args = [*TASKS["cnn"], "--method", "topk", "--no-progress", "--out", str(tmp_path)]
    launch(torchrun("cnn"), [*args, "--max-steps", "4"])
    steps = (tmp_path / "steps.csv").read_text()
    refused = start(torchrun("cnn"), [*args, "--max-steps", "2", "--synthetic-data"])
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and said.count("holds the checkpoints of a training run") == 1, said[-3000:]
    assert (tmp_path / "steps.csv").read_text() == steps
    launch(torchrun("cnn"), [*args, "--max-steps", "2", "--synthetic-data", "--fresh"])
    assert not glob.glob(str(tmp_path / "checkpoint-rank*"))
    out = launch(torchrun("cnn"), [*args, "--max-steps", "3"])
    assert "resuming" not in out
    assert [int(r["step"]) for r in read_csv(tmp_path / "steps.csv")] == [1, 2, 3]


def test_a_thread_count_above_the_kernels_limit_is_refused_before_the_process_group(capsys, monkeypatch):
    """--threads took any count >= 0, and gradsparse.set_num_threads, which takes at most 4096,
    ended every rank in a ValueError traceback once the launcher's environment was read (under
    torchrun, mpirun or srun). Refused by argparse with the limit, before the process group."""
    from examples.cnn import __main__ as cnn

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # as under torchrun
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process keeps its threads
    monkeypatch.setattr(driver.dist, "init_process_group", never("the process group was joined"))
    _assert_refused_before_the_process_group(
        cnn, ["--threads", "5000"], "argument --threads: 5000 is more than 4096", capsys
    )


def _multi_node_mpirun(monkeypatch) -> list:
    """Rank 0 of 4 that mpirun started across 2 nodes (2 a node), with no MASTER_ADDR; this process
    keeps its threads, and init_process_group records the backends it was asked for (returned)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    joined: list = []
    monkeypatch.setattr(driver.dist, "init_process_group", lambda backend: joined.append(backend))
    return joined


def test_a_multi_node_mpirun_without_master_addr_is_told_to_give_one(monkeypatch):
    """Across nodes gradsparse.launch leaves MASTER_ADDR unset (127.0.0.1 would be each node's own):
    the examples say which address to pass and how, before the process group, unless the MPI
    backend (which needs none) is asked for."""
    joined = _multi_node_mpirun(monkeypatch)
    monkeypatch.setattr(driver.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(driver.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(driver.dist, "is_mpi_available", lambda: True)
    with pytest.raises(SystemExit, match=r"MASTER_ADDR is unset: .*mpirun -x MASTER_ADDR=node1 .*--backend mpi"):
        driver.init_distributed(argparse.Namespace(threads=1, backend="gloo"))
    assert joined == []
    assert driver.init_distributed(argparse.Namespace(threads=1, backend="mpi")) == (0, 4) and joined == ["mpi"]


def test_backend_mpi_on_a_torch_without_mpi_says_so_and_what_to_use(monkeypatch):
    """pip's torch has no MPI backend: --backend mpi there stops before the process
    group with the fix (torch's own error is a traceback), and the MASTER_ADDR message does not
    offer it."""
    joined = _multi_node_mpirun(monkeypatch)
    monkeypatch.setattr(driver.dist, "is_mpi_available", lambda: False)
    with pytest.raises(SystemExit, match=r"--backend mpi: this torch has no MPI backend.*--backend gloo"):
        driver.init_distributed(argparse.Namespace(threads=1, backend="mpi"))
    with pytest.raises(SystemExit, match=r"MASTER_ADDR is unset") as raised:
        driver.init_distributed(argparse.Namespace(threads=1, backend="gloo"))
    assert "--backend mpi" not in str(raised.value) and joined == []
