"""The driver's summary: time to the first method's quality (within the task's tolerance), its
ratio, and the note that loopback hides the network."""

from examples import driver


class Score(driver.Task):
    metric = "accuracy"


class Perplexity(driver.Task):
    metric = "perplexity"
    higher_is_better = False


def rows(*points: tuple[float, float], loss: float = 1.0) -> list[dict]:
    return [{"accuracy": q, "perplexity": q, "loss": loss, "elapsed_seconds": t, "bytes_total": 1e6} for t, q in points]


def test_time_to_target_uses_the_first_evaluation_within_the_tolerance():
    results = {"dense": rows((10, 0.80), (20, 0.86), (30, 0.87)), "topk": rows((4, 0.79), (8, 0.861), (12, 0.865))}
    text = driver.summarize(Score(), results)
    assert "target accuracy 0.8600 (dense's final 0.8700 - 0.01)" in text
    dense, topk = text.splitlines()[2:]
    assert dense.split()[3:5] == ["20.0s", "1.00x"], dense
    assert topk.split()[3:5] == ["8.0s", "0.40x"], topk


def test_a_run_that_never_reaches_the_target_says_so_and_lower_is_better_for_perplexity():
    results = {"dense": rows((10, 120.0), (20, 100.0)), "topk": rows((5, 130.0), (10, 106.0))}
    text = driver.summarize(Perplexity(), results)
    assert "target perplexity 105.0000 (dense's final 100.0000 x 1.05)" in text
    topk = text.splitlines()[3]
    assert "not yet" in topk and topk.split()[-2] == "-", topk


def test_the_loopback_note_appears_only_when_every_worker_is_local(monkeypatch):
    monkeypatch.delenv("GRADSPARSE_CLUSTER", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert "loopback" in driver.network_note(4)
    note = driver.network_note(4, {"dense": 225e6, "topk": 9e6})  # bytes per worker
    assert "at least: dense 36.0 s, topk 1.4 s" in note, note
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one worker per host: a real cluster
    assert driver.network_note(4) == ""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GRADSPARSE_CLUSTER", "4x50mbit")
    assert driver.network_note(4) == ""


def test_step_costs_leave_the_first_step_out_and_take_the_median():
    steps = [(9.0, 100), (1.0, 10), (3.0, 30), (2.0, 20)]
    assert driver.step_costs(steps) == (2.0, 20.0)
    assert driver.step_costs([(4.0, 7)]) == (4.0, 7.0)  # one step: it is all there is


def test_the_synthetic_summary_gives_step_time_and_traffic_against_the_first_method():
    text = driver.summarize_steps({"dense": (2.0, 8e6), "topk": (0.5, 1.6e5)})
    dense, topk = text.splitlines()[2:]
    assert dense.split() == ["dense", "2.000s", "1.000x", "8.000", "1.0000x"], dense
    assert topk.split() == ["topk", "0.500s", "0.250x", "0.160", "0.0200x"], topk


def test_the_synthetic_summary_of_one_worker_gives_no_traffic_ratio():
    """One worker sends nothing: the first method's 0 bytes ended a --synthetic-data run on one
    worker in a ZeroDivisionError after every method had trained, with no summary."""
    text = driver.summarize_steps({"dense": (2.0, 0.0), "topk": (0.5, 0.0)})
    dense, topk = text.splitlines()[2:]
    assert dense.split() == ["dense", "2.000s", "1.000x", "0.000", "-"], dense
    assert topk.split() == ["topk", "0.500s", "0.250x", "0.000", "-"], topk


def test_a_reference_that_diverged_sets_no_target():
    """A first method whose loss went NaN ends at a NaN perplexity: the summary set the target NaN
    and read every method, one that trained well included, as "not yet" there. It now says that
    there is no target and gives no time to it."""
    results = {"dense": rows((10, 300.0), (20, float("nan"))), "topk": rows((5, 250.0), (10, 180.0))}
    text = driver.summarize(Perplexity(), results)
    assert text.splitlines()[0] == "no target: dense's final perplexity is nan, so no time to it is given", text
    for line in text.splitlines()[2:]:
        assert line.split()[3:5] == ["-", "-"], line
    assert text.splitlines()[3].split()[1] == "180.0000"


def test_a_reference_whose_loss_diverged_sets_no_target_though_its_score_is_a_number():
    """A CNN whose loss went NaN still scores chance accuracy (0.1070): the summary set the target
    just below it, and every method reached it."""
    results = {"dense": rows((10, 0.5), (20, 0.107), loss=float("nan")), "topk": rows((5, 0.6), (10, 0.8))}
    text = driver.summarize(Score(), results)
    assert text.splitlines()[0] == "no target: dense's final loss is nan (accuracy 0.1070), so no time to it is given"
    assert text.splitlines()[3].split()[3:5] == ["-", "-"], text


def test_a_method_at_the_printed_target_has_reached_it():
    """0.5006 - 0.01 is a hair above 0.4906 in floating point: a method that ended exactly at the
    target printed (4906 of 10000 right) read "not yet"."""
    text = driver.summarize(Score(), {"dense": rows((10, 0.5006)), "topk": rows((10, 0.4906))})
    assert "target accuracy 0.4906 (dense's final 0.5006 - 0.01)" in text
    assert text.splitlines()[3].split()[3] == "10.0s", text
    assert not Score().reached(0.4905, 0.5006 - 0.01)


def test_powersgd_is_charged_the_whole_gradient_until_it_compresses_and_what_torch_compresses_after():
    """torch's PowerSGD all-reduces the gradient itself for its first start_powerSGD_iter (2)
    steps, which were charged at the compressed size; and it compresses a matrix only where that
    more than halves it (a 16 x 16 matrix at rank 4, 256 elements against 2 x 128, it sends whole)."""
    import argparse

    import torch

    class Ddp(torch.nn.Module):  # what Communication reads of a DDP: its module and register_comm_hook
        def __init__(self, module):
            super().__init__()
            self.module = module

        def register_comm_hook(self, state, hook):
            self.hooked = (state, hook)

    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 64, bias=False))
    assert driver._powersgd_elements(model, 4) == 256 + (64 + 16) * 4
    args = argparse.Namespace(fsdp=False, powersgd_rank=4, seed=0)
    comm = driver.Communication("powersgd", Ddp(model), args, world_size=2)
    sent = []
    for step in range(4):
        comm.torch_state.iter = step + 1  # the hook counts the step at its last bucket
        sent.append(comm.step_figures()["bytes_sent"])
    whole, compressed = (16 * 16 + 16 * 64) * 4, (256 + 80 * 4) * 4  # ring at 2 ranks: 2 (P - 1) / P = 1
    assert sent == [whole, whole, compressed, compressed]
