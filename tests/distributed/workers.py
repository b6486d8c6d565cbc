"""Functions run on every rank by the distributed tests (module level, so the ranks can import them by name).

No `from __future__ import annotations`: DDP checks hook annotations as objects.
"""

import contextlib
import copy
import gc
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs
from gradsparse.checkpoint import checksum

STEPS = 20


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 6)).to(dtype)


def batches(rank: int, steps: int = STEPS, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        yield torch.randn(24, 16, generator=g).to(dtype), torch.randint(0, 6, (24,), generator=g)


def train(ddp: nn.Module, rank: int, steps: int = STEPS, nan_at: tuple[int, int] | None = None) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(batches(rank, steps, next(ddp.parameters()).dtype)):
        loss = nn.functional.cross_entropy(ddp(x).float(), y)
        if nan_at == (step, rank):
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()


def exchanges_used(state: gs.State) -> dict[int, str]:
    """The exchange each bucket ran since the last call (it resets the state's statistics)."""
    return {b: s["exchange"] for b, s in state.stats(reset=True)["buckets"].items()}


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# (a) density 1.0 against DDP without a hook ---------------------------------------------------


def topk_full_density_vs_no_hook(rank: int, world_size: int) -> tuple[list, list]:
    hooked = DDP(make_model(), bucket_cap_mb=0.004)
    hooked.register_comm_hook(gs.TopK(density=1.0), gs.hook)
    train(hooked, rank)
    plain = DDP(make_model(), bucket_cap_mb=0.004)
    train(plain, rank)
    return params_of(hooked.module), params_of(plain.module)


def accumulation_full_density_vs_no_hook(rank: int, world_size: int, static_graph: bool) -> tuple[list, list, int]:
    """Gradient accumulation: 3 batches per optimizer step, the first two under no_sync() (the
    first iteration synchronises: DDP's static graph needs it). Top-k at density 1.0 against DDP
    without a hook, and the steps the state counted."""

    def run(hooked: bool) -> tuple[list, int]:
        ddp = DDP(make_model(), bucket_cap_mb=0.004, static_graph=static_graph)
        state = gs.register(ddp, gs.TopK(density=1.0)) if hooked else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for i, (x, y) in enumerate(batches(rank, 12)):
            sync = i % 3 == 0
            with contextlib.nullcontext() if sync else ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
            if sync:
                opt.step()
                opt.zero_grad()
        return params_of(ddp.module), state.step if hooked else 0

    (hooked, steps), (plain, _) = run(True), run(False)
    return hooked, plain, steps


class TwoHeads(nn.Module):
    """A trunk and two heads, one used at even steps and the other at odd ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.even, self.odd = nn.Linear(16, 48), nn.Linear(48, 6), nn.Linear(48, 6)

    def forward(self, x: torch.Tensor, even: bool) -> torch.Tensor:
        return (self.even if even else self.odd)(torch.relu(self.trunk(x)))


def train_two_heads(ddp: nn.Module, rank: int, steps: int) -> list[torch.Tensor]:
    """SGD on a DDP of TwoHeads, the even head at even steps; returns the parameters."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for i, (x, y) in enumerate(batches(rank, steps)):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x, i % 2 == 0), y).backward()
        opt.step()
    return params_of(ddp.module)


def unused_parameters_vs_no_hook(rank: int, world_size: int, density: float) -> tuple[list, list, list]:
    """DDP(find_unused_parameters=True) on TwoHeads: with Top-k at ``density``, and without a hook."""

    def run(hooked: bool) -> list:
        ddp = DDP(TwoHeads(), find_unused_parameters=True, bucket_cap_mb=0.001)
        if hooked:
            gs.register(ddp, gs.TopK(density=density))
        return train_two_heads(ddp, rank, 8)

    return run(True), run(False), [p.detach().clone() for p in TwoHeads().parameters()]


def frozen_then_unfrozen(rank: int, world_size: int, density: float | None) -> tuple[list, int, list]:
    """Three phases of 3 steps on one model and one state (None: DDP without a hook): the first
    layer frozen, then every layer trained, then the last layer frozen; each phase wraps the
    module in a new DDP (DDP reduces the parameters that required gradients when it was made).
    Returns the parameters, the steps the state counted and the names its residuals are saved under."""
    model = make_model()
    state = None if density is None else gs.TopK(density=density)
    for frozen in (model[4], None, model[0]):
        for p in model.parameters():
            p.requires_grad_(frozen is None or all(p is not q for q in frozen.parameters()))
        ddp = DDP(model, bucket_cap_mb=0.004)
        if state is not None:
            gs.register(ddp, state)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        for x, y in batches(rank, 3):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    if state is None:
        return params_of(model), 0, []
    return params_of(model), state.step, sorted(state.state_dict()["residuals"])


def rewrapped_continues(rank: int, world_size: int, method: str, rewrap_at: int | None, static_graph: bool) -> list:
    """8 steps of one state on Shuffled (first-step bucket layout differs from the rebuilt one),
    with the module wrapped in a new DDP and the state registered there before step ``rewrap_at``
    (as Lightning's next fit() does); the same optimizer throughout. Returns the parameters."""
    torch.manual_seed(0)
    model = Shuffled()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gs.TopK(density=0.05) if method == "topk" else gs.ExDyna(density=0.05)
    ddp = None
    for i, (x, y) in enumerate(batches(rank, 8)):
        if i in (0, rewrap_at):
            ddp = DDP(model, bucket_cap_mb=0.004, static_graph=static_graph)
            gs.register(ddp, state)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return params_of(model)


# (b), (c) recording every bucket the hook sees -------------------------------------------------


def recorded_topk(rank: int, world_size: int, density: float, momentum: float = 0.0) -> list[dict]:
    """Trains with Top-k and records, per hook call: step, bucket, parameter names and sizes, the
    gradient in, the averaged bucket out, and this rank's residual (and velocity) after the call."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.TopK(density=density, momentum=momentum)
    log: list[dict] = []

    def recording_hook(state: gs.State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        record = {"step": state.step, "bucket": bucket.index(), "grad": bucket.buffer().clone()}

        def done(fut: torch.futures.Future) -> torch.Tensor:
            out = fut.value()
            entry = state._table.buckets[record["bucket"]]
            record["names"] = list(entry.names)
            record["numels"] = list(entry.numels)
            record["out"] = out.clone()
            record["residual"] = {k: v.clone() for k, v in entry.views("residual").items()}
            record["velocity"] = {k: v.clone() for k, v in entry.views("velocity").items()}
            log.append(record)
            return out

        return gs.hook(state, bucket).then(done)

    gs.register(ddp, state, hook=recording_hook)
    train(ddp, rank)
    return log


class Chain(nn.Module):
    """Declared b, a, head and run a -> b -> head. With one parameter per bucket DDP's first
    buckets follow the declaration backwards (head, a, b) and its rebuilt ones the order the
    gradients are ready in (head, b, a): the rebuild keeps bucket 0 and swaps the other two."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b, self.a, self.head = (nn.Linear(32, 32, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def mass_applied(rank: int, world_size: int, case: str) -> tuple[dict, dict, dict, list]:
    """Top-k at density 0.1 for 6 steps through DDP's own paths: "rebuild" (Chain, whose rebuild
    keeps bucket 0), "hooked" (the same, the state hooked with model.register_comm_hook for 3
    steps, then taken over by gradsparse.register on a new DDP of the model), "unused" (TwoHeads
    with find_unused_parameters=True, one head unused on every rank at each step) or
    "accumulation" (the same with gradient_as_bucket_view=True, and two batches a step, the first
    under no_sync(), each with a head of its own: a head may be used under no_sync() alone, or in
    neither batch), or "static" (as "unused" for 3 steps, then a new DDP with static_graph=True
    whose steps all use the even head). Returns, by parameter, the gradients the hook was handed and those DDP applied
    (each .grad after backward), summed over the steps, the final residual, and the parameter
    names of every hook call by step."""
    per_step = 2 if case == "accumulation" else 1  # batches
    chain = case in ("rebuild", "hooked")
    if chain:
        model = Chain()
        ddp = DDP(model, bucket_cap_mb_list=[0.003] * 3)  # one 4 KB parameter per bucket
    else:
        model = TwoHeads()
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001, gradient_as_bucket_view=per_step > 1)
    names = {id(p): n for n, p in model.named_parameters()}
    handed = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    applied = {n: torch.zeros_like(t) for n, t in handed.items()}
    layouts: list[tuple[int, list[str]]] = []

    def recording_hook(state: gs.State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = bucket.parameters()
        layouts.append((state.step, [names[id(p)] for p in params]))
        for p, piece in zip(params, bucket.buffer().split([p.numel() for p in params]), strict=True):
            handed[names[id(p)]] += piece.double()
        return gs.hook(state, bucket)

    if case == "hooked":
        state = gs.TopK(density=0.1)
        ddp.register_comm_hook(state, recording_hook)
    else:
        state = gs.register(ddp, gs.TopK(density=0.1), hook=recording_hook)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        if case == "hooked" and step == 3:
            ddp = DDP(model, bucket_cap_mb_list=[0.003] * 3)
            gs.register(ddp, state, hook=recording_hook)
        if case == "static" and step == 3:  # the odd head, with a residual, is used no more
            ddp = DDP(model, static_graph=True, bucket_cap_mb=0.001)
            gs.register(ddp, state, hook=recording_hook)
        model.zero_grad(set_to_none=True)  # a parameter DDP leaves alone keeps no gradient
        for i in range(per_step):
            x = torch.randn(8, 32 if chain else 16, generator=g)
            even = step % 2 == 0 if per_step == 1 else (step + i) % 3 == 0
            even = even or (case == "static" and step >= 3)
            with ddp.no_sync() if i < per_step - 1 else contextlib.nullcontext():
                (ddp(x) if chain else ddp(x, even)).pow(2).mean().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                applied[n] += p.grad.double().reshape(-1)
    residuals = {n: t.double().reshape(-1) for n, t in state.state_dict()["residuals"].items()}
    return handed, applied, residuals, layouts


def sub_group_unused_parameters(rank: int, world_size: int) -> list[torch.Tensor]:
    """Two pairs of ranks, each its own DDP and state on its pair's sub-group, with
    find_unused_parameters=True: DDP's all-reduce of the used-parameter map and the state's
    exchanges must not meet on one group."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    ddp = DDP(TwoHeads(), process_group=pair, find_unused_parameters=True, bucket_cap_mb=0.001)
    gs.register(ddp, gs.TopK(density=0.1, process_group=pair, timeout=60))
    return train_two_heads(ddp, rank, 30)


class _HalfUsed(nn.Module):
    """Two parameters; ``b`` takes part only when ``use_b`` (else unused: find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(20))
        self.b = nn.Parameter(torch.zeros(20))

    def forward(self, ga, gb, use_b):
        loss = (self.a * ga).sum()
        return loss + (self.b * gb).sum() if use_b else loss


def spardl_teams_with_a_parameter_unused_on_some_ranks(rank: int, world_size: int) -> list[float]:
    """SparDL(teams=2), ``b`` used on alternate ranks each step: per step, the largest element of
    |sum of residuals after + P x gradient - (sum of residuals before + sum of local gradients)| for ``b``."""
    model = _HalfUsed()
    ddp = DDP(model, find_unused_parameters=True)
    state = gs.register(ddp, gs.SparDL(density=0.34, teams=2))
    gen = torch.Generator().manual_seed(rank)
    errors = []
    for step in range(6):
        ga, gb = torch.randn(20, generator=gen), torch.randn(20, generator=gen)
        use_b = (step + rank) % 2 == 0
        before = state.state_dict()["residuals"].get("b", torch.zeros(20)).clone()
        model.a.grad = model.b.grad = None
        ddp(ga, gb, use_b).backward()
        after = state.state_dict()["residuals"]["b"]
        grad = torch.zeros(20) if model.b.grad is None else model.b.grad
        mine = torch.stack([before, after, gb if use_b else torch.zeros(20), grad]).double()
        total = mine.clone()
        dist.all_reduce(total)
        errors.append(float((total[1] + world_size * mine[3] - total[0] - total[2]).abs().max()))
    return errors


# (d) bad configurations and bad data ----------------------------------------------------------


def mpi_refusal(rank: int, world_size: int, case: str) -> tuple[str, str]:
    """Under mpirun, what registering a TopK state raises on this rank. "mixed": rank 0 asks for
    transport="mpi", the others for "process_group"; "sub_group": ranks 0 and 1 give their
    sub-group with transport="mpi" (the others wait at a barrier)."""
    group = None
    if case == "sub_group":
        group = dist.new_group([0, 1])
        if rank > 1:
            dist.barrier()
            return "not a member", ""
    transport = "mpi" if case == "sub_group" or rank == 0 else "process_group"
    state = gs.TopK(density=0.25, transport=transport, process_group=group, timeout=20)
    outcome = _outcome(lambda: gs.register(DDP(nn.Linear(8, 2), process_group=group), state))
    dist.barrier()
    return outcome


def mpi_serialized_states(rank: int, world_size: int) -> tuple[int, tuple[str, str], tuple[str, str]]:
    """Under mpirun, in a program that initialised MPI itself at MPI_THREAD_SERIALIZED (one
    communicating thread at a time): the thread level MPI provided, what registering a second
    transport="mpi" state raises while the first is alive, and what registering and training one
    does once the first was closed."""
    import ctypes
    import ctypes.util

    mpi = ctypes.CDLL(ctypes.util.find_library("mpi"), mode=ctypes.RTLD_GLOBAL)
    provided = ctypes.c_int()
    assert mpi.MPI_Init_thread(None, None, 2, ctypes.byref(provided)) == 0  # 2: MPI_THREAD_SERIALIZED
    first = DDP(make_model())
    state = gs.register(first, gs.TopK(density=0.1, transport="mpi"))
    alive = _outcome(lambda: gs.register(DDP(make_model()), gs.TopK(density=0.1, transport="mpi")))
    train(first, rank, steps=2)
    state.close()
    states = []

    def register_and_train() -> None:
        second = DDP(make_model())
        states.append(gs.register(second, gs.TopK(density=0.1, transport="mpi")))
        train(second, rank, steps=2)

    closed = _outcome(register_and_train)
    for later in states:
        later.close()
    mpi.MPI_Finalize()  # the program's own, as it initialised MPI (gradsparse finalises only what it initialised)
    return provided.value, alive, closed


def mpi_thread_level(rank: int, world_size: int, level: str) -> tuple[int, tuple[str, str], tuple[str, str]]:
    """Under mpirun, in a program that initialised MPI itself at thread ``level`` (1:
    MPI_THREAD_FUNNELED, 2: MPI_THREAD_SERIALIZED, 3: MPI_THREAD_MULTIPLE): the level MPI
    provided, what registering a transport="mpi" state raises, and what an MPI engine beside
    another thread that calls MPI raises (the one gradsparse counts where torch.distributed's
    backend is "mpi": its process group's worker)."""
    import ctypes
    import ctypes.util

    mpi = ctypes.CDLL(ctypes.util.find_library("mpi"), mode=ctypes.RTLD_GLOBAL)
    provided = ctypes.c_int()
    assert mpi.MPI_Init_thread(None, None, int(level), ctypes.byref(provided)) == 0
    alone = _outcome(lambda: gs.register(DDP(make_model()), gs.TopK(density=0.1, transport="mpi")).close())
    beside = _outcome(lambda: gs._C.Engine.mpi(other_mpi_threads=1).shutdown())
    mpi.MPI_Finalize()  # the program's own, as it initialised MPI
    return provided.value, alone, beside


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # the test asserts on the type and the message, per rank
        return type(e).__name__, str(e)
    return "ok", ""


def bad_configuration(rank: int, world_size: int, case: str) -> tuple[str, str]:
    def run():
        if case == "density_everywhere":
            gs.TopK(density=2.0)
        elif case == "density_on_rank_1":  # rank 1 raises at once; rank 0 at its set-up, within the timeout
            gs.TopK(density=-1.0 if rank == 1 else 0.1, timeout=5).setup()
        elif case == "missing_on_rank_1":  # rank 1 makes no state at all
            if rank == 0:
                gs.TopK(density=0.1, timeout=5).setup()
        elif case == "nan_density":
            gs.TopK(density=math.nan)
        elif case == "negative_threshold":
            gs.Threshold(threshold=-0.5)
        elif case == "unknown_option":
            gs.TopK(density=0.1, warmup=3)
        elif case == "options_differ":
            gs.TopK(density=0.1, warmup_steps=rank).setup()
        elif case == "versions_differ":  # a rank whose installation is older or newer
            if rank == 1:
                gs.__version__ = "0.0.1"
            gs.TopK(density=0.1).setup()
        elif case == "float64_bucket":
            ddp = DDP(make_model(dtype=torch.float64))
            ddp.register_comm_hook(gs.TopK(density=0.1), gs.hook)
            train(ddp, rank, steps=2)
        elif case == "buckets_differ":  # DDP keeps each rank's buckets under find_unused_parameters=True
            ddp = DDP(make_model(), find_unused_parameters=True, bucket_cap_mb=1e-6 if rank == 0 else 25)
            gs.register(ddp, gs.TopK(density=0.1))
            train(ddp, rank, steps=2)
        elif case == "skip_unused_buckets":  # DDP hands no bucket of unused parameters: none may end the step
            ddp = DDP(make_model(), find_unused_parameters=True, skip_all_reduce_unused_params=True)
            gs.register(ddp, gs.TopK(density=0.1))
            train(ddp, rank, steps=2)
        elif case == "group_mismatch":
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            ddp = DDP(make_model(), process_group=pairs[rank // 2])
            gs.register(ddp, gs.TopK(density=0.1))
            train(ddp, rank, steps=2)
        else:
            raise AssertionError(case)

    return _outcome(run)


def nonfinite_gradient(
    rank: int, world_size: int, policy: str, momentum: float = 0.0, warmup_steps: int = 0
) -> tuple[tuple[str, str], list]:
    """The outcome, the skipped steps, and whether every residual and velocity is finite after."""
    ddp = DDP(make_model())
    state = gs.register(ddp, gs.TopK(density=0.1, nonfinite=policy, momentum=momentum, warmup_steps=warmup_steps))
    outcome = _outcome(lambda: train(ddp, rank, steps=4, nan_at=(2, 1)))
    saved = state.state_dict()
    finite = all(bool(t.isfinite().all()) for kind in ("residuals", "velocities") for t in saved[kind].values())
    return outcome, [state.stats()["total"]["skipped_steps"], finite, len(saved["velocities"])]


def a_raised_step_under_unused_parameters(rank: int, world_size: int, hook: str) -> tuple[list[str], list]:
    """DDP(find_unused_parameters=True) on TwoHeads (the even head at even steps) with a TopK state
    (nonfinite="raise"), registered as it is (``hook`` "state") or under a hook of the user's that
    raises at step 0 instead ("user"): 6 steps, rank 1's loss NaN at step 0. Returns each step's
    outcome and the parameters."""
    ddp = DDP(TwoHeads(), find_unused_parameters=True, bucket_cap_mb=0.001)
    steps = []

    def raising(state, bucket):
        if not steps:
            raise ValueError("the user's hook raised")
        return gs.hook(state, bucket)

    gs.register(ddp, gs.TopK(density=0.1, timeout=20), **({"hook": raising} if hook == "user" else {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for i, (x, y) in enumerate(batches(rank, 6)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x, i % 2 == 0), y)
        if i == 0 and rank == 1 and hook == "state":
            loss = loss * float("nan")
        outcome = _outcome(lambda loss=loss: (loss.backward(), opt.step()))
        steps.append(f"{outcome[0]}: {outcome[1]}" if outcome[0] != "ok" else "ok")
    return steps, params_of(ddp.module)


def states_created_and_closed(rank: int, world_size: int, count: int) -> list[int]:
    """``count`` states, each registered on a DDP, trained 2 steps and closed: the process groups
    torch.distributed holds after the first and after the last."""
    held = []
    for i in range(count):
        ddp = DDP(make_model())
        state = gs.register(ddp, gs.TopK(density=0.1))
        train(ddp, rank, steps=2)
        state.close()
        if i in (0, count - 1):
            held.append(len(dist.distributed_c10d._world.pg_map))
    return held


def a_forked_child_leaves_the_parents_engine(rank: int, world_size: int) -> tuple[int, str]:
    """After a step, the process forks; the child starts threads of its own (glibc may then reuse
    the engine thread's descriptor), lets them end, then closes the state and drops it. Returns the
    child's exit code and what it said."""
    import threading
    import time

    ddp = DDP(make_model())
    state = gs.register(ddp, gs.TopK(density=0.1))
    train(ddp, rank, steps=1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        said = "ok"
        try:
            threads = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            state.close()
            del state, ddp
            gc.collect()
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    said = os.read(read, 4096).decode()
    state.close()
    return os.waitstatus_to_exitcode(status), said


def loss_scaled_training(rank: int, world_size: int, method: str, momentum: float) -> dict:
    """12 steps of a 2-rank DDP with a sparse state, three ways: without loss scaling
    (nonfinite="skip"); under a GradScaler whose scale starts at 16 and doubles after every good
    step (growth_interval=1; state.set_scaler, nonfinite="propagate"); and the same with the
    state saved after step 7 and loaded into a new state and DDP with a fresh scaler at another
    scale.
    At step 4 rank 1's loss is NaN: the scaled runs' scaler skips that optimizer step and halves
    its scale; the run without one skips it by hand. Returns each run's parameters, the scales
    the scaler went through, and the saved state dict's loss scale."""
    make = {"topk": lambda: gs.TopK(density=0.1, momentum=momentum, nonfinite=policy),
            "micro": lambda: gs.MiCRO(density=0.1, momentum=momentum, nonfinite=policy),
            "threshold": lambda: gs.Threshold(threshold=0.02, momentum=momentum, nonfinite=policy)}[method]  # fmt: skip
    out: dict = {"scales": []}

    def run(scaled: bool, resume: bool) -> list[torch.Tensor]:
        nonlocal policy
        policy = "propagate" if scaled else "skip"
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = gs.register(ddp, make())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1, enabled=scaled)
        state.set_scaler(scaler if scaled else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if momentum else 0.9)
        for step, (x, y) in enumerate(batches(rank, 12)):
            if resume and step == 8:
                saved = copy.deepcopy(state.state_dict())
                out["saved_scale"] = saved["loss_scale"]
                ddp = DDP(model, bucket_cap_mb=0.004)
                state = gs.register(ddp, make())
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-3, growth_interval=1)
                state.set_scaler(scaler)
                state.load_state_dict(saved)
            loss = nn.functional.cross_entropy(ddp(x), y)
            if (step, rank) == (4, 1):
                loss = loss * float("nan")
            opt.zero_grad()
            scaler.scale(loss).backward()
            if scaled:
                scaler.step(opt)
                scaler.update()
                if not resume:
                    out["scales"].append(scaler.get_scale())
            elif step != 4:
                opt.step()
        return params_of(model)

    policy = "skip"
    out["plain"] = run(False, False)
    out["scaled"] = run(True, False)
    out["resumed"] = run(True, True)
    return out


def dense_state_matches_no_hook(rank: int, world_size: int) -> tuple[list, list, dict]:
    hooked = DDP(make_model())
    state = gs.Dense()
    hooked.register_comm_hook(state, gs.hook)
    train(hooked, rank)
    plain = DDP(make_model())
    train(plain, rank)
    return params_of(hooked.module), params_of(plain.module), state.stats()["total"]


def train_with_resume(
    rank: int,
    make,
    steps: int,
    save_at: int | None,
    path: str,
    after_step=None,
    load_first: bool = False,
    load_path: str | None = None,
) -> tuple:
    """Trains ``make(seed)``'s (model, ddp, state, optimizer) for ``steps`` steps; before step
    ``save_at`` saves model, optimizer and state to ``path``, then builds a new one with other
    weights (seed 123: the load must restore them) and loads the checkpoint at ``load_path``
    (default: the one just saved); with ``load_first`` the new state is registered after its
    load (``make(seed, register=False)``), as Lightning's resume does. ``after_step(state)`` runs
    after every step. Returns the final model and state, and the state dict loaded (or None)."""
    torch.manual_seed(0)
    model, ddp, state, opt = make(0)
    loaded = {"gs": None}
    for i, (x, y) in enumerate(batches(rank, steps)):
        if i == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gs": state.state_dict()}, path)
            model, ddp, state, opt = make(123, register=False) if load_first else make(123)
            loaded = torch.load(load_path or path)  # torch's default, weights_only=True, as users load
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["opt"])
            state.load_state_dict(loaded["gs"])
            if load_first:
                gs.register(ddp, state)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(state)
    return model, state, loaded["gs"]


def hooked_model(seed: int, method, register: bool = True):
    """make_model(seed) in a DDP of several buckets with ``method()`` registered (or not yet), and
    its SGD."""
    model = make_model(seed)
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.register(ddp, method()) if register else method()
    return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05)


def checkpoint_resume(rank: int, world_size: int, path: str) -> tuple[list, list]:
    """Trains 6 steps straight, and 3 + save + new model/state + load + 3: same parameters.
    Threshold selection is elementwise, so the result cannot depend on how DDP lays out its
    buckets (the new DDP starts with its initial layout): any difference is lost state."""

    def make(seed: int):
        return hooked_model(seed, lambda: gs.Threshold(threshold=0.01))

    straight, _, _ = train_with_resume(rank, make, 6, None, f"{path}.{rank}")
    resumed, _, _ = train_with_resume(rank, make, 6, 3, f"{path}.{rank}")
    return params_of(straight), params_of(resumed)


AUTO_METHODS = {  # method -> (state with exchange="auto" on a transport, the glossary name of its gather)
    "topk": (lambda transport: gs.TopK(density=0.1, exchange="auto", transport=transport), "fixed-size gather"),
    "sage": (
        lambda transport: gs.SAGE(density=0.1, sampling="per_tensor", exchange="auto", transport=transport),
        "gather-and-add",
    ),
}


def auto_exchange(rank: int, world_size: int, path: str, method: str, transport: str = "process_group") -> list[dict]:
    """``method`` with exchange="auto" (gradsparse.exchange_trial), 12 steps, recording each
    step's exchange per bucket: straight through; saved after step 9 (once the trial has decided)
    and after step 4 (during it), each time loaded into a new model and state that go on; and the
    checkpoint of step 9 loaded before the new state's registration. That last run loads the
    second run's checkpoint, not its own: each run's trial times its own steps, and two runs may
    decide differently where the two exchanges take about as long."""

    def make(seed: int, register: bool = True):
        return hooked_model(seed, lambda: AUTO_METHODS[method][0](transport), register)

    def run(save_at: int | None, load_first: bool = False) -> dict:
        steps = []

        def record(state) -> None:
            steps.append(exchanges_used(state))

        checkpoint = f"{path}.{save_at}.{rank}"
        model, state, loaded = train_with_resume(
            rank, make, 12, save_at, f"{checkpoint}.first" if load_first else checkpoint, record, load_first, checkpoint
        )
        return {
            "steps": steps,
            "trial": state.stats().get("exchange_trial"),
            "chosen": state.state_dict()["exchanges"],
            "saved": None if loaded is None else loaded["exchanges"],
            "params": params_of(model),
        }

    return [run(None), run(9), run(4), run(9, load_first=True)]


def check_auto_exchange(results: list[list[dict]], method: str) -> None:
    """exchange="auto": steps 1 to 6 alternate the two exchanges in every bucket; then each
    bucket keeps the one with the lower mean time, on every rank alike. A state dict saved after
    the decision carries it (the resumed run does not time again); one saved during the trial
    does not (the resumed run times again, from its second step)."""
    names = {"gather": AUTO_METHODS[method][1], "reduce_scatter": "reduce-scatter + all-gather"}
    for runs in zip(*results, strict=True):  # the same run on every rank
        first = runs[0]
        for other in runs[1:]:
            assert other["steps"] == first["steps"] and other["trial"] == first["trial"]
            assert other["chosen"] == first["chosen"] and other["saved"] == first["saved"]
            for a, b in zip(first["params"], other["params"], strict=True):
                assert torch.equal(a, b)  # the replicas stay equal through every switch
    straight, after_decision, during_trial, loaded_first = results[0]
    buckets = sorted(straight["steps"][-1])
    assert len(buckets) > 1
    alternation = [("gather", "reduce_scatter")[t % 2] for t in range(6)]
    assert [set(step.values()) for step in straight["steps"][1:7]] == [{names[n]} for n in alternation]
    chosen = straight["chosen"]
    assert sorted(chosen) == buckets == sorted(straight["trial"])
    for b in buckets:
        means = straight["trial"][b]
        assert means["gather"] > 0 and means["reduce_scatter"] > 0
        assert chosen[b] == ("gather" if means["gather"] <= means["reduce_scatter"] else "reduce_scatter")
        assert all(step[b] == names[chosen[b]] for step in straight["steps"][7:])
    for resumed in (after_decision, loaded_first):  # loaded before registration: the same decision kept
        assert resumed["saved"] == resumed["chosen"] is not None
        assert all(step[b] == names[resumed["saved"][b]] for step in resumed["steps"][9:] for b in step)
    assert loaded_first["steps"][9:] == after_decision["steps"][9:]  # the same checkpoint, loaded
    assert all(torch.equal(a, b) for a, b in zip(loaded_first["params"], after_decision["params"], strict=True))
    assert during_trial["saved"] is None
    assert [set(step.values()) for step in during_trial["steps"][5:11]] == [{names[n]} for n in alternation]
    assert during_trial["chosen"] is not None and during_trial["trial"] is not None


UNEVEN_METHODS = {
    "topk": lambda: gs.TopK(density=0.1),
    "topk_auto": lambda: gs.TopK(density=0.1, exchange="auto"),
    "micro": lambda: gs.MiCRO(density=0.1),
    "spardl": lambda: gs.SparDL(density=0.1),
}


def uneven_inputs(rank: int, world_size: int, method: str) -> dict:
    """Rank r trains 6 + 3 r batches inside DDP's join() (uneven inputs): a rank that has run
    out shadows the others' steps, with DDP calling the hook on zero gradients."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.register(ddp, UNEVEN_METHODS[method]())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def residual_mass() -> float:
        return sum(float(t.abs().sum()) for t in state.state_dict()["residuals"].values())

    with ddp.join():
        for x, y in batches(rank, 6 + 3 * rank):
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        at_join = residual_mass()
    return {"params": params_of(model), "steps": state.step, "at_join": at_join, "at_end": residual_mass()}


# Every method trains ----------------------------------------------------------------------------

TRAINING_METHODS = {
    "dense": lambda: None,
    "topk": lambda: gs.TopK(density=0.05),
    "threshold": lambda: gs.Threshold(threshold=2e-3),
    "randomk": lambda: gs.RandomK(density=0.05),
    # A contiguous block moves whole layers at once with their delayed sums: on this model it
    # learns the slowest of all (loss 0.56 / 0.57 / 0.53 / 0.39 at density 0.05 / 0.1 / 0.2 / 0.5,
    # dense 0.38; docs/methods.md), so it trains here at 0.5, where it must match dense.
    "randomblock": lambda: gs.RandomBlock(density=0.5),
    "gaussiank": lambda: gs.GaussianK(density=0.05),
    "gaussiank_sidco": lambda: gs.GaussianK(density=0.05, variant="sidco"),
    "dgc": lambda: gs.DGC(density=0.05),
    "redsync": lambda: gs.RedSync(density=0.05),
    "sage": lambda: gs.SAGE(density=0.05),
    "sage_per_tensor": lambda: gs.SAGE(density=0.05, sampling="per_tensor"),
    "micro": lambda: gs.MiCRO(density=0.05),
    "micro_gather": lambda: gs.MiCRO(density=0.05, exchange="gather"),
    "exdyna": lambda: gs.ExDyna(density=0.05),
    "sidco": lambda: gs.SIDCo(density=0.05, fit="gpareto", stages=2),
    "sidco_gamma": lambda: gs.SIDCo(density=0.05, fit="gamma_gpareto", stages=2),
    "spardl": lambda: gs.SparDL(density=0.05),
    "spardl_teams": lambda: gs.SparDL(density=0.05, teams=2),
}


def teacher_data(rank: int, steps: int):
    """A learnable task: labels from a fixed random teacher network, inputs per rank and step."""
    torch.manual_seed(7)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 6))
    g = torch.Generator().manual_seed(5000 + rank)
    data = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=g)
        with torch.no_grad():
            data.append((x, teacher(x).argmax(1)))
    return data


def fit(model: nn.Module, data, opt: torch.optim.Optimizer | None = None) -> list[float]:
    """Trains on ``data`` (SGD, lr 0.1, momentum 0.5 unless ``opt`` is given); returns the losses."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_every_method(rank: int, world_size: int, steps: int, device: str = "cpu") -> dict[str, float]:
    """Trains the same model with every method; returns the mean loss of the last 10 steps.
    On ``device="cuda"`` the model, data and buckets live on the GPU (every rank on GPU 0 over
    Gloo, or one GPU per rank over NCCL)."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    data = [(x.to(device), y.to(device)) for x, y in teacher_data(rank, steps)]
    out = {}
    for name, make in TRAINING_METHODS.items():
        if name == "spardl_teams" and world_size % 2:
            continue  # two teams need an even world
        ddp = DDP(make_model(seed=3).to(device))
        state = make()
        if state is not None:
            ddp.register_comm_hook(state, gs.hook)
        losses = fit(ddp, data)
        out[name] = sum(losses[-10:]) / 10
        if state is not None:
            state.close()
    return out


def assert_every_method_trains(results: list[dict[str, float]]) -> None:
    """After train_every_method's 150 steps, each method's loss (mean of the last 10
    steps, over ranks) must be within 0.15 of dense's and below 60% of the initial loss (ln 6 for
    6 classes): sparse methods at density 0.05 converge more slowly, not to a different place."""
    losses = {name: sum(r[name] for r in results) / len(results) for name in results[0]}  # over ranks' data
    dense = losses["dense"]
    print({k: round(v, 3) for k, v in losses.items()})
    for name, loss in losses.items():
        assert loss < 0.6 * math.log(6), f"{name}: loss {loss:.3f} did not fall"
        assert loss < dense + 0.15, f"{name}: loss {loss:.3f} vs dense {dense:.3f}"


# Every exchange on a real transport -------------------------------------------------------------

# name -> (method, options, world sizes it needs a divisor of). Each exercises one exchange.
EXCHANGE_CASES = {
    "dense": ("dense", {}),
    "fixed_size_gather": ("topk", {"density": 0.05}),
    "fixed_size_gather_full": ("topk", {"density": 1.0}),
    "gather_and_add": ("threshold", {"threshold": 1.6}),
    "gather_and_add_full": ("threshold", {"threshold": 0.0}),
    "shared": ("randomk", {"density": 0.05}),
    "shared_full": ("randomk", {"density": 1.0}),
    "union": ("micro", {"density": 0.05}),
    "union_full": ("micro", {"density": 1.0}),
    "union_reference": ("exdyna", {"density": 0.05, "reference": True}),
    "exclusive_gather": ("exdyna", {"density": 0.05, "exchange": "gather"}),
    "spardl": ("spardl", {"density": 0.05}),
    "spardl_full": ("spardl", {"density": 1.0}),
    "spardl_teams": ("spardl", {"density": 0.05, "teams": 2}),
    "reduce_scatter_allgather": ("topk", {"density": 0.05, "exchange": "reduce_scatter"}),
    "reduce_scatter_allgather_counts": ("threshold", {"threshold": 1.6, "exchange": "reduce_scatter"}),
}


def exchange_case_applies(name: str, world_size: int) -> bool:
    return (
        EXCHANGE_CASES[name][1].get("teams", 1) <= world_size
        and world_size % EXCHANGE_CASES[name][1].get("teams", 1) == 0
    )


def gradient_stream(world_size: int, steps: int, numel: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(77 + world_size)
    return [[torch.randn(numel, generator=g) * (1 + t) for _ in range(world_size)] for t in range(steps)]


class Flat(nn.Module):
    """One parameter whose gradient is exactly the input: loss = <weight, g>."""

    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


def exchange_stream(rank: int, world_size: int, transport: str, steps: int = 6, numel: int = 1237) -> dict:
    """Runs every applicable exchange case through DDP and the hook on ``transport`` with a
    known gradient stream. Per case and step: the averaged bucket DDP wrote into the gradient,
    this rank's residual, and the bytes the transport counted. Rank 0 also runs the same methods
    on ThreadTransport (the library's reference path, itself checked against the re-statements)."""
    from gradsparse.testing.thread_ranks import run_steps

    stream = gradient_stream(world_size, steps, numel)
    out = {}
    for name, (method, options) in EXCHANGE_CASES.items():
        if not exchange_case_applies(name, world_size):
            continue
        model = Flat(numel)
        ddp = DDP(model)
        state = (
            gs.METHODS[method](**options, transport=transport) if method != "dense" else gs.Dense(transport=transport)
        )
        gs.register(ddp, state)
        record = {"out": [], "residual": [], "bytes": []}
        for t in range(steps):
            ddp.zero_grad()
            ddp(stream[t][rank]).backward()
            record["out"].append(model.weight.grad.clone())
            residuals = state.state_dict()["residuals"]
            record["residual"].append(residuals["weight"].clone() if residuals else torch.zeros(numel))
            record["bytes"].append(state.stats()["total"]["bytes_sent"])
        if rank == 0 and method != "dense":
            methods = [state._make_method([numel]) for _ in range(world_size)]
            ref = run_steps(world_size, lambda r, methods=methods: methods[r], stream)
            record["thread_out"] = [s[0].output for s in ref]
            record["thread_residual"] = [[s[r].residual for r in range(world_size)] for s in ref]
            record["thread_bytes"] = [[s[r].bytes_sent for r in range(world_size)] for s in ref]
        state.close()
        out[name] = record
    return out


# Faults -------------------------------------------------------------------------------------------


class _Crash(RuntimeError):
    """What kills rank 1 in peer_exits(how="raise")."""


def peer_exits(
    rank: int,
    world_size: int,
    method: str,
    timeout: float,
    transport: str = "process_group",
    stall: bool = False,
    reports: str = "",
    how: str = "exit",
) -> dict:
    """Rank 1 exits in the middle of step 3 (after its forward pass), or with ``stall`` first
    stays there, alive and silent, until every other rank has seen its error (each leaves a file
    in the folder ``reports``; at most three timeouts); the others report what their training
    loop saw and how long it took to see it (with ``stall`` once every one of them has seen its
    own: a survivor that exited first could end another's wait before its timeout did).
    ``how``: "exit" (os._exit(3)) or "raise" (an exception nobody catches, as a crashing training
    script dies)."""
    import time

    def reported(r: int) -> str:
        return os.path.join(reports, f"rank{r}")

    def wait_for_reports(ranks: list[int]) -> None:  # at most three timeouts
        deadline = time.monotonic() + 3 * float(timeout)
        while time.monotonic() < deadline and not all(os.path.exists(reported(r)) for r in ranks):
            time.sleep(0.05)

    ddp = DDP(make_model(), bucket_cap_mb=0.004)
    state = gs.METHODS[method](density=0.1, timeout=float(timeout), transport=transport)
    ddp.register_comm_hook(state, gs.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches(rank, 6)):
        start = time.monotonic()
        try:
            loss = nn.functional.cross_entropy(ddp(x), y)
            if step == 3 and rank == 1:
                if stall:
                    wait_for_reports([r for r in range(world_size) if r != rank])
                print(f"rank 1 exits at {time.time():.3f}", flush=True)  # read by the mpirun test
                if how == "raise":
                    raise _Crash("rank 1 dies of an error in its training loop")
                os._exit(3)
            opt.zero_grad()
            loss.backward()
            opt.step()
        except _Crash:
            raise
        except Exception as e:  # the test checks the type, the message and the time
            seconds = time.monotonic() - start
            if reports:
                open(reported(rank), "w").close()
            if stall:  # each survivor stays until all have seen their error: none sees another's exit
                wait_for_reports([r for r in range(world_size) if r != 1])
            return {"step": step, "error": type(e).__name__, "message": str(e), "seconds": seconds}
    return {"step": None}


# Checkpoints: exact resume, every rank's own residuals ------------------------------------------


class Shuffled(nn.Module):
    """Parameters declared in another order than the forward uses them, so DDP's first-step bucket
    layout (reverse declaration order) differs from the one it rebuilds after the first step (the
    order the gradients arrived in): a resumed run starts in a layout the saved run never used."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(48, 6)
        self.stem = nn.Linear(16, 48)
        self.middle = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.middle(torch.relu(self.stem(x)))))


class BFloat16Head(nn.Module):
    """Shuffled with its head in bfloat16: DDP keeps a bucket per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Shuffled()
        self.net.head.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        return net.head(torch.relu(net.middle(torch.relu(net.stem(x)))).bfloat16()).float()


def static_graph_mixed_dtypes_resume(rank: int, world_size: int) -> dict:
    """DDP(static_graph=True) over float32 and bfloat16 parameters: 3 steps, a checkpoint, and a
    new model, DDP and state loading it (as a new process does) for 3 more steps. The first
    iteration of each DDP reduces all buckets at the end of backward. Returns the steps each state
    counted and the parameters."""

    def build(seed: int):
        torch.manual_seed(seed)
        model = BFloat16Head()
        ddp = DDP(model, bucket_cap_mb=0.004, static_graph=True)
        return model, ddp, gs.register(ddp, gs.TopK(density=0.05)), torch.optim.SGD(ddp.parameters(), lr=0.05)

    def run(ddp, opt, part) -> None:
        for x, y in part:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

    data = list(batches(rank, 6))
    model, ddp, state, opt = build(0)
    run(ddp, opt, data[:3])
    saved = {"model": model.state_dict(), "gs": state.state_dict()}
    first = state.step
    model, ddp, state, opt = build(123)
    model.load_state_dict(saved["model"])
    state.load_state_dict(saved["gs"])
    run(ddp, opt, data[3:])
    return {"steps": (first, state.step), "params": params_of(model)}


RESUME_METHODS = {
    "topk": lambda: gs.TopK(density=0.05),
    "topk_momentum": lambda: gs.TopK(density=0.05, momentum=0.9),
    "exdyna": lambda: gs.ExDyna(density=0.05),
    "spardl": lambda: gs.SparDL(density=0.05),
    "micro": lambda: gs.MiCRO(density=0.05),
}


def resume_exactly(rank: int, world_size: int, method: str, path: str, static_graph: bool = False) -> dict:
    """8 steps straight, against 4 steps + checkpoint + a new model, DDP, optimizer and state (as a
    new process has) + load + 4 steps, with no extra iteration of any kind. With ``static_graph``
    DDP rebuilds its buckets only after its second step."""
    data = list(batches(rank, 8))
    first_step_buckets: list[list[str]] = []

    def build(seed: int):
        torch.manual_seed(seed)
        model = Shuffled()
        ddp = DDP(model, bucket_cap_mb=0.004, static_graph=static_graph)
        names = {id(p): n for n, p in model.named_parameters()}

        def recording(state: gs.State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if state.step == 4:  # the first step after the checkpoint
                first_step_buckets.append([names[id(p)] for p in bucket.parameters()])
            return gs.hook(state, bucket)

        state = gs.register(ddp, RESUME_METHODS[method](), hook=recording)
        momentum = 0.0 if state.config()["momentum"] else 0.9  # momentum correction replaces the optimizer's
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)

    def run(ddp, opt, part) -> None:
        for x, y in part:
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    model, ddp, state, opt = build(0)
    run(ddp, opt, data)
    straight = params_of(model)

    model, ddp, state, opt = build(0)
    run(ddp, opt, data[:4])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gs": state.state_dict()}, f"{path}.{rank}")
    first_step_buckets.clear()
    model, ddp, state, opt = build(123)
    saved = torch.load(f"{path}.{rank}")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["gs"])
    run(ddp, opt, data[4:])
    return {
        "straight": straight,
        "resumed": params_of(model),
        "saved_layout": saved["gs"]["layout"],
        "first_step_buckets": first_step_buckets,
        "residual_norms": {n: float(t.norm()) for n, t in saved["gs"]["residuals"].items()},
    }


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear head: in channels_last, the convolutions' weights are
    not in row-major order (their gradients, and DDP's bucket views of them, neither)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def channels_last_resume(rank: int, world_size: int, path: str) -> dict:
    """A channels_last SmallCNN with Top-k: 6 steps straight, against 3 steps + checkpoint + a new
    model, DDP, optimizer and state + load + 3 steps, the new model channels_last, or contiguous
    with the state registered before or after its load."""
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 6, (4,), generator=g)) for _ in range(6)]

    def build(seed: int, memory_format: torch.memory_format = torch.channels_last, register: bool = True):
        torch.manual_seed(seed)
        model = SmallCNN().to(memory_format=memory_format)
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = gs.TopK(density=0.1)
        return model, ddp, gs.register(ddp, state) if register else state, torch.optim.SGD(ddp.parameters(), lr=0.05)

    def run(ddp, opt, part) -> None:
        for x, y in part:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.to(memory_format=torch.channels_last)), y).backward()
            opt.step()

    model, ddp, state, opt = build(0)
    run(ddp, opt, data)
    out = {"straight": params_of(model)}
    model, ddp, state, opt = build(0)
    run(ddp, opt, data[:3])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gs": state.state_dict()}, f"{path}.{rank}")
    saved = torch.load(f"{path}.{rank}")
    for case, memory_format, register in [
        ("resumed", torch.channels_last, True),
        ("contiguous", torch.contiguous_format, True),
        ("contiguous, registered after the load", torch.contiguous_format, False),
    ]:
        model, ddp, state, opt = build(123, memory_format, register)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["gs"])
        if not register:
            gs.register(ddp, state)
        run(ddp, opt, data[3:])
        out[case] = params_of(model)
    out["strides"] = saved["gs"]["strides"]
    return out


