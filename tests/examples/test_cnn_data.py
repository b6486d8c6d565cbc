"""The CNN example's data readers on fixture files written here in the official formats, the
augmentation, and the models' shapes."""

import argparse
import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from examples.cnn import data, models
from examples.cnn.__main__ import ImageClassification, main


def write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("t10k", 5)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    x_train, y_train, x_test, y_test = data.fashion_mnist(str(tmp_path))
    assert x_train.shape == (12, 1, 28, 28) and x_test.shape == (5, 1, 28, 28)
    assert y_train.tolist() == [i % 10 for i in range(12)] and y_test.tolist() == [0, 1, 2, 3, 4]
    assert abs(float(x_train.mean())) < 1e-5 and abs(float(x_train.std()) - 1) < 1e-4


def test_idx_rejects_a_truncated_file(tmp_path):
    write_idx(tmp_path / "x.gz", np.zeros((3, 4)))
    with gzip.open(tmp_path / "x.gz") as f:
        raw = f.read()
    with gzip.open(tmp_path / "y.gz", "wb") as f:
        f.write(raw[:-1])
    with pytest.raises(ValueError, match="expected 12 elements"):
        data.read_idx(str(tmp_path / "y.gz"))


def test_idx_cut_short_in_its_header_or_its_gzip_stream_names_the_file(tmp_path):
    """A download cut short ended in struct.error or gzip's EOFError, naming no file."""
    write_idx(tmp_path / "x.gz", np.zeros((3, 4)))
    with gzip.open(tmp_path / "x.gz") as f:
        raw = f.read()
    with gzip.open(tmp_path / "header.gz", "wb") as f:
        f.write(raw[:9])  # magic and the first dimension, half of the second
    with pytest.raises(ValueError, match=r"header\.gz: the IDX header ends before its 2 dimensions"):
        data.read_idx(str(tmp_path / "header.gz"))
    (tmp_path / "stream.gz").write_bytes((tmp_path / "x.gz").read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"stream\.gz: not a whole gzip file .*; download or install it again"):
        data.read_idx(str(tmp_path / "stream.gz"))


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist(str(tmp_path))


def cifar_arrays(n: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), [int(v) for v in rng.integers(0, classes, n)]


def test_cifar10_python_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    expected = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x, y = cifar_arrays(4, 10, len(expected))
        expected.append((x, y))
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": x, b"labels": y, b"batch_label": name.encode()}, f)
    x_train, y_train, x_test, y_test = data.read_cifar_python(str(folder), "cifar10")
    assert x_train.shape == (20, 3, 32, 32) and x_test.shape == (4, 3, 32, 32)
    assert y_train.tolist() == [label for _, y in expected[:5] for label in y] and y_test.tolist() == expected[5][1]
    # channel-major layout: the first 1024 bytes of a row are the red plane
    assert torch.equal(x_train[0, 0].reshape(-1), torch.as_tensor(expected[0][0][0, :1024]))
    assert torch.equal(x_test[3, 2].reshape(-1), torch.as_tensor(expected[5][0][3, 2048:]))
    xn, _, _, _ = data.cifar("cifar10", str(tmp_path))  # finds the sub-folder, normalises
    assert xn.dtype == torch.float32 and xn.shape == (20, 3, 32, 32)


def test_cifar100_python_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        x, y = cifar_arrays(6, 100, 1)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": x, b"fine_labels": y, b"coarse_labels": [v // 5 for v in y]}, f)
    _, y_train, _, _ = data.read_cifar_python(str(folder), "cifar100")
    assert y_train.tolist() == y


@pytest.mark.parametrize("dataset,label_bytes,files", [
    ("cifar10", 1, [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]),
    ("cifar100", 2, ["train.bin", "test.bin"]),
])  # fmt: skip
def test_cifar_binary_records(tmp_path, dataset, label_bytes, files):
    rng = np.random.default_rng(3)
    labels, pixels = {}, {}
    for name in files:
        x, y = cifar_arrays(3, 100 if dataset == "cifar100" else 10, len(labels))
        coarse = [v // 5 for v in y]
        records = [([c, f] if label_bytes == 2 else [f]) + list(row) for c, f, row in zip(coarse, y, x, strict=True)]
        (tmp_path / name).write_bytes(bytes(v for r in records for v in r))
        labels[name], pixels[name] = y, x
    x_train, y_train, x_test, y_test = data.read_cifar_binary(str(tmp_path), dataset)
    assert x_train.shape == (len(y_train), 3, 32, 32)
    assert y_test.tolist() == labels[files[-1]] and x_test.shape == (3, 3, 32, 32)
    assert len(y_train) == 3 * (len(files) - 1)
    # the fine labels and the pixels, channel-major, of every record in file order
    assert y_train.tolist() == [label for name in files[:-1] for label in labels[name]]
    assert torch.equal(x_train.reshape(-1, 3072), torch.as_tensor(np.concatenate([pixels[n] for n in files[:-1]])))
    assert torch.equal(x_test.reshape(-1, 3072), torch.as_tensor(pixels[files[-1]]))
    (tmp_path / files[0]).write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="not a multiple"):
        data.read_cifar_binary(str(tmp_path), dataset)
    del rng


