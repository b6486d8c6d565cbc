"""NCF example: MovieLens parsers, leave-one-out split, negative sampling, HR/NDCG and batching.

Every fixture is written here, in the real files' formats; no MovieLens data is needed."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from examples import driver
from examples.ncf import __main__ as ncf
from examples.ncf import data
from examples.ncf.model import NeuMF

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# (user, item, rating, timestamp): user 1's latest is item 30; user 2 has two ratings at its
# latest timestamp 500 (items 20 and 40: the larger id, 40, is the test item); user 7 rated
# item 10 twice (one interaction).
ROWS = [
    (1, 10, 4.0, 100),
    (1, 30, 3.5, 300),
    (1, 20, 5.0, 200),
    (2, 40, 1.0, 500),
    (2, 20, 2.0, 500),
    (2, 50, 3.0, 400),
    (7, 10, 4.5, 50),
    (7, 50, 2.0, 60),
    (7, 10, 3.0, 70),
]


def write_ml20m(path, rows=ROWS):
    lines = ["userId,movieId,rating,timestamp"] + [f"{u},{i},{r},{t}" for u, i, r, t in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_ml1m(path, rows=ROWS):
    path.write_text("".join(f"{u}::{i}::{int(r)}::{t}\n" for u, i, r, t in rows), encoding="latin-1")
    return str(path)


def write_udata(path, rows=ROWS):
    path.write_text("".join(f"{u}\t{i}\t{int(r)}\t{t}\n" for u, i, r, t in rows))
    return str(path)


def write_inter(path, rows=ROWS):
    header = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    path.write_text(header + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    return str(path)


EXPECTED = (
    [u for u, _, _, _ in ROWS],
    [i for _, i, _, _ in ROWS],
    [float(t) for _, _, _, t in ROWS],
)


@pytest.mark.parametrize(
    "writer, name, reader",
    [
        (write_ml20m, "ratings.csv", data.read_ml20m_csv),
        (write_ml1m, "ratings.dat", data.read_ml1m_dat),
        (write_udata, "u.data", data.read_ml100k_udata),
        (write_inter, "ml-100k.inter", data.read_recbole_inter),
    ],
)
def test_parsers_read_users_items_timestamps(tmp_path, writer, name, reader):
    path = writer(tmp_path / name)
    users, items, timestamps = reader(path)
    assert users.tolist() == EXPECTED[0]
    assert items.tolist() == EXPECTED[1]
    assert timestamps.tolist() == EXPECTED[2]
    assert data.reader_for(path) is reader


def test_inter_columns_found_by_header_name(tmp_path):
    path = tmp_path / "x.inter"
    path.write_text("timestamp:float\trating:float\titem_id:token\tuser_id:token\n900\t5\t3\t8\n100\t1\t4\t9\n")
    users, items, timestamps = data.read_recbole_inter(str(path))
    assert users.tolist() == [8, 9] and items.tolist() == [3, 4] and timestamps.tolist() == [900.0, 100.0]


def test_parsers_reject_other_files(tmp_path):
    wrong_header = tmp_path / "ratings.csv"
    wrong_header.write_text("movieId,title,genres\n1,Toy Story (1995),Animation\n")
    with pytest.raises(ValueError, match="userId,movieId"):
        data.read_ml20m_csv(str(wrong_header))
    no_user = tmp_path / "a.inter"
    no_user.write_text("item_id:token\ttimestamp:float\n1\t2\n")
    with pytest.raises(ValueError, match="user_id"):
        data.read_recbole_inter(str(no_user))
    garbage = tmp_path / "u.data"
    garbage.write_text("a\tb\tc\td\n")
    with pytest.raises(ValueError, match="not a MovieLens ratings file"):
        data.read_ml100k_udata(str(garbage))


def test_leave_one_out_holds_out_each_users_latest():
    d = data.leave_one_out(*(np.array(c) for c in EXPECTED))
    # users 1, 2, 7 -> 0, 1, 2; items 10, 20, 30, 40, 50 -> 0..4
    assert (d.n_users, d.n_items) == (3, 5)
    assert d.test_items.tolist() == [2, 3, 0]  # item 30; item 40 (tie at 500, larger id); item 10 (latest of the two)
    train = sorted(zip(d.train_users.tolist(), d.train_items.tolist(), strict=True))
    assert train == [(0, 0), (0, 1), (1, 1), (1, 4), (2, 4)]
    assert d.rated_count.tolist() == [3, 3, 2]
    for u, i in [*train, *enumerate(d.test_items.tolist())]:
        assert bool(d.is_rated(torch.tensor([u]), torch.tensor([i])))
    assert not bool(d.is_rated(torch.tensor([2]), torch.tensor([1])))


def test_leave_one_out_tie_break_ignores_file_order():
    rows = np.array([[5, 9, 100], [5, 3, 100], [5, 7, 50]])
    forward = data.leave_one_out(rows[:, 0], rows[:, 1], rows[:, 2])
    backward = data.leave_one_out(rows[::-1, 0], rows[::-1, 1], rows[::-1, 2])
    assert forward.test_items.tolist() == backward.test_items.tolist() == [2]  # raw item 9


def random_interactions(n_users=40, n_items=300, per_user=(5, 150), seed=0):
    """Users rating up to half the items at distinct random times."""
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u in range(n_users):
        chosen = rng.choice(n_items, size=rng.integers(*per_user), replace=False)
        users += [u] * len(chosen)
        items += chosen.tolist()
    timestamps = rng.permutation(len(users)).astype(np.float64)
    return np.array(users), np.array(items), timestamps


def rating_rows(users, items, timestamps):
    """As (user, item, rating, timestamp) rows for the file writers."""
    return [(u, i, 4.0, int(t)) for u, i, t in zip(users.tolist(), items.tolist(), timestamps.tolist(), strict=True)]


@pytest.mark.parametrize("table", [True, False])
def test_training_negatives_are_never_training_positives_and_may_be_the_test_item(table, monkeypatch):
    """As in the original protocol, a user's test item can be drawn as a training negative: it was
    not, so training learned which unrated item was the test one (HR@10 about 4 points high)."""
    if not table:  # the binary-search path of large datasets
        monkeypatch.setattr(data, "TABLE_LIMIT", 0)
    d = data.leave_one_out(*random_interactions())
    assert (d.rated_table is not None) == table
    users = d.train_users.repeat(40)
    negatives = data.sample_negatives(d, users, torch.Generator().manual_seed(1))
    trained = set(zip(d.train_users.tolist(), d.train_items.tolist(), strict=True))
    assert all((u, i) not in trained for u, i in zip(users.tolist(), negatives.tolist(), strict=True))
    assert bool((negatives == d.test_items[users]).any())
    assert negatives.min() >= 0 and negatives.max() < d.n_items


def test_evaluation_negatives_distinct_unrated_and_fixed():
    d = data.leave_one_out(*random_interactions())
    negatives = data.evaluation_negatives(d, 100)
    assert negatives.shape == (d.n_users, 100)
    rated = set(zip(d.train_users.tolist(), d.train_items.tolist(), strict=True)) | set(
        enumerate(d.test_items.tolist())
    )
    for u, row in enumerate(negatives.tolist()):
        assert len(set(row)) == 100
        assert all((u, i) not in rated for i in row)
    assert torch.equal(negatives, data.evaluation_negatives(d, 100))  # fixed seed
    with pytest.raises(ValueError, match="--eval-negatives"):
        data.evaluation_negatives(d, d.n_items)


def test_epoch_samples_deterministic_and_negatives_unrated():
    d = data.leave_one_out(*random_interactions())
    users, items, labels = data.epoch_samples(d, epoch=3, rank=1, world_size=3, negatives=4, seed=5)
    again = data.epoch_samples(d, epoch=3, rank=1, world_size=3, negatives=4, seed=5)
    assert all(torch.equal(a, b) for a, b in zip((users, items, labels), again, strict=True))
    other = data.epoch_samples(d, epoch=4, rank=1, world_size=3, negatives=4, seed=5)
    assert not torch.equal(users, other[0])
    per_rank = d.n_train // 3
    assert len(users) == 5 * per_rank and int(labels.sum()) == per_rank
    assert bool(d.is_rated(users[labels == 1], items[labels == 1]).all())
    assert not bool(d.is_rated(users[labels == 0], items[labels == 0], test=False).any())
    # the ranks' positives are disjoint
    shards = [data.epoch_samples(d, 3, r, 3, 0, 5) for r in range(3)]
    keys = [set((u * d.n_items + i).tolist()) for u, i, _ in shards]
    assert sum(map(len, keys)) == len(set().union(*keys)) == 3 * per_rank


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def test_hit_and_ndcg_by_rank():
    scores = torch.tensor(
        [
            [9.0, 1.0, 2.0, 3.0],  # test item first
            [3.0, 5.0, 4.0, 1.0],  # third
            [0.0, 5.0, 4.0, 1.0],  # last
        ]
    )
    hit, ndcg = data.hit_and_ndcg(scores, k=10)
    assert hit.tolist() == [1.0, 1.0, 1.0]
    assert ndcg.tolist() == pytest.approx([1.0, 1 / math.log2(4), 1 / math.log2(5)])
    hit, ndcg = data.hit_and_ndcg(scores, k=2)
    assert hit.tolist() == [1.0, 0.0, 0.0] and ndcg.tolist() == [1.0, 0.0, 0.0]
    tied = data.hit_and_ndcg(torch.ones(1, 101), k=10)  # a constant model does not score a hit
    assert tied[0].tolist() == [0.0]


def test_a_diverged_model_scores_no_hit():
    """NaN compares false, so NaN scores ranked the test item first: HR@10 and NDCG@10 of 1.0."""
    nan = math.nan
    scores = torch.tensor(
        [
            [nan] * 12,  # every score NaN
            [nan] + [0.0] * 11,  # the test item's
            [1.0] + [nan] * 9 + [0.0] * 2,  # 9 negatives': they rank above it, so it is 10th
            [1.0] + [nan] * 10 + [0.0],  # 10 negatives': 11th
        ]
    )
    hit, ndcg = data.hit_and_ndcg(scores, k=10)
    assert hit.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert ndcg.tolist() == pytest.approx([0.0, 0.0, 1 / math.log2(11), 0.0])
    assert data.hit_and_ndcg(torch.full((1, 6), nan), k=10)[0].tolist() == [0.0]  # fewer candidates than k


class FixedScores(nn.Module):
    """Scores a pair by a table lookup: test items at the rank given per user."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, users, items):
        return self.table[users, items]