def _dcp_build(seed: int, method: str):
    """resume_exactly's model, DDP, state and optimizer."""
    torch.manual_seed(seed)
    model = Shuffled()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.register(ddp, RESUME_METHODS[method]())
    momentum = 0.0 if state.config()["momentum"] else 0.9  # momentum correction replaces the optimizer's
    return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)


def _dcp_run(ddp: nn.Module, opt: torch.optim.Optimizer, part) -> None:
    for x, y in part:
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _dcp_checkpoint(ddp: nn.Module, opt: torch.optim.Optimizer, state: gs.State) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ddp, opt)
    return {"model": msd, "optim": osd, "gradsparse": gs.ShardedState(state)}


def _held(state: gs.State) -> dict:
    """What a state holds of its own, comparable across a checkpoint: residuals and velocities
    (copies), method states, step and statistics."""
    saved = state.state_dict()
    return {
        "residuals": {n: t.clone() for n, t in saved["residuals"].items()},
        "velocities": {n: t.clone() for n, t in saved["velocities"].items()},
        "methods": saved["methods"],
        "step": saved["step"],
        "stats": saved["stats"],
    }


def resume_exactly_through_dcp(rank: int, world_size: int, method: str, path: str) -> dict:
    """resume_exactly with torch.distributed.checkpoint: 8 steps straight, against 4 steps +
    dcp.save({"model", "optim", "gradsparse": gs.ShardedState(state)}) + a new model, DDP,
    optimizer and state (as a new process has) + dcp.load + 4 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    data = list(batches(rank, 8))
    model, ddp, state, opt = _dcp_build(0, method)
    _dcp_run(ddp, opt, data)
    straight = params_of(model)
    state.close()

    model, ddp, state, opt = _dcp_build(0, method)
    _dcp_run(ddp, opt, data[:4])
    dcp.save(_dcp_checkpoint(ddp, opt, state), checkpoint_id=path)
    held = _held(state)
    state.close()

    model, ddp, state, opt = _dcp_build(123, method)
    loaded = _dcp_checkpoint(ddp, opt, state)
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(ddp, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    restored = _held(state)
    _dcp_run(ddp, opt, data[4:])
    state.close()
    return {"straight": straight, "resumed": params_of(model), "held": held, "restored": restored}


def dcp_save_at(rank: int, world_size: int, method: str, path: str) -> None:
    """4 steps, then dcp.save of the model and gs.ShardedState(state)."""
    import torch.distributed.checkpoint as dcp

    _, ddp, state, opt = _dcp_build(0, method)
    _dcp_run(ddp, opt, list(batches(rank, 4)))
    dcp.save(_dcp_checkpoint(ddp, opt, state), checkpoint_id=path)
    state.close()


def dcp_load_at(rank: int, world_size: int, method: str, path: str) -> tuple[str | None, int]:
    """dcp.load of dcp_save_at's checkpoint into a new model and state: the error, and the step the
    state holds after it."""
    import torch.distributed.checkpoint as dcp

    _, ddp, state, opt = _dcp_build(123, method)
    try:
        dcp.load(_dcp_checkpoint(ddp, opt, state), checkpoint_id=path)
        error = None
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    step = state.step
    state.close()
    return error, step


def plain_state_through_dcp(rank: int, world_size: int, path: str, wrap: str) -> tuple[str | None, str | None]:
    """The state handed to dcp.save, then to dcp.load, as it is (``wrap`` "state") or in
    gs.AllRanks ("all_ranks"), not in gs.ShardedState: each error."""
    import torch.distributed.checkpoint as dcp

    model, ddp, state, opt = _dcp_build(0, "topk")
    _dcp_run(ddp, opt, list(batches(rank, 2)))
    handed = state if wrap == "state" else gs.AllRanks(state)
    errors = []
    for call in (dcp.save, dcp.load):
        try:
            call({"model": model.state_dict(), "gs": handed}, checkpoint_id=path)
            errors.append(None)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            errors.append(f"{type(e).__name__}: {e}")
    # the state dict saved the ordinary way is unchanged
    torch.save(state.state_dict(), f"{path}.{rank}.pt")
    fresh = _dcp_build(0, "topk")[2]
    fresh.load_state_dict(torch.load(f"{path}.{rank}.pt"))
    state.close()
    fresh.close()
    return errors[0], errors[1]


def stay_until_rank_0_is_done(done: str) -> None:
    """The rank that does not call a collective stays alive (without calling it) until rank 0 has
    its outcome, however long the loaded machine makes that take: had it exited, rank 0 would see
    Gloo's "Connection closed by peer" instead of its state's timeout."""
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)


def all_ranks_on_rank_0_alone(rank: int, world_size: int, done: str) -> str | None:
    """gradsparse.AllRanks(state).state_dict() called under ``if rank == 0:``: rank 0's error (the
    others go on without calling it, and stay past the state's timeout of 2 s, until rank 0 writes
    the file ``done``)."""
    state = gs.TopK(density=0.05, timeout=2)
    ddp = DDP(make_model())
    gs.register(ddp, state)
    train(ddp, rank, steps=2)
    if rank != 0:
        stay_until_rank_0_is_done(done)
        return None
    try:
        gs.AllRanks(state).state_dict()
    except RuntimeError as e:
        return str(e)
    finally:
        open(done, "w").close()
    return "returned"


def all_ranks_on_each_node(rank: int, world_size: int, local_ranks: list[str | None]) -> list | str:
    """Each rank's LOCAL_RANK from ``local_ranks`` (None: unset), 2 training steps, then
    AllRanks(state, each_node=True).state_dict() twice: per call, the ranks' parts this rank holds
    (None on a rank that does not write), or the error."""
    os.environ.pop("LOCAL_RANK", None)
    if local_ranks[rank] is not None:
        os.environ["LOCAL_RANK"] = local_ranks[rank]
    state = gs.TopK(density=0.05)
    ddp = DDP(make_model())
    gs.register(ddp, state)
    train(ddp, rank, steps=2)
    saver = gs.AllRanks(state, each_node=True)
    try:
        return [saver.state_dict()["ranks"] for _ in range(2)]
    except ValueError as e:
        return str(e)


# DDP on data-parallel sub-groups -------------------------------------------------------------

SUB_GROUP_METHODS = {
    "topk": lambda group: gs.TopK(density=0.05, process_group=group),
    "micro": lambda group: gs.MiCRO(density=0.05, process_group=group),
    "spardl": lambda group: gs.SparDL(density=0.05, process_group=group),
}


def _pair_build(seed: int, method: str, group: dist.ProcessGroup | None, module=Shuffled):
    """_dcp_build on the DDP group ``group``, with the state's on it too."""
    torch.manual_seed(seed)
    model = module()
    ddp = DDP(model, bucket_cap_mb=0.004, process_group=group)
    state = gs.register(ddp, SUB_GROUP_METHODS[method](group))
    return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def sub_group_training(rank: int, world_size: int, method: str, seeds: tuple[int, ...]) -> tuple[list, dict]:
    """At 4 ranks two pairs, [0, 1] and [2, 3], each a DDP and state of its own on its sub-group
    (at 2 ranks one pair on the default group); pair p's model starts from ``seeds[p]``, and its
    ranks train on batches(0) and batches(1). The parameters and residuals after 6 steps."""
    group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2] if world_size == 4 else None
    model, ddp, state, opt = _pair_build(seeds[rank // 2], method, group)
    _dcp_run(ddp, opt, list(batches(rank % 2, 6)))
    residuals = _held(state)["residuals"]
    state.close()
    return params_of(model), residuals


def groups_of_other_ranks(rank: int, world_size: int, case: str) -> dict:
    """4 ranks, every one creating the groups [1, 2, 3] and [0, 1] (as torch asks: every rank
    creates every group), so that rank 1 belongs to one group more than ranks 2 and 3. "sub_group":
    a state on [1, 2, 3] registers and trains a step; "each_node": a state on the default group
    saves with AllRanks(each_node=True), ranks 0 and 2 first on their "nodes". Both waited until
    the timeout under torch 2.13: torch named the state's own group after the number of groups each
    rank belonged to."""
    trio, _ = dist.new_group([1, 2, 3]), dist.new_group([0, 1])
    out: dict = {}
    if case == "sub_group":
        if rank in (1, 2, 3):
            ddp = DDP(nn.Linear(4, 4), process_group=trio)
            state = gs.register(ddp, gs.TopK(density=0.5, process_group=trio, timeout=30))
            ddp(torch.randn(2, 4)).sum().backward()
            out["step"] = state.step
            state.close()
        return out
    os.environ["LOCAL_RANK"] = str(rank % 2)
    ddp = DDP(nn.Linear(4, 4))
    state = gs.register(ddp, gs.TopK(density=0.5, timeout=30))
    ddp(torch.randn(2, 4)).sum().backward()
    saved = gs.AllRanks(state, each_node=True).state_dict()
    out["holds"] = saved["ranks"] is not None
    state.close()
    return out


def sub_group_checkpoints(rank: int, world_size: int, method: str, path: str, same_model: bool) -> dict:
    """Two pairs, [0, 1] and [2, 3], each a DDP and state of its own on its sub-group; the second
    trains a step more (5 against 4), and with ``same_model`` False on another model (a pipeline
    stage). Then each way of checkpointing, loaded into a new model, DDP and state: the rank's own
    file (on the first pair alone: its load is collective on the pair, not on every rank),
    gs.AllRanks (received by each pair's first rank: whether this rank did, under "received"),
    gs.reshard of it, gs.ShardedState through dcp over every rank (one model only) and through a
    dcp of each pair over its group. What the state held, and what each way restored."""
    import torch.distributed.checkpoint as dcp

    pair = rank // 2
    group = [dist.new_group([0, 1]), dist.new_group([2, 3])][pair]
    module = Shuffled if same_model or pair == 0 else make_model

    def restored(load) -> dict:
        built = _pair_build(123, method, group, module)  # the model kept alive while its state is used
        state = built[2]
        load(state)
        held = _held(state)
        state.close()
        return held

    _, ddp, state, opt = _pair_build(0, method, group, module)
    _dcp_run(ddp, opt, list(batches(rank, 4 + pair)))
    out: dict = {"held": _held(state), "restored": {}}
    torch.save(state.state_dict(), f"{path}.rank{rank}")
    all_ranks = gs.AllRanks(state).state_dict()
    out["received"] = all_ranks["ranks"] is not None
    if out["received"]:
        torch.save(all_ranks, f"{path}.pair{pair}")
    if same_model:
        dcp.save({"gradsparse": gs.ShardedState(state)}, checkpoint_id=f"{path}.dcp")
    sharded = gs.ShardedState(state, process_group=group)
    dcp.save({"gradsparse": sharded}, checkpoint_id=f"{path}.dcp{pair}", process_group=group)
    state.close()
    dist.barrier()  # every file written

    ways = out["restored"]
    if pair == 0:
        ways["own_file"] = restored(lambda s: s.load_state_dict(torch.load(f"{path}.rank{rank}")))
    ways["all_ranks"] = restored(lambda s: s.load_state_dict(torch.load(f"{path}.pair{pair}")))
    ways["resharded"] = restored(lambda s: s.load_state_dict(gs.reshard(torch.load(f"{path}.pair{pair}"), 2)))
    if same_model:
        ways["dcp"] = restored(lambda s: dcp.load({"gradsparse": gs.ShardedState(s)}, checkpoint_id=f"{path}.dcp"))
    ways["dcp_of_the_pair"] = restored(
        lambda s: dcp.load(
            {"gradsparse": gs.ShardedState(s, process_group=group)},
            checkpoint_id=f"{path}.dcp{pair}",
            process_group=group,
        )
    )
    return out


def resharded_mass(rank: int, world_size: int, path: str, options: dict, save: bool) -> dict:
    """Top-k with ``options`` on make_model through DDP. With ``save``: 3 steps on each rank's own
    batches, then gs.AllRanks' state dict to ``path``; otherwise a new model, DDP and state that
    load gs.reshard of that file to this world size. Then one step of zero gradients, in which
    each rank sends from what it held alone: the gradient DDP applied and this rank's residual
    after it (their sum over the ranks / P is the pending mass the step started from, plus
    momentum's share of the velocities), and the link exchange="auto" priced with before the
    load and after the step."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.register(ddp, gs.TopK(**options))
    link = state._link
    if save:
        for x, y in batches(rank, 3):
            nn.functional.cross_entropy(ddp(x), y).backward()
            model.zero_grad()
        saved = gs.AllRanks(state).state_dict()
        if rank == 0:
            torch.save(saved, path)
    else:
        state.load_state_dict(gs.reshard(torch.load(path), world_size))
    model.zero_grad(set_to_none=True)
    x, y = next(batches(rank, 1))
    (nn.functional.cross_entropy(ddp(x), y) * 0).backward()
    applied = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    residuals = state.state_dict()["residuals"]
    residual = torch.cat([residuals[n].reshape(-1) for n, _ in model.named_parameters()]).double()
    state.close()
    return {"applied": applied, "residual": residual, "link": (link, state._link)}


def _stopped_in_autograd(model: nn.Module, backward) -> None:
    """Runs ``backward()`` with the gradient of make_model's layer 0 output raising in autograd:
    after the later layers' buckets, before the first layer's. The error is swallowed."""

    def stop(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("stopped in autograd")

    def hook_output(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(stop)

    stopper = model[0].register_forward_hook(hook_output)
    try:
        with contextlib.suppress(RuntimeError):
            backward()
    finally:
        stopper.remove()


def _rewrapped(model: nn.Module, state: gs.State) -> nn.Module:
    """``model`` in a new DDP with ``state`` registered there, after a backward that stopped
    half-way: the caller drops the old DDP first, so that its reducer's hooks go with it."""
    gc.collect()
    ddp = DDP(model, bucket_cap_mb=0.004)
    gs.register(ddp, state)
    return ddp


def step_after_a_backward_that_stopped(rank: int, world_size: int) -> list[torch.Tensor]:
    """Top-k on make_model in a DDP of several buckets: a step; a step whose first bucket fails in
    gradsparse (an injected error) and whose backward then stops in autograd, before the last
    bucket; the module in a new DDP, the state registered there, and one more step. Returns the
    parameters after it."""
    torch.manual_seed(0)
    model, state = make_model(), gs.TopK(density=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = list(batches(rank, 3))

    def step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    ddp = DDP(model, bucket_cap_mb=0.004)
    gs.register(ddp, state)
    step(ddp, *data[0])
    reduce_bucket = state._reduce_bucket

    def failing(bucket, index: int, last: bool):
        if not last:
            raise RuntimeError("injected")
        return reduce_bucket(bucket, index, last)

    state._reduce_bucket = failing
    _stopped_in_autograd(model, lambda: step(ddp, *data[1]))
    del state._reduce_bucket
    del ddp
    ddp = _rewrapped(model, state)
    step(ddp, *data[2])
    return [p.detach().clone() for p in model.parameters()]


class TwoDtypes(nn.Module):
    """A float32 Linear, then a bfloat16 one: DDP makes a bucket of each dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(8, 6).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


def steps_where_ddp_and_requires_grad_disagree(rank: int, world_size: int, how: str, options: dict) -> list[int]:
    """TwoDtypes with one parameter whose requires_grad does not say whether DDP reduces it
    (``how``): b.bias left to its own devices (DDP's parameters to ignore), or unfrozen after DDP
    was built (DDP does not reduce it), or a.bias frozen after DDP was built (DDP still reduces
    it). DDP made with ``options``, Top-k registered: the state's step after each of 3 steps."""
    torch.manual_seed(0)
    model = TwoDtypes()
    if how == "ignored":
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["b.bias"])
    if how == "unfrozen_since":
        model.b.bias.requires_grad_(False)
    ddp = DDP(model, **options)
    if how == "unfrozen_since":
        model.b.bias.requires_grad_(True)
    if how == "frozen_since":
        model.a.bias.requires_grad_(False)
    state = gs.register(ddp, gs.TopK(density=0.5))
    steps = []
    for x, y in batches(rank, 3):
        nn.functional.cross_entropy(ddp(x), y).backward()
        steps.append(state.step)
    return steps


def first_static_graph_step_overflowed(rank: int, world_size: int, bound: bool) -> dict:
    """Top-k with nonfinite="propagate" on TwoDtypes (a bucket per dtype) with static_graph=True,
    registered with gradsparse.register (``bound``) or with model.register_comm_hook alone, which
    cannot tell the last bucket of DDP's first static-graph step. An Inf in rank 0's bfloat16
    layer's gradient in that step: the float32 bucket must take back what it sent. The buckets'
    statistics after that step."""
    torch.manual_seed(0)
    model = TwoDtypes()
    ddp = DDP(model, static_graph=True)
    state = gs.TopK(density=0.5, nonfinite="propagate")
    if bound:
        gs.register(ddp, state)
    else:
        ddp.register_comm_hook(state, gs.hook)
    handle = model.b.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf)) if rank == 0 else None
    x, y = next(iter(batches(rank, 1)))
    nn.functional.cross_entropy(ddp(x), y).backward()
    if handle is not None:
        handle.remove()
    return {"step": state.step, "buckets": state.stats()["buckets"]}


def overflow_after_a_backward_that_stopped(rank: int, world_size: int) -> dict:
    """Top-k with nonfinite="propagate" on make_model in a DDP of several buckets: a step; a step
    whose backward stops in autograd (after the later layers' buckets were reduced, before the
    first layer's); the module in a new DDP with the state registered there, and a step in which
    an Inf in rank 0's first-layer gradient makes every other bucket take back what it sent. The
    buckets' statistics after it."""
    torch.manual_seed(0)
    model, state = make_model(), gs.TopK(density=0.5, nonfinite="propagate")
    data = list(batches(rank, 3))

    ddp = DDP(model, bucket_cap_mb=0.004)
    gs.register(ddp, state)
    nn.functional.cross_entropy(ddp(data[0][0]), data[0][1]).backward()
    _stopped_in_autograd(model, lambda: nn.functional.cross_entropy(ddp(data[1][0]), data[1][1]).backward())
    del ddp
    ddp = _rewrapped(model, state)
    if rank == 0:
        model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf))
    nn.functional.cross_entropy(ddp(data[2][0]), data[2][1]).backward()
    return {"step": state.step, "buckets": state.stats()["buckets"]}


