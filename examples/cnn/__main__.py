"""Image classification with gradsparse: `torchrun --standalone --nproc-per-node=4 -m examples.cnn`.

Defaults (the main job): the small CNN on Fashion-MNIST (installed offline), 4 Gloo workers,
plain DDP (dense all-reduce) then Top-k at density 0.01 with momentum correction, 4 epochs each with
the learning rate's drop before the last (the main-job preset, which fills in what the command
line does not give); per-epoch loss, test
accuracy, achieved density and bytes sent, then a summary. Models: smallcnn, resnet18,
resnet20, vgg16, vgg19; datasets: fashion-mnist, cifar10, cifar100 (--data-dir with the
official archive; see examples/README.md). The original benchmarks' settings are presets:
`python -m examples.cnn --list-presets`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

from examples import driver
from examples.cnn import data, models

# dataset -> channels, classes, image size, training images, test images
DATASETS = {
    "fashion-mnist": (1, 10, 28, 60_000, 10_000),
    "cifar10": (3, 10, 32, 50_000, 10_000),
    "cifar100": (3, 100, 32, 50_000, 10_000),
}

# The original benchmarks, from the seeds' training scripts. Epochs and batch sizes as in them: runs
# of hours to days on GPUs; the learning rate is the scripts' base rate scaled to their world
# size (warm-up included), so use the same number of workers to reproduce them.
PRESETS = {
    "exdyna-resnet18-cifar10": dict(model="resnet18", dataset="cifar10", method="exdyna", density=0.001,
                                    batch_size=32, lr=0.1 * 32 / 128 * 8, lr_warmup_epochs=5, lr_milestones="150",
                                    momentum=0.9, weight_decay=5e-4, epochs=200),
    "exdyna-resnet18-cifar100": dict(model="resnet18", dataset="cifar100", method="exdyna", density=0.001,
                                     batch_size=32, lr=0.1 * 32 / 128 * 8, lr_warmup_epochs=5, lr_milestones="150",
                                     momentum=0.9, weight_decay=5e-4, epochs=200),
    "micro-resnet18-cifar10": dict(model="resnet18", dataset="cifar10", method="micro", density=0.001,
                                   batch_size=32, lr=0.1 * 32 / 128 * 16, lr_warmup_epochs=5, lr_milestones="150",
                                   momentum=0.9, weight_decay=5e-4, epochs=200),
    "sage-resnet18-cifar10": dict(model="resnet18", dataset="cifar10", method="sage", density=0.001,
                                  batch_size=256, lr=0.1 * 256 / 128 * 4, lr_warmup_epochs=5, lr_milestones="150",
                                  momentum=0.9, weight_decay=5e-4, epochs=200),
    "spardl-vgg16-cifar10": dict(model="vgg16", dataset="cifar10", method="spardl", density=0.01, batch_size=16,
                                 lr=0.1, lr_warmup_epochs=10, momentum=0.9, weight_decay=1e-4, epochs=121),
    "spardl-resnet20-cifar10": dict(model="resnet20", dataset="cifar10", method="spardl", density=0.01,
                                    batch_size=16, lr=0.1, lr_warmup_epochs=10, momentum=0.9, weight_decay=1e-4,
                                    epochs=121),
    "spardl-vgg19-cifar100": dict(model="vgg19", dataset="cifar100", method="spardl", density=0.01, batch_size=16,
                                  lr=0.1, lr_warmup_epochs=10, momentum=0.9, weight_decay=1e-4, epochs=161),
    "sidco-resnet20-cifar10": dict(model="resnet20", dataset="cifar10", method="sidco", density=0.001,
                                   batch_size=512, lr=0.1, lr_warmup_epochs=5, lr_milestones="80,120",
                                   momentum=0.9, epochs=140),
    "sidco-vgg16-cifar10": dict(model="vgg16", dataset="cifar10", method="sidco", density=0.001, batch_size=512,
                                lr=0.1, lr_warmup_epochs=5, lr_milestones="80,120", momentum=0.9, epochs=140),
    # Offline: the configuration of docs/results.md.
    "demo": dict(model="smallcnn", dataset="fashion-mnist", method="dense,topk", density=0.01, batch_size=64,
                 lr=0.05, momentum=0.9, epochs=4),
}  # fmt: skip
# The main job (a run without --preset): the demo with momentum correction and the learning rate's
# drop before the last epoch; Top-k ends within 1 point of dense on every seed tried
# (docs/results.md, "The main job").
PRESETS["main-job"] = dict(PRESETS["demo"], lr_milestones="3", momentum_correction=True)


class ImageClassification(driver.Task):
    metric = "accuracy"
    metric_fields = ("accuracy",)

    def __init__(self, args: argparse.Namespace):
        channels, classes, size, n_train, n_test = DATASETS[args.dataset]
        if args.model in ("vgg16", "vgg19") and size != 32:  # else models.build's ValueError, once launched
            raise SystemExit(
                f"--model {args.model} needs 32x32 images, but --dataset {args.dataset} has {size}x{size}: "
                "use --dataset cifar10 or cifar100, or another --model"
            )
        if args.synthetic_data:
            self.x_train, self.y_train = data.synthetic(n_train, channels, size, classes, args.seed)
            self.x_test, self.y_test = data.synthetic(n_test, channels, size, classes, args.seed + 1)
        elif args.dataset == "fashion-mnist":
            self.x_train, self.y_train, self.x_test, self.y_test = data.fashion_mnist(args.data_dir)
        else:
            self.x_train, self.y_train, self.x_test, self.y_test = data.cifar(args.dataset, args.data_dir)
        if args.test_samples:
            self.x_test, self.y_test = self.x_test[: args.test_samples], self.y_test[: args.test_samples]
        self.name = f"{args.model} on {driver.dataset_label(args)}"
        self.model_args = (args.model, channels, classes, size)
        self.augment = args.dataset != "fashion-mnist" and not args.no_augment
        self.batch_size = args.batch_size
        self.samples_per_batch = args.batch_size
        self.seed = args.seed
        self.device = driver.device()

    def build_model(self) -> nn.Module:
        return models.build(*self.model_args)

    def steps_per_epoch(self, world_size: int) -> int:
        steps = len(self.x_train) // world_size // self.batch_size
        if steps == 0:
            raise SystemExit(f"--batch-size {self.batch_size} x {world_size} workers exceeds the training set")
        return steps

    def batches(self, epoch: int, rank: int, world_size: int):
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        shard = torch.randperm(len(self.x_train), generator=g)[rank::world_size]
        aug = torch.Generator().manual_seed(self.seed * 100_003 + epoch * 1009 + rank)
        for step in range(self.steps_per_epoch(world_size)):
            idx = shard[step * self.batch_size : (step + 1) * self.batch_size]
            x = self.x_train[idx]
            if self.augment:
                x = data.augment(x, aug)
            yield x.to(self.device), self.y_train[idx].to(self.device)

    def train_step(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, rank: int, world_size: int) -> dict[str, float]:
        model.eval()
        correct = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            # The same number of forward passes on every rank, the last ones empty where this rank's
            # share runs out: with --fsdp each one gathers the parameters from every rank.
            for first in range(0, len(self.x_test), world_size * 1000):
                start = first + rank * 1000
                logits = model(self.x_test[start : start + 1000].to(self.device))
                correct[0] += (logits.argmax(1).cpu() == self.y_test[start : start + 1000]).sum()
                correct[1] += len(logits)
        dist.all_reduce(correct)
        return {"accuracy": float(correct[0] / correct[1])}


def add_task_arguments(group) -> None:
    group.add_argument("--model", choices=models.MODELS, default="smallcnn")
    group.add_argument("--dataset", choices=tuple(DATASETS), default="fashion-mnist")
    group.add_argument("--no-augment", action="store_true", help="CIFAR: no random crops and flips")
    group.add_argument(
        "--test-samples", type=driver.count, default=0, help="evaluate on the first N test images only (0: all)"
    )
    # A run without --preset takes the main job's settings where it gives none.
    group.set_defaults(preset="main-job")


def main(argv: list[str] | None = None):
    return driver.main(
        ImageClassification,
        __doc__,
        argv,
        add_task_arguments=add_task_arguments,
        presets=PRESETS,
        default_out="runs/cnn",
    )


if __name__ == "__main__":
    main()