def make_args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    ncf.add_task_arguments(parser.add_argument_group("task"))
    return parser.parse_args(["--data-dir", str(tmp_path), *extra])


def test_evaluate_on_hand_checkable_ranks(tmp_path):
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions(n_users=4, per_user=(5, 20))))
    task = ncf.Recommendation(make_args(tmp_path, "--eval-negatives", "5"))
    d, negatives = task.data, task.eval_negatives
    # user 0: the test item scores highest; user 1: third (two negatives above it); users 2, 3: last
    table = torch.zeros(d.n_users, d.n_items)
    for u in range(d.n_users):
        table[u, negatives[u]] = torch.arange(1.0, 6.0)  # 1..5
    table[0, d.test_items[0]] = 10.0
    table[1, d.test_items[1]] = 3.5
    table[2, d.test_items[2]] = table[3, d.test_items[3]] = 0.5
    scores = task.evaluate(FixedScores(table), rank=0, world_size=1)
    assert scores["hr@10"] == pytest.approx(1.0)  # 6 candidates: every rank is within the top 10
    assert scores["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4) + 2 / math.log2(7)) / 4)
    # two "ranks" without a process group: rank 0 scores users 0 and 2, rank 1 users 1 and 3
    assert task.evaluate(FixedScores(table), rank=0, world_size=2)["ndcg@10"] == pytest.approx(
        (1 + 1 / math.log2(7)) / 2
    )
    assert task.evaluate(FixedScores(table), rank=1, world_size=2)["ndcg@10"] == pytest.approx(
        (1 / math.log2(4) + 1 / math.log2(7)) / 2
    )


def test_evaluate_first_rank_everywhere_gives_one(tmp_path):
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions(n_users=6)))
    task = ncf.Recommendation(make_args(tmp_path))
    table = torch.zeros(task.data.n_users, task.data.n_items)
    table[torch.arange(task.data.n_users), task.data.test_items] = 1.0
    assert task.evaluate(FixedScores(table), 0, 1) == {"hr@10": 1.0, "ndcg@10": 1.0}