def all_ranks_with_a_damaged_part(rank: int, world_size: int, damage: str) -> tuple[str | None, float | None]:
    """Every rank loads an AllRanks state dict of 2 training steps whose rank 1's part was damaged
    after the save (``damage``: "byte", a byte of a residual; "method", a method state the method
    refuses; "size", a residual cut short, with its checksum, loaded into a new state before it is
    registered on a new DDP). Returns this rank's error (None: it loaded) and how far the attempt
    moved the sum of its residuals' norms (0: a refused load leaves them as they were; None for
    "size", loaded into a new state)."""
    state = gs.DGC(density=0.05, timeout=30)  # a method with a state of its own (its step)
    ddp = DDP(make_model())
    gs.register(ddp, state)
    train(ddp, rank, steps=2)
    saved = [gs.AllRanks(state).state_dict()]
    dist.broadcast_object_list(saved, src=0)  # the file every rank reads
    part = saved[0]["ranks"][1]
    if damage == "byte":
        next(iter(part["residuals"].values())).view(torch.uint8)[0].add_(1)
    elif damage == "size":
        name = next(iter(part["residuals"]))
        part["residuals"][name] = part["residuals"][name][:3].clone()
        part["checksums"][name] = checksum(part["residuals"][name])
        state = gs.DGC(density=0.05, timeout=30)
    else:
        part["methods"][0] = {"step": 2.5}
    before = sum(float(t.norm()) for t in state.state_dict()["residuals"].values())
    error = None
    try:
        state.load_state_dict(saved[0])
        if damage == "size":  # the names are checked against the model at registration
            gs.register(DDP(make_model()), state)
    except ValueError as e:
        error = str(e)
    if damage == "size":  # a new state: nothing of this run's to move
        return error, None
    after = sum(float(t.norm()) for t in state.state_dict()["residuals"].values())
    return error, after - before


