"""gradsparse.testing.run_distributed: ranks in new processes (forked from a server that imported
torch once, joined through a store the caller hosts) that see the caller's environment as it is at
the call, with every rank's result, error or timeout reported."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from gradsparse.testing import DistributedError, run_distributed

pytestmark = pytest.mark.distributed


def environment(rank: int, world_size: int, names: list[str]) -> dict:
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), **{n: os.environ.get(n) for n in names}}


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    names = ["GRADSPARSE_TEST_SET", "GRADSPARSE_TEST_REMOVED", "GRADSPARSE_TEST_GIVEN"]
    monkeypatch.setenv("GRADSPARSE_TEST_REMOVED", "before")
    run_distributed(environment, 2, names)  # the fork server runs from here on, with that variable
    monkeypatch.delenv("GRADSPARSE_TEST_REMOVED")
    monkeypatch.setenv("GRADSPARSE_TEST_SET", "after")
    seen = run_distributed(environment, 3, names, env={"GRADSPARSE_TEST_GIVEN": "given"})
    assert seen == [
        {"rank": r, "world": 3, "GRADSPARSE_TEST_SET": "after", "GRADSPARSE_TEST_REMOVED": None,
         "GRADSPARSE_TEST_GIVEN": "given"}
        for r in range(3)
    ]  # fmt: skip


def fails_or_sleeps(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own error")
    if rank == 2:
        time.sleep(60)
    return rank


def returns_rank(rank: int, world_size: int) -> int:
    return rank


def test_each_rank_reports_its_result_its_error_or_its_timeout():
    # The processes' server started first (importing torch and gradsparse takes seconds of a
    # loaded machine), so that the 6 s below are the ranks' own.
    assert run_distributed(returns_rank, 1) == [0]
    with pytest.raises(DistributedError) as info:
        run_distributed(fails_or_sleeps, 3, timeout=6)
    assert info.value.results == {0: 0}
    assert set(info.value.errors) == {1, 2}
    assert "ValueError: rank 1's own error" in info.value.errors[1]
    assert info.value.errors[2] == "rank 2 did not finish within 6 s (killed)"


def group_after_rank_0_left(rank: int, world_size: int) -> list[float]:
    if rank == 0:
        return []
    time.sleep(2.0)  # rank 0, which used to host the store, has returned and exited by now
    group = dist.new_group([1, 2], use_local_synchronization=True)  # a rendezvous through the store
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    return total.tolist()


def test_the_store_outlives_every_rank():
    assert run_distributed(group_after_rank_0_left, 3) == [[], [3.0], [3.0]]
