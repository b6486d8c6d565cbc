"""Functions run on every rank by tests/distributed/test_frameworks.py: gradsparse inside Lightning,
Accelerate, the Hugging Face Trainer and torch.compile (module level, so the ranks can import them
by name).

No `from __future__ import annotations`: DDP checks hook annotations as objects.
"""

import csv
import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs
from tests.distributed.workers import Shuffled, batches, params_of


def _launcher_environment(rank: int, world_size: int) -> None:
    """The variables torchrun would set, for frameworks that read them (the process group itself
    is already initialised by run_distributed, and both frameworks then use it as it is)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
    )  # fmt: skip


# Lightning --------------------------------------------------------------------------------------


def _lightning_module():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = Shuffled()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            data = torch.utils.data.TensorDataset(
                torch.randn(64, 16, generator=g), torch.randint(0, 6, (64,), generator=g)
            )
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)  # 4 batches a rank and epoch

    return Classifier


def _trainer(folder: str, epochs: int, callbacks: list, **kwargs):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    return pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", max_epochs=epochs, callbacks=callbacks,
        logger=CSVLogger(folder, name="", version=""), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def _logged(folder: str, figure: str) -> list[float]:
    """The values of Sparsify's ``gradsparse/<figure>`` in the rows of the CSV log under ``folder``
    that hold one."""
    with open(glob.glob(f"{folder}/**/metrics.csv", recursive=True)[0]) as f:
        rows = list(csv.DictReader(f))
    return [float(r[f"gradsparse/{figure}"]) for r in rows if r.get(f"gradsparse/{figure}")]


def lightning_resume(rank: int, world_size: int, folder: str) -> dict:
    """Sparsify(ExDyna) on CPU: 2 epochs straight, against 1 epoch + Trainer.save_checkpoint (which
    rank 0 writes) + a new module, state and Trainer resumed from that file for the second epoch."""
    _launcher_environment(rank, world_size)
    Classifier = _lightning_module()
    out: dict = {}

    straight = Classifier(seed=0)
    state = gs.ExDyna(density=0.05)
    _trainer(f"{folder}/straight", 2, [gs.lightning.Sparsify(state)]).fit(straight)
    out["straight"] = params_of(straight)
    out["steps"] = state.step
    if rank == 0:
        out["logged"] = _logged(f"{folder}/straight", "achieved_density")
        out["logged_bytes"] = _logged(f"{folder}/straight", "bytes_sent")

    first = Classifier(seed=0)
    state = gs.ExDyna(density=0.05)
    trainer = _trainer(f"{folder}/first", 1, [gs.lightning.Sparsify(state)])
    trainer.fit(first)
    trainer.save_checkpoint(f"{folder}/epoch1.ckpt")  # every rank calls it; rank 0 writes
    out["saved_residuals"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}

    resumed = Classifier(seed=123)
    state = gs.ExDyna(density=0.05)
    _trainer(f"{folder}/resumed", 2, [gs.lightning.Sparsify(state)]).fit(resumed, ckpt_path=f"{folder}/epoch1.ckpt")
    out["resumed"] = params_of(resumed)

    # A checkpoint of gradsparse before 2026-12-01 keeps the state under a key that names the method.
    if rank == 0:
        checkpoint = torch.load(f"{folder}/epoch1.ckpt", weights_only=False)
        checkpoint["callbacks"] = {
            k.replace("Sparsify", "Sparsify[ExDyna]"): v for k, v in checkpoint["callbacks"].items()
        }
        torch.save(checkpoint, f"{folder}/earlier.ckpt")
    dist.barrier()
    resumed = Classifier(seed=123)
    state = gs.ExDyna(density=0.05)
    _trainer(f"{folder}/earlier", 2, [gs.lightning.Sparsify(state)]).fit(resumed, ckpt_path=f"{folder}/earlier.ckpt")
    out["resumed_earlier"] = params_of(resumed)

    # Another method: refused on every rank (it resumed from zero residuals without a word)
    try:
        _trainer(f"{folder}/other", 2, [gs.lightning.Sparsify(gs.MiCRO(density=0.05))]).fit(
            Classifier(seed=123), ckpt_path=f"{folder}/epoch1.ckpt"
        )
    except ValueError as e:
        out["other_method"] = str(e)

    # A checkpoint written without Sparsify: fit() from it is refused (it went on from zero
    # residuals without a word); validate() from it, which restores no training, is not.
    plain = _trainer(f"{folder}/plain", 1, [])
    plain.fit(Classifier(seed=0))
    plain.save_checkpoint(f"{folder}/plain.ckpt")
    sparsify = gs.lightning.Sparsify(gs.ExDyna(density=0.05))
    try:
        _trainer(f"{folder}/from_plain", 2, [sparsify]).fit(Classifier(seed=0), ckpt_path=f"{folder}/plain.ckpt")
    except ValueError as e:
        out["without_residuals"] = str(e)
    validated = Classifier(seed=0)
    validated.validation_step = lambda batch, batch_idx: None
    validated.val_dataloader = validated.train_dataloader
    _trainer(f"{folder}/validated", 1, [sparsify]).validate(validated, ckpt_path=f"{folder}/plain.ckpt")
    return out


def lightning_resume_at_another_world_size(rank: int, world_size: int, folder: str) -> dict:
    """The checkpoint of lightning_resume (2 ranks) resumed here (another world size): refused,
    naming how to reshard the callback's entry; then resumed after following that advice."""
    _launcher_environment(rank, world_size)
    Classifier = _lightning_module()
    out: dict = {}
    try:
        _trainer(f"{folder}/elsewhere", 2, [gs.lightning.Sparsify(gs.ExDyna(density=0.05))]).fit(
            Classifier(seed=123), ckpt_path=f"{folder}/epoch1.ckpt"
        )
    except ValueError as e:
        out["refused"] = str(e)
    key = gs.lightning.Sparsify(gs.ExDyna(density=0.05)).state_key
    checkpoint = torch.load(f"{folder}/epoch1.ckpt", weights_only=False)
    checkpoint["callbacks"][key] = gs.reshard(checkpoint["callbacks"][key], world_size)
    torch.save(checkpoint, f"{folder}/resharded.ckpt")
    state = gs.ExDyna(density=0.05)
    _trainer(f"{folder}/resharded", 2, [gs.lightning.Sparsify(state)]).fit(
        Classifier(seed=123), ckpt_path=f"{folder}/resharded.ckpt"
    )
    out["steps"] = state.step
    return out


