"""The public-dataset loaders on small files generated in each dataset's published on-disk format,
read through ``load_dataset`` (the same code path as the real files), plus tokenisation and errors."""

from __future__ import annotations

import csv
import gzip
import hashlib
import pickle
import struct
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from symalign.data import load_dataset
from symalign.data.base import cache_dir
from symalign.data.public import SPECS
from symalign.data.public.common import Remote, carve_val
from symalign.data.public.labelled import AG_NEWS_CLASSES, DBPEDIA_CLASSES
from symalign.data.tokenize import ByteTokenizer, check_vocab, id_dtype, load_tokenizer
from symalign.errors import ConfigError, DatasetError

try:  # the dev extra installs pyarrow; without it only the parquet / Arrow tests are skipped
    import pyarrow as pa
    import pyarrow.ipc  # noqa: F401
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="pyarrow not installed (pip install -e '.[dev]')")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SYMALIGN_DATA", str(tmp_path / "data-home"))


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().astype(np.uint8).tobytes()


def _check_split(ds, x_src: np.ndarray, y_src: np.ndarray, seed: int, fraction: float) -> None:
    """Train and val are the source rows at the seeded hold-out, pixels scaled exactly by 1/255."""
    tr, va = carve_val(len(y_src), seed, fraction)
    src = torch.from_numpy(x_src)
    assert torch.equal(ds.x_train, src[tr].float() / 255) and torch.equal(ds.x_val, src[va].float() / 255)
    assert torch.equal(ds.y_train, torch.from_numpy(y_src[tr])) and torch.equal(ds.y_val, torch.from_numpy(y_src[va]))
    assert sorted(tr.tolist() + va.tolist()) == list(range(len(y_src)))


# ----------------------------------------------------------------------------------------- MNIST
def _idx_bytes(arr: np.ndarray) -> bytes:
    return struct.pack(">BBBB", 0, 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}i", *arr.shape) + arr.tobytes()


def _mnist(folder: Path, gz: bool, n_train: int = 24, n_test: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train).astype(np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test).astype(np.uint8)}
    for stem, a in arrays.items():
        if gz:
            with gzip.open(folder / f"{stem}.gz", "wb") as f:
                f.write(_idx_bytes(a))
        else:
            (folder / stem).write_bytes(_idx_bytes(a))
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_torchvision_layout(tmp_path, gz):
    src = _mnist(tmp_path / "m" / "MNIST" / "raw", gz)
    ds = load_dataset("mnist", root=tmp_path / "m", split_seed=3)
    assert ds.modality == "image" and ds.n_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (22, 2, 6)  # 1/12 held out, as Fashion-MNIST
    _check_split(ds, src["train-images-idx3-ubyte"][:, None], src["train-labels-idx1-ubyte"].astype(np.int64),
                 3, 1 / 12)
    assert torch.equal(ds.x_test, torch.from_numpy(src["t10k-images-idx3-ubyte"][:, None]).float() / 255)
    assert list((tmp_path / "cache").glob("mnist-*.npz"))
    again = load_dataset("mnist", root=tmp_path / "m", split_seed=3)  # from the cache
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)


def test_mnist_default_location_is_symalign_data(tmp_path):
    _mnist(tmp_path / "data-home" / "mnist", gz=True)
    assert len(load_dataset("mnist").x_test) == 6


FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_mnist_loader_reads_real_idx_files():
    """Fashion-MNIST ships in MNIST's exact file format: the mnist loader must agree with the fashion one."""
    real = load_dataset("mnist", root=FASHION, use_cache=False)
    assert (len(real.x_train), len(real.x_val), len(real.x_test)) == (55_000, 5_000, 10_000)
    from symalign.data.images import load_fashion_arrays

    ref = load_fashion_arrays(0)
    assert torch.equal(real.x_test, torch.from_numpy(ref["x_test"].copy()).float() / 255)
    assert torch.equal(real.y_val, torch.from_numpy(ref["y_val"]))


