"""examples.gpt, the Hugging Face Trainer example, runs under torchrun as its docstring says and
sends what its methods send."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_trainer_example_trains_dense_and_topk_and_reports_both(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "examples.gpt", "--method", "dense,topk", "--max-steps", "4", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, f"examples.gpt failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = re.findall(r"^ +(\w+) +([0-9.]+) +[0-9.]+s +([0-9.]+)$", done.stdout, flags=re.MULTILINE)
    rows = {method: (float(perplexity), float(sent)) for method, perplexity, sent in summary}
    assert set(rows) == {"dense", "topk"}, done.stdout[-2000:]
    assert all(perplexity > 1 for perplexity, _ in rows.values()), rows
    # Top-k at density 0.01 over gather-and-add: 2 ranks x 1% of the pairs (index and value) against
    # a ring all-reduce's whole gradient, about 2% of dense's bytes.
    assert 0 < rows["topk"][1] < 0.05 * rows["dense"][1], rows
