"""Fashion-MNIST in its original IDX format (Debian's dataset-fashion-mnist package installs it)."""

from __future__ import annotations

import gzip
import os
import shlex
import struct

import torch

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_IDX_TYPES = {0x08: torch.uint8}


def read_idx(path: str) -> torch.Tensor:
    """Reads an IDX file (optionally gzipped): magic 0x0000TTDD (type TT, DD dimensions), the
    dimensions as big-endian uint32, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile) as error:  # a download cut short, or not gzip data
        raise ValueError(f"{path}: not a whole gzip file ({error}); download or install it again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code not in _IDX_TYPES:
        raise ValueError(f"{path}: unsupported IDX element type 0x{dtype_code:02x}")
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: the IDX header ends before its {ndim} dimensions")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    count = 1
    for d in dims:
        count *= d
    offset = 4 + 4 * ndim
    if len(raw) != offset + count:
        raise ValueError(f"{path}: expected {count} elements after the header, found {len(raw) - offset}")
    return torch.frombuffer(bytearray(raw[offset:]), dtype=_IDX_TYPES[dtype_code]).reshape(dims)


_FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                        "t10k-labels-idx1-ubyte")  # fmt: skip


def fashion_mnist_missing(root: str | None = None) -> list[str]:
    """The paths of Fashion-MNIST's four files that are not under ``root`` (default
    FASHION_MNIST_DIR, where Debian's dataset-fashion-mnist installs them)."""
    paths = [os.path.join(root or FASHION_MNIST_DIR, f"{name}.gz") for name in _FASHION_MNIST_FILES]
    return [p for p in paths if not os.path.exists(p)]


def fashion_mnist(root: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); images float32 N x 1 x 28 x 28,
    normalised with the training set's mean and standard deviation."""
    root = root or FASHION_MNIST_DIR
    paths = {name: os.path.join(root, f"{name}.gz") for name in _FASHION_MNIST_FILES}
    missing = fashion_mnist_missing(root)
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found: {', '.join(missing)}. Install it with "
            "`apt-get install dataset-fashion-mnist` (files land in /usr/share/datasets/fashion-mnist), "
            "or pass --data-dir pointing at the four *-ubyte.gz files."
        )
    x_train = read_idx(paths["train-images-idx3-ubyte"]).float().div_(255).unsqueeze(1)
    y_train = read_idx(paths["train-labels-idx1-ubyte"]).long()
    x_test = read_idx(paths["t10k-images-idx3-ubyte"]).float().div_(255).unsqueeze(1)
    y_test = read_idx(paths["t10k-labels-idx1-ubyte"]).long()
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


# CIFAR-10 and CIFAR-100 ----------------------------------------------------------------------------

CIFAR_DOWNLOAD = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
_CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
_CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def _unpickle(path: str) -> dict:
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def _images(rows, path: str) -> torch.Tensor:
    """A batch's b"data": a uint8 array N x 3072 (numpy in the official files)."""
    data = torch.as_tensor(rows, dtype=torch.uint8).reshape(-1)
    if data.numel() % 3072:
        raise ValueError(f"{path}: image data is not a whole number of 3x32x32 images")
    return data.reshape(-1, 3, 32, 32)