def _damage_a_part(saved: dict, damage: str) -> dict:
    """``saved`` (one rank's state dict, as saved) damaged after the save: "byte", a byte of a
    residual changed; "nan", a residual NaN (with a checksum that matches); "size", a residual cut
    short (likewise); "method", another method's state dict in its place."""
    name = next(iter(saved["residuals"]))
    residual = saved["residuals"][name]
    if damage == "byte":
        residual.view(torch.uint8)[0].add_(1)
    elif damage in ("nan", "size"):
        residual = residual.clone()
        residual[0] = math.nan
        saved["residuals"][name] = residual if damage == "nan" else residual[1:4].clone()
        saved["checksums"][name] = checksum(saved["residuals"][name])
    else:
        saved = dict(saved, **{"class": "TopK"})
    return saved


def a_damaged_per_rank_file(rank: int, world_size: int, path: str, damage: str, when: str) -> tuple:
    """Each rank saves its own state dict (state.state_dict(), to a file with its rank in the name)
    after 1 step and after 2; a new state on a new DDP loads the second, rank 1's damaged after the
    save (_damage_a_part) or, for ``damage`` "step", rank 1's first, then trains a step. ``when`` the load comes: "after" gradsparse.register (the
    README's way); "before_register", after init_process_group; "before_init", before
    init_process_group (in this process it exists: as if it did not), checked at set-up. Returns
    this rank's error (None: it trained), the seconds from the load to the error, and how far the
    residuals moved (0: the load left them as they were)."""
    import time
    from unittest import mock

    state = gs.DGC(density=0.05, timeout=60)  # a method with a state of its own (its step)
    ddp = DDP(make_model())
    gs.register(ddp, state)
    train(ddp, rank, steps=1)
    torch.save(state.state_dict(), f"{path}-rank{rank}-step1.pt")
    train(ddp, rank, steps=1)
    torch.save(state.state_dict(), f"{path}-rank{rank}.pt")
    state.close()
    saved = torch.load(f"{path}-rank{rank}.pt")
    if rank == 1:  # "step": its file of the step before (a save stopped before it reached rank 1)
        saved = torch.load(f"{path}-rank{rank}-step1.pt") if damage == "step" else _damage_a_part(saved, damage)
    state, ddp = gs.DGC(density=0.05, timeout=60), DDP(make_model())
    start, error = time.monotonic(), None
    try:
        if when == "after":
            gs.register(ddp, state)
            state.load_state_dict(saved)
        elif when == "before_register":
            state.load_state_dict(saved)
            gs.register(ddp, state)
        else:
            with mock.patch.object(dist, "is_initialized", return_value=False):
                state.load_state_dict(saved)
            gs.register(ddp, state)
        train(ddp, rank, steps=1)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    moved = sum(float(t.norm()) for t in state.state_dict()["residuals"].values())
    state.close()
    return error, elapsed, moved