# ----------------------------------------------------------------------------------------- CIFAR
def _pickle(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def _cifar10(folder: Path, per_batch: int = 4, n_test: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True)
    xs, ys = [], []
    for i in range(1, 6):
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = rng.integers(0, 10, per_batch).tolist()
        _pickle(d / f"data_batch_{i}", {"batch_label": f"training batch {i} of 5", "labels": y, "data": x,
                                        "filenames": [f"img{j}.png" for j in range(per_batch)]})
        xs.append(x)
        ys.extend(y)
    xt = rng.integers(0, 256, (n_test, 3072), dtype=np.uint8)
    _pickle(d / "test_batch", {"batch_label": "testing batch 1 of 1", "labels": [9, 0, 5][:n_test], "data": xt})
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _pickle(d / "batches.meta", {"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072})
    return np.concatenate(xs), np.asarray(ys, dtype=np.int64), xt


def test_cifar10_pickles(tmp_path):
    x, y, xt = _cifar10(tmp_path / "c")
    ds = load_dataset("cifar10", root=tmp_path / "c")
    assert ds.input_shape == (3, 32, 32) and ds.n_classes == 10
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (18, 2, 3)
    img = x.reshape(-1, 3, 32, 32)  # row = 1024 red, 1024 green, 1024 blue bytes, each 32x32 row-major
    assert img[5, 1, 2, 7] == x[5, 1024 + 2 * 32 + 7]
    _check_split(ds, img, y, 0, 0.1)
    assert torch.equal(ds.x_test, torch.from_numpy(xt.reshape(-1, 3, 32, 32)).float() / 255)
    assert ds.y_test.tolist() == [9, 0, 5]


def test_cifar10_archive_is_unpacked_and_download_checks_md5(tmp_path, monkeypatch):
    _cifar10(tmp_path / "src")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / archive.name).write_bytes(archive.read_bytes())
    assert len(load_dataset("cifar10", root=tmp_path / "local").x_test) == 3  # archive in root: unpacked
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    good = Remote(archive.as_uri(), archive.name, md5, extract=True)
    monkeypatch.setitem(SPECS, "cifar10", replace(SPECS["cifar10"], remotes=(good,)))
    ds = load_dataset("cifar10", root=tmp_path / "fetched", download=True)
    assert len(ds.x_train) == 18 and (tmp_path / "fetched" / "cifar-10-batches-py" / "test_batch").is_file()
    monkeypatch.setitem(SPECS, "cifar10", replace(SPECS["cifar10"], remotes=(replace(good, md5="0" * 32),)))
    with pytest.raises(DatasetError, match="md5"):
        load_dataset("cifar10", root=tmp_path / "bad-md5", download=True)
    assert not (tmp_path / "bad-md5" / archive.name).exists()  # no half-verified file left behind


@pytest.mark.parametrize("labels,k", [("fine", 100), ("coarse", 20)])
def test_cifar100_fine_and_coarse(tmp_path, labels, k):
    rng = np.random.default_rng(2)
    d = tmp_path / "c" / "cifar-100-python"
    d.mkdir(parents=True)
    split = {}
    for name, n in (("train", 20), ("test", 5)):
        split[name] = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                       "fine_labels": rng.integers(0, 100, n).tolist(),
                       "coarse_labels": rng.integers(0, 20, n).tolist()}
        _pickle(d / name, {"filenames": [], "batch_label": name, **split[name]})
    _pickle(d / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                         "coarse_label_names": [f"c{i}" for i in range(20)]})
    ds = load_dataset("cifar100", root=tmp_path / "c", labels=labels)
    assert ds.n_classes == k and (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (18, 2, 5)
    _check_split(ds, split["train"]["data"].reshape(-1, 3, 32, 32),
                 np.asarray(split["train"][f"{labels}_labels"], dtype=np.int64), 0, 0.1)
    assert ds.y_test.tolist() == split["test"][f"{labels}_labels"]


# ----------------------------------------------------------------------------------------- image folder
def _png(path: Path, arr: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_imagefolder_pngs_decode_exactly_and_resize(tmp_path):
    rng = np.random.default_rng(4)
    root = tmp_path / "imnet"
    pixels = {}
    for split, n in (("train", 5), ("val", 2)):
        for c in ("n01", "n02", "n03"):
            for i in range(n):
                a = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                _png(root / split / c / f"{c}_{i}.png", a)
                pixels[a.transpose(2, 0, 1).tobytes()] = ("n01", "n02", "n03").index(c)
    _png(root / "train" / "n02" / "gray.png", np.full((8, 8), 77, dtype=np.uint8))  # grey -> RGB
    ds = load_dataset("imagefolder", root=root, image_size=8)
    assert ds.input_shape == (3, 8, 8) and ds.n_classes == 3
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (15, 1, 6)  # 2 % held out, at least one
    for x, y in ((ds.x_test, ds.y_test), (ds.x_train, ds.y_train)):
        for img, label in zip(x, y):
            key = _as_bytes(torch.round(img * 255))
            back = torch.from_numpy(np.frombuffer(key, np.uint8).reshape(3, 8, 8).copy())
            assert torch.equal(img, back.float() / 255)
            if key in pixels:  # every PNG read back bit-exactly, with its folder's label
                assert pixels[key] == int(label)
            else:
                assert key == bytes([77]) * 192 and int(label) == 1
    # resizing: shorter side scaled to image_size, centre crop; a constant image stays constant
    _png(root / "test" / "n01" / "wide.png", np.full((12, 20, 3), (10, 200, 30), dtype=np.uint8))
    small = load_dataset("imagefolder", root=root, image_size=4, per_class=1)
    assert small.x_test.shape == (1, 3, 4, 4) and len(small.x_train) == len(small.x_val) == 3  # test/: no carving
    assert torch.equal(small.x_test[0], torch.tensor([10.0, 200.0, 30.0]).view(3, 1, 1).expand(3, 4, 4) / 255)


# ----------------------------------------------------------------------------------------- LM corpora
def test_enwik8_raw_and_zip_90_5_5(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, 2000, dtype=np.uint8).tobytes()  # not valid UTF-8
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "enwik8").write_bytes(data)
    ds = load_dataset("enwik8", root=tmp_path / "raw")
    assert ds.task == "lm" and ds.vocab_size == 256 and ds.x_train.dtype == torch.uint8
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (1800, 100, 100)
    assert _as_bytes(ds.x_train) + _as_bytes(ds.x_val) + _as_bytes(ds.x_test) == data
    (tmp_path / "zip").mkdir()
    with zipfile.ZipFile(tmp_path / "zip" / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", data)
    zds = load_dataset("enwik8", root=tmp_path / "zip", subset=50)
    assert torch.equal(zds.x_test, ds.x_test) and _as_bytes(zds.x_train) == data[:50]


WIKI = {"train": " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles \n\n"
                 " = = Gameplay = = \n",
        "valid": " \n = Homarus gammarus = \n \n Homarus gammarus , known as the lobster \n",
        "test": " \n = Robert Boulter = \n \n Robert Boulter is an English film , television actor \n"}


def _hf_rows(text: str) -> list[str]:  # what the Hugging Face release stores: whitespace-only lines -> ""
    return [line if line.strip() else "" for line in text.splitlines(keepends=True)]


def _wikitext_parquet(root: Path) -> None:
    d = root / "wikitext-103-raw-v1"
    d.mkdir(parents=True)
    rows = _hf_rows(WIKI["train"])
    pq.write_table(pa.table({"text": rows[:3]}), d / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": rows[3:]}), d / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"text": _hf_rows(WIKI["valid"])}), d / "validation-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": _hf_rows(WIKI["test"])}), d / "test-00000-of-00001.parquet")


@needs_pyarrow
def test_wikitext103_raw_files_and_parquet_agree(tmp_path):
    raw = tmp_path / "raw" / "wikitext-103-raw"
    raw.mkdir(parents=True)
    for split, text in WIKI.items():
        (raw / f"wiki.{split}.raw").write_text(text, encoding="utf-8")
    _wikitext_parquet(tmp_path / "hf")
    (tmp_path / "hf" / "wikitext-2-raw-v1").mkdir()  # another config of the hub repository: not read
    pq.write_table(pa.table({"text": ["other\n"]}),
                   tmp_path / "hf" / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet")
    a = load_dataset("wikitext103", root=tmp_path / "raw")
    b = load_dataset("wikitext103", root=tmp_path / "hf")
    for s, split in (("train", "train"), ("val", "valid"), ("test", "test")):
        want = "".join(_hf_rows(WIKI[split])).encode("utf-8")
        assert _as_bytes(getattr(a, f"x_{s}")) == want == _as_bytes(getattr(b, f"x_{s}"))
    assert "Senjō".encode() in _as_bytes(a.x_train)


def test_lm1b_shards_and_heldout(tmp_path):
    root = tmp_path / "1-billion-word-language-modeling-benchmark-r13output"
    shards = {f"news.en-0000{i}-of-00100": f"Sentence {i} one .\nSentence {i} two .\n" for i in (1, 2)}
    held = {f"news.en.heldout-0000{i}-of-00050": f"Held {i} .\n" for i in (0, 1, 2)}
    for sub, files in (("training-monolingual.tokenized.shuffled", shards),
                       ("heldout-monolingual.tokenized.shuffled", held)):
        (root / sub).mkdir(parents=True)
        for name, text in files.items():
            (root / sub / name).write_text(text)
    ds = load_dataset("lm1b", root=tmp_path)  # the archive's top folder is found inside root
    assert _as_bytes(ds.x_train) == "".join(shards.values()).encode()
    assert _as_bytes(ds.x_test) == b"Held 0 .\n" and _as_bytes(ds.x_val) == b"Held 1 .\n"
    assert _as_bytes(load_dataset("lm1b", root=tmp_path, subset=12).x_train) == b"Sentence 1 o"


# ----------------------------------------------------------------------------------------- text classification
AG = [(3, "Wall St. Bears Claw Back", 'Reuters - Short-sellers, "ultra-cynics", are green\\again.'),
      (1, "Olympics: Phelps wins", "ATHENS - Michael Phelps won, again."),
      (2, "Ölpreis steigt", "Frankfurt — der Preis stieg."),
      (4, "New chip", 'A faster chip, with "quotes".'),
      (1, "Short", "x")] * 4


def _write_csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


@needs_pyarrow
def test_ag_news_parquet_and_csv_agree(tmp_path):
    train, test = AG[:16], AG[16:]
    for split, rows in (("train", train), ("test", test)):
        _write_csv(tmp_path / "csv" / "ag_news_csv" / f"{split}.csv", rows)
        (tmp_path / "hf" / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": [f"{t} {d}" for _, t, d in rows], "label": [c - 1 for c, _, _ in rows]}),
                       tmp_path / "hf" / "data" / f"{split}-00000-of-00001.parquet")
    a = load_dataset("ag_news", root=tmp_path / "csv")
    b = load_dataset("ag_news", root=tmp_path / "hf")
    assert a.n_classes == len(AG_NEWS_CLASSES) == 4 and a.vocab_size == 256 and a.input_shape == (256,)
    assert (len(a.x_train), len(a.x_val), len(a.x_test)) == (15, 1, 4)  # 5 % of train held out
    for s in ("train", "val", "test"):
        assert torch.equal(getattr(a, f"x_{s}"), getattr(b, f"x_{s}"))
        assert torch.equal(getattr(a, f"y_{s}"), getattr(b, f"y_{s}"))
    want = f"{AG[16][1]} {AG[16][2]}".encode()
    assert _as_bytes(a.x_test[0][:len(want)]) == want and int(a.x_test[0][len(want):].abs().sum()) == 0
    assert a.y_test.tolist() == [c - 1 for c, _, _ in test]


@needs_pyarrow
def test_dbpedia_parquet_and_csv_agree(tmp_path):
    rows = [(k % 14 + 1, f"Title {k}", f" Content number {k}, with a comma.") for k in range(22)]
    for split, part in (("train", rows[:20]), ("test", rows[20:])):
        _write_csv(tmp_path / "csv" / "dbpedia_csv" / f"{split}.csv", part)
        (tmp_path / "hf" / "dbpedia_14").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"label": [c - 1 for c, _, _ in part], "title": [t for _, t, _ in part],
                                 "content": [c for _, _, c in part]}),
                       tmp_path / "hf" / "dbpedia_14" / f"{split}-00000-of-00001.parquet")
    a = load_dataset("dbpedia", root=tmp_path / "csv", seq_len=40)
    b = load_dataset("dbpedia", root=tmp_path / "hf", seq_len=40)
    assert a.n_classes == len(DBPEDIA_CLASSES) and a.input_shape == (40,)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test) and a.y_test.tolist() == [6, 7]
    assert _as_bytes(a.x_test[1]).rstrip(b"\0") == b"Title 21 Content number 21, with a comma"  # stripped, 40 bytes


