"""The Python snippets of README.md and docs/methods.md, each run as written inside the smallest
script a user would write around it (a tiny model, random data, CPU, Gloo), on every rank of
`torchrun --standalone --nproc-per-node=2 -m tests.distributed.snippets FOLDER`
(tests/distributed/test_snippets.py), and checked for what the text around it says.

Each snippet runs by exec() of its own lines, in a namespace that holds what a user's script has
around it (the imports the fragment does not make, a model, an optimizer) and nothing else, so a
name that does not exist, an argument in the wrong place or a missing step fails here, with a
traceback into the snippet. Some run in pieces, with the user's code between them (a training
step, a collective). One line is changed, and says so: the loss-scaling snippet's
`torch.amp.GradScaler("cuda")` runs as `torch.amp.GradScaler("cpu")`, its CPU equivalent (on a
machine without CUDA the former disables itself, and nothing of the snippet would be exercised).
"""

import contextlib
import io
import math
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/methods.md")


def snippets() -> list[tuple[str, str]]:
    """(doc, code) of every ```python block of DOCS, dedented, after as many empty lines as come
    before it in the doc, so that a traceback names the doc's own line."""
    found = []
    for relative in DOCS:
        text = (ROOT / relative).read_text()
        for m in re.finditer(r"^([ \t]*)```python\n(.*?)^[ \t]*```", text, flags=re.MULTILINE | re.DOTALL):
            lines = [line.removeprefix(m.group(1)) for line in m.group(2).splitlines(keepends=True)]
            found.append((relative, "\n" * text.count("\n", 0, m.start(2)) + "".join(lines)))
    return found


def run(code: str, namespace: dict, where: str) -> dict:
    """exec() code as the module a user runs, its tracebacks naming ``where``, the doc."""
    namespace.setdefault("__name__", "__main__")
    exec(compile(code, where, "exec"), namespace)
    return namespace


def split(code: str, before: str) -> tuple[str, str]:
    """The snippet up to the first line that starts with ``before``, and the rest (after empty
    lines in place of the first part's, for the line numbers)."""
    lines = code.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith(before)), None)
    assert at is not None, f"the snippet has no line starting with {before!r}, where its scaffolding splits it:\n{code}"
    return "".join(lines[:at]), "\n" * at + "".join(lines[at:])


def imports() -> dict:
    """What a user's script has imported around a fragment that does not import for itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsparse as gs

    return {
        "torch": torch, "dist": dist, "nn": nn, "DDP": DDP, "gs": gs, "dcp": dcp, "fully_shard": fully_shard,
        "get_model_state_dict": get_model_state_dict, "get_state_dict": get_state_dict,
        "set_state_dict": set_state_dict,
    }  # fmt: skip


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def batches(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for _ in range(steps):
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def data_loader(steps: int) -> torch.utils.data.DataLoader:
    x, y = (torch.cat(t) for t in zip(*batches(steps), strict=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def train(model: nn.Module, optimizer=None, steps: int = 3, seed: int = 0) -> None:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(steps, seed):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def quick_start(code: str, where: str, folder: str) -> None:
    """Its own imports and nothing else but the user's build_model and train; it initialises the
    process group that the other snippets then use."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        ns = run(code, {"build_model": build_model, "train": train}, where)
    density = float(output.getvalue())  # the print: state.stats()["total"]["density"]
    assert 0 < density <= 0.01, f"{where}: printed density {density}"
    assert ns["state"].step == 3
    saved = torch.load(os.path.join(folder, f"gradsparse-rank{dist.get_rank()}.pt"))  # torch's default: weights only
    assert saved["residuals"].keys() == dict(build_model().named_parameters()).keys(), saved["residuals"].keys()


def fsdp2(code: str, where: str, folder: str) -> None:
    path = os.path.join(folder, "fsdp")
    ns = run(code, {**imports(), "model": build_model(), "train": train, "path": path}, where)
    assert ns["state"].step == 3 and 0 < ns["state"].stats()["total"]["density"] <= 0.01
    assert os.path.exists(os.path.join(path, ".metadata"))