def auto_after_a_load_on_one_rank(rank: int, world_size: int, path: str, then: str) -> dict:
    """exchange="auto": every rank saves its state after 9 steps (the trial decided at step 7);
    on a new state rank 0 alone loads its file between init_process_group and register, which
    register refuses on every rank. Then (``then``) each rank registers the state again and trains
    8 steps ("trains"), or loads its own file and trains ("reloads"). Returns the refusal, the
    seconds it took, the exchange of each step's buckets and the decision saved."""
    import time

    def exchanges_of_steps(ddp, state, steps: int) -> list[dict]:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        used = []
        for x, y in batches(rank, steps):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            used.append(exchanges_used(state))
        return used

    def new_auto():
        return gs.TopK(density=0.1, exchange="auto", timeout=60), DDP(make_model(), bucket_cap_mb=0.004)

    state, ddp = new_auto()
    gs.register(ddp, state)
    train(ddp, rank, steps=9)
    saved = state.state_dict()
    torch.save(saved, f"{path}-rank{rank}.pt")
    state.close()
    state, ddp = new_auto()
    if rank == 0:
        state.load_state_dict(torch.load(f"{path}-rank{rank}.pt"))
    start, error = time.monotonic(), None
    try:
        gs.register(ddp, state)
    except ValueError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    gs.register(ddp, state)  # the refused register hooked nothing
    if then == "reloads":
        state.load_state_dict(torch.load(f"{path}-rank{rank}.pt"))
    used = exchanges_of_steps(ddp, state, 8)
    state.close()
    return {"error": error, "elapsed": elapsed, "used": used, "saved": saved["exchanges"], "params": params_of(ddp)}