def lightning_accumulation(rank: int, world_size: int, folder: str) -> dict:
    """Trainer(accumulate_grad_batches=3), which runs the batches before each optimizer step under
    DDP's no_sync (4 batches: a window of 3, then the epoch's last alone): Sparsify(TopK(density=1.0))
    against the same Trainer without it, the state's steps, the optimizer's, and the logged rows."""
    _launcher_environment(rank, world_size)
    Classifier = _lightning_module()
    state = gs.TopK(density=1.0)
    out: dict = {}
    for name, callbacks in (("plain", []), ("sparse", [gs.lightning.Sparsify(state)])):
        model = Classifier(seed=0)
        trainer = _trainer(f"{folder}/{name}", 1, callbacks, accumulate_grad_batches=3)
        trainer.fit(model)
        out[name] = params_of(model)
    out["steps"], out["optimizer_steps"] = state.step, trainer.global_step
    if rank == 0:
        out["logged_bytes"] = _logged(f"{folder}/sparse", "bytes_sent")
    return out


def lightning_strategy_hook(rank: int, world_size: int) -> dict:
    """Lightning's own DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...): the strategy (and the
    state) are built before the process group exists, as Lightning does; Lightning then registers
    the hook with its own function on CUDA devices, which is called here directly on CPU."""
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    state = gs.TopK(density=0.05)
    DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gs.hook)  # raised before states were lazy
    torch.manual_seed(0)
    ddp = DDP(Shuffled())
    _register_ddp_comm_hook(model=ddp, ddp_comm_state=state, ddp_comm_hook=gs.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in batches(rank, 3):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"steps": state.step, "density": state.stats()["total"]["density"]}


# Accelerate -------------------------------------------------------------------------------------


def _slow_custom_checkpoint_writes(rank: int):
    """On rank 0, Accelerate's write of a registered object's state (the residuals of every rank)
    starts 2 s late, as a large one, or one on a slow file system, ends late."""
    import contextlib
    import time

    import accelerate.checkpointing as checkpointing

    write = checkpointing.save

    def late(obj, f, **kwargs):
        if rank == 0 and "custom_checkpoint" in str(f):
            time.sleep(2)
        return write(obj, f, **kwargs)

    @contextlib.contextmanager
    def patched():
        checkpointing.save = late
        try:
            yield
        finally:
            checkpointing.save = write

    return patched()