def dcp_recipe(code: str, where: str, folder: str) -> None:
    """Saves after 3 steps, trains 3 more; then, as a new run would, a new model, optimizer and
    registered state (and nothing else of the first run) resume with the snippet's last lines
    and repeat those 3 steps exactly."""
    import gradsparse as gs

    def build():
        model = nn.parallel.DistributedDataParallel(build_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, gs.register(model, gs.TopK(density=0.05))

    save, resume = split(code, "# to resume")
    path = os.path.join(folder, "dcp")
    model, opt, state = build()
    train(model, opt, steps=3)
    run(save, {**imports(), "model": model, "opt": opt, "state": state, "path": path}, where)
    train(model, opt, steps=3, seed=1)
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt, state = build()
    run(resume, {**imports(), "model": model, "opt": opt, "state": state, "path": path}, where)
    assert state.step == 3
    train(model, opt, steps=3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True)), f"{where}: not exact"


def lightning_sparsify(code: str, where: str, folder: str) -> None:
    """The Trainer line as written; its CPU settings come from Lightning's PL_TRAINER_*
    variables (accelerator, devices: 2 ranks, a few steps), which Trainer() reads."""
    import lightning.pytorch as pl

    import gradsparse as gs

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    settings = {"ACCELERATOR": "cpu", "DEVICES": "2", "MAX_STEPS": "4", "DEFAULT_ROOT_DIR": folder,
                "ENABLE_PROGRESS_BAR": "0", "ENABLE_MODEL_SUMMARY": "0", "ENABLE_CHECKPOINTING": "0"}  # fmt: skip
    os.environ.update({f"PL_TRAINER_{k}": v for k, v in settings.items()})
    ns = run(code, {"pl": pl, "gs": gs}, where)
    trainer = ns["trainer"]
    loader = data_loader(4)
    trainer.fit(Classifier(), loader)
    [sparsify] = [c for c in trainer.callbacks if isinstance(c, gs.lightning.Sparsify)]
    assert trainer.world_size == 2 and sparsify.state.step == 4, (trainer.world_size, sparsify.state.step)
    logged = {name.removeprefix("gradsparse/") for name in trainer.callback_metrics}
    assert set(gs.metrics.LOGGED) <= logged, logged  # the names the README lists


def loss_scaling(code: str, where: str, folder: str) -> None:
    """On the CPU: GradScaler("cpu") for GradScaler("cuda"). A step whose loss overflows is
    skipped by the scaler on every rank and halves the scale; the others train."""
    cpu = code.replace('torch.amp.GradScaler("cuda")', 'torch.amp.GradScaler("cpu")')
    assert cpu != code, f'{where}: no torch.amp.GradScaler("cuda") to run on the CPU'
    set_up, step = split(cpu, "scaler.scale(loss)")
    ddp_model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    ns = run(set_up, {**imports(), "ddp_model": ddp_model, "optimizer": optimizer}, where)
    scales = []
    for i, (x, y) in enumerate(batches(4)):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp_model(x), y) * (math.inf if i == 2 and dist.get_rank() == 0 else 1)
        before = [p.detach().clone() for p in ddp_model.parameters()]
        run(step, {**ns, "loss": loss}, where)
        changed = any(not torch.equal(a, b) for a, b in zip(before, ddp_model.parameters(), strict=True))
        assert changed == (i != 2), f"{where}: step {i} changed the parameters: {changed}"
        scales.append(ns["scaler"].get_scale())
    assert scales[2] == scales[1] / 2 == scales[3], scales
    assert ns["state"].step == 4


def accelerate_recipe(code: str, where: str, folder: str) -> None:
    """After the snippet, save_state and load_state (with the README's wait_for_everyone between
    them) bring back each rank's own residuals."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = data_loader(4)
    ns = run(code, {**imports(), "accelerator": accelerator, "model": model, "optimizer": optimizer,
                    "loader": loader}, where)  # fmt: skip
    model, optimizer, state = ns["model"], ns["optimizer"], ns["state"]
    assert type(model).__name__ == "DistributedDataParallel"
    train(model, optimizer, steps=2)
    saved = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    accelerator.save_state(os.path.join(folder, "accelerate"))
    train(model, optimizer, steps=2, seed=1)
    accelerator.wait_for_everyone()
    accelerator.load_state(os.path.join(folder, "accelerate"))
    loaded = state.state_dict()["residuals"]
    assert state.step == 2 and all(torch.equal(saved[n], loaded[n]) for n in saved)


def transformers_trainer(code: str, where: str, folder: str) -> None:
    """A Trainer's model (keyword inputs, the loss in its output), arguments and data around the
    snippet, whose train() runs 2 steps and checkpoints after them: the state counted both, and
    the checkpoint's folder holds the residuals."""
    import transformers

    from tests.distributed.frameworks import LossOf

    data = [{"x": x, "labels": y} for batch in data_loader(2) for x, y in zip(*batch, strict=True)]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(folder, "transformers"), use_cpu=True, ddp_backend="gloo", max_steps=2,
        per_device_train_batch_size=8, save_steps=2, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    ns = run(
        code,
        {**imports(), "transformers": transformers, "model": LossOf(build_model()), "args": args, "data": data},
        where,
    )
    assert ns["state"].step == 2, ns["state"].step
    assert os.path.isfile(os.path.join(folder, "transformers", "checkpoint-2", "gradsparse.pt"))