def load_on_rank_0_alone(rank: int, world_size: int, other: str, done: str) -> tuple:
    """After set-up, load_state_dict on rank 0 only while rank 1, without calling it, stays past
    the state's timeout of 2 s until rank 0 writes the file ``done`` (``other`` "sleeps") or trains
    ("trains"): this rank's error (None: it loaded, or trained) and the seconds it took. Where rank
    1 slept, both ranks then load and train a step: the error of that (None: it worked) comes
    third."""
    import time

    state = gs.TopK(density=0.3, timeout=2)
    ddp = DDP(make_model())
    gs.register(ddp, state)
    train(ddp, rank, steps=2)
    saved = state.state_dict()
    start, error = time.monotonic(), None
    try:
        if rank == 0:
            try:
                state.load_state_dict(saved)
            finally:
                open(done, "w").close()
        elif other == "trains":
            train(ddp, rank, steps=1)
        else:
            stay_until_rank_0_is_done(done)
    except RuntimeError as e:
        error = str(e)
    elapsed, again = time.monotonic() - start, None
    if other == "sleeps":
        dist.barrier()
        try:
            state.load_state_dict(saved)
            train(ddp, rank, steps=1)
        except RuntimeError as e:
            again = str(e)
    return error, elapsed, again


def a_damaged_sharded_part(rank: int, world_size: int, path: str, damage: str) -> tuple:
    """dcp.save of gs.ShardedState(state) after 2 steps, and dcp.load into a new model and state,
    rank 1's block damaged as DCP hands it over ("nan": a residual NaN; "blob": its method states
    not JSON), then a training step. Returns this rank's error (None: it trained), the seconds from
    the load to the error, and the step the state holds after it."""
    import time

    import torch.distributed.checkpoint as dcp

    class Damaged(gs.ShardedState):
        def load_state_dict(self, state_dict: dict) -> None:
            if rank == 1:
                if damage == "nan":
                    block = next(iter(state_dict["residuals"].values())).to_local()
                    block[0] = math.nan
                else:
                    state_dict["methods"].to_local()[:8] = ord("{")
            super().load_state_dict(state_dict)

    def build(seed: int):
        torch.manual_seed(seed)
        ddp = DDP(Shuffled(), bucket_cap_mb=0.004)
        return ddp, gs.register(ddp, gs.TopK(density=0.05, timeout=60)), torch.optim.SGD(ddp.parameters(), lr=0.05)

    ddp, state, opt = build(0)
    _dcp_run(ddp, opt, list(batches(rank, 2)))
    dcp.save(_dcp_checkpoint(ddp, opt, state), checkpoint_id=path)
    state.close()
    ddp, state, opt = build(123)
    loaded = dict(_dcp_checkpoint(ddp, opt, state), gradsparse=Damaged(state))
    start, error = time.monotonic(), None
    try:
        dcp.load(loaded, checkpoint_id=path)
        _dcp_run(ddp, opt, list(batches(rank, 1)))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    step = state.step
    state.close()
    return error, elapsed, step