def _accelerate_build(seed: int, each_node: bool = False):
    """The documented recipe: register after accelerator.prepare(), and AllRanks(state) in
    register_for_checkpointing (``each_node``: saved on each node, as both are told)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=each_node))
    torch.manual_seed(seed)
    model = Shuffled()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    state = gs.register(model, gs.SparDL(density=0.05))
    accelerator.register_for_checkpointing(gs.AllRanks(state, each_node=each_node))
    return accelerator, model, opt, state


def _accelerate_run(accelerator, model, opt, part) -> None:
    for x, y in part:
        opt.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()


def accelerate_resume(rank: int, world_size: int, folder: str) -> dict:
    """8 steps of the recipe straight, against 4 + save_state + new objects + load_state + 4, and
    against 2 + save_state + 2 + save_state to the same folder (rank 0's write late) +
    wait_for_everyone + load_state in the same run + 4."""
    _launcher_environment(rank, world_size)
    data = list(batches(rank, 8))
    accelerator, model, opt, state = _accelerate_build(0)
    out = {"wrapped": type(model).__name__}
    _accelerate_run(accelerator, model, opt, data)
    out["straight"] = params_of(model)
    accelerator, model, opt, state = _accelerate_build(0)
    _accelerate_run(accelerator, model, opt, data[:4])
    out["saved_residuals"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    accelerator.save_state(f"{folder}/state")
    accelerator, model, opt, state = _accelerate_build(123)
    accelerator.load_state(f"{folder}/state")
    out["loaded_residuals"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    _accelerate_run(accelerator, model, opt, data[4:])
    out["resumed"] = params_of(model)

    # In the same run: save_state returns on the other ranks before rank 0 has written the
    # residuals, so load_state there read the folder's earlier file without the README's barrier.
    accelerator, model, opt, state = _accelerate_build(0)
    _accelerate_run(accelerator, model, opt, data[:2])
    accelerator.save_state(f"{folder}/latest")
    _accelerate_run(accelerator, model, opt, data[2:4])
    out["saved_again"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    with _slow_custom_checkpoint_writes(rank):
        accelerator.save_state(f"{folder}/latest")
    accelerator.wait_for_everyone()
    accelerator.load_state(f"{folder}/latest")
    out["loaded_again"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    _accelerate_run(accelerator, model, opt, data[4:])
    out["resumed_in_the_same_run"] = params_of(model)
    return out


def accelerate_each_node(rank: int, world_size: int, folder: str) -> dict:
    """Each rank a node of its own (its first process), saving into a folder of its own, as with
    ProjectConfiguration(save_on_each_node=True) without a shared file system: 8 steps straight,
    against 4 + save_state + new objects + load_state from its own folder + 4."""
    _launcher_environment(rank, world_size)
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank))
    data = list(batches(rank, 8))
    accelerator, model, opt, _ = _accelerate_build(0, each_node=True)
    _accelerate_run(accelerator, model, opt, data)
    out = {"straight": params_of(model)}
    accelerator, model, opt, _ = _accelerate_build(0, each_node=True)
    _accelerate_run(accelerator, model, opt, data[:4])
    accelerator.save_state(f"{folder}/node{rank}")
    accelerator, model, opt, _ = _accelerate_build(123, each_node=True)
    accelerator.load_state(f"{folder}/node{rank}")
    _accelerate_run(accelerator, model, opt, data[4:])
    out["resumed"] = params_of(model)
    return out


def accelerate_with_a_comm_hook(rank: int, world_size: int) -> str:
    """gs.register on a model that Accelerate prepared with DistributedDataParallelKwargs(comm_hook=
    FP16), which registers that hook: the refusal."""
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    _launcher_environment(rank, world_size)
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    model = Accelerator(cpu=True, kwargs_handlers=[handler]).prepare(Shuffled())
    try:
        gs.register(model, gs.TopK(density=0.05))
    except ValueError as e:
        return str(e)
    return ""


# torch.compile ----------------------------------------------------------------------------------


def compiled_training(rank: int, world_size: int, wrapping: str) -> dict:
    """Six TopK steps with the model wrapped as ``wrapping``: eager DDP(m), DDP(torch.compile(m)) or
    torch.compile(DDP(m)); returns the parameters and the residual names a checkpoint holds."""
    torch.manual_seed(0)
    model = Shuffled()
    if wrapping == "eager":
        wrapped = DDP(model)
    elif wrapping == "compile_inside":
        wrapped = DDP(torch.compile(model))
    elif wrapping == "compile_outside":
        wrapped = torch.compile(DDP(model))
    else:
        raise AssertionError(wrapping)
    state = gs.register(wrapped, gs.TopK(density=0.05))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(rank, 6):
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
    saved = state.state_dict()
    return {"params": params_of(model), "steps": state.step, "state": saved}


def load_into_eager(rank: int, world_size: int, saved: list[dict]) -> dict:
    """Loads the state dict that rank saved from a compiled model into an eager one."""
    ddp = DDP(Shuffled())
    state = gs.register(ddp, gs.TopK(density=0.05))
    state.load_state_dict(saved[rank])
    return {"residuals": state.state_dict()["residuals"]}


def python_reducer_refused(rank: int, world_size: int) -> dict:
    """DDP built under optimize_ddp="python_reducer" calls hooks per parameter and drops their
    futures: gradsparse.register refuses it, and gradsparse.hook registered directly stops the
    backward (a failed future would have left the gradients unreduced). Each error's message."""
    before, torch._dynamo.config.optimize_ddp = torch._dynamo.config.optimize_ddp, "python_reducer"
    try:
        ddp = DDP(Shuffled())
    finally:
        torch._dynamo.config.optimize_ddp = before
    out = {}
    try:
        gs.register(ddp, gs.TopK(density=0.05))
    except ValueError as error:
        out["register"] = str(error)
    ddp.register_comm_hook(gs.TopK(density=0.05), gs.hook)
    x, y = next(iter(batches(rank, 1)))
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except RuntimeError as error:
        out["backward"] = str(error)
    return out


# gradsparse.register's arguments ----------------------------------------------------------------


class _CountingHook:
    """A hook object (no __name__, as functools.partial has none) that counts the buckets it passes on."""

    def __init__(self) -> None:
        self.buckets = 0

    def __call__(self, state, bucket):
        self.buckets += 1
        return gs.hook(state, bucket)


def _renamed_hook(state, b):  # its second parameter is not named "bucket", which DDP looked up by name
    return gs.hook(state, b)


def register_arguments(rank: int, world_size: int) -> dict:
    """Wrong arguments to gradsparse.register, each refused on every rank (the messages), then the
    hooks DDP could not take as they were, each training 2 steps (the state's steps and the buckets
    the hook object passed on)."""
    import functools

    def ddp():
        torch.manual_seed(0)
        return DDP(Shuffled())

    wrong = {
        "none": lambda: gs.register(ddp(), gs.TopK(density=0.05), hook=None),
        "one_argument": lambda: gs.register(ddp(), gs.TopK(density=0.05), hook=lambda bucket: bucket),
        "state_as_hook": lambda: gs.register(ddp(), gs.TopK(density=0.05), hook=gs.TopK(density=0.05)),
        "swapped": lambda: gs.register(gs.TopK(density=0.05), ddp()),
        "class": lambda: gs.register(ddp(), gs.TopK),
    }
    out: dict = {"errors": {}}
    for name, call in wrong.items():
        try:
            call()
        except TypeError as e:
            out["errors"][name] = str(e)
    counting = _CountingHook()
    hooks = {
        "renamed": _renamed_hook,
        "partial": functools.partial(_renamed_hook),
        "object": counting,
    }
    out["steps"] = {}
    for name, user_hook in hooks.items():
        model = ddp()
        state = gs.register(model, gs.TopK(density=0.05), hook=user_hook)
        for x, y in batches(rank, 2):
            nn.functional.cross_entropy(model(x), y).backward()
        out["steps"][name] = state.step
    out["object_buckets"] = counting.buckets
    return out


def lightning_double_precision(rank: int, world_size: int, folder: str) -> dict:
    """Sparsify in a Trainer(precision="64-true"): refused at fit's start; the parameters stay as they were."""
    _launcher_environment(rank, world_size)
    model = _lightning_module()(seed=0)
    before = params_of(model)
    try:
        _trainer(folder, 1, [gs.lightning.Sparsify(gs.TopK(density=0.05))], precision="64-true").fit(model)
    except Exception as e:  # Lightning wraps a callback's error
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    return {"error": error, "unchanged": all(torch.equal(a, b.double()) or torch.equal(a, b)
                                               for a, b in zip(params_of(model), before, strict=True))}  # fmt: skip


def lightning_loss_scaling(rank: int, world_size: int, folder: str, method: str) -> dict:
    """Sparsify of ``method`` ("topk-skip", "topk-propagate": TopK with that nonfinite, or "dense")
    in a Trainer whose precision scales the loss with a GradScaler (16-mixed: on CUDA devices
    Lightning's own, here a CPU one given as the plugin). Returns the error, the steps, whether
    the state follows the plugin's scaler and the loss scale its state dict records."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    _launcher_environment(rank, world_size)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    model = _lightning_module()(seed=0)
    state = gs.Dense() if method == "dense" else gs.TopK(density=0.05, nonfinite=method.split("-")[1])
    try:
        _trainer(folder, 1, [gs.lightning.Sparsify(state)], plugins=[plugin]).fit(model)
    except Exception as e:  # Lightning wraps a callback's error
        return {"error": f"{type(e).__name__}: {e}", "steps": state.step}
    return {"error": None, "steps": state.step, "follows": state._scaler is scaler,
            "loss_scale": state.state_dict()["loss_scale"]}  # fmt: skip


# Hugging Face Transformers ----------------------------------------------------------------------


class LossOf(nn.Module):
    """A classifier as a Trainer takes a model: keyword inputs, and the loss in the output."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def _hf_trainer(folder: str, **options):
    """A transformers.Trainer of Shuffled on 96 samples (4 steps an epoch of 12 per rank, on 2 ranks),
    SGD with momentum through the Trainer's own optimizer options, and checkpoints every 4 steps."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(7)
    data = [{"x": torch.randn(16, generator=g), "labels": torch.randint(0, 6, (), generator=g)} for _ in range(96)]
    torch.manual_seed(0)
    args = dict(
        output_dir=folder, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=12, num_train_epochs=2,
        learning_rate=0.05, optim="sgd", optim_args="momentum=0.9", lr_scheduler_type="constant",
        save_strategy="steps", save_steps=4, logging_steps=2, report_to="none", disable_tqdm=True, seed=0,
    )  # fmt: skip
    args = TrainingArguments(**{**args, **options})
    return Trainer(model=LossOf(Shuffled()), args=args, train_dataset=data, eval_dataset=data[:24])


def transformers_resume(rank: int, world_size: int, folder: str) -> dict:
    """gradsparse.transformers.sparsify(trainer, ExDyna): 8 steps straight, against a new Trainer,
    model and state resumed from the checkpoint of step 4 for the last 4 steps (by path, and with
    resume_from_checkpoint=True, the last one in the output folder); the state's steps under
    gradient accumulation; the Trainer's logs, with evaluations between them; and the error of a
    resume from a checkpoint written without sparsify."""
    _launcher_environment(rank, world_size)
    out: dict = {}
    trainer = _hf_trainer(f"{folder}/straight")
    state = gs.transformers.sparsify(trainer, gs.ExDyna(density=0.05))
    trainer.train()
    out["straight"], out["steps"], out["wrapped"] = params_of(trainer.model), state.step, type(trainer.model_wrapped)
    out["residuals"] = {n: t.clone() for n, t in state.state_dict()["residuals"].items()}
    out["logged"] = [entry for entry in trainer.state.log_history if "loss" in entry]
    for name, resume in (("by_path", f"{folder}/straight/checkpoint-4"), ("last", True)):
        trainer = _hf_trainer(f"{folder}/straight" if resume is True else f"{folder}/{name}")
        if resume is True:  # the last checkpoint is step 8's: resume from step 4's as the last one
            if rank == 0:
                import shutil

                shutil.rmtree(f"{folder}/straight/checkpoint-8")
            dist.barrier()
        state = gs.transformers.sparsify(trainer, gs.ExDyna(density=0.05))
        trainer.train(resume_from_checkpoint=resume)
        out[name] = params_of(trainer.model)
    trainer = _hf_trainer(f"{folder}/accumulated", gradient_accumulation_steps=2, save_strategy="no")
    state = gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
    trainer.train()  # the Trainer's batches but the last of each step run under no_sync
    out["accumulated_steps"], out["optimizer_steps"] = state.step, trainer.state.global_step
    trainer.train()  # again: the state goes on
    out["steps_after_a_second_train"] = state.step
    trainer = _hf_trainer(f"{folder}/evaluated", eval_strategy="steps", eval_steps=1, max_steps=4, save_strategy="no")
    gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
    trainer.train()  # evaluates after every step, logs training every 2
    trainer.evaluate()
    out["evaluated_log"] = trainer.state.log_history
    _hf_trainer(f"{folder}/plain", max_steps=4).train()  # a checkpoint without residuals
    trainer = _hf_trainer(f"{folder}/plain")
    gs.transformers.sparsify(trainer, gs.ExDyna(density=0.05))
    try:
        trainer.train(resume_from_checkpoint=f"{folder}/plain/checkpoint-4")
    except FileNotFoundError as e:
        out["without_residuals"] = str(e)
    return out


def transformers_compiled(rank: int, world_size: int, folder: str) -> dict:
    """The same 4 steps under gradsparse.transformers.sparsify with TrainingArguments(torch_compile=True),
    which compiles the Trainer's DDP (torch.compile(DDP(model))), and without it; then an eager
    Trainer resumes from the compiled run's checkpoint for 4 more steps."""
    _launcher_environment(rank, world_size)
    out: dict = {}
    for name, options in (("eager", {}), ("compiled", {"torch_compile": True})):
        trainer = _hf_trainer(f"{folder}/{name}", max_steps=4, **options)
        state = gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
        trainer.train()
        out[name] = {"params": params_of(trainer.model), "steps": state.step, "wrapped": type(trainer.model_wrapped)}
        out[name]["residuals"] = state.state_dict()["residuals"]
    trainer = _hf_trainer(f"{folder}/compiled", max_steps=8)
    state = gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
    trainer.train(resume_from_checkpoint=f"{folder}/compiled/checkpoint-4")
    out["resumed_steps"] = state.step
    return out


def transformers_each_node(rank: int, world_size: int, folder: str) -> dict:
    """Each rank a node of its own (its first process) writing checkpoints into a folder of its own,
    as under save_on_each_node=True without a shared file system: 8 steps straight, against a new
    Trainer on each node resumed from its own copy of step 4's checkpoint."""
    _launcher_environment(rank, world_size)
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank))
    out: dict = {}
    for name, resume in (("straight", None), ("resumed", f"{folder}/node{rank}/checkpoint-4")):
        trainer = _hf_trainer(f"{folder}/node{rank}", save_on_each_node=True)
        gs.transformers.sparsify(trainer, gs.ExDyna(density=0.05))
        trainer.train(resume_from_checkpoint=resume)
        out[name] = params_of(trainer.model)
    out["files"] = sorted(os.listdir(f"{folder}/node{rank}/checkpoint-4"))
    return out


