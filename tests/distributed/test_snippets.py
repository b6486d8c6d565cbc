"""The Python snippets of README.md and docs/methods.md run as written, each inside the smallest
script a user would write around it, on 2 Gloo ranks under torchrun
(tests/distributed/snippets.py), and do what the text around them says. A snippet that calls a
function that does not exist, passes an argument it does not take or leaves out a step fails here,
naming the doc's line."""

import subprocess
import sys

import pytest

from tests.distributed import snippets
from tests.subprocesses import ROOT, environment


def test_every_python_snippet_of_the_docs_has_its_scaffolding():
    found = snippets.scaffolded()
    assert len(found) == len(snippets.SCAFFOLDS) == 9, [snippets.located(doc, code) for doc, code, _ in found]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_docs_python_snippets_run_as_written(tmp_path):
    env = environment(OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*torchrun, "-m", "tests.distributed.snippets", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the docs' snippets failed:\n{output[-6000:]}"
    for doc, code, _ in snippets.scaffolded():
        for rank in range(2):
            assert f"rank {rank}: {snippets.located(doc, code)} ran" in output, output[-3000:]