@needs_pyarrow
def test_imdb_parquet_and_acl_folders_agree(tmp_path):
    reviews = {"train": {"neg": {"3_2.txt": "Awful.<br /><br />Bad.", "12_1.txt": "Worst."},
                         "pos": {"0_9.txt": "Great!", "7_10.txt": "Loved it.", "11_8.txt": "Fine film."}},
               "test": {"neg": {"1_3.txt": "Dull."}, "pos": {"2_7.txt": "Nice."}}}
    for split, by_class in reviews.items():
        texts, labels = [], []
        for label, cls in enumerate(("neg", "pos")):
            for fname in sorted(by_class[cls], key=lambda n: int(n.split("_")[0])):
                path = tmp_path / "acl" / "aclImdb" / split / cls / fname
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(by_class[cls][fname])
                texts.append(by_class[cls][fname])
                labels.append(label)
        (tmp_path / "hf" / "plain_text").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts, "label": labels}),
                       tmp_path / "hf" / "plain_text" / f"{split}-00000-of-00001.parquet")
        (tmp_path / "arrow" / "imdb" / "plain_text").mkdir(parents=True, exist_ok=True)  # the `datasets` cache
        table = pa.table({"text": texts, "label": labels})
        with pa.ipc.new_stream(tmp_path / "arrow" / "imdb" / "plain_text" / f"imdb-{split}.arrow", table.schema) as w:
            w.write_table(table)
    a = load_dataset("imdb", root=tmp_path / "acl")
    b = load_dataset("imdb", root=tmp_path / "hf")
    c = load_dataset("imdb", root=tmp_path / "arrow")
    assert a.n_classes == 2 and a.input_shape == (1024,) and len(a.x_train) + len(a.x_val) == 5
    for other in (b, c):
        assert torch.equal(a.x_train, other.x_train) and torch.equal(a.y_val, other.y_val)
    assert a.y_test.tolist() == [0, 1]
    assert _as_bytes(a.x_test[0]).rstrip(b"\0") == b"Dull."


