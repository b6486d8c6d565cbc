"""MovieLens ratings as implicit feedback for NCF: parsers, the leave-one-out split, negative sampling.

Every rating counts as a positive interaction, whatever its value. Each user's latest interaction
(largest timestamp; among equal timestamps the largest item id) is held out as the test item; the
rest are the training positives; the training negatives are items without a training interaction
(the test item among them, as in the original protocol). Evaluation ranks the test item among
``eval_negatives`` items the user never interacted with, drawn once with a fixed seed.

Formats (files.grouplens.org/datasets/movielens/):

    ml-20m/ratings.csv   header ``userId,movieId,rating,timestamp``, comma separated
    ml-1m/ratings.dat    ``UserID::MovieID::Rating::Timestamp``, no header
    ml-100k/u.data       ``user<TAB>item<TAB>rating<TAB>timestamp``, no header
    ml-100k.inter        RecBole's atomic file: tab separated, typed header such as
                         ``user_id:token  item_id:token  rating:float  timestamp:float``

MovieLens-100K also installs offline as part of the PyPI package recbole (``pip install --no-deps
recbole==1.2.1``); it is read from the installed package and never copied anywhere.
"""

from __future__ import annotations

import importlib.util
import io
import os
from dataclasses import dataclass

import numpy as np
import torch

GROUPLENS = "https://files.grouplens.org/datasets/movielens"
DATASETS = ("ml-100k", "ml-1m", "ml-20m")
# dataset -> (ratings file name, archive name)
FILES = {"ml-20m": ("ratings.csv", "ml-20m"), "ml-1m": ("ratings.dat", "ml-1m"), "ml-100k": ("u.data", "ml-100k")}
RECBOLE_INTER = os.path.join("dataset_example", "ml-100k", "ml-100k.inter")
# Membership of (user, item) pairs: a bool table up to this many pairs (MovieLens-1M: 22 M), binary
# search in the sorted pairs beyond it (MovieLens-20M: 3.7 G pairs, 20 M interactions).
TABLE_LIMIT = 1 << 27
EVAL_SEED = 20_240_501  # the evaluation negatives do not depend on --seed: every run is scored on the same lists

Ratings = tuple[np.ndarray, np.ndarray, np.ndarray]  # raw user ids, raw item ids, timestamps (float64)


# ------------------------------------------------------------------------------------------------
# Parsers
# ------------------------------------------------------------------------------------------------


def _columns(table: np.ndarray, path: str) -> Ratings:
    table = np.atleast_2d(table)
    if table.size == 0:
        raise ValueError(f"{path}: no ratings")
    return table[:, 0].astype(np.int64), table[:, 1].astype(np.int64), table[:, 2].astype(np.float64)


def _load(source, path: str, delimiter: str, skiprows: int = 0) -> Ratings:
    try:
        table = np.loadtxt(source, delimiter=delimiter, skiprows=skiprows, usecols=(0, 1, 3), dtype=np.int64, ndmin=2)
    except ValueError as error:
        raise ValueError(f"{path}: not a MovieLens ratings file ({error})") from None
    return _columns(table, path)


def read_ml20m_csv(path: str) -> Ratings:
    """MovieLens-20M (and -25M, -latest) ratings.csv: a header line, then userId,movieId,rating,timestamp."""
    with open(path) as f:
        header = f.readline().strip().lower()
    if not header.startswith("userid,movieid"):
        raise ValueError(f"{path}: expected the header userId,movieId,rating,timestamp, found {header!r}")
    return _load(path, path, ",", skiprows=1)


def read_ml1m_dat(path: str) -> Ratings:
    """MovieLens-1M (and -10M) ratings.dat: UserID::MovieID::Rating::Timestamp per line."""
    with open(path, encoding="latin-1") as f:
        text = f.read()
    return _load(io.StringIO(text.replace("::", "\t")), path, "\t")


def read_ml100k_udata(path: str) -> Ratings:
    """MovieLens-100K u.data (and its u1.base ... splits): user, item, rating, timestamp separated by tabs."""
    return _load(path, path, "\t")