def ops_toolbox(code: str, where: str, folder: str) -> None:
    """Each rank selects from its own gradient and sends the message with all_gather, the
    collective a user picks; every rank adds every rank's received message. The result is the
    mean of the ranks' top-k, computed here with plain torch."""
    world_size, k = dist.get_world_size(), 10
    torch.manual_seed(dist.get_rank())
    grad, residual, out = torch.randn(100), torch.zeros(100), torch.zeros(100)
    select, receive = split(code, "indices, values = gs.unpack(")
    ns = run(select, {**imports(), "grad": grad, "residual": residual, "k": k}, where)
    messages = [torch.empty_like(ns["message"]) for _ in range(world_size)]
    dist.all_gather(messages, ns["message"])
    for received in messages:
        run(receive, {**ns, "received": received, "out": out, "world_size": world_size}, where)
    grads = [torch.empty(100) for _ in range(world_size)]
    torch.manual_seed(dist.get_rank())
    dist.all_gather(grads, torch.randn(100))
    expected = torch.zeros(100)
    for g in grads:
        top = g.abs().topk(k).indices
        expected[top] += g[top] / world_size
    torch.testing.assert_close(out, expected)
    assert int((residual != 0).sum()) == 100 - k  # what was selected left the residual


def methods_doc(code: str, where: str, folder: str) -> None:
    ddp_model = nn.parallel.DistributedDataParallel(build_model())
    ns = run(code, {**imports(), "ddp_model": ddp_model}, where)
    train(ddp_model, steps=2)
    assert ns["state"].step == 2


#: Each snippet's scaffolding, by the start of a line that only that snippet has (tests/distributed/test_snippets.py
#: checks that every ```python block of DOCS has exactly one).
SCAFFOLDS = {
    "dist.init_process_group(": quick_start,
    "fully_shard(model)": fsdp2,
    "dcp.load(": dcp_recipe,
    "trainer = pl.Trainer(": lightning_sparsify,
    "trainer = transformers.Trainer(": transformers_trainer,
    "scaler = ": loss_scaling,
    "model, optimizer, loader = accelerator.prepare(": accelerate_recipe,
    "indices, values = ": ops_toolbox,
    "state = gs.MiCRO(": methods_doc,
}


def scaffold_of(code: str) -> list[str]:
    """The SCAFFOLDS keys that start a line of ``code``."""
    return [key for key in SCAFFOLDS if any(line.startswith(key) for line in code.splitlines())]


def located(doc: str, code: str) -> str:
    """``doc:line`` of the snippet's first line."""
    before = len(code) - len(code.lstrip("\n"))
    return f"{doc}:{before + 1}"


def scaffolded() -> list[tuple[str, str, str]]:
    """(doc, code, SCAFFOLDS key) of every snippet, the quick start first (it initialises the
    process group). A snippet without scaffolding, or with two, fails here: none is skipped."""
    found = []
    for doc, code in snippets():
        keys = scaffold_of(code)
        assert len(keys) == 1, (
            f"{located(doc, code)}: a ```python block that tests/distributed/snippets.py runs with "
            f"{'no' if not keys else 'more than one'} scaffolding (SCAFFOLDS keys {keys}); give it one"
        )
        found.append((doc, code, keys[0]))
    unused = set(SCAFFOLDS) - {key for _, _, key in found}
    assert not unused, f"no ```python block of {DOCS} has a line starting with {sorted(unused)}"
    return sorted(found, key=lambda snippet: SCAFFOLDS[snippet[2]] is not quick_start)


def main(folder: str) -> None:
    os.chdir(folder)  # where the snippets write their files (gradsparse-rank{r}.pt)
    for doc, code, key in scaffolded():
        SCAFFOLDS[key](code, doc, folder)
        print(f"rank {dist.get_rank()}: {located(doc, code)} ran", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