def test_missing_cifar_shows_the_download_step(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-10-python\.tar\.gz"):
        data.cifar("cifar10", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        data.cifar("cifar100", None)


def test_the_cifar_download_step_works_for_a_data_dir_that_does_not_exist_yet(tmp_path):
    """The step printed for a missing --data-dir was `curl ... | tar -xz -C <dir>`, which tar
    refuses for a folder that does not exist ("Cannot open"): it now makes the folder first, and
    quotes it for the shell."""
    missing = tmp_path / "new data"
    with pytest.raises(FileNotFoundError) as info:
        data.cifar("cifar10", str(missing))
    step = str(info.value).splitlines()[-1].strip()
    assert step.startswith(f"mkdir -p '{missing}' && curl -L ") and step.endswith(f"| tar -xz -C '{missing}'"), step


def test_augmentation_crops_and_flips_deterministically():
    n = 32
    x = torch.arange(n * 3 * 32 * 32, dtype=torch.float32).reshape(n, 3, 32, 32)
    a = data.augment(x, torch.Generator().manual_seed(5))
    b = data.augment(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == x.shape
    seen = set()  # (dy, dx, flipped) of each image
    for i in range(n):  # every output image is a shifted (and maybe mirrored) window of the padded input
        padded = torch.nn.functional.pad(x[i], (4, 4, 4, 4))
        windows = {(dy, dx): padded[:, dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)}
        found = [
            (*at, f)
            for at, w in windows.items()
            for f, image in ((False, w), (True, w.flip(2)))
            if torch.equal(a[i], image)
        ]
        assert len(found) == 1, (i, found)
        seen |= set(found)
    # the crops move in both directions, and some images are mirrored, some not
    assert len({dy for dy, _, _ in seen}) > 1 and len({dx for _, dx, _ in seen}) > 1, seen
    assert {flipped for _, _, flipped in seen} == {False, True}, seen


@pytest.mark.parametrize("name,size,params", [
    ("smallcnn", 28, 80_202), ("resnet20", 32, 272_474), ("resnet18", 32, 11_173_962), ("vgg16", 32, 14_728_266),
])  # fmt: skip
def test_models_shapes_and_sizes(name, size, params):
    channels = 1 if size == 28 else 3
    model = models.build(name, channels, 10, size)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, channels, size, size)).shape == (2, 10)


def test_vgg_needs_32_pixel_images():
    with pytest.raises(ValueError, match="needs 32x32 images"):
        models.build("vgg19", 1, 10, 28)


def test_synthetic_images_have_the_requested_shapes_and_are_deterministic():
    x, y = data.synthetic(20, 3, 32, 10, seed=4)
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (20,)
    assert int(y.min()) >= 0 and int(y.max()) < 10
    again, _ = data.synthetic(20, 3, 32, 10, seed=4)
    assert torch.equal(x, again)


def test_test_samples_evaluates_on_the_first_images_only(capsys):
    args = argparse.Namespace(dataset="cifar10", synthetic_data=True, seed=0, model="smallcnn", data_dir=None,
                              no_augment=False, batch_size=8, test_samples=300)  # fmt: skip
    task = ImageClassification(args)
    assert task.x_test.shape == (300, 3, 32, 32) and task.y_test.shape == (300,)
    assert len(task.x_train) == 50_000
    with pytest.raises(SystemExit):
        main(["--test-samples", "-1"])
    assert "argument --test-samples: -1 is negative: give 0 or a positive number" in capsys.readouterr().err


class CountingModel(torch.nn.Module):
    """Constant logits; records the size of every batch it is given."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def forward(self, x):
        self.sizes.append(len(x))
        return torch.zeros(len(x), 10)


def test_evaluation_runs_the_same_forward_passes_on_every_rank(monkeypatch):
    """Each rank took every world_size-th block of 1,000 test images, so with 2,500 images on 2
    ranks (or Fashion-MNIST's 10,000 on 4) rank 0 ran one forward pass more than the others. With
    --fsdp every forward pass gathers the parameters from all ranks: the run hung at its first
    evaluation. Every rank now runs as many (the last ones empty), and each image is scored once."""
    args = argparse.Namespace(dataset="cifar10", synthetic_data=True, seed=0, model="smallcnn", data_dir=None,
                              no_augment=False, batch_size=8, test_samples=2500)  # fmt: skip
    task = ImageClassification(args)
    monkeypatch.setattr("examples.cnn.__main__.dist.all_reduce", lambda tensor: None)  # one rank at a time
    for world_size in (2, 4):
        models_by_rank = [CountingModel() for _ in range(world_size)]
        for rank, model in enumerate(models_by_rank):
            task.evaluate(model, rank, world_size)
        passes = {len(model.sizes) for model in models_by_rank}
        assert len(passes) == 1, (world_size, [model.sizes for model in models_by_rank])
        assert sum(sum(model.sizes) for model in models_by_rank) == 2500


def test_vgg_on_fashion_mnist_is_refused_naming_both_options():
    """--model vgg16 with --dataset fashion-mnist (28x28) loaded the data and joined the process
    group, then rank 0 ended in models.build's ValueError traceback while the other ranks waited
    on it. The task refuses the pair on every rank, naming both options and what to give instead."""
    args = argparse.Namespace(dataset="fashion-mnist", synthetic_data=True, seed=0, model="vgg16", data_dir=None,
                              no_augment=False, batch_size=8, test_samples=0)  # fmt: skip
    with pytest.raises(SystemExit, match=r"--model vgg16 needs 32x32 images, but --dataset fashion-mnist has 28x28"):
        ImageClassification(args)
