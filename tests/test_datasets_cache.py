"""``--data NAME`` reads a dataset from the ``datasets`` library's local cache, offline.

The cache is laid out as ``datasets`` leaves a Hub dataset after a download
(``HF_DATASETS_CACHE/<namespace>___<name>/<config>/<version>/<hash>/`` with the
split ``.arrow`` files and ``dataset_info.json``), built here from a local JSON
file with ``datasets``' own builder; with ``HF_DATASETS_OFFLINE=1`` ``datasets``
answers the name from that folder.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from _cli_util import run_symalign  # noqa: E402
from _tok_util import TOKENIZERS, corpus, gpt2  # noqa: E402

from symalign.errors import DatasetError  # noqa: E402
from symalign.evaluate import EvalOptions, build_eval  # noqa: E402
from symalign.jobs.interpolate import load_hf_model  # noqa: E402


def _cached_dataset(tmp_path, monkeypatch, splits: dict[str, list[str]], name: str = "local/tiny_text"):
    """Put ``splits`` (a ``text`` column each) in a fresh offline ``datasets`` cache under ``name``."""
    from datasets.packaged_modules.json.json import Json

    files = {}
    for split, lines in splits.items():
        files[split] = str(tmp_path / f"{split}.jsonl")
        with open(files[split], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": s}) + "\n" for s in lines)
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name=name.split("/")[-1], hash="0123abcd",
                   data_files=files)
    builder.download_and_prepare()
    cache = tmp_path / "hf-datasets-cache"
    ns, ds_name = name.split("/")
    shutil.copytree(builder.cache_dir, cache / f"{ns}___{ds_name}" / "default" / "0.0.0" / "0123abcd")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # datasets reads both variables when it is imported: set what it read
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    return cache


@pytest.mark.slow  # ~10 s on the loaded 2-core machine (two tiny GPT-2s, a 3-point curve)
def test_dataset_name_from_offline_cache(monkeypatch, capsys, tmp_path):
    train_text = corpus(400, seed=1)
    tok = TOKENIZERS["bpe"](train_text)
    a, b = gpt2(tmp_path / "a", tok), gpt2(tmp_path / "b", tok, seed=1)
    train, test = corpus(20, seed=5).splitlines(), corpus(60, seed=6).splitlines()
    _cached_dataset(tmp_path, monkeypatch, {"train": train, "test": test})

    # the evaluated token stream is the tokenizer's own encoding of the cached test split
    ev = build_eval(a, load_hf_model(a), "local/tiny_text", EvalOptions(context=16, eval_items=1000))
    got = torch.cat([x["input_ids"] for x in ev.batches]).flatten().tolist()
    want: list[int] = []
    for i, s in enumerate(test):
        want += ([tok.eos_token_id] if i else []) + tok(s, add_special_tokens=False)["input_ids"]
    assert len(got) >= 16 and got == want[:len(want) // 16 * 16]
    ev_train = build_eval(a, load_hf_model(a), "local/tiny_text", EvalOptions(context=16, split="train"))
    first = tok(train[0], add_special_tokens=False)["input_ids"][:16]
    assert ev_train.batches[0]["input_ids"][0].tolist()[:len(first)] == first

    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "local/tiny_text",
                                  "--context", "16", "--points", "3", "--no-progress", "--json",
                                  "--out", tmp_path / "run")
    assert code == 0, err
    res = json.loads(out[out.index("{"):])
    assert res["evaluation"]["items"] == len(got) // 16
    assert (tmp_path / "run" / "results.json").is_file()


def test_name_missing_from_offline_cache_is_one_line(monkeypatch, capsys, tmp_path):
    tok = TOKENIZERS["bpe"](corpus(400, seed=1))
    a, b = gpt2(tmp_path / "a", tok), gpt2(tmp_path / "b", tok, seed=1)
    _cached_dataset(tmp_path, monkeypatch, {"test": corpus(20, seed=6).splitlines()})
    with pytest.raises(DatasetError, match="local datasets cache"):
        build_eval(a, load_hf_model(a), "local/not_cached", EvalOptions(context=16))
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "local/not_cached",
                                  "--context", "16", "--points", "2", "--no-progress", "--out", tmp_path / "run")
    assert code == 2 and "local datasets cache" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cache_read_never_asks_the_hub(monkeypatch, tmp_path):
    """Without HF_DATASETS_OFFLINE in the environment (datasets imported online), reading a cached name makes
    no Hub request: symalign sets datasets' offline flag for the call (the variable alone is read only at
    import) and restores it after."""
    import huggingface_hub

    from symalign.data.user import load_user_data

    lines = corpus(20, seed=6).splitlines()
    _cached_dataset(tmp_path, monkeypatch, {"test": lines})
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    calls: list[str] = []

    def no_hub(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise ConnectionError("no network in this test")
        return call

    for name in ("hf_hub_download", "dataset_info", "list_repo_tree"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, no_hub(name))
    data = load_user_data("local/tiny_text", None, None, None)
    assert data.texts == lines and calls == []
    assert datasets.config.HF_HUB_OFFLINE is False
