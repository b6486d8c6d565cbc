"""Recommendation with NCF (NeuMF) and gradsparse: `torchrun --standalone --nproc-per-node=4 -m examples.ncf`.

Defaults (offline): MovieLens-100K from the installed recbole package (`pip install --no-deps
recbole==1.2.1`), a small NeuMF, 4 sampled negatives per positive, Adam, plain DDP then Top-k at
density 0.01 (the ml100k preset). Every rating is a positive; each user's latest interaction is
the test item, ranked among 100 items the user never interacted with: HR@10 and NDCG@10 (random
scoring gives HR@10 of about 0.1). MovieLens-1M and -20M: --dataset ml-1m / ml-20m with --data-dir
(the loader's error shows the download). The original benchmarks' settings are presets:
`python -m examples.ncf --list-presets`. --batch-size is per worker: the presets of the 2^20
global batch divide it by their world size, 4.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

from examples import driver
from examples.ncf import data
from examples.ncf.model import NeuMF

TOP_K = 10

# The original benchmarks, from the seeds' training scripts: NeuMF on MovieLens-20M, 4 workers, a global batch of
# 2^20 (2^18 per worker), Adam, 30 epochs. Runs of hours on GPUs; use 4 workers to reproduce them.
_SEEDS_NCF = dict(dataset="ml-20m", factors=64, layers="256,256,128,64", dropout=0.5, negatives=4,
                  batch_size=2**20 // 4, lr=0.0045, adam_betas="0.25,0.5", adam_eps=1e-8, weight_decay=0.0,
                  epochs=30)  # fmt: skip
PRESETS = {
    "exdyna-ncf-ml20m": dict(method="exdyna", density=0.001, **_SEEDS_NCF),
    "micro-ncf-ml20m": dict(method="micro", density=0.001, **_SEEDS_NCF),
    "sage-ncf-ml20m": dict(method="sage", density=0.095, **_SEEDS_NCF),
    # Offline, the default: with 4 workers on 2 CPU cores, dense trains 6 epochs of 241 steps in
    # about 45 s (HR@10 0.47 after the first epoch, 0.62 after the sixth; NDCG@10 0.25, 0.36).
    # One DDP bucket per embedding table: the GMF tables' gradients are 30 to 100 times smaller
    # than the MLP tables', so a selection over one bucket holding both never picks them
    # (docs/results.md, "Closing the quality gaps").
    "ml100k": dict(dataset="ml-100k", method="dense,topk", density=0.01, factors=32, layers="64,32,16", dropout=0.0,
                   negatives=4, batch_size=512, lr=0.005, adam_betas="0.9,0.999", adam_eps=1e-8, weight_decay=0.0,
                   epochs=6, bucket_cap_mb=0.05),
}  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in str(text).split(",") if x.strip())


def _layer_sizes(text: str) -> str:
    """argparse type of --layers, checked as the model will read it (the text is kept)."""
    try:
        sizes = _ints(text)
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or sizes[0] % 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give sizes of at least 1 separated by commas, the first even (the two MLP embeddings "
            "side by side), for example 64,32,16"
        )
    return text


def _betas(text: str) -> str:
    """argparse type of --adam-betas: two numbers in [0, 1), as Adam takes them (the text is kept)."""
    try:
        betas = _floats(text)
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise argparse.ArgumentTypeError(f"{text!r}: give two numbers in [0, 1) separated by a comma, e.g. 0.9,0.999")
    return text


class Recommendation(driver.Task):
    metric = f"hr@{TOP_K}"
    metric_fields = (f"hr@{TOP_K}", f"ndcg@{TOP_K}")
    optimizer_class = torch.optim.Adam

    def __init__(self, args: argparse.Namespace):
        if args.synthetic_data:
            ratings, source = data.synthetic_ratings(args.dataset, args.seed), "synthetic"
        else:
            ratings, source = data.load_ratings(args.dataset, args.data_dir)
        self.data = data.leave_one_out(*ratings)
        # A synthetic run is not evaluated: no ranking negatives (13.8 M item ids at MovieLens-20M's size)
        self.eval_negatives = None
        if not args.synthetic_data:
            try:
                self.eval_negatives = data.evaluation_negatives(self.data, args.eval_negatives)
            except ValueError as e:  # on every rank alike, once the data is read: no traceback
                most = int((self.data.n_items - self.data.rated_count).min())
                raise SystemExit(
                    f"--eval-negatives {args.eval_negatives}: {e}; give --eval-negatives {most} or fewer"
                ) from None
        self.layers = _ints(args.layers)
        self.betas = _floats(args.adam_betas)
        if len(self.betas) != 2:
            raise SystemExit(f"--adam-betas {args.adam_betas!r}: two comma-separated numbers, for example 0.9,0.999")
        d = self.data
        self.name = (
            f"NeuMF on {driver.dataset_label(args)} ({d.n_users:,} users, {d.n_items:,} items, "
            f"{d.n_train:,} training ratings)"
        )
        self.source = source
        self.factors, self.dropout = args.factors, args.dropout
        self.negatives, self.batch_size, self.seed = args.negatives, args.batch_size, args.seed
        self.samples_per_batch = args.batch_size
        self.device = driver.device()

    def build_model(self) -> nn.Module:
        return NeuMF(self.data.n_users, self.data.n_items, self.factors, self.layers, self.dropout)

    def make_optimizer(self, params, args: argparse.Namespace) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=args.lr, betas=self.betas, eps=args.adam_eps, weight_decay=args.weight_decay)

    def steps_per_epoch(self, world_size: int) -> int:
        steps = data.steps_per_epoch(self.data.n_train, world_size, self.negatives, self.batch_size)
        if steps == 0:
            raise SystemExit(
                f"--batch-size {self.batch_size} x {world_size} workers exceeds the {self.data.n_train:,} training "
                f"positives x {1 + self.negatives} samples each"
            )
        return steps

    def batches(self, epoch: int, rank: int, world_size: int):
        users, items, labels = data.epoch_samples(self.data, epoch, rank, world_size, self.negatives, self.seed)
        b = self.batch_size
        for step in range(self.steps_per_epoch(world_size)):
            part = slice(step * b, (step + 1) * b)
            yield users[part].to(self.device), items[part].to(self.device), labels[part].to(self.device)

    def train_step(self, model: nn.Module, batch) -> torch.Tensor:
        users, items, labels = batch
        return nn.functional.binary_cross_entropy_with_logits(model(users, items), labels)

    def evaluate(self, model: nn.Module, rank: int, world_size: int, chunk: int = 4096) -> dict[str, float]:
        """HR@10 and NDCG@10 over all users; rank r scores users r, r + P, ... (all-reduced)."""
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # hits, ndcg, users
        users = torch.arange(rank, self.data.n_users, world_size)
        most = -(-self.data.n_users // world_size)  # rank 0's users, the most any rank has
        with torch.no_grad():
            # The same number of forward passes on every rank, the last one empty where this rank
            # has fewer users: with --fsdp each one gathers the parameters from every rank.
            for start in range(0, most, chunk):
                u = users[start : start + chunk]
                items = torch.cat([self.data.test_items[u].unsqueeze(1), self.eval_negatives[u]], dim=1)
                scores = model(
                    u.unsqueeze(1).expand_as(items).reshape(-1).to(self.device), items.reshape(-1).to(self.device)
                )
                hit, ndcg = data.hit_and_ndcg(scores.view(items.shape).float().cpu(), TOP_K)
                totals += torch.stack([hit.sum(), ndcg.sum(), torch.tensor(float(len(u)), dtype=torch.float64)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
        return {
            self.metric_fields[0]: float(totals[0] / totals[2]),
            self.metric_fields[1]: float(totals[1] / totals[2]),
        }


def add_task_arguments(group) -> None:
    group.add_argument("--dataset", choices=data.DATASETS, default="ml-100k")
    group.add_argument("--factors", type=driver.positive, default=32, help="GMF embedding width")
    group.add_argument(
        "--layers",
        type=_layer_sizes,
        default="64,32,16",
        help="MLP sizes, the first being the two MLP embeddings side by side",
    )
    group.add_argument("--dropout", type=driver.probability, default=0.0, help="after each MLP layer")
    group.add_argument("--negatives", type=driver.count, default=4, help="sampled negatives per training positive")
    group.add_argument(
        "--eval-negatives", type=driver.positive, default=100, help="items the test item is ranked against"
    )
    group.add_argument("--adam-betas", type=_betas, default="0.9,0.999", help="Adam's beta1,beta2")
    group.add_argument("--adam-eps", type=driver.bounded(0, example="1e-8"), default=1e-8, help="Adam's epsilon")
    # The ml100k preset is the default; its settings also replace the driver's defaults (which
    # suit SGD on images) in --help.
    offline = PRESETS["ml100k"]
    group.set_defaults(preset="ml100k", **{k: offline[k] for k in ("batch_size", "lr", "epochs", "weight_decay")})


def main(argv: list[str] | None = None):
    return driver.main(
        Recommendation,
        __doc__,
        argv,
        add_task_arguments=add_task_arguments,
        presets=PRESETS,
        default_out="runs/ncf",
    )


if __name__ == "__main__":
    main()
