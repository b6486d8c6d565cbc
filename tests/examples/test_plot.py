"""examples.plot on run folders written by hand: what it draws and what it refuses."""

import os
import warnings

import pytest

from examples import plot

HEADER = "epoch,step,loss,accuracy,density,bytes_sent,bytes_total,train_seconds,elapsed_seconds\n"


def write_run(folder, *epochs: str) -> None:
    os.makedirs(folder)
    with open(os.path.join(folder, "epochs.csv"), "w") as f:
        f.write(HEADER + "".join(f"{row}\n" for row in epochs))


def test_a_run_stopped_in_its_first_epoch_is_left_out_with_a_note(tmp_path, capsys):
    """Its epochs.csv holds the header alone; plotting the folder of runs ended in an IndexError."""
    write_run(tmp_path / "runs" / "dense", "1,10,2.0,0.5,1,100,100,1.0,1.0", "2,20,1.5,0.6,1,100,200,1.0,2.0")
    write_run(tmp_path / "runs" / "topk")
    png = plot.main([str(tmp_path / "runs"), "--out", str(tmp_path / "cmp.png"), "--table"])
    assert os.path.getsize(png) > 0
    out, err = capsys.readouterr()
    assert "topk: no epoch recorded yet in" in err and "(the run stopped in its first epoch): left out" in err
    assert "| dense | 2 |" in out and "| topk |" not in out


def test_a_png_into_a_missing_folder_is_refused_before_drawing(tmp_path, capsys):
    """savefig's FileNotFoundError came once every run had been read and drawn."""
    write_run(tmp_path / "dense", "1,10,2.0,0.5,1,100,100,1.0,1.0")
    out = tmp_path / "no-such-folder" / "cmp.png"
    with pytest.raises(SystemExit) as info:
        plot.main([str(tmp_path / "dense"), "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out}: the folder {out.parent} does not exist; create it or write the PNG elsewhere" in err


def test_one_worker_runs_give_no_bytes_ratio_and_a_linear_bytes_axis(tmp_path, capsys, monkeypatch):
    """One worker sends nothing, dense included: --table ended in a ZeroDivisionError, and the
    bytes axis, log-scaled, left out every point (matplotlib warned that nothing was positive)."""
    from matplotlib.figure import Figure

    write_run(tmp_path / "runs" / "dense", "1,10,2.0,0.5,1,0,0,1.0,2.0")
    write_run(tmp_path / "runs" / "topk", "1,10,2.1,0.4,0.01,0,0,1.0,3.0")
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: saved.append(figure))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot.main([str(tmp_path / "runs"), "--out", str(tmp_path / "cmp.png"), "--table"])
    assert saved[0].axes[1].get_xscale() == "linear"
    out = capsys.readouterr().out
    assert "| dense | 1 | 0.5 | 2.0000 | 2.0 | 0.00 | - | 1.00x |" in out
    assert "| topk | 1 | 0.4 | 2.1000 | 3.0 | 0.00 | - | 1.50x |" in out


def test_a_row_cut_short_is_left_out_with_a_note(tmp_path, capsys):
    """A run stopped (or a disk filled) while writing its last row: float(None) ended in a TypeError."""
    write_run(tmp_path / "dense", "1,10,2.0,0.5,1,100,100,1.0,1.0", "2,20,1.5,0.6,1,100,200,1.0,2.0", "3,30,1.2")
    plot.main([str(tmp_path / "dense"), "--out", str(tmp_path / "cmp.png"), "--table"])
    out, err = capsys.readouterr()
    assert "epochs.csv: line 4 is incomplete and left out" in err
    assert "| dense | 2 | 0.6 |" in out


def test_runs_of_the_same_name_from_two_jobs_are_told_apart_by_their_folders(tmp_path, capsys, monkeypatch):
    """Two jobs' folders of runs, each with dense and topk: the legend held dense and topk twice, and
    --table compared both jobs' runs with the second job's dense. Labels take the job's folder only
    where names collide, and each run is compared with the dense run of its own job."""
    from matplotlib.figure import Figure

    for job, seconds in (("job1", 2.0), ("job2", 4.0)):
        write_run(tmp_path / job / "dense", f"1,10,2.0,0.5,1,100,100,1.0,{seconds}")
        write_run(tmp_path / job / "topk", f"1,10,2.1,0.4,0.01,1,1,1.0,{seconds * 1.5}")
    write_run(tmp_path / "other" / "micro", "1,10,2.2,0.3,0.01,2,2,1.0,5.0")
    saved = []  # the figure plot.main writes
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: saved.append(figure))
    plot.main([str(tmp_path / "job1"), str(tmp_path / "job2"), "--out", str(tmp_path / "cmp.png"), "--table"])
    (figure,) = saved
    assert figure.axes[1].get_xscale() == "log"  # every run sent bytes
    labels = ["job1/dense", "job1/topk", "job2/dense", "job2/topk"]
    for axes in figure.axes:
        assert [line.get_label() for line in axes.get_lines()] == labels
    out = capsys.readouterr().out
    assert "| job1/topk | 1 | 0.4 | 2.1000 | 3.0 | 0.00 | 1.00% | 1.50x |" in out
    assert "| job2/topk | 1 | 0.4 | 2.1000 | 6.0 | 0.00 | 1.00% | 1.50x |" in out
    # names that differ keep their folder's name alone
    plot.main([str(tmp_path / "job1"), str(tmp_path / "other"), "--out", str(tmp_path / "cmp.png"), "--table"])
    assert [line.get_label() for line in saved[-1].axes[0].get_lines()] == ["dense", "topk", "micro"]
    assert "| micro | 1 | 0.3 | 2.2000 | 5.0 | 0.00 | 2.00% | 2.50x |" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["cmp", "cmp.txt"])
def test_an_out_that_is_no_png_is_refused_before_drawing(tmp_path, capsys, name):
    """--out cmp wrote cmp.png and said it wrote cmp; --out cmp.txt ended in matplotlib's
    "Format 'txt' is not supported" once every run had been drawn."""
    write_run(tmp_path / "dense", "1,10,2.0,0.5,1,100,100,1.0,1.0")
    with pytest.raises(SystemExit) as info:
        plot.main([str(tmp_path / "dense"), "--out", str(tmp_path / name)])
    assert info.value.code == 2
    assert "the plot is a PNG; give a file name ending in .png" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["dense"]