def read_recbole_inter(path: str) -> Ratings:
    """RecBole's atomic .inter file: tab separated with a header of name:type fields; the user_id,
    item_id and timestamp columns are used (ids must be integer tokens)."""
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
    names = [field.split(":")[0] for field in header]
    wanted = ("user_id", "item_id", "timestamp")
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ValueError(f"{path}: header {header} has no {', '.join(missing)} field")
    columns = tuple(names.index(name) for name in wanted)
    try:
        table = np.loadtxt(path, delimiter="\t", skiprows=1, usecols=columns, dtype=np.float64, ndmin=2)
    except ValueError as error:
        raise ValueError(f"{path}: not a ratings .inter file with integer ids ({error})") from None
    if table.size and not np.all(table[:, :2] == np.round(table[:, :2])):
        raise ValueError(f"{path}: user and item ids must be integers")
    return _columns(table, path)


READERS = {"ratings.csv": read_ml20m_csv, "ratings.dat": read_ml1m_dat, "u.data": read_ml100k_udata}


def reader_for(path: str):
    name = os.path.basename(path)
    if name.endswith(".inter"):
        return read_recbole_inter
    if name in READERS:
        return READERS[name]
    if name.endswith(".csv"):
        return read_ml20m_csv
    if name.endswith(".dat"):
        return read_ml1m_dat
    return read_ml100k_udata


# ------------------------------------------------------------------------------------------------
# Finding the files
# ------------------------------------------------------------------------------------------------


def recbole_ml100k() -> str | None:
    """The ml-100k.inter file inside the installed recbole package (located without importing it,
    so its own dependencies need not be installed), or None."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, RECBOLE_INTER)
        if os.path.exists(path):
            return path
    return None


def download_hint(dataset: str) -> str:
    name, archive = FILES[dataset]
    hint = (
        f"download it with\n"
        f"  curl -LO {GROUPLENS}/{archive}.zip && unzip {archive}.zip\n"
        f"then pass --data-dir {archive} (the folder holding {name})"
    )
    if dataset == "ml-100k":
        hint += (
            "; or, offline, install the copy shipped in the recbole package with\n"
            "  pip install --no-deps recbole==1.2.1\n"
            "and leave --data-dir out"
        )
    return hint


def find_ratings(dataset: str, data_dir: str | None) -> str:
    """The ratings file of ``dataset``: ``data_dir`` may be the file itself, the folder holding it
    or the folder holding the extracted archive. MovieLens-100K without --data-dir: recbole's copy."""
    if dataset not in FILES:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    name, archive = FILES[dataset]
    if data_dir is None:
        if dataset == "ml-100k":
            path = recbole_ml100k()
            if path is not None:
                return path
            raise FileNotFoundError(
                f"{dataset}: {RECBOLE_INTER} not found (recbole is not installed) and no --data-dir with {name}; "
                + download_hint(dataset)
            )
        raise FileNotFoundError(f"{dataset}: {name} is needed; " + download_hint(dataset))
    if os.path.isfile(data_dir):
        return data_dir
    names = [name] + (["ml-100k.inter"] if dataset == "ml-100k" else [])
    candidates = [os.path.join(folder, n) for folder in (data_dir, os.path.join(data_dir, archive)) for n in names]
    for path in candidates:
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"{dataset}: {name} not found (looked for {', '.join(candidates)}); " + download_hint(dataset)
    )


# dataset -> users, items, ratings; every MovieLens user rated at least 20 movies
SIZES = {"ml-100k": (943, 1_682, 100_000), "ml-1m": (6_040, 3_706, 1_000_209), "ml-20m": (138_493, 26_744, 20_000_263)}
MIN_PER_USER = 20


def synthetic_ratings(dataset: str, seed: int = 0) -> Ratings:
    """Random ratings with the users, items and rating count of ``dataset`` (--synthetic-data):
    every user rates at least 20 items and every item is rated; repeated pairs count once in
    :func:`leave_one_out`, so a few fewer interactions remain than ratings drawn."""
    n_users, n_items, n = SIZES[dataset]
    rng = np.random.default_rng(seed)
    users = np.concatenate(
        [np.repeat(np.arange(n_users), MIN_PER_USER), rng.integers(n_users, size=n - MIN_PER_USER * n_users)]
    )
    items = rng.integers(n_items, size=n)
    items[:n_items] = rng.permutation(n_items)
    return users, items, rng.permutation(n).astype(np.float64)