# ---------------------------------------------------------------------------------------------
# Files, batches, model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dataset, name, archive", [("ml-20m", "ratings.csv", "ml-20m"), ("ml-1m", "ratings.dat", "ml-1m")]
)
def test_missing_file_error_names_file_and_download(tmp_path, dataset, name, archive):
    for data_dir in (str(tmp_path), None):
        with pytest.raises(FileNotFoundError) as error:
            data.find_ratings(dataset, data_dir)
        message = str(error.value)
        assert name in message
        assert f"curl -LO https://files.grouplens.org/datasets/movielens/{archive}.zip" in message
        assert f"unzip {archive}.zip" in message


def test_missing_ml100k_error_offers_download_and_recbole(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as error:
        data.find_ratings("ml-100k", str(tmp_path))
    message = str(error.value)
    assert "u.data" in message and "files.grouplens.org/datasets/movielens/ml-100k.zip" in message
    assert "pip install --no-deps recbole==1.2.1" in message
    monkeypatch.setattr(data, "recbole_ml100k", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"ml-100k\.inter"):
        data.find_ratings("ml-100k", None)


def test_find_ratings_in_folder_archive_folder_or_file(tmp_path):
    (tmp_path / "ml-1m").mkdir()
    path = write_ml1m(tmp_path / "ml-1m" / "ratings.dat")
    assert data.find_ratings("ml-1m", str(tmp_path)) == path
    assert data.find_ratings("ml-1m", str(tmp_path / "ml-1m")) == path
    assert data.find_ratings("ml-1m", path) == path
    inter = write_inter(tmp_path / "ml-100k.inter")
    assert data.find_ratings("ml-100k", str(tmp_path)) == inter


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_gets_steps_per_epoch_batches(tmp_path, world_size):
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions()))
    task = ncf.Recommendation(make_args(tmp_path, "--batch-size", "37", "--negatives", "3"))
    steps = task.steps_per_epoch(world_size)
    assert steps == (task.data.n_train // world_size) * 4 // 37 > 0
    for rank in range(world_size):
        batches = list(task.batches(epoch=1, rank=rank, world_size=world_size))
        assert len(batches) == steps
        assert all(len(b[0]) == len(b[1]) == len(b[2]) == 37 for b in batches)


def test_batch_too_large_for_the_data(tmp_path):
    write_udata(tmp_path / "u.data")
    task = ncf.Recommendation(make_args(tmp_path, "--eval-negatives", "1", "--batch-size", "1000"))
    with pytest.raises(SystemExit, match="--batch-size 1000"):
        task.steps_per_epoch(2)


def test_negative_counts_and_zero_sizes_are_refused_at_parsing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_args(tmp_path, "--negatives", "-1")
    assert "argument --negatives: -1 is negative: give 0 or a positive number" in capsys.readouterr().err
    assert make_args(tmp_path, "--negatives", "0").negatives == 0  # 0: positives only
    for option in ("--factors", "--eval-negatives", "--epochs", "--batch-size"):  # sizes: at least 1
        with pytest.raises(SystemExit):
            make_args(tmp_path, option, "0")
        assert f"argument {option}: 0 is not positive: give 1 or more" in capsys.readouterr().err


def test_neumf_shapes_and_seed_parameter_count():
    model = NeuMF(10, 20, factors=8, layers=(16, 8, 4), dropout=0.5)
    logits = model(torch.tensor([0, 9, 3]), torch.tensor([19, 0, 5]))
    assert logits.shape == (3,)
    assert [m.out_features for m in model.mlp if isinstance(m, nn.Linear)] == [8, 4]
    assert model.mlp_user.embedding_dim == 8 and model.output.in_features == 8 + 4
    n_users, n_items = 138_493, 26_744  # MovieLens-20M: the seeds' 31,832,577 parameters
    gmf = (n_users + n_items) * 64
    mlp = (n_users + n_items) * 128 + (256 * 256 + 256) + (256 * 128 + 128) + (128 * 64 + 64)
    assert gmf + mlp + 129 == 31_832_577
    with pytest.raises(ValueError, match="even"):
        NeuMF(2, 2, layers=(15, 8))


def test_optimizer_is_adam_with_the_given_settings(tmp_path, monkeypatch):
    write_udata(tmp_path / "u.data")
    args = make_args(tmp_path, "--eval-negatives", "1", "--lr", "0.0045", "--adam-betas", "0.25,0.5")
    made = {}
    # constructing a real optimizer imports torch._dynamo (seconds): record the call instead
    monkeypatch.setattr(torch.optim, "Adam", lambda params, **kw: made.update(params=list(params), **kw))
    task = ncf.Recommendation(args)
    model = task.build_model()
    task.make_optimizer(model.parameters(), args)
    assert made["lr"] == 0.0045 and made["betas"] == (0.25, 0.5) and made["eps"] == 1e-8
    assert made["weight_decay"] == 0.0 and len(made["params"]) == len(list(model.parameters()))


def test_train_step_learns_on_a_fixture(tmp_path):
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions(n_users=10, per_user=(20, 60))))
    task = ncf.Recommendation(make_args(tmp_path, "--batch-size", "128"))
    torch.manual_seed(0)
    model = task.build_model()
    batches = list(task.batches(0, 0, 1))
    with torch.no_grad():
        before = sum(task.train_step(model, b).item() for b in batches)
    for _ in range(5):  # plain gradient steps (a torch optimizer imports torch._dynamo: seconds)
        for batch in batches:
            model.zero_grad()
            task.train_step(model, batch).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
    with torch.no_grad():
        after = sum(task.train_step(model, b).item() for b in batches)
    assert after < 0.8 * before


