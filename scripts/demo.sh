#!/usr/bin/env bash
# Sets up (scripts/setup.sh demo) and runs the main job: a small CNN on Fashion-MNIST trained by
# 4 local Gloo workers, first with plain DDP, then with Top-k at density 0.01, that is
#
#   torchrun --standalone --nproc-per-node=4 -m examples.cnn [ARGS...]
#
# with the interpreter setup.sh installed into (scripts/env.sh). ARGS go to examples.cnn
# (python -m examples.cnn --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
source scripts/env.sh
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=4 -m examples.cnn "$@"
