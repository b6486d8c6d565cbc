"""The LSTM example's corpora on fixture files written here in the official formats (WikiText-2,
PTB, the `bible` program's output), its language-model batching, and the task's recurrent state
and evaluation."""

import argparse
import math
import shutil

import pytest
import torch
import torch.distributed as dist

from examples import driver
from examples.lstm import __main__ as lstm_main
from examples.lstm import data
from examples.lstm.model import LSTMLanguageModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# WikiText-2's layout: every line starts with a space, headings are " = Title = ", empty lines
# hold a single space, and rare words are already <unk>.
WIKI = {
    "train": [" ", " = Valkyria Chronicles = ", " ", " The game was <unk> in Japan . ", " The Game began . ", " "],
    "valid": [" ", " = Robert = ", " The game ended in Paris . "],
    "test": [" The game was fun . "],
}
PTB = {
    "train": [" no it was n't black monday ", " the dow fell N points ", " the <unk> was n't black "],
    "valid": [" it fell again "],
    "test": [" monday was black ", " the end "],
}


def write_splits(folder, names: dict[str, str], lines: dict[str, list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, name in names.items():
        (folder / name).write_text("".join(line + "\n" for line in lines[split]), encoding="utf-8")


def decode(corpus: data.Corpus, split: str) -> list[str]:
    return [corpus.vocab[i] for i in corpus.split(split).tolist()]


def test_wikitext2_reads_the_tokens_files(tmp_path):
    write_splits(tmp_path / "wikitext-2", data.FILES["wikitext2"], WIKI)
    corpus = data.wikitext2(str(tmp_path))  # the archive's folder under --data-dir is found too
    train = decode(corpus, "train")
    assert train[:8] == ["<eos>", "=", "Valkyria", "Chronicles", "=", "<eos>", "<eos>", "The"]
    assert train.count("<eos>") == len(WIKI["train"])  # one per line, empty lines included
    assert len(train) == sum(len(line.split()) + 1 for line in WIKI["train"])
    assert corpus.vocab[0] == "<unk>" and len(set(corpus.vocab)) == len(corpus.vocab)
    assert set(corpus.vocab) == set(train)  # built from the training split only
    assert corpus.vocab.index("<eos>") < corpus.vocab.index("game")  # most frequent first
    # validation words outside the training vocabulary become <unk>
    assert decode(corpus, "valid") == ["<eos>", "=", "<unk>", "=", "<eos>", "The", "game", "<unk>", "in", "<unk>",
                                       ".", "<eos>"]  # fmt: skip
    assert decode(corpus, "test") == ["The", "game", "was", "<unk>", ".", "<eos>"]


def test_wikitext2_lowercase_merges_case_variants(tmp_path):
    write_splits(tmp_path, data.FILES["wikitext2"], WIKI)
    kept, lowered = data.wikitext2(str(tmp_path)), data.wikitext2(str(tmp_path), lowercase=True)
    assert "The" in kept.vocab and "Game" in kept.vocab
    assert "The" not in lowered.vocab and "game" in lowered.vocab and "<unk>" in lowered.vocab
    assert len(lowered.vocab) == len(kept.vocab) - 1  # "Game" joined "game"; "The" became "the"
    assert decode(lowered, "test") == ["the", "game", "was", "<unk>", ".", "<eos>"]


def test_ptb_reads_the_txt_files(tmp_path):
    write_splits(tmp_path, data.FILES["ptb"], PTB)
    corpus = data.ptb(str(tmp_path))
    assert decode(corpus, "train")[:7] == ["no", "it", "was", "n't", "black", "monday", "<eos>"]
    assert len(corpus.train) == 6 + 5 + 5 + 3
    assert decode(corpus, "valid") == ["it", "fell", "<unk>", "<eos>"]
    assert decode(corpus, "test") == ["monday", "was", "black", "<eos>", "the", "<unk>", "<eos>"]
    assert corpus.vocab[:6] == ["<unk>", "<eos>", "black", "n't", "the", "was"]  # by count, then name


def test_min_count_maps_rare_words_to_unk(tmp_path):
    write_splits(tmp_path, data.FILES["ptb"], PTB)
    corpus = data.ptb(str(tmp_path), min_count=2)
    assert corpus.vocab == ["<unk>", "<eos>", "black", "n't", "the", "was"]
    assert decode(corpus, "valid") == ["<unk>", "<unk>", "<unk>", "<eos>"]


@pytest.mark.parametrize("dataset", ["wikitext2", "ptb"])
def test_missing_files_name_the_file_and_the_download(tmp_path, dataset):
    names = data.FILES[dataset]
    (tmp_path / names["train"]).write_text("a b\n")
    with pytest.raises(FileNotFoundError) as error:
        data.load(dataset, str(tmp_path))
    message = str(error.value)
    assert names["valid"] in message and names["test"] in message and names["train"] not in message
    assert "curl" in message and "--data-dir" in message
    with pytest.raises(FileNotFoundError, match="pass --data-dir"):
        data.load(dataset, None)


# The King James Bible ----------------------------------------------------------------------------

# The `bible` program's layout (bible-kjv 4.38): a blank line, the chapter header, a blank line,
# then verses "  <n> text" wrapped at 80 columns onto unindented lines.
BIBLE = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.
  3 And God said, Let there be light: and there was light.

1 Samuel 3

  1 And the child Samuel ministered unto the LORD before Eli. And the word of the
LORD was precious in those days; there was no open vision.
  10 And the LORD came, and stood, and called as at other times, Samuel, Samuel.
Then Samuel answered, Speak; for thy servant heareth.
"""


def test_parse_bible_strips_headers_and_verse_numbers():
    verses = data.parse_bible(BIBLE)
    assert [ref for ref, _ in verses] == ["Genesis 1:1", "Genesis 1:2", "Genesis 1:3", "1 Samuel 3:1", "1 Samuel 3:10"]
    assert verses[1][1] == (
        "And the earth was without form, and void; and darkness was upon the face of the deep. "
        "And the Spirit of God moved upon the face of the waters."
    )
    assert verses[4][1].endswith("Samuel, Samuel. Then Samuel answered, Speak; for thy servant heareth.")
    assert not any(text[0].isdigit() or "Genesis" in text for _, text in verses)


def test_parse_bible_rejects_text_outside_a_chapter():
    with pytest.raises(ValueError, match="before any chapter"):
        data.parse_bible("  1 In the beginning\n")


def test_tokenize_splits_off_punctuation():
    assert data.tokenize("Let there be light: and the LORD's house, (selah)") == [
        "let", "there", "be", "light", ":", "and", "the", "lord", "'s", "house", ",", "(", "selah", ")",
    ]  # fmt: skip
    assert data.tokenize("The LORD's", lowercase=False) == ["The", "LORD", "'s"]


def test_kjv_splits_by_chapters_with_one_eos_per_verse():
    verses = [(f"Book {c}:{v}", f"word{c} common .") for c in range(1, 21) for v in (1, 2)]
    splits = data.split_chapters(verses)
    chapters = {s: sorted({int(ref.split()[1].split(":")[0]) for ref, _ in splits[s]}) for s in data.SPLITS}
    assert chapters["valid"] == [9, 19] and chapters["test"] == [10, 20]
    assert len(chapters["train"]) == 16
    corpus = data.kjv_from_verses(verses)
    assert decode(corpus, "train")[:8] == ["word1", "common", ".", "<eos>", "word1", "common", ".", "<eos>"]
    assert len(corpus.train) == 16 * 2 * 4 and len(corpus.valid) == len(corpus.test) == 2 * 2 * 4
    assert "word9" not in corpus.vocab and decode(corpus, "valid")[:4] == ["<unk>", "common", ".", "<eos>"]


def test_kjv_reads_its_cache_without_running_bible(tmp_path, monkeypatch):
    (tmp_path / "kjv.txt").write_text("Genesis 1:1\tIn the beginning.\nGenesis 1:2\tAnd the earth.\n")
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: pytest.fail("ran `bible` despite the cache"))
    assert data.kjv_verses(str(tmp_path)) == [("Genesis 1:1", "In the beginning."), ("Genesis 1:2", "And the earth.")]


def test_kjv_without_bible_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(data.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"apt-get install -y bible-kjv") as error:
        data.kjv(str(tmp_path))
    assert "kjv.txt" in str(error.value)


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs the bible-kjv package")
def test_kjv_from_the_installed_bible(tmp_path):
    verses = data.kjv_verses(str(tmp_path))
    assert len(verses) == 31102 and (tmp_path / "kjv.txt").exists()
    assert verses[0] == ("Genesis 1:1", "In the beginning God created the heaven and the earth.")
    assert verses[-1] == ("Revelation 22:21", "The grace of our Lord Jesus Christ be with you all. Amen.")
    corpus = data.kjv_from_verses(verses)
    sizes = [len(corpus.split(s)) for s in data.SPLITS]
    assert 0.75 < sizes[0] / sum(sizes) < 0.85 and min(sizes[1:]) > 0.08 * sum(sizes)
    assert sum(1 for t in corpus.train.tolist() if t == corpus.vocab.index("<eos>")) > 24000


# Batching ----------------------------------------------------------------------------------------


def test_columns_give_each_rank_its_own_contiguous_slice():
    stream = torch.arange(103)
    parts = [data.columns(stream, 4, r, 2) for r in range(2)]
    assert all(p.shape == (12, 4) for p in parts)  # 51 tokens per rank, 12 per column
    assert parts[0][:, 0].tolist() == list(range(12)) and parts[0][:, 1].tolist() == list(range(12, 24))
    assert parts[1][0].tolist() == [51, 63, 75, 87]
    with pytest.raises(ValueError, match="smaller batch"):
        data.columns(torch.arange(7), 4, 0, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_windows_are_shifted_by_one_token(world_size):
    stream = torch.arange(1000)
    counts = []
    for rank in range(world_size):
        cols = data.columns(stream, 5, rank, world_size)
        batches = list(data.windows(cols, 7))
        counts.append(len(batches))
        assert len(batches) == data.num_windows(len(cols), 7)
        for x, y in batches:
            assert x.shape == y.shape == (7, 5)
            assert torch.equal(y, x + 1)  # the stream counts up, so the next token is x + 1
        flat = torch.cat([x for x, _ in batches])
        assert torch.equal(flat[:, 0], torch.arange(len(flat)) + cols[0, 0])  # consecutive windows
    assert len(set(counts)) == 1


def test_partial_windows_make_every_token_a_target_once():
    cols = data.columns(torch.arange(50), 2)  # 25 tokens per column
    batches = list(data.windows(cols, 7, partial=True))
    assert [len(x) for x, _ in batches] == [7, 7, 7, 3]
    targets = torch.cat([y for _, y in batches])
    assert torch.equal(targets[:, 0], torch.arange(1, 25)) and torch.equal(targets[:, 1], torch.arange(26, 50))


# The task ----------------------------------------------------------------------------------------


def make_task(tmp_path, *argv: str) -> lstm_main.LanguageModel:
    write_splits(tmp_path, data.FILES["ptb"], {s: PTB[s] * 40 for s in data.SPLITS})
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    lstm_main.add_task_arguments(parser.add_argument_group("task"))
    args = parser.parse_args(["--dataset", "ptb", "--data-dir", str(tmp_path), "--emb", "16", "--hidden", "16",
                              "--layers", "2", "--dropout", "0", "--bptt", "5", "--batch-size", "3", *argv])  # fmt: skip
    return lstm_main.LanguageModel(args)


def test_task_defaults_are_those_of_language_models(tmp_path):
    task = make_task(tmp_path)
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    lstm_main.add_task_arguments(parser.add_argument_group("task"))
    args = parser.parse_args([])
    assert (args.momentum, args.lr, args.clip, args.dataset, args.tied) == (0.0, 20.0, 0.25, "kjv", True)
    assert task.metric == "perplexity" and not task.higher_is_better
    assert task.samples_per_batch == 15


def test_model_sizes_must_be_positive(capsys):
    parser = argparse.ArgumentParser()
    lstm_main.add_task_arguments(parser.add_argument_group("task"))
    for option in ("--emb", "--hidden", "--layers", "--bptt"):
        with pytest.raises(SystemExit):
            parser.parse_args([option, "0"])
        assert f"argument {option}: 0 is not positive: give 1 or more" in capsys.readouterr().err
    assert parser.parse_args(["--bptt", "1"]).bptt == 1


def test_tied_sizes_must_match(tmp_path):
    with pytest.raises(SystemExit, match="--no-tied"):
        make_task(tmp_path, "--emb", "8")
    untied = make_task(tmp_path, "--emb", "8", "--no-tied")
    assert untied.vocab_size == 13  # <unk>, <eos> and the 11 distinct words of the PTB fixture's training split
    model = untied.build_model()
    assert model.decoder.weight.shape == (13, 16) and model.embedding.weight.shape == (13, 8)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_gets_steps_per_epoch_batches(tmp_path, world_size):
    task = make_task(tmp_path)
    steps = task.steps_per_epoch(world_size)
    assert steps > 0
    for rank in range(world_size):
        batches = list(task.batches(0, rank, world_size))
        assert len(batches) == steps
        assert [position for _, _, position in batches] == list(range(steps))
        assert all(x.shape == y.shape == (5, 3) for x, y, _ in batches)
        assert all(torch.equal(x[1:], y[:-1]) for x, y, _ in batches)


def test_state_is_carried_reset_and_restored_exactly(tmp_path):
    task = make_task(tmp_path)
    torch.manual_seed(0)
    model = task.build_model()
    batches = list(task.batches(0, 0, 1))[:3]
    task.start_epoch(0)
    losses = [task.train_step(model, b).item() for b in batches]
    assert task.state is not None and not task.state[0].requires_grad
    task.start_epoch(0)
    task.train_step(model, batches[0])
    task.train_step(model, batches[1])
    saved = task.state_dict()
    assert saved["position"] == 2  # the data position: the next window is the third
    task.start_epoch(1)
    assert task.state is None and task.position == 0
    task.load_state_dict(saved)
    assert task.train_step(model, batches[2]).item() == losses[2]
    assert task.train_step(model, batches[0]).item() == losses[0]  # window 0 starts from a zero state
    with pytest.raises(RuntimeError, match="window 1 of the epoch, but the batch is window 2"):
        task.train_step(model, batches[2])  # a state that does not belong to the window
    task.load_state_dict({**saved, "state": None})
    assert task.train_step(model, batches[2]).item() != losses[2]  # the state matters


def test_evaluate_reports_perplexity_near_the_vocabulary_size_for_an_untrained_model(tmp_path):
    task = make_task(tmp_path)
    torch.manual_seed(0)
    model = task.build_model()
    with torch.no_grad():  # uniform predictions: perplexity = vocabulary size
        model.embedding.weight.zero_()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = task.evaluate(model, 0, 1)
    finally:
        dist.destroy_process_group()
    assert set(result) == set(task.metric_fields)
    assert math.isclose(result["perplexity"], task.vocab_size, rel_tol=1e-4)
    assert math.isclose(result["test_perplexity"], task.vocab_size, rel_tol=1e-4)
    # two ranks' slices cover the split but for the first token of each column and the remainders
    counts = [task._cross_entropy(model.eval(), task.valid_data, r, 2)[1].item() for r in range(2)]
    assert len(task.valid_data) - 2 * (2 * task.batch_size) <= sum(counts) < len(task.valid_data)


def test_model_sizes():
    benchmark = LSTMLanguageModel(28869, 650, 650, 3, 0.4, tied=True)  # the seeds' lower-cased WikiText-2
    assert sum(p.numel() for p in benchmark.parameters()) == 28_949_319
    untied = LSTMLanguageModel(100, 8, 16, 1, 0.0, tied=False)
    logits, (h, c) = untied(torch.zeros(5, 3, dtype=torch.int64))
    assert logits.shape == (5, 3, 100) and h.shape == c.shape == (1, 3, 16)
    with pytest.raises(ValueError, match="--no-tied"):
        LSTMLanguageModel(100, 8, 16, 1, 0.0, tied=True)


def test_presets_only_name_known_arguments():
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    lstm_main.add_task_arguments(parser.add_argument_group("task"))
    known = vars(parser.parse_args([]))
    for name, settings in lstm_main.PRESETS.items():
        assert set(settings) <= set(known), name
        assert settings["momentum"] == 0.0, name
    assert lstm_main.PRESETS["exdyna-lstm-wikitext2"]["lr"] == 10.0  # 2.5 x (32 / 64) x 8 workers


@pytest.mark.parametrize("lowercase, words", [(False, 33_278), (True, 28_869)])
def test_synthetic_wikitext2_has_its_vocabulary_and_split_sizes(lowercase, words):
    corpus = data.synthetic("wikitext2", lowercase)
    assert len(corpus.vocab) == words
    assert [len(corpus.split(s)) for s in data.SPLITS] == [2_088_628, 217_646, 245_569]
    assert int(corpus.train.max()) < words and int(corpus.train.min()) >= 0


def test_synthetic_data_stands_in_only_for_downloads():
    with pytest.raises(SystemExit, match="--dataset kjv installs offline"):
        data.synthetic("kjv")


def test_an_evaluation_too_short_for_the_workers_is_refused(tmp_path, monkeypatch):
    """--eval-tokens below 2 per worker left every rank with nothing to evaluate: the summed cross
    entropy of no token, exp(0 / 1), read as a perplexity of 1.0, a perfect model, which every
    method then "reached" after its first epoch. Refused where the world size is known (on every
    rank, before the first step), naming the option and the least that works."""
    monkeypatch.setattr(lstm_main.dist, "all_reduce", lambda tensor: None)  # one worker: the sums are its own
    task = make_task(tmp_path, "--eval-tokens", "3")
    with pytest.raises(SystemExit, match=r"--eval-tokens 3: .*2 workers.*at least 4"):
        task.steps_per_epoch(2)
    assert task.steps_per_epoch(1) > 0  # 3 tokens: 2 targets for one worker
    perplexity = task.evaluate(task.build_model(), 0, 1)["perplexity"]
    assert perplexity > 1.0 and math.isfinite(perplexity)