def test_presets_carry_the_seeds_settings():
    for name, method, density in [
        ("exdyna-ncf-ml20m", "exdyna", 0.001),
        ("micro-ncf-ml20m", "micro", 0.001),
        ("sage-ncf-ml20m", "sage", 0.095),
    ]:
        p = ncf.PRESETS[name]
        assert (p["method"], p["density"], p["dataset"]) == (method, density, "ml-20m")
        assert p["batch_size"] * 4 == 2**20 and p["lr"] == 0.0045 and p["adam_betas"] == "0.25,0.5"
        assert (p["factors"], p["layers"], p["dropout"], p["negatives"], p["epochs"]) == (
            64,
            "256,256,128,64",
            0.5,
            4,
            30,
        )
    assert ncf.PRESETS["ml100k"]["dataset"] == "ml-100k"


def test_synthetic_ratings_have_the_datasets_users_and_items(tmp_path):
    task = ncf.Recommendation(make_args(tmp_path, "--dataset", "ml-1m", "--synthetic-data"))
    n_users, n_items, n_ratings = data.SIZES["ml-1m"]
    assert (task.data.n_users, task.data.n_items) == (n_users, n_items)
    assert task.name.startswith("NeuMF on synthetic ml-1m")
    # every user keeps a test item and training positives; repeated pairs (a few %) count once
    assert int(task.data.test_items.min()) >= 0
    assert 0.95 * (n_ratings - n_users) < task.data.n_train <= n_ratings - n_users
    assert int(torch.bincount(task.data.train_users, minlength=n_users).min()) >= 10