def load_ratings(dataset: str, data_dir: str | None) -> tuple[Ratings, str]:
    """(raw users, raw items, timestamps) and the file they came from."""
    path = find_ratings(dataset, data_dir)
    return reader_for(path)(path), path


# ------------------------------------------------------------------------------------------------
# Implicit feedback, leave-one-out
# ------------------------------------------------------------------------------------------------


@dataclass
class Interactions:
    """Users and items renumbered 0..n-1 in the order of their raw ids."""

    n_users: int
    n_items: int
    train_users: torch.Tensor  # int64, the training positives
    train_items: torch.Tensor
    test_items: torch.Tensor  # int64 [n_users]: each user's held-out (latest) item
    rated: torch.Tensor  # sorted int64 keys user * n_items + item of every interaction, test items included
    rated_count: torch.Tensor  # int64 [n_users]: distinct items each user interacted with
    rated_table: torch.Tensor | None = None  # bool [n_users * n_items], when that is small enough

    def __post_init__(self) -> None:
        if self.rated_table is None and self.n_users * self.n_items <= TABLE_LIMIT:
            self.rated_table = torch.zeros(self.n_users * self.n_items, dtype=torch.bool)
            self.rated_table[self.rated] = True

    @property
    def n_train(self) -> int:
        return len(self.train_users)

    def is_rated(self, users: torch.Tensor, items: torch.Tensor, *, test: bool = True) -> torch.Tensor:
        """Whether each (user, item) pair is an interaction: a training one, or with ``test`` the
        user's held-out test item too."""
        keys = users * self.n_items + items
        if self.rated_table is not None:
            rated = self.rated_table[keys]
        else:
            pos = torch.searchsorted(self.rated, keys).clamp_(max=len(self.rated) - 1)
            rated = self.rated[pos] == keys
        return rated if test else rated & (items != self.test_items[users])


def leave_one_out(users: np.ndarray, items: np.ndarray, timestamps: np.ndarray) -> Interactions:
    """Implicit feedback with each user's latest interaction held out. Repeated (user, item)
    pairs count once (at their latest timestamp); among a user's interactions with the latest
    timestamp, the one with the largest item id is the test item."""
    raw_users, u = np.unique(users, return_inverse=True)
    raw_items, i = np.unique(items, return_inverse=True)
    u, i, t = u.reshape(-1).astype(np.int64), i.reshape(-1).astype(np.int64), np.asarray(timestamps, np.float64)
    n_users, n_items = len(raw_users), len(raw_items)
    # one row per (user, item): the latest
    order = np.lexsort((t, i, u))
    u, i, t = u[order], i[order], t[order]
    last_of_pair = np.r_[(u[1:] != u[:-1]) | (i[1:] != i[:-1]), True]
    u, i, t = u[last_of_pair], i[last_of_pair], t[last_of_pair]
    # per user by time, then item id: the last row of each user is the test item
    order = np.lexsort((i, t, u))
    u, i = u[order], i[order]
    last_of_user = np.r_[u[1:] != u[:-1], True]
    test_items = np.full(n_users, -1, dtype=np.int64)
    test_items[u[last_of_user]] = i[last_of_user]
    train = ~last_of_user
    return Interactions(
        n_users=n_users,
        n_items=n_items,
        train_users=torch.from_numpy(u[train].copy()),
        train_items=torch.from_numpy(i[train].copy()),
        test_items=torch.from_numpy(test_items),
        rated=torch.from_numpy(np.sort(u * n_items + i)),
        rated_count=torch.from_numpy(np.bincount(u, minlength=n_users).astype(np.int64)),
    )


# ------------------------------------------------------------------------------------------------
# Negatives
# ------------------------------------------------------------------------------------------------