def read_cifar_python(folder: str, dataset: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "python version" batches: cifar-10-batches-py/{data_batch_1..5,test_batch} (key
    b"labels") or cifar-100-python/{train,test} (key b"fine_labels"). Returns uint8 images
    N x 3 x 32 x 32 and int64 labels, train then test."""
    if dataset == "cifar10":
        train_files = [os.path.join(folder, f"data_batch_{i}") for i in range(1, 6)]
        test_files, key = [os.path.join(folder, "test_batch")], b"labels"
    else:
        train_files, test_files, key = [os.path.join(folder, "train")], [os.path.join(folder, "test")], b"fine_labels"

    def load(files):
        xs, ys = [], []
        for path in files:
            batch = _unpickle(path)
            if b"data" not in batch or key not in batch:
                raise ValueError(f"{path}: not a {dataset} batch (no {key.decode()!r} entry)")
            xs.append(_images(batch[b"data"], path))
            ys.append(torch.as_tensor(list(batch[key]), dtype=torch.int64))
        return torch.cat(xs), torch.cat(ys)

    return (*load(train_files), *load(test_files))


def read_cifar_binary(folder: str, dataset: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "binary version": records of <label byte(s)> + 3072 pixel bytes; CIFAR-10 has one
    label byte (cifar-10-batches-bin/data_batch_1..5.bin, test_batch.bin), CIFAR-100 two
    (coarse, fine: cifar-100-binary/train.bin, test.bin; the fine label is used)."""
    if dataset == "cifar10":
        train = [os.path.join(folder, f"data_batch_{i}.bin") for i in range(1, 6)]
        test, label_bytes = [os.path.join(folder, "test_batch.bin")], 1
    else:
        train, test, label_bytes = [os.path.join(folder, "train.bin")], [os.path.join(folder, "test.bin")], 2

    def load(files):
        xs, ys = [], []
        for path in files:
            with open(path, "rb") as f:
                raw = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            record = label_bytes + 3072
            if raw.numel() % record:
                raise ValueError(f"{path}: size {raw.numel()} is not a multiple of the {record}-byte record")
            raw = raw.reshape(-1, record)
            ys.append(raw[:, label_bytes - 1].long())
            xs.append(raw[:, label_bytes:].reshape(-1, 3, 32, 32))
        return torch.cat(xs), torch.cat(ys)

    return (*load(train), *load(test))


def cifar(dataset: str, root: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CIFAR-10/100 from ``root``, which holds the extracted official archive (python or binary
    version) or is that archive's folder itself. Images float32, normalised per channel."""
    if root is None:
        raise FileNotFoundError(
            f"{dataset}: pass --data-dir with the extracted official archive; download it with\n"
            f"  mkdir -p data && curl -L {CIFAR_DOWNLOAD[dataset]} | tar -xz -C data\n"
            f"then use --data-dir data"
        )
    names = {
        "cifar10": (("cifar-10-batches-py", read_cifar_python), ("cifar-10-batches-bin", read_cifar_binary)),
        "cifar100": (("cifar-100-python", read_cifar_python), ("cifar-100-binary", read_cifar_binary)),
    }[dataset]
    for sub, reader in names:
        for folder in (os.path.join(root, sub), root):
            probe = "test_batch" if dataset == "cifar10" else "test"
            if reader is read_cifar_binary:
                probe += ".bin"
            if os.path.exists(os.path.join(folder, probe)):
                x_train, y_train, x_test, y_test = reader(folder, dataset)
                norm = lambda x: (x.float().div_(255) - _CIFAR_MEAN) / _CIFAR_STD  # noqa: E731
                return norm(x_train), y_train, norm(x_test), y_test
    where = shlex.quote(root)  # may not exist yet: tar -C needs it made
    raise FileNotFoundError(
        f"{dataset}: no {' or '.join(s for s, _ in names)} folder under {root}; download with\n"
        f"  mkdir -p {where} && curl -L {CIFAR_DOWNLOAD[dataset]} | tar -xz -C {where}"
    )


def synthetic(count: int, channels: int, size: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` normalised random images of ``channels`` x ``size`` x ``size`` and uniform labels
    (--synthetic-data: the shapes of a dataset that is not installed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, channels, size, size, generator=g), torch.randint(classes, (count,), generator=g)


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The standard CIFAR augmentation: random crop with 4 pixels of zero padding, random
    horizontal flip; deterministic given the generator."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n,), generator=generator)
    dx = torch.randint(0, 9, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    cropped = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
    return torch.where(flip.view(n, 1, 1, 1), cropped.flip(3), cropped)
