"""Datasets: registry, deterministic splits, cache, parsers on tiny generated files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from symalign.data import eval_batches, load_dataset, train_batch
from symalign.data.base import cache_path, cached, split_stream
from symalign.data.images import FASHION_DIR, load_fashion_arrays, read_idx
from symalign.data.text import load_fortunes, markdown_play_to_text, parse_wordnet_data, split_fortunes
from symalign.errors import DatasetError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMALIGN_CACHE", str(tmp_path / "cache"))


def test_digits_split_is_deterministic_and_cached(tmp_path):
    a = load_dataset("digits")
    assert a.task == "classification" and a.n_classes == 10 and a.input_shape == (1, 8, 8)
    assert 0.0 <= float(a.x_train.min()) and float(a.x_train.max()) <= 1.0
    assert len(a.x_train) + len(a.x_val) + len(a.x_test) == 1797
    assert list((tmp_path / "cache").glob("digits-*.npz"))
    b = load_dataset("digits")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    c = load_dataset("digits", split_seed=1)
    assert not torch.equal(a.y_train, c.y_train)


def test_unknown_dataset():
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("no-such-dataset")


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}i", *arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_idx_parser_and_fashion_loader_on_generated_files(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("t10k", 6)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    imgs = read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    assert imgs.shape == (24, 28, 28) and imgs.dtype == np.uint8
    arrays = load_fashion_arrays(0, root=tmp_path, val_fraction=0.25)
    assert arrays["x_train"].shape == (18, 1, 28, 28) and arrays["x_test"].shape == (6, 1, 28, 28)
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x00\x00\x08\x01" + struct.pack(">i", 10) + b"\x00" * 3)
    with pytest.raises(DatasetError, match="header says"):
        read_idx(bad)


def test_missing_fashion_names_install_command(tmp_path):
    with pytest.raises(DatasetError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_arrays(0, root=tmp_path / "nowhere")


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_idx_headers():
    assert read_idx(FASHION_DIR / "t10k-labels-idx1-ubyte.gz").shape == (10000,)


def test_text_parsers():
    md = "# Play\n\n## ACT I\n\n_Enter ROMEO_\n\n**ROMEO**  \nBut soft!  \n"
    assert markdown_play_to_text(md) == "Play\n\nACT I\n\nEnter ROMEO\n\nROMEO:\nBut soft!\n"
    wn = ("  1 This software and database is being provided\n"
          "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived  \n"
          "00001930 29 v 01 walk 0 000 | move on foot\n")
    assert parse_wordnet_data(wn) == [("that which is perceived", 3), ("move on foot", 29)]
    assert split_fortunes("a\nb\n%\nc\n%\n") == ["a\nb", "c"]


def test_fortunes_loader_on_generated_dir(tmp_path):
    (tmp_path / "big").write_text("\n%\n".join(f"fortune {i}" for i in range(5)) + "\n%\n")
    (tmp_path / "small").write_text("only one\n%\n")
    (tmp_path / "big.dat").write_bytes(b"\x00")
    texts, labels, names = load_fortunes(tmp_path, min_entries=3)
    assert names == ["big"] and len(texts) == 5 and set(labels) == {0}


def test_synthetic_kinds_and_batches():
    img = load_dataset("synthetic", kind="image")
    txt = load_dataset("synthetic", kind="text")
    lm = load_dataset("synthetic", kind="lm")
    assert img.modality == "image" and txt.modality == "text" and lm.task == "lm"
    x, y = train_batch(lm, 3, 4, seed=1, context=8)
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = train_batch(lm, 3, 4, seed=1, context=8)
    assert torch.equal(x, x2)
    xi, yi = train_batch(img, 0, 16, seed=0)
    assert xi.shape == (16, 1, 8, 8) and yi.shape == (16,)
    xt, _ = train_batch(txt, 0, 8, seed=0)
    assert xt.dtype == torch.int64
    # one epoch visits every example once
    seen = torch.cat([train_batch(img, s, 16, seed=0)[1] for s in range(len(img.x_train) // 16)])
    assert len(seen) == len(img.x_train) // 16 * 16
    wins = list(eval_batches(lm, "val", 4, context=8))
    assert all(a.shape[1] == 8 for a, _ in wins)


def test_split_stream_and_cache_atomic(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    tr, va, te = split_stream(data, 0, block=100)
    assert len(tr) + len(va) + len(te) == 1000 and len(va) > 0 and len(te) > 0
    calls = []

    def build():
        calls.append(1)
        return {"a": np.arange(3)}

    assert cached("toy", {"k": 1}, build)["a"].tolist() == [0, 1, 2]
    assert cached("toy", {"k": 1}, build)["a"].tolist() == [0, 1, 2] and len(calls) == 1
    path = cache_path("toy", {"k": 1})
    path.write_bytes(b"garbage")  # a corrupt cache is rebuilt
    assert cached("toy", {"k": 1}, build)["a"].tolist() == [0, 1, 2] and len(calls) == 2
    assert not list(path.parent.glob(".*.tmp"))
