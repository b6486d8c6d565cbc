"""A small GPT-2 trained by the Hugging Face Trainer on the King James Bible, its gradients
sparsified by ``gradsparse.transformers.sparsify``: the recipe for Trainer users, offline.

    torchrun --standalone --nproc-per-node=2 -m examples.gpt --method dense,topk

The model is built from a configuration (nothing is downloaded): GPT-2 with 2 layers of width 128
over the Bible's words (examples.lstm's corpus, lower-cased, words seen fewer than 3 times as
<unk>), contexts of 64 words, AdamW (the Trainer's default). Each method trains a model of its own
from the same start, dense for the learning rate's warm-up (a tenth of the steps) and sparse
after; the summary gives each one's validation perplexity, training time and bytes sent per rank
and step. Figures in examples/README.md.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import transformers

import gradsparse as gs
from examples.driver import bounded, count, positive
from examples.lstm import data


def blocks(stream: torch.Tensor, length: int) -> list[dict]:
    """The token stream cut into contexts of ``length`` words, each its own labels (the model
    shifts them)."""
    count = len(stream) // length
    return [{"input_ids": x, "labels": x} for x in stream[: count * length].view(count, length)]


def state_of(method: str, density: float, warmup_steps: int) -> gs.State:
    cls = gs.METHODS[method]
    options = {"warmup_steps": warmup_steps} if method != "dense" else {}
    return cls(density=density, **options) if any(o.name == "density" for o in cls.OPTIONS) else cls(**options)


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m examples.gpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="dense,topk", help=f"comma-separated, of {', '.join(gs.METHODS)}")
    parser.add_argument("--density", type=float, default=0.01, help="checked by each method, as it takes it")
    parser.add_argument("--max-steps", type=positive, default=200)
    parser.add_argument("--batch-size", type=positive, default=16, help="contexts per rank and step")
    parser.add_argument("--lr", type=bounded(0, low_ok=False, example="1e-3"), default=1e-3)
    parser.add_argument("--bucket-cap-mb", type=bounded(0, low_ok=False, example="25"), default=None,
                        help="DDP's bucket size (its default: 25)")  # fmt: skip
    parser.add_argument("--sparse-warmup-steps", type=count, default=None,
                        help="dense steps before sparsification (default: the learning rate's warm-up, a tenth)")  # fmt: skip
    parser.add_argument("--data-dir", default=None, help="where the corpus is cached (default ~/.cache/gradsparse)")
    parser.add_argument("--out", default="runs/gpt", help="the Trainer's output folder, one per method")
    args = parser.parse_args(argv)
    lr_warmup = args.max_steps // 10
    warmup = lr_warmup if args.sparse_warmup_steps is None else args.sparse_warmup_steps
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in gs.METHODS]
    if not methods or unknown:
        parser.error(f"--method {args.method!r}: choose one or more of {', '.join(gs.METHODS)}")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:  # one output folder per method
        parser.error(f"--method: {', '.join(twice)} given twice; each method trains once, in <out>/<method>")
    for method in methods:  # refused before any method trains, not at its turn
        try:
            state_of(method, args.density, warmup).close()
        except (TypeError, ValueError) as e:
            parser.error(f"--method {method}: {e}")
    corpus = data.load("kjv", args.data_dir, min_count=3)
    train, valid = blocks(corpus.train, 64), blocks(corpus.valid, 64)[:256]
    config = transformers.GPT2Config(vocab_size=len(corpus.vocab), n_positions=64, n_embd=128, n_layer=2, n_head=4)
    rows = []
    for method in methods:
        torch.manual_seed(0)
        options = transformers.TrainingArguments(
            output_dir=f"{args.out}/{method}", max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=32, learning_rate=args.lr, warmup_steps=lr_warmup,
            logging_steps=max(1, args.max_steps // 10), save_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), seed=0, ddp_bucket_cap_mb=args.bucket_cap_mb,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        trainer = transformers.Trainer(model=model, args=options, train_dataset=train, eval_dataset=valid)
        gs.transformers.sparsify(trainer, state_of(method, args.density, warmup))
        seconds = trainer.train().metrics["train_runtime"]
        sent = [
            entry["gradsparse/bytes_sent"] for entry in trainer.state.log_history if "gradsparse/bytes_sent" in entry
        ]
        loss = trainer.evaluate()["eval_loss"]
        rows.append(
            {"method": method, "perplexity": math.exp(loss), "seconds": seconds, "bytes": sum(sent) / len(sent)}
        )
    if trainer.is_world_process_zero():
        print(f"\n{'method':>10} {'perplexity':>11} {'train time':>11} {'MB sent/rank/step':>18}")
        for r in rows:
            print(f"{r['method']:>10} {r['perplexity']:>11.1f} {r['seconds']:>10.1f}s {r['bytes'] / 1e6:>18.3f}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