class CountingScores(FixedScores):
    """FixedScores that records how many pairs each forward pass is given."""

    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        self.sizes = []

    def forward(self, users, items):
        self.sizes.append(len(users))
        return super().forward(users, items)


def test_evaluation_runs_the_same_forward_passes_on_every_rank(tmp_path):
    """Rank r scores users r, r + P, ... in chunks: with 5 users on 2 ranks and chunks of 2, rank 0
    ran 2 forward passes and rank 1 one. With --fsdp every forward pass gathers the parameters from
    all ranks: the run hung at its first evaluation. Every rank now runs as many (the last one
    empty), and each user is scored once."""
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions(n_users=5)))
    task = ncf.Recommendation(make_args(tmp_path, "--eval-negatives", "5"))
    table = torch.zeros(task.data.n_users, task.data.n_items)
    for world_size in (2, 3, 6):
        models = [CountingScores(table) for _ in range(world_size)]
        for rank, model in enumerate(models):
            task.evaluate(model, rank, world_size, chunk=2)
        assert len({len(model.sizes) for model in models}) == 1, (world_size, [m.sizes for m in models])
        assert sum(sum(model.sizes) for model in models) == 5 * 6  # each user: the test item and 5 negatives


def test_more_evaluation_negatives_than_a_user_has_unrated_items_is_refused_with_the_most_allowed(tmp_path):
    """--eval-negatives above the unrated items of some user ended every rank in a ValueError
    traceback once the data was read (MovieLens-100K: 1,000, one user rated 737 of 1,682 items).
    Refused with the option, its value and the most that every user can be given."""
    write_udata(tmp_path / "u.data", rating_rows(*random_interactions(n_users=4, per_user=(5, 20))))
    d = ncf.Recommendation(make_args(tmp_path, "--eval-negatives", "5")).data
    most = int((d.n_items - d.rated_count).min())
    with pytest.raises(SystemExit) as refused:
        ncf.Recommendation(make_args(tmp_path, "--eval-negatives", str(most + 1)))
    message = str(refused.value)
    assert message.startswith(f"--eval-negatives {most + 1}: user ") and message.endswith(
        f"give --eval-negatives {most} or fewer"
    ), message
    assert ncf.Recommendation(make_args(tmp_path, "--eval-negatives", str(most))).eval_negatives.shape == (4, most)
