"""Helpers shared by gradsparse's tests and benchmarks: a multi-process launcher on 127.0.0.1
(distributed) and several ranks as threads of one process (thread_ranks)."""

from gradsparse.testing.distributed import DistributedError, free_port, run_distributed

__all__ = ["DistributedError", "free_port", "run_distributed"]