# ----------------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A tiny word-level Hugging Face tokenizer, built offline and saved with ``save_pretrained``."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = "= valkyria chronicles iii senjō no 3 : <unk> gameplay homarus gammarus , known as the lobster robert " \
            "boulter is an english film television actor wall st. bears claw back".split()
    words += [f"w{i}" for i in range(300)]  # > 256 ids: stored as uint16, loaded as int32
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{w: i + 4 for i, w in enumerate(dict.fromkeys(words))}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path = tmp_path_factory.mktemp("tok")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                         sep_token="[SEP]").save_pretrained(path)
    return path


@needs_pyarrow
def test_hf_tokenizer_for_lm_and_classification(tmp_path, word_tokenizer):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(word_tokenizer)  # the reference: transformers itself
    _wikitext_parquet(tmp_path / "wt")
    lm = load_dataset("wikitext103", root=tmp_path / "wt", tokenizer=str(word_tokenizer))
    assert lm.vocab_size == len(ref) > 256 and lm.x_train.dtype == torch.int32  # uint16 in the cache
    want = ref("".join(_hf_rows(WIKI["valid"])), add_special_tokens=False)["input_ids"]
    assert lm.x_val.tolist() == want and 1 not in want[:3]  # known words are not [UNK]
    for split in ("train", "test"):
        _write_csv(tmp_path / "ag" / "ag_news_csv" / f"{split}.csv", AG)
    cls = load_dataset("ag_news", root=tmp_path / "ag", tokenizer=word_tokenizer, seq_len=6)
    assert cls.input_shape == (6,) and cls.vocab_size == len(ref)
    enc = ref([f"{t} {d}" for _, t, d in AG], truncation=True, max_length=6)["input_ids"]
    assert cls.x_test[0].tolist() == enc[0] and enc[0][0] == ref.cls_token_id and enc[0][-1] == ref.sep_token_id
    short = next(i for i, (_, t, _) in enumerate(AG) if t == "Short")
    assert cls.x_test[short].tolist() == enc[short] + [ref.pad_token_id] * (6 - len(enc[short]))
    cached_names = {p.name for p in (tmp_path / "cache").glob("ag_news-*.npz")}
    load_dataset("ag_news", root=tmp_path / "ag", seq_len=6)  # byte-level: a different cache entry
    assert len({p.name for p in (tmp_path / "cache").glob("ag_news-*.npz")} - cached_names) == 1


