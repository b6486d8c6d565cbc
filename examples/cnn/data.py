"""Fashion-MNIST in its original IDX format (Debian's dataset-fashion-mnist package installs it)."""

from __future__ import annotations

import gzip
import os
import struct

import torch

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_IDX_TYPES = {0x08: torch.uint8}


def read_idx(path: str) -> torch.Tensor:
    """Reads an IDX file (optionally gzipped): magic 0x0000TTDD (type TT, DD dimensions), the
    dimensions as big-endian uint32, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code not in _IDX_TYPES:
        raise ValueError(f"{path}: unsupported IDX element type 0x{dtype_code:02x}")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    count = 1
    for d in dims:
        count *= d
    offset = 4 + 4 * ndim
    if len(raw) != offset + count:
        raise ValueError(f"{path}: expected {count} elements after the header, found {len(raw) - offset}")
    return torch.frombuffer(bytearray(raw[offset:]), dtype=_IDX_TYPES[dtype_code]).reshape(dims)


def fashion_mnist(root: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); images float32 N x 1 x 28 x 28,
    normalised with the training set's mean and standard deviation."""
    root = root or FASHION_MNIST_DIR
    paths = {
        name: os.path.join(root, f"{name}.gz")
        for name in (
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        )
    }
    missing = [p for p in paths.values() if not os.path.exists(p)]
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
