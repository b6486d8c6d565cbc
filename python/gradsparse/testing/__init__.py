"""Helpers shared by gradsparse's tests and benchmarks: a multi-process launcher on 127.0.0.1 and
plain PyTorch re-statements of the methods."""

from gradsparse.testing.distributed import DistributedError, run_distributed

__all__ = ["DistributedError", "run_distributed"]