def test_vocab_check(word_tokenizer):
    tok = load_tokenizer(word_tokenizer)
    check_vocab(tok, tok.vocab_size)
    check_vocab(tok, tok.vocab_size + 5)
    with pytest.raises(ConfigError, match=f"vocab_size={tok.vocab_size - 1}.*>= {tok.vocab_size}"):
        check_vocab(tok, tok.vocab_size - 1)
    with pytest.raises(ConfigError, match="vocab_size=100"):
        check_vocab(ByteTokenizer(), 100)
    assert load_tokenizer(None).vocab_size == load_tokenizer("bytes").vocab_size == 256
    assert [id_dtype(v) for v in (256, 257, 65536, 65537)] == [np.uint8, np.uint16, np.uint16, np.uint32]


def test_bad_tokenizer_folders(tmp_path, word_tokenizer):
    with pytest.raises(DatasetError, match="no such folder"):
        load_tokenizer(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(DatasetError, match="takes no tokenizer"):
        load_dataset("digits", tokenizer=word_tokenizer)


# ----------------------------------------------------------------------------------------- errors
def test_missing_dataset_says_what_to_put_where(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset("cifar10", root=tmp_path / "nowhere")
    msg = str(e.value)
    assert str(tmp_path / "nowhere") in msg and "cifar-10-batches-py/{data_batch_1..5" in msg
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg and "download=True" in msg
    with pytest.raises(DatasetError, match=r"data-home/wikitext103.*wiki\.train\.raw.*Salesforce/wikitext"):
        load_dataset("wikitext-103")  # alias; default folder $SYMALIGN_DATA/wikitext103
    with pytest.raises(DatasetError, match="image-net.org"):
        load_dataset("imagenet", root=tmp_path)
    with pytest.raises(DatasetError, match="cannot download file:"):  # a failed download names the URL
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(SPECS, "enwik8", replace(SPECS["enwik8"], remotes=(
                Remote((tmp_path / "absent.zip").as_uri(), "enwik8.zip"),)))
            load_dataset("enwik8", root=tmp_path / "e", download=True)


@needs_pyarrow
def test_wrong_format_errors_name_the_file(tmp_path):
    _cifar10(tmp_path / "c")
    with pytest.raises(DatasetError, match=r"MNIST not found .*cifar-10-batches-py/.*train-images-idx3-ubyte"):
        load_dataset("mnist", root=tmp_path / "c")  # a CIFAR folder given as MNIST
    batch = tmp_path / "c" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:300])  # truncated pickle
    with pytest.raises(DatasetError, match=r"data_batch_2: not a CIFAR python pickle"):
        load_dataset("cifar10", root=tmp_path / "c")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    _pickle(batch, {"data": Evil(), "labels": []})  # a pickle that would run code is refused
    with pytest.raises(DatasetError, match=r"data_batch_2.*print is not allowed"):
        load_dataset("cifar10", root=tmp_path / "c")
    (tmp_path / "m").mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / "m" / stem).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte: not an unsigned-byte IDX file"):
        load_dataset("mnist", root=tmp_path / "m")
    (tmp_path / "p" / "data").mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(pa.table({"sentence": ["a"], "label": [0]}), tmp_path / "p" / "data" / f"{split}-0.parquet")
    with pytest.raises(DatasetError, match=r"train-0\.parquet: the parquet table has no column 'text'"):
        load_dataset("ag_news", root=tmp_path / "p")
    for version in ("v1", "v2"):  # two cache versions of the same split: ambiguous
        (tmp_path / "two" / version).mkdir(parents=True)
        for split in ("train", "test"):
            pq.write_table(pa.table({"text": ["a"], "label": [0]}), tmp_path / "two" / version / f"{split}.parquet")
    with pytest.raises(DatasetError, match=r"'train' tables lie in 2 folders.*set root"):
        load_dataset("ag_news", root=tmp_path / "two")
    (tmp_path / "p" / "data" / "train-0.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"train-0\.parquet: not a readable parquet table"):
        load_dataset("ag_news", root=tmp_path / "p")
    _write_csv(tmp_path / "l" / "ag_news_csv" / "train.csv", [(7, "t", "d")])
    _write_csv(tmp_path / "l" / "ag_news_csv" / "test.csv", [(1, "t", "d")])
    with pytest.raises(DatasetError, match=r"train\.csv: labels span 6\.\.6, expected 0\.\.3"):
        load_dataset("ag_news", root=tmp_path / "l")
    with pytest.raises(DatasetError, match="takes no image_size"):
        load_dataset("mnist", root=tmp_path / "m", image_size=32)
    assert cache_dir() == tmp_path / "cache"


def test_hf_model_refuses_a_tokenizer_larger_than_its_vocabulary(tmp_path, word_tokenizer):
    """An hf: family whose vocab_size cannot hold the tokenizer's ids is refused before any
    training (nothing is written); with vocab_size left out it is filled in from the tokenizer."""
    pytest.importorskip("transformers")
    from symalign.errors import ConfigError
    from symalign.experiments import parse_config, run_experiment
    from symalign.experiments.protocol import check_inputs

    raw = tmp_path / "wikitext-103-raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        (raw / f"wiki.{split}.raw").write_text(" = valkyria chronicles iii = \n\n the lobster robert boulter \n" * 40)
    cfg = {"name": "tok", "data": "wikitext103",
           "data_options": {"root": str(tmp_path), "tokenizer": str(word_tokenizer)},
           "model": {"family": "hf:gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 100},
           "train": {"steps": 1, "batch_size": 2, "context": 8},
           "protocol": {"scopes": ["all-attention"], "points": 2, "eval_items": 2}}
    with pytest.raises(ConfigError, match="vocab"):
        run_experiment(parse_config(cfg), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    del cfg["model"]["vocab_size"]
    check_inputs(parse_config(cfg))  # the tokenizer's vocabulary is filled in
