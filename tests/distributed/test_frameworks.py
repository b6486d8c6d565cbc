"""gradsparse where users train: Lightning, Accelerate, the Hugging Face Trainer and torch.compile,
each on 2 Gloo ranks.

lightning, accelerate and transformers are test dependencies (pyproject.toml's test extra,
scripts/setup.sh): these tests import them and fail without them rather than skip.
"""

import math
from types import SimpleNamespace

import lightning  # noqa: F401  (a missing test dependency fails here, loudly)
import pytest
import torch
import transformers  # noqa: F401

from gradsparse.testing import run_distributed
from tests.distributed import frameworks
from tests.distributed.workers import Shuffled

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _assert_equal_params(a: list, b: list, what: str) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), f"{what}: differs by {(x - y).abs().max()}"


def test_lightning_sparsify_trains_logs_and_resumes_each_rank_exactly(tmp_path):
    results = run_distributed(frameworks.lightning_resume, 2, str(tmp_path), timeout=400)
    for rank, r in enumerate(results):
        assert r["steps"] == 8, r["steps"]  # 2 epochs x 4 batches went through the hook
        # rank 0 wrote the checkpoint, but each rank got its own residuals back: resume is exact
        _assert_equal_params(r["straight"], r["resumed"], f"rank {rank}")
        _assert_equal_params(r["straight"], r["resumed_earlier"], f"rank {rank}, a checkpoint of the earlier key")
        assert "MiCRO.load_state_dict: the state dict was saved by ExDyna(" in r.get("other_method", ""), r
        assert "fit(ckpt_path=...) resumes from a checkpoint that holds no residuals" in r.get(
            "without_residuals", ""
        ), r.get("without_residuals")
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["saved_residuals"].values(),
                                                     results[1]["saved_residuals"].values(), strict=True))  # fmt: skip
    # At another world size: refused naming how to reshard the callback's entry, which then resumes
    [elsewhere] = run_distributed(frameworks.lightning_resume_at_another_world_size, 1, str(tmp_path), timeout=300)
    assert "checkpoint['callbacks']['gradsparse.lightning.Sparsify'] = gradsparse.reshard(" in elsewhere.get(
        "refused", ""
    ), elsewhere
    assert elsewhere["steps"] == 12, elsewhere  # the saved 4 steps, then the second epoch's 8 batches at one rank
    logged = results[0]["logged"]
    assert len(logged) == 8 and all(0 < d <= 0.1 for d in logged), logged  # ExDyna's achieved density, target 0.05
    assert all(b > 0 for b in results[0]["logged_bytes"])