def sample_negatives(data: Interactions, users: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One training negative per entry of ``users``: an item this user has no training interaction
    with (uniform over those items; rejection sampling, deterministic given the generator). The
    user's held-out test item is among them, as in the original NCF protocol: left out (until
    2026-12-06), it was the one unrated item never labelled negative, which told training what
    the test item was and raised HR@10 by about 4 points (docs/results.md, NCF). There is always
    one to draw: the test item is no training interaction."""
    items = torch.empty_like(users)
    todo = torch.arange(len(users))
    while todo.numel():
        draw = torch.randint(data.n_items, (todo.numel(),), generator=generator)
        items[todo] = draw
        todo = todo[data.is_rated(users[todo], draw, test=False)]
    return items


def evaluation_negatives(data: Interactions, count: int = 100, seed: int = EVAL_SEED) -> torch.Tensor:
    """[n_users, count] distinct items per user that the user never interacted with."""
    short = data.n_items - data.rated_count < count
    if bool(short.any()):
        user = int(short.nonzero()[0])
        raise ValueError(
            f"user {user} interacted with {int(data.rated_count[user])} of {data.n_items} items: fewer than "
            f"{count} are left for the evaluation negatives (lower --eval-negatives)"
        )
    generator = torch.Generator().manual_seed(seed)
    items = torch.randint(data.n_items, (data.n_users, count), generator=generator)
    rows = torch.arange(data.n_users)  # rows whose last draws are unchecked
    while rows.numel():
        block = items[rows]
        bad = data.is_rated(rows.unsqueeze(1), block)
        ordered, order = block.sort(dim=1)  # a repeat within a row: all but one occurrence are redrawn
        repeat = torch.zeros_like(bad)
        repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
        bad |= torch.zeros_like(bad).scatter_(1, order, repeat)
        block[bad] = torch.randint(data.n_items, (int(bad.sum()),), generator=generator)
        items[rows] = block
        rows = rows[bad.any(dim=1)]
    return items


def epoch_samples(
    data: Interactions, epoch: int, rank: int, world_size: int, negatives: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's training samples of an epoch, shuffled: (users, items, labels 1.0 / 0.0).

    The training positives are shuffled with a generator seeded by (seed, epoch), the same on every
    rank, and cut into ``world_size`` shards of n_train // world_size (the few left over sit the
    epoch out); each rank adds ``negatives`` sampled negatives per positive and shuffles its shard
    with a generator seeded by (seed, epoch, rank)."""
    base = (seed * 1_000_003 + epoch) * 1_009
    order = torch.randperm(data.n_train, generator=torch.Generator().manual_seed(base))
    per_rank = data.n_train // world_size
    shard = order[rank * per_rank : (rank + 1) * per_rank]
    users, items = data.train_users[shard], data.train_items[shard]
    local = torch.Generator().manual_seed(base + 1 + rank)
    neg_users = users.repeat(negatives)
    neg_items = sample_negatives(data, neg_users, local)
    all_users = torch.cat([users, neg_users])
    all_items = torch.cat([items, neg_items])
    labels = torch.cat([torch.ones(len(users)), torch.zeros(len(neg_users))])
    mix = torch.randperm(len(all_users), generator=local)
    return all_users[mix], all_items[mix], labels[mix]


def steps_per_epoch(n_train: int, world_size: int, negatives: int, batch_size: int) -> int:
    """Full batches per rank and epoch (a rank's last partial batch is dropped)."""
    return (n_train // world_size) * (1 + negatives) // batch_size


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------


def hit_and_ndcg(scores: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores`` [users, 1 + negatives], column 0 being the test item: the hit
    (test item among the top k) and its NDCG@k, 1 / log2(rank + 2) with rank 0 for the best.
    Negatives tied with the test item rank above it (a constant model scores 0, not 1), and so do
    NaN scores; a NaN test item is no hit (a diverged model scores 0, not 1)."""
    rank = (~(scores[:, 1:] < scores[:, :1])).sum(dim=1)
    hit = (rank < k) & ~scores[:, 0].isnan()
    ndcg = torch.where(hit, 1.0 / torch.log2(rank.double() + 2), torch.zeros((), dtype=torch.float64))
    return hit.double(), ndcg
