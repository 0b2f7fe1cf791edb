"""Evaluation with the checkpoint's own tokenizer, image processor and objective, on the user's data."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _cli_util import run_symalign  # noqa: E402
from _tok_util import TOKENIZERS, bert, corpus, gpt2, image_folder, vit  # noqa: E402

from symalign import lmc  # noqa: E402
from symalign.evaluate import EvalOptions, build_eval, eval_curve, evaluate_model  # noqa: E402
from symalign.jobs.interpolate import load_hf_model  # noqa: E402

T = transformers


def _text_file(tmp_path, n_lines=120, seed=0):
    p = tmp_path / "corpus.txt"
    p.write_text(corpus(n_lines, seed), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def train_text():
    return corpus(400, seed=1)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_stream_is_the_tokenizers_own_encoding(kind, tmp_path, train_text):
    tok = TOKENIZERS[kind](train_text)
    d = gpt2(tmp_path / "a", tok)
    text_file = _text_file(tmp_path)
    text = text_file.read_text(encoding="utf-8")
    model = load_hf_model(d)
    ev = build_eval(d, model, str(text_file), EvalOptions(context=32, eval_items=10_000, batch_size=4))
    got = torch.cat([b["input_ids"] for b in ev.batches]).flatten().tolist()
    enc = T.AutoTokenizer.from_pretrained(str(d))(text, add_special_tokens=False, return_offsets_mapping=True)
    want = enc["input_ids"]
    n = len(want) // 32
    assert ev.objective == "causal-lm" and n >= 3
    assert got == want[:n * 32]
    # bytes predicted: from the end of each window's first token to the end of its last token
    offs = enc["offset_mapping"]
    byte_end = [len(text[:e].encode("utf-8")) for _, e in offs]
    assert ev.n_bytes == sum(byte_end[w * 32 + 31] - byte_end[w * 32] for w in range(n))


def test_causal_loss_at_t0_is_the_models_own(tmp_path, train_text):
    tok = TOKENIZERS["bpe"](train_text)
    a, b = gpt2(tmp_path / "a", tok, seed=0), gpt2(tmp_path / "b", tok, seed=1)
    text_file = _text_file(tmp_path)
    ids = T.AutoTokenizer.from_pretrained(str(a))(text_file.read_text(), add_special_tokens=False)["input_ids"]
    n = len(ids) // 32
    windows = torch.tensor(ids[:n * 32]).view(n, 32)
    model = load_hf_model(a)
    ev = build_eval(a, model, str(text_file), EvalOptions(context=32, eval_items=10_000, batch_size=3))
    curve, metrics = eval_curve(model, lmc.full_state(model), lmc.full_state(load_hf_model(b)), ev, points=3)
    for d, t in ((a, 0), (b, -1)):
        with torch.no_grad():  # HF's own shift and mean, all windows in one batch
            own = T.GPT2LMHeadModel.from_pretrained(str(d)).eval()(input_ids=windows, labels=windows).loss.item()
        assert metrics[t].loss == pytest.approx(own, rel=1e-6)
        assert metrics[t].perplexity == pytest.approx(torch.tensor(own).exp().item(), rel=1e-5)
        assert metrics[t].loss_per_byte == pytest.approx(metrics[t].loss * metrics[t].count / ev.n_bytes, rel=1e-12)


@pytest.mark.slow
def test_interpolate_cli_text_file_loss_and_plot(monkeypatch, capsys, tmp_path, train_text):
    tok = TOKENIZERS["bpe"](train_text)
    a, b = gpt2(tmp_path / "a", tok, seed=0), gpt2(tmp_path / "b", tok, seed=1)
    text_file = _text_file(tmp_path)
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", text_file, "--context", "32",
                                  "--points", "3", "--baseline", b, "--out", tmp_path / "o", "--json")
    assert code == 0, err
    res = json.loads(out)
    ids = T.AutoTokenizer.from_pretrained(str(a))(text_file.read_text(), add_special_tokens=False)["input_ids"]
    n = len(ids) // 32
    windows = torch.tensor(ids[:n * 32]).view(n, 32)
    with torch.no_grad():
        own = T.GPT2LMHeadModel.from_pretrained(str(a)).eval()(input_ids=windows, labels=windows).loss.item()
    assert res["task"] == "causal-lm" and res["points"][0]["loss"] == pytest.approx(own, rel=1e-6)
    assert res["naive"]["loss"] == res["curve"]["loss"]  # baseline B == B: the same batches
    assert "t=" in err  # the progress bar on stderr
    assert (tmp_path / "o" / "curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "o" / "results.json").read_text())["curve"] == res["curve"]


def test_masked_lm_masks_are_fixed_and_loss_is_the_models_own(tmp_path, train_text):
    tok = TOKENIZERS["wordpiece"](train_text)
    a, b = bert(tmp_path / "a", tok, seed=0), bert(tmp_path / "b", tok, seed=1)
    model = load_hf_model(a)
    ev = build_eval(a, model, str(_text_file(tmp_path)), EvalOptions(context=24, eval_items=12, batch_size=5))
    assert ev.objective == "masked-lm"
    ids = torch.cat([x["input_ids"] for x in ev.batches])
    labels = torch.cat([x["labels"] for x in ev.batches])
    assert (ids[:, 0] == tok.cls_token_id).all() and (ids[:, -1] == tok.sep_token_id).all()
    masked = labels != -100
    assert not masked[:, 0].any() and not masked[:, -1].any()
    assert masked.sum(1).eq(round(0.15 * 22)).all()
    assert (ids[masked] == tok.mask_token_id).float().mean() > 0.5
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    curve, metrics = eval_curve(model, lmc.full_state(model), lmc.full_state(load_hf_model(b)), ev, points=4)
    hook.remove()
    per_point = [torch.cat(seen[i * len(ev.batches):(i + 1) * len(ev.batches)]) for i in range(4)]
    assert all(torch.equal(p, per_point[0]) for p in per_point) and torch.equal(per_point[0], ids)
    with torch.no_grad():
        own = T.BertForMaskedLM.from_pretrained(str(a)).eval()(input_ids=ids, labels=labels).loss.item()
    assert metrics[0].loss == pytest.approx(own, rel=1e-6)
    # the same seed gives the same masks when built again; another seed others
    again = build_eval(a, model, str(tmp_path / "corpus.txt"), EvalOptions(context=24, eval_items=12, batch_size=5))
    assert torch.equal(torch.cat([x["input_ids"] for x in again.batches]), ids)
    other = build_eval(a, model, str(tmp_path / "corpus.txt"),
                       EvalOptions(context=24, eval_items=12, batch_size=5, mask_seed=1))
    assert not torch.equal(torch.cat([x["labels"] for x in other.batches]), labels)


def test_unigram_masked_lm(tmp_path, train_text):
    tok = TOKENIZERS["unigram"](train_text)
    a = bert(tmp_path / "a", tok)
    ev = build_eval(a, load_hf_model(a), str(_text_file(tmp_path)), EvalOptions(context=16, eval_items=4))
    labels = torch.cat([x["labels"] for x in ev.batches])
    assert ev.objective == "masked-lm" and (labels != -100).sum(1).eq(round(0.15 * 16)).all()


def test_jsonl_sequence_classification(tmp_path, train_text):
    tok = TOKENIZERS["wordpiece"](train_text)
    a = bert(tmp_path / "a", tok, head="cls", num_labels=2)
    lines = corpus(30, seed=3).splitlines()
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(json.dumps({"body": s, "label": ["neg", "pos"][i % 2]}) for i, s in enumerate(lines)))
    model = load_hf_model(a)
    ev = build_eval(a, model, str(f), EvalOptions(text_field="body", batch_size=8))
    assert ev.objective == "sequence-classification" and ev.items == 30
    enc = T.AutoTokenizer.from_pretrained(str(a))(lines, padding=True, return_tensors="pt")
    y = torch.tensor([i % 2 for i in range(30)])
    with torch.no_grad():
        own = T.BertForSequenceClassification.from_pretrained(str(a)).eval()(**enc, labels=y).loss.item()
    assert evaluate_model(model, ev).loss == pytest.approx(own, rel=1e-6)


def test_image_folder_classification(tmp_path):
    a = vit(tmp_path / "a", num_labels=3)
    root = image_folder(tmp_path / "imgs")
    model = load_hf_model(a)
    ev = build_eval(a, model, str(root), EvalOptions(batch_size=5))
    assert ev.objective == "image-classification" and ev.items == 12
    from PIL import Image

    images = [Image.open(root / c / f"{i}.png").convert("RGB") for c in ("cat", "dog", "fox") for i in range(4)]
    px = T.ViTImageProcessor.from_pretrained(str(a))(images=images, return_tensors="pt")["pixel_values"]
    y = torch.arange(3).repeat_interleave(4)
    with torch.no_grad():
        own = T.ViTForImageClassification.from_pretrained(str(a)).eval()(pixel_values=px, labels=y).loss.item()
    assert evaluate_model(model, ev).loss == pytest.approx(own, rel=1e-6)


def test_saved_dataset_split_and_field(tmp_path, train_text):
    datasets = pytest.importorskip("datasets")
    tok = TOKENIZERS["bpe"](train_text)
    a = gpt2(tmp_path / "a", tok)
    train, test = corpus(20, seed=5).splitlines(), corpus(60, seed=6).splitlines()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": train}),
                          "test": datasets.Dataset.from_dict({"body": test})}).save_to_disk(str(tmp_path / "ds"))
    model = load_hf_model(a)
    ev = build_eval(a, model, str(tmp_path / "ds"), EvalOptions(text_field="body", context=16, eval_items=1000))
    got = torch.cat([x["input_ids"] for x in ev.batches]).flatten().tolist()
    want: list[int] = []
    for i, s in enumerate(test):
        want += ([tok.eos_token_id] if i else []) + tok(s, add_special_tokens=False)["input_ids"]
    assert got == want[:len(want) // 16 * 16]
    ev_train = build_eval(a, model, str(tmp_path / "ds"), EvalOptions(text_field="body", context=16, split="train"))
    first = tok(train[0], add_special_tokens=False)["input_ids"][:16]
    assert ev_train.batches[0]["input_ids"][0].tolist()[:len(first)] == first


def test_missing_tokenizer_refused_unless_given(monkeypatch, capsys, tmp_path, train_text):
    tok = TOKENIZERS["bpe"](train_text)
    a, b = gpt2(tmp_path / "a", tok), gpt2(tmp_path / "b", tok, seed=1)
    for f in a.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    text = _text_file(tmp_path)
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", text, "--out", tmp_path / "o")
    assert code == 2 and "has no tokenizer files" in err and "--tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", text, "--tokenizer", b,
                                  "--context", "32", "--points", "2", "--out", tmp_path / "o", "--no-progress")
    assert code == 0, err


def test_different_vocabularies_refused(monkeypatch, capsys, tmp_path, train_text):
    a = gpt2(tmp_path / "a", TOKENIZERS["bpe"](train_text, vocab=300))
    b = gpt2(tmp_path / "b", TOKENIZERS["bpe"](corpus(400, seed=9) + "zzz qqq xxx\n", vocab=300))
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", _text_file(tmp_path),
                                  "--out", tmp_path / "o")
    assert code == 2 and "tokenizers of" in err and "differ" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def _bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    image_folder(tmp_path / "oneclass", classes=("cat",))
    (tmp_path / "short.txt").write_text("The king.\n")
    return {"empty": ("empty.txt", "is empty"), "binary": ("binary.txt", "binary file"),
            "jsonl": ("nofield.jsonl", "nofield.jsonl:2: no field 'text'"),
            "oneclass": ("oneclass", "one class only"), "short": ("short.txt", "fewer than one window")}


@pytest.mark.parametrize("case", ["empty", "binary", "jsonl", "oneclass", "short"])
def test_bad_input_one_line_exit_2(case, monkeypatch, capsys, tmp_path, train_text):
    cases = _bad_inputs(tmp_path)
    name, msg = cases[case]
    if case == "oneclass":
        a, b = vit(tmp_path / "a", num_labels=2), vit(tmp_path / "b", seed=1, num_labels=2)
    else:
        tok = TOKENIZERS["bpe"](train_text)
        a, b = gpt2(tmp_path / "a", tok), gpt2(tmp_path / "b", tok, seed=1)
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", tmp_path / name,
                                  "--context", "32", "--out", tmp_path / "o")
    lines = [ln for ln in err.splitlines() if ln.startswith("symalign: error")]
    assert code == 2 and len(lines) == 1 and msg in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_saved_image_dataset_and_eval_tokens(tmp_path, train_text):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    root = image_folder(tmp_path / "imgs", classes=("a", "b", "c"), per_class=2)
    files = sorted(root.rglob("*.png"))
    ds = datasets.Dataset.from_dict({"image": [Image.open(f) for f in files],
                                     "label": [["a", "b", "c"].index(f.parent.name) for f in files]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.ClassLabel(names=["a", "b", "c"])}))
    ds.save_to_disk(str(tmp_path / "ds"))
    a = vit(tmp_path / "a", num_labels=3)
    ev_disk = build_eval(a, load_hf_model(a), str(tmp_path / "ds"), EvalOptions())
    ev_dir = build_eval(a, load_hf_model(a), str(root), EvalOptions())
    assert ev_disk.items == 6
    assert torch.equal(torch.cat([b["labels"] for b in ev_disk.batches]),
                       torch.cat([b["labels"] for b in ev_dir.batches]))
    assert torch.allclose(torch.cat([b["pixel_values"] for b in ev_disk.batches]),
                          torch.cat([b["pixel_values"] for b in ev_dir.batches]))
    tok = TOKENIZERS["bpe"](train_text)
    g = gpt2(tmp_path / "g", tok)
    ev = build_eval(g, load_hf_model(g), str(_text_file(tmp_path)), EvalOptions(context=16, eval_tokens=100))
    assert ev.items == 100 // 16 and ev.info["tokens"] == 6 * 15


@pytest.mark.slow
def test_interpolate_scope_model_after_whole_model_align(monkeypatch, capsys, tmp_path, train_text):
    """B aligned with --scope model (folded norms, untied head): refused with the hint as it is, and with
    --scope model both ends are rewritten exactly: A -> align(g.A) is flat, A -> g.A is not."""
    from hf_tiny import make_model

    from symalign.families import get_adapter
    from symalign.spec import apply, sample

    tok = TOKENIZERS["bpe"](train_text)
    a = make_model("gpt2", dtype=torch.float32, seed=0, vocab_size=len(tok))
    spec = get_adapter(a).spec(a)
    b = make_model("gpt2", dtype=torch.float32, seed=0, vocab_size=len(tok))
    b.load_state_dict(apply(spec, sample(spec, 3), a.state_dict()))
    for m, name in ((a, "A"), (b, "B")):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    code, out, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                  tmp_path / "B2", "--scope", "model")
    assert code == 0, err
    text = _text_file(tmp_path)
    args = ["--data", text, "--context", "16", "--points", "3", "--no-progress", "--json"]
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", tmp_path / "B2", *args,
                                  "--out", tmp_path / "o1")
    # B2 is marked folded (symalign.json), so interpolate folds A itself: the aligned path, flat here
    assert code == 0, err
    auto = json.loads(out)
    assert auto["a_folded"] is True and auto["rewrite"] == "model"
    assert max(auto["curve"]["loss"]) - min(auto["curve"]["loss"]) <= 1e-5 * auto["curve"]["loss"][0]
    (tmp_path / "B2" / "symalign.json").unlink()  # an unmarked folded checkpoint: refused with the hint
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", tmp_path / "B2", *args,
                                  "--out", tmp_path / "o3")
    assert code == 2 and "--scope model" in err and not (tmp_path / "o3").exists()
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", tmp_path / "B2", *args,
                                  "--scope", "model", "--baseline", tmp_path / "B", "--out", tmp_path / "o2")
    assert code == 0, err
    res = json.loads(out)
    loss = res["curve"]["loss"]
    assert max(loss) - min(loss) <= 1e-5 * loss[0]  # every point computes A's function
    assert abs(res["naive"]["loss"][1] - loss[1]) > 1e-3 * loss[1]  # the naive midpoint is another function
    assert res["naive"]["loss"][0] == pytest.approx(loss[0], rel=1e-5)  # rewritten A: A's loss


def test_byte_level_tokenizer(tmp_path):
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=256, n_positions=32)).save_pretrained(
        tmp_path / "a")
    text_file = _text_file(tmp_path, n_lines=20)
    model = load_hf_model(tmp_path / "a")
    ev = build_eval(tmp_path / "a", model, str(text_file), EvalOptions(tokenizer="bytes", eval_items=1000))
    data = text_file.read_bytes()
    got = torch.cat([b["input_ids"] for b in ev.batches]).flatten().tolist()
    assert ev.info["context"] == 32 and got == list(data[:len(data) // 32 * 32])
    assert ev.n_bytes == len(got) // 32 * 31  # every predicted token is one byte