def test_lightning_sparsify_under_gradient_accumulation_steps_once_per_optimizer_step(tmp_path):
    """The batches Lightning accumulates run under no_sync and reach no hook: the state counts the
    optimizer's steps, at density 1.0 trains as the Trainer without it, and Sparsify's logged rows
    are one per optimizer step, each with its exchange (after such a batch Sparsify reads the
    statistics of no exchange: no step, and no density)."""
    results = run_distributed(frameworks.lightning_accumulation, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r["steps"] == r["optimizer_steps"] == 2, r
        _assert_equal_params(r["plain"], r["sparse"], f"rank {rank}")
    assert len(results[0]["logged_bytes"]) == 2 and all(b > 0 for b in results[0]["logged_bytes"]), results[0]


def test_lightning_sparsify_logs_nothing_after_a_batch_that_reduced_nothing():
    """After a batch Lightning accumulates (under no_sync, no hook runs) Sparsify logged zero bytes
    and seconds, as if a step had sent nothing."""
    import gradsparse as gs

    calls = []
    module = SimpleNamespace(log_dict=lambda figures, **options: calls.append(figures))
    gs.lightning.Sparsify(gs.TopK(density=0.05)).on_train_batch_end(None, module, None, None, 0)
    assert calls == []


def test_lightning_sparsify_refuses_a_prefix_that_is_no_string():
    """A prefix such as 5 was taken, and the first training batch failed in log_dict with Python's
    "unsupported operand type(s) for +"."""
    import gradsparse as gs

    with pytest.raises(TypeError, match=r"Sparsify: prefix must be a string, .* got 5 \(int\); for example prefix="):
        gs.lightning.Sparsify(gs.TopK(density=0.05), prefix=5)


def test_lightning_ddp_strategy_comm_hook_path():
    for r in run_distributed(frameworks.lightning_strategy_hook, 2, timeout=200):
        assert r["steps"] == 3 and 0 < r["density"] <= 0.05


def test_accelerate_recipe_resumes_each_rank_exactly(tmp_path):
    """Also load_state in the run that saved: save_state writes the residuals on rank 0 alone and
    returns on the other ranks without waiting for that write, so rank 1 read the earlier file
    saved to that folder and trained on from those residuals, without a word, until the README
    told to call accelerator.wait_for_everyone() in between."""
    results = run_distributed(frameworks.accelerate_resume, 2, str(tmp_path), timeout=400)
    for rank, r in enumerate(results):
        assert r["wrapped"] == "DistributedDataParallel"
        for name, saved in r["saved_residuals"].items():
            assert torch.equal(saved, r["loaded_residuals"][name]), f"rank {rank}: {name} is not its own"
        _assert_equal_params(r["straight"], r["resumed"], f"rank {rank}")
    for rank, r in enumerate(results):
        for name, saved in r["saved_again"].items():
            assert torch.equal(saved, r["loaded_again"][name]), f"rank {rank}: {name} is not the last one saved"
    for rank, r in enumerate(results):
        _assert_equal_params(r["straight"], r["resumed_in_the_same_run"], f"rank {rank}, in the same run")


def test_accelerate_saving_on_each_node_resumes_every_node_from_its_own_disk(tmp_path):
    """ProjectConfiguration(save_on_each_node=True) and AllRanks(state, each_node=True): each node's
    first process writes every rank's residuals, so a node without a shared file system resumes
    from its own folder (with AllRanks(state), the other nodes' files held no residuals)."""
    for rank, r in enumerate(run_distributed(frameworks.accelerate_each_node, 2, str(tmp_path), timeout=400)):
        _assert_equal_params(r["straight"], r["resumed"], f"node {rank}, resumed from its own folder")


def test_accelerate_with_a_comm_hook_of_its_own_is_refused_naming_the_setting():
    """Accelerate registers DistributedDataParallelKwargs(comm_hook=...) at prepare(): the refusal
    told to wrap the module anew in DDP, not to leave that setting out."""
    for rank, refusal in enumerate(run_distributed(frameworks.accelerate_with_a_comm_hook, 2, timeout=300)):
        assert "already has a communication hook" in refusal, f"rank {rank}: {refusal!r}"
        assert "with Accelerate, leave comm_hook out of DistributedDataParallelKwargs" in refusal, refusal


def test_transformers_trainer_sparsified_resumes_each_rank_exactly(tmp_path):
    """A Trainer resumed from a checkpoint, by its path or as the last one, ends where the run
    that wrote it ends: each rank gets its own residuals back from the checkpoint's folder. Under
    gradient accumulation the state steps once per optimizer step; a second train() goes on with
    the state. Sparsify's figures join the Trainer's training logs, and no evaluation's log."""
    from gradsparse.metrics import LOGGED

    results = run_distributed(frameworks.transformers_resume, 2, str(tmp_path), timeout=400)
    for rank, r in enumerate(results):
        assert r["wrapped"].__name__ == "DistributedDataParallel" and r["steps"] == 8, r
        assert r["accumulated_steps"] == r["optimizer_steps"] == 4, r  # 8 batches, 2 a step
        assert r["steps_after_a_second_train"] == 8, r
        assert len(r["logged"]) == 4, r["logged"]  # every 2 steps, with the figures of those 2
        for entry in r["logged"]:
            assert 0 < entry["gradsparse/achieved_density"] <= 0.1 and entry["gradsparse/bytes_sent"] > 0, entry
            assert {f"gradsparse/{name}" for name in LOGGED} <= set(entry), entry
        evaluations = [entry for entry in r["evaluated_log"] if "eval_loss" in entry]
        assert len(evaluations) == 5 and not any(k.startswith("gradsparse/") for e in evaluations for k in e), (
            evaluations
        )
        trained = [entry for entry in r["evaluated_log"] if "loss" in entry]
        assert [e["step"] for e in trained] == [2, 4] and all("gradsparse/bytes_sent" in e for e in trained), trained
        _assert_equal_params(r["straight"], r["by_path"], f"rank {rank}, resumed by path")
        _assert_equal_params(r["straight"], r["last"], f"rank {rank}, resumed from the last checkpoint")
    residuals = [r["residuals"].values() for r in results]
    assert any(not torch.equal(a, b) for a, b in zip(*residuals, strict=True))  # each rank has its own
    for r in results:  # refused on every rank, rather than resumed with zero residuals
        assert "checkpoint-4 holds no residuals (gradsparse.pt): it was written by a Trainer without" in r.get(
            "without_residuals", ""
        ), r.get("without_residuals")


def test_transformers_trainer_saving_on_each_node_resumes_every_node_from_its_own_disk(tmp_path):
    """Under save_on_each_node=True each node's first process writes the checkpoint, residuals
    included, so a node without a shared file system resumes from its own copy."""
    for rank, r in enumerate(run_distributed(frameworks.transformers_each_node, 2, str(tmp_path), timeout=400)):
        assert "gradsparse.pt" in r["files"] and "model.safetensors" in r["files"], r["files"]
        _assert_equal_params(r["straight"], r["resumed"], f"node {rank}, resumed from its own checkpoint")


@pytest.mark.timeout(1100)  # a cold inductor cache is slow
def test_transformers_trainer_with_torch_compile_trains_and_checkpoints_like_eager(tmp_path):
    """TrainingArguments(torch_compile=True) compiles the Trainer's DDP: sparsify finds the DDP
    inside, trains as eager does (up to inductor's rounding), names the residuals after the
    model's own parameters, and an eager Trainer resumes from the compiled run's checkpoint."""
    for rank, r in enumerate(run_distributed(frameworks.transformers_compiled, 2, str(tmp_path), timeout=800)):
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["wrapped"].__name__ == "OptimizedModule" and eager["steps"] == compiled["steps"] == 4, r
        for a, b in zip(eager["params"], compiled["params"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        assert (
            set(compiled["residuals"])
            == set(eager["residuals"])
            == {n for n, _ in frameworks.LossOf(Shuffled()).named_parameters()}
        )
        for name, residual in compiled["residuals"].items():
            torch.testing.assert_close(residual, eager["residuals"][name], rtol=1e-4, atol=1e-5, msg=name)
        assert r["resumed_steps"] == 8, r


def test_transformers_trainer_hands_its_loss_scaler_to_the_state(tmp_path):
    """Under TrainingArguments(fp16=True) the Trainer scales the loss with a GradScaler, which the
    state never heard of: its residuals stayed in the scale of the step that left them (training
    moved 0.01 away from the unscaled run within 6 steps), the state dict said they were in scale
    1, and under nonfinite="raise" the first overflow stopped training. The state now follows the
    scaler (the same parameters as without one, to the bit: the scales are powers of two), and a
    state that cannot is refused before training, naming the fix."""
    for rank, r in enumerate(run_distributed(frameworks.transformers_loss_scaling, 2, str(tmp_path), timeout=400)):
        _assert_equal_params(r["plain"]["params"], r["scaled"]["params"], f"rank {rank}, under the scaler")
        assert r["plain"]["loss_scale"] == 1.0 and r["scaled"]["loss_scale"] > 16.0, r
        assert "the Trainer scales the loss with a GradScaler (TrainingArguments(fp16=True))" in r["raise"], r
        assert 'create TopK with nonfinite="propagate" (or train with bf16=True' in r["raise"], r["raise"]


def test_transformers_trainer_with_model_init_gives_each_new_model_a_new_state(tmp_path):
    """Trainer(model_init=...) builds a new model at every train() (hyperparameter_search's trials):
    the second train() was refused ("already registered on another model"), a fix the user could
    not apply. Each new model now gets a new state of the same options, so the second run, from the
    same seed, ends exactly as the first (with the first run's residuals it would not)."""
    for rank, r in enumerate(run_distributed(frameworks.transformers_model_init, 2, str(tmp_path), timeout=400)):
        _assert_equal_params(r["first"], r["second"], f"rank {rank}, the second train()")
        assert r["steps"] == (4, 4, False), r["steps"]


def test_transformers_sparsify_refuses_what_it_cannot_sparsify(tmp_path):
    """Not a Trainer; a Trainer sparsified twice; a Trainer of one process (no DDP: nothing to
    sparsify, which would otherwise train dense without a word)."""
    import gradsparse as gs

    trainer = frameworks._hf_trainer(str(tmp_path), max_steps=1, ddp_backend=None)  # one process
    with pytest.raises(
        TypeError, match=r"trainer must be a transformers.Trainer .* got LossOf; .* gradsparse.register"
    ):
        gs.transformers.sparsify(trainer.model, gs.TopK(density=0.05))
    with pytest.raises(TypeError, match=r"state must be a gradsparse state .* got"):
        gs.transformers.sparsify(trainer, "topk")
    gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
    with pytest.raises(ValueError, match="sparsified already; call sparsify once per Trainer"):
        gs.transformers.sparsify(trainer, gs.TopK(density=0.05))
    with pytest.raises(
        TypeError, match=r"trains a LossOf, not a DistributedDataParallel, .*\(torchrun --nproc-per-node"
    ):
        trainer.train()


def test_ddp_built_under_the_python_reducer_is_refused_on_every_rank():
    for r in run_distributed(frameworks.python_reducer_refused, 2, timeout=200):
        assert r["register"].startswith("gradsparse.register: this DistributedDataParallel was built under "), r
        assert r["backward"].startswith("gradsparse.hook: DDP passed one parameter's gradient, not a bucket"), r
        for message in r.values():
            assert 'optimize_ddp = "python_reducer"' in message and "set optimize_ddp back to its default" in message


@pytest.mark.timeout(1100)  # above its three runs' own limits (a cold inductor cache is slow)
@pytest.mark.parametrize("wrapping", ["compile_inside", "compile_outside"])
def test_torch_compile_trains_with_the_hook_like_eager(wrapping):
    eager = run_distributed(frameworks.compiled_training, 2, "eager", timeout=300)
    compiled = run_distributed(frameworks.compiled_training, 2, wrapping, timeout=500)
    for rank, (e, c) in enumerate(zip(eager, compiled, strict=True)):
        assert c["steps"] == e["steps"] == 6
        for a, b in zip(e["params"], c["params"], strict=True):
            # inductor fuses the forward and backward: equal up to float rounding
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        # checkpoints name residuals after the model's own parameters, whatever the wrapping
        assert set(c["state"]["residuals"]) == set(e["state"]["residuals"]) == {
            "head.weight", "head.bias", "stem.weight", "stem.bias", "middle.weight", "middle.bias"
        }  # fmt: skip
    loaded = run_distributed(frameworks.load_into_eager, 2, [c["state"] for c in compiled], timeout=200)
    for rank, r in enumerate(loaded):
        for name, value in compiled[rank]["state"]["residuals"].items():
            assert torch.equal(r["residuals"][name], value), f"rank {rank}: {name} was not restored"


def test_register_refuses_wrong_arguments_on_every_rank_and_takes_any_two_argument_hook():
    """A hook whose second parameter is not named "bucket" (def timed(state, b)), a
    functools.partial and a callable object failed in DDP's check with KeyError: 'bucket' or an
    AttributeError on __name__; None failed with DDP's "Communication hook must be callable.",
    naming neither the argument nor the fix, after the state's collective set-up; swapped
    arguments and a state class were refused without saying so."""
    for r in run_distributed(frameworks.register_arguments, 2, timeout=200):
        errors = r["errors"]
        assert set(errors) == {"none", "one_argument", "state_as_hook", "swapped", "class"}, errors
        assert (
            "register: hook must be callable, got None (NoneType); pass a function hook(state, bucket)"
            in errors["none"]
        )
        assert "hook must take two arguments, the state and the bucket, got " in errors["one_argument"]
        assert "(bucket); pass a function hook(state, bucket)" in errors["one_argument"]
        assert "hook must be a communication hook, got the state" in errors["state_as_hook"]
        assert (
            "the arguments are swapped; the model comes first, gradsparse.register(model, state)" in errors["swapped"]
        )
        assert (
            "got the class gradsparse.TopK itself; create one with its options, for example gradsparse.TopK("
            in (errors["class"])
        )
        assert r["steps"] == {"renamed": 2, "partial": 2, "object": 2}, r["steps"]
        assert r["object_buckets"] > 0


def test_lightning_sparsify_refuses_double_precision_before_training(tmp_path):
    """Trainer(precision="64-true") trained until the first backward, which failed in the hook
    advising model.float() before wrapping the model in DDP, a fix Lightning's precision undoes."""
    for r in run_distributed(frameworks.lightning_double_precision, 2, str(tmp_path), timeout=300):
        assert r["error"] is not None and "the Trainer's precision is '64-true'" in r["error"], r["error"]
        assert "use Trainer(precision='32-true')" in r["error"] and "model.float()" not in r["error"], r["error"]
        assert r["unchanged"]


def test_lightning_sparsify_saving_without_a_process_group_names_the_spawn_strategies():
    """Under strategy="ddp_spawn" (or ddp_fork, ddp_notebook) fit() trains in processes Lightning
    starts, and the residuals end with them; trainer.save_checkpoint in the launching process
    afterwards failed in torch's words, "Default process group has not been initialized". Run in a
    process of its own, which has no process group whatever other tests left in this one."""
    import subprocess
    import sys

    code = (
        "import gradsparse as gs, gradsparse.lightning\n"
        "try:\n"
        "    gs.lightning.Sparsify(gs.TopK(density=0.05)).state_dict()\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR gradsparse.lightning.Sparsify: trainer.save_checkpoint was called in a process without a process" in (
        done.stdout
    ), done.stdout + done.stderr[-3000:]
    assert "strategy='ddp_spawn'" in done.stdout and "a ModelCheckpoint callback" in done.stdout


def test_lightning_sparsify_takes_loss_scaling_with_nonfinite_propagate(tmp_path):
    """precision="16-mixed" on CUDA devices scales the loss with a GradScaler, which learns of an
    overflow from the Inf/NaN gradients DDP hands back. nonfinite="skip" wrote zeros in their
    place, so the scaler took every overflowed step for a good one: that state is refused, naming
    the fix. With nonfinite="propagate" Sparsify hands the plugin's scaler to the state, whose
    residuals then follow the loss scale (the state dict records the scale they are in, read
    from the scaler: not 1)."""
    for r in run_distributed(frameworks.lightning_loss_scaling, 2, str(tmp_path / "skip"), "topk-skip", timeout=300):
        assert r["error"] is not None, "trained under a GradScaler with nonfinite='skip'"
        assert "precision '16-mixed' scales the loss with a GradScaler" in r["error"], r["error"]
        assert "create TopK with nonfinite=\"propagate\" (or train with precision='bf16-mixed'" in r["error"], r[
            "error"
        ]
        assert r["steps"] == 0
    folder = str(tmp_path / "propagate")
    for r in run_distributed(frameworks.lightning_loss_scaling, 2, folder, "topk-propagate", timeout=300):
        assert r["error"] is None and r["steps"] > 0, r
        assert r["follows"] and r["loss_scale"] != 1.0 and math.log2(r["loss_scale"]).is_integer(), r
    # the Dense state's all-reduce hands Inf/NaN on as DDP's does: it trains under the scaler
    for r in run_distributed(frameworks.lightning_loss_scaling, 2, str(tmp_path / "dense"), "dense", timeout=300):
        assert r["error"] is None and r["steps"] > 0, r


def _fit_start(state, monkeypatch, *, strategy=None, scaler=None, register=None) -> None:
    """Sparsify(state).on_fit_start in a stand-in Trainer (no process group here): its strategy
    (by default one whose model find_ddp takes for the DDP), its precision plugin's scaler (with
    one, precision '16-mixed', else '32-true'), and ``register`` in place of gradsparse.register
    (None: the real one, here on a model that is no DDP, which it refuses)."""

    import torch.nn as nn

    import gradsparse as gs

    if strategy is None:
        monkeypatch.setattr(gs.lightning, "find_ddp", lambda model: model)
        strategy = SimpleNamespace(model=nn.Linear(2, 2))
    if register is not None:
        monkeypatch.setattr(gs.lightning, "register", register)
    trainer = SimpleNamespace(
        strategy=strategy,
        precision="32-true" if scaler is None else "16-mixed",
        precision_plugin=SimpleNamespace(scaler=scaler),
    )
    gs.lightning.Sparsify(state).on_fit_start(trainer, None)


def test_lightning_sparsify_keeps_the_users_scaler_where_the_trainer_scales_no_loss(monkeypatch):
    """Under a precision without loss scaling Sparsify called state.set_scaler(None), dropping the
    scaler the user had set (one that scales the loss under manual optimization): the residuals
    then no longer followed its scale. The scaler of an earlier 16-mixed fit, which Sparsify set,
    is still dropped when a later fit scales no loss."""
    import gradsparse as gs

    mine = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    state = gs.TopK(density=0.05, nonfinite="propagate").set_scaler(mine)
    for _ in range(2):  # each fit() with a Sparsify of its own, as each Trainer takes its callbacks
        _fit_start(state, monkeypatch, register=lambda ddp, state: state)
        assert state._scaler is mine
    lightnings = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    _fit_start(state, monkeypatch, scaler=lightnings, register=lambda ddp, state: state)
    assert state._scaler is lightnings
    _fit_start(state, monkeypatch, register=lambda ddp, state: state)
    assert state._scaler is None


@pytest.mark.parametrize("before", ["none", "users"])
def test_lightning_sparsify_whose_registration_fails_leaves_the_states_scaler_as_it_was(monkeypatch, before):
    """Sparsify handed the Trainer's GradScaler to the state before registering it, and a
    registration that failed left the state following that scaler."""
    import gradsparse as gs

    mine = torch.amp.GradScaler("cpu", init_scale=2.0**4) if before == "users" else None
    state = gs.TopK(density=0.05, nonfinite="propagate").set_scaler(mine)
    with pytest.raises(TypeError, match=r"gradsparse\.register: model must be a DistributedDataParallel"):
        _fit_start(state, monkeypatch, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    assert state._scaler is mine


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "ModelParallelStrategy"])
def test_lightning_sparsify_under_an_fsdp_strategy_names_gradsparse_fsdp(monkeypatch, strategy):
    """Under Lightning's FSDP strategies the refusal said only to use DDP, not that gradsparse
    sparsifies FSDP2 models with gradsparse.fsdp.sparsify."""
    import lightning.pytorch.strategies as strategies

    import gradsparse as gs

    sharded = getattr(strategies, strategy)()
    monkeypatch.setattr(type(sharded), "model", property(lambda self: None))  # not set up: no model yet
    with pytest.raises(ValueError) as refused:
        _fit_start(gs.TopK(density=0.05), monkeypatch, strategy=sharded)
    message = str(refused.value)
    assert f"the Trainer's strategy {strategy} " in message and "gradsparse.fsdp.sparsify(model, state)" in message
    assert "fully_shard" in message and "Trainer(strategy='ddp')" in message