def transformers_loss_scaling(rank: int, world_size: int, folder: str) -> dict:
    """6 steps of TopK under the Trainer's GradScaler (TrainingArguments(fp16=True) on CUDA, where
    Accelerate puts it at trainer.accelerator.scaler; here a CPU one put there, whose scale doubles
    after every step) against the same steps without one; then a state without
    nonfinite="propagate" under it. Returns the parameters, the saved loss scales and the error."""
    _launcher_environment(rank, world_size)
    out: dict = {}
    for name in ("plain", "scaled", "raise"):
        trainer = _hf_trainer(f"{folder}/{name}", save_strategy="no", max_grad_norm=0.0, max_steps=6)
        state = gs.TopK(density=0.1, nonfinite="raise" if name == "raise" else "propagate")
        gs.transformers.sparsify(trainer, state)
        if name != "plain":
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
        try:
            trainer.train()
        except ValueError as e:
            out[name] = str(e)
            continue
        out[name] = {"params": params_of(trainer.model), "loss_scale": state.state_dict()["loss_scale"]}
    return out


def transformers_model_init(rank: int, world_size: int, folder: str) -> dict:
    """A Trainer made with model_init (as hyperparameter_search makes one) trained twice: each
    train() builds a new model from the same seed, so both end alike when each starts from zero
    residuals. Returns both runs' parameters and the states' steps."""
    from transformers import Trainer

    _launcher_environment(rank, world_size)
    base = _hf_trainer(f"{folder}/init", save_strategy="no", max_steps=4)

    def model_init():
        torch.manual_seed(0)
        return LossOf(Shuffled())

    trainer = Trainer(model_init=model_init, args=base.args, train_dataset=base.train_dataset)
    first = gs.transformers.sparsify(trainer, gs.TopK(density=0.1))
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, gs.transformers._Sparsify))
    out = {}
    for run in ("first", "second"):
        trainer.train()
        out[run] = params_of(trainer.model)
    out["steps"] = (first.step, callback.state.step, callback.state is first)
    return out
