"""Runs a worker function under mpirun: every process maps the OpenMPI variables with
gradsparse.launch, joins a Gloo group (for DDP) and saves its result to OUT/rank<r>.pt.

    mpirun -np 3 python -m tests.distributed.mpi_run OUT workers.exchange_stream mpi
"""

import os
import sys

import torch
import torch.distributed as dist

import gradsparse as gs
from tests.distributed import workers


def main() -> None:
    out, function, *args = sys.argv[1:]
    launcher = gs.launch.setup_environment()
    assert launcher == "mpirun", f"expected to run under mpirun, found {launcher}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        result = getattr(workers, function.removeprefix("workers."))(rank, world_size, *args)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
