"""The compute : communication ratio of one data-parallel step, on the workers it runs on.

    python -m benchmarks.cluster --rate 100mbit -- -m benchmarks.step_ratio [--model smallcnn] [--batch-size 64]

Every rank times, in the same processes: the median forward + backward of an example CNN on one
batch of synthetic inputs of the right shape (no communication), and the median dense all-reduce
(the process group's backend) of one float32 tensor as large as the model's gradient, which is
what DDP moves per step. Rank 0 prints both and ratio = all-reduce / compute: how much of a dense
step is communication, the figure that decides what sparsification can gain. Launched by torchrun
(env://), on the emulated cluster or anywhere else.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.utils import check_threads, end_process_group, require_launcher
from examples.cnn.models import MODELS, build

SHAPES = {"smallcnn": (1, 28, 10), "resnet20": (3, 32, 10), "resnet18": (3, 32, 10), "vgg16": (3, 32, 10)}


def median_seconds(fn, repeat: int) -> float:
    times = []
    for i in range(repeat + 2):  # two warm-up runs
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_ratio", description=__doc__)
    parser.add_argument("--model", default="smallcnn", choices=[m for m in MODELS if m in SHAPES])
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--repeat", args.repeat), ("--threads", args.threads)):
        if value < 1:  # on every rank alike, before the process group
            parser.error(f"{flag} must be at least 1, got {value}")
    check_threads(parser, args.threads)
    require_launcher(parser, "benchmarks.step_ratio")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    channels, size, classes = SHAPES[args.model]
    torch.manual_seed(0)
    model = build(args.model, channels, classes, size)
    x, y = torch.randn(args.batch_size, channels, size, size), torch.randint(0, classes, (args.batch_size,))

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()

    numel = sum(p.numel() for p in model.parameters())
    flat = torch.zeros(numel)
    compute_s = median_seconds(compute, args.repeat)
    allreduce_s = median_seconds(lambda: dist.all_reduce(flat), args.repeat)
    figures = {"model": args.model, "parameters": numel, "batch": args.batch_size, "world": dist.get_world_size(),
               "compute_s": compute_s, "allreduce_s": allreduce_s, "ratio": allreduce_s / compute_s}  # fmt: skip
    if dist.get_rank() == 0:
        print(
            f"{args.model} ({numel:,} parameters), batch {args.batch_size}/worker, {dist.get_world_size()} workers: "
            f"compute {compute_s * 1e3:.1f} ms, dense all-reduce {allreduce_s * 1e3:.1f} ms, "
            f"ratio all-reduce/compute {allreduce_s / compute_s:.2f}",
            flush=True,
        )
    end_process_group()
    return figures


if __name__ == "__main__":
    main()