def propagated_overflow_with_a_head_unused_here(rank: int, world_size: int) -> tuple[dict, dict, list[str]]:
    """MiCRO (union exchange) under a GradScaler with nonfinite="propagate" on TwoHeads with
    find_unused_parameters=True, rank 0 using the even head and rank 1 the odd one for 3 steps,
    then the other; at step 4 an Inf in rank 0's trunk makes the scaler skip the step, and the
    heads' buckets take back what they sent. Returns this rank's residuals before and after that
    step, and the names of the head it did not use in it (whose residual the step must leave alone)."""
    model = TwoHeads()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    state = gs.register(ddp, gs.MiCRO(density=0.1, nonfinite="propagate"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    state.set_scaler(scaler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    before = {}

    def overflow(module, inputs, out):
        out.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.inf))

    for i, (x, y) in enumerate(batches(rank, 4)):
        if i == 3:
            before = {name: t.clone() for name, t in state.state_dict()["residuals"].items()}
        handle = model.trunk.register_forward_hook(overflow) if i == 3 and rank == 0 else None
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x, (rank == 0) != (i == 3)), y)  # the heads swap at step 4
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if handle is not None:
            handle.remove()
    unused = [f"{'even' if rank == 0 else 'odd'}.{p}" for p in ("weight", "bias")]
    return before, {name: t.clone() for name, t in state.state_dict()["residuals"].items()}, unused


class _Scale1:
    """A stand-in loss scaler whose scale stays at 1 (torch's GradScaler refuses float16 parameters)."""

    def get_scale(self) -> float:
        return 1.0


class _Weighted(nn.Module):
    """One float16 parameter of 8 elements; the loss's gradient is 65504 in the first 4, 1 in the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, dtype=torch.float16))
        self.register_buffer("scale", torch.tensor([65504.0] * 4 + [1.0] * 4, dtype=torch.float16))

    def forward(self) -> torch.Tensor:
        return (self.weight * self.scale).float().sum()


def float16_sum_past_the_range(rank: int, world_size: int, method: str, nonfinite: str) -> dict:
    """One float16 step of ``method`` ("topk" or "randomk") at density 1 under ``nonfinite`` where
    every rank's gradient is 65504 in half of the elements. What it handed back (None where the
    step raised), the error's text, and this rank's residual and statistics after it."""
    ddp = DDP(_Weighted())
    state = gs.register(ddp, gs.METHODS[method](density=1.0, nonfinite=nonfinite))
    if nonfinite == "propagate":
        state.set_scaler(_Scale1())
    error = None
    try:
        ddp().backward()
    except RuntimeError as e:  # DDP's hook wraps the state's NonFiniteError
        error = str(e)
    stats = state.stats()["total"]
    return {
        "grad": None if error else ddp.module.weight.grad.float().tolist(),
        "error": error,
        "residual": next(iter(state.state_dict()["residuals"].values())).float().tolist(),
        "steps": (stats["steps"], stats["skipped_steps"]),
    }


def auto_exchange_timed_again(rank: int, world_size: int, static_graph: bool, nan_step: int | None) -> dict:
    """exchange="auto" where the trial's first times do not count: under static_graph=True DDP
    rebuilds its buckets after the second step; ``nan_step`` puts a NaN in rank 0's gradient at
    that step, which nonfinite="skip" skips on every rank. Each step's exchange per bucket, and the
    trial's figures."""
    model = make_model(0)
    ddp = DDP(model, bucket_cap_mb=0.004, static_graph=static_graph)
    state = gs.register(ddp, gs.TopK(density=0.1, exchange="auto", nonfinite="skip"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps = []
    for step, (x, y) in enumerate(batches(rank, 16), start=1):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        (loss * math.nan if step == nan_step and rank == 0 else loss).backward()
        opt.step()
        steps.append(exchanges_used(state))
    return {"steps": steps, "trial": state.stats()["exchange_trial"], "chosen": state.state_dict()["exchanges"]}


def auto_exchange_taken_over(rank: int, world_size: int) -> dict:
    """exchange="auto" decided by a state hooked with model.register_comm_hook (9 steps, DDP's two
    buckets of bucket_cap_mb=0.004), then taken over by gradsparse.register on a new DDP of the
    model: the trial's figures before and after, the decision saved after, and the exchange of
    each bucket at the next step."""
    model = make_model(0)
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.TopK(density=0.1, exchange="auto")
    ddp.register_comm_hook(state, gs.hook)
    train(ddp, rank, steps=9)
    before = state.stats()["exchange_trial"]
    ddp = DDP(model, bucket_cap_mb=0.004)
    gs.register(ddp, state)
    after, chosen = state.stats(reset=True)["exchange_trial"], state.state_dict()["exchanges"]
    train(ddp, rank, steps=1)
    used = {b: s["exchange"] for b, s in state.stats()["buckets"].items()}
    return {"before": before, "after": after, "chosen": chosen, "used": used}


def auto_exchange_in_another_layout(rank: int, world_size: int, bucket_cap_mb: float, static_graph: bool) -> dict:
    """exchange="auto" decided in DDP's two buckets of bucket_cap_mb=0.004, saved after 9 steps with
    reduce-scatter + all-gather in place of whatever it decided for each (so that a decision kept
    shows apart from the model's pick, gather-and-add for these buckets), and resumed in a DDP of
    ``bucket_cap_mb`` (``static_graph`` rebuilds its buckets a step later). The saved layout, and
    each resumed step's exchange per bucket by its parameters' names; the final layout, decision
    and trial figures."""
    model = make_model(0)
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gs.register(ddp, gs.TopK(density=0.1, exchange="auto"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps = []
    for step, (x, y) in enumerate(batches(rank, 20)):
        if step == 9:
            saved = state.state_dict()
            assert saved["exchanges"] is not None  # the trial has decided
            saved["exchanges"] = dict.fromkeys(saved["exchanges"], "reduce_scatter")
            resumed = make_model(123)
            resumed.load_state_dict(model.state_dict())
            ddp = DDP(resumed, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph)
            state = gs.register(ddp, gs.TopK(density=0.1, exchange="auto"))
            state.load_state_dict(saved)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if step >= 9:
            layout = state.state_dict()["layout"]
            used = state.stats(reset=True)["buckets"]
            steps.append({tuple(layout[b]): s["exchange"] for b, s in used.items()})
    after = state.state_dict()
    return {
        "saved_layout": saved["layout"],
        "steps": steps,
        "layout": after["layout"],
        "chosen": after["exchanges"],
        "trial": state.stats()["exchange_trial"],
    }


class Bag(nn.Module):
    """Bags of embedding rows into a linear head: with ``sparse``, DDP hands the table's gradient
    over as a sparse tensor, in a bucket of its own."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(60, 4, mode="sum", sparse=sparse)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(x))


def sparse_embedding_gradients(rank: int, world_size: int, method: str, path: str) -> dict:
    """The same 8 steps of Bag(sparse=True) and Bag(sparse=False), each parameter in a bucket of its
    own after DDP's first step (so both reduce the same buckets; the first, in which DDP's layouts
    differ, is dense): the table's gradients, sparse or dense, are reduced alike. The sparse run
    also resumes from a checkpoint after 4 steps (new model, DDP, optimizer and state + load + 4
    steps)."""
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randint(0, 60, (6, 3), generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(8)]
    layouts = []

    def build(seed: int, sparse: bool):
        torch.manual_seed(seed)
        model = Bag(sparse)
        ddp = DDP(model, bucket_cap_mb=1e-5)
        state = gs.register(ddp, getattr(gs, method)(density=0.1, warmup_steps=1))
        return (
            model,
            ddp,
            state,
            torch.optim.SGD(ddp.parameters(), lr=0.5),
        )  # SGD without momentum takes sparse gradients

    def run(model, ddp, opt, part) -> None:
        for x, y in part:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            layouts.append(model.table.weight.grad.layout)
            opt.step()

    out = {}
    for sparse in (False, True):
        model, ddp, state, opt = build(0, sparse)
        run(model, ddp, opt, data)
        out[sparse] = params_of(model)
        state.close()
    out["layouts"] = layouts[len(data) :]  # the sparse run's
    model, ddp, state, opt = build(0, True)
    run(model, ddp, opt, data[:4])
    torch.save({"model": model.state_dict(), "gs": state.state_dict()}, f"{path}.{rank}")
    state.close()
    model, ddp, state, opt = build(123, True)
    saved = torch.load(f"{path}.{rank}")
    model.load_state_dict(saved["model"])
    state.load_state_dict(saved["gs"])
    run(model, ddp, opt, data[4:])
    out["resumed"] = params_of(model)
    out["residual"] = float(saved["gs"]["residuals"]["table.weight"].abs().sum())
    state.close()
    return out
