"""Sequence-to-sequence evaluation (T5): the teacher-forced objective and ``symalign interpolate`` on T5.

* the objective's loss equals Hugging Face's own ``model(input_ids, attention_mask, labels=...).loss``
  (token-weighted over batches), with the checkpoint's own tokenizer (a Unigram tokenizer trained offline,
  T5-style ``x </s>`` post-processing);
* ``symalign interpolate A B --data pairs.jsonl`` runs end to end; its endpoints are each model's own loss;
  against B' = ``symalign align`` of a planted head permutation of A, the curve is flat;
* data without ``source`` / ``target`` fields, plain text and built-in datasets are refused with one line,
  exit 2; heads without an objective are refused before any weights are loaded.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from _cli_util import run_symalign
from _tok_util import WORDS, corpus

from symalign.evaluate import EvalOptions, build_eval, evaluate_model
from symalign.families import get_adapter
from symalign.spec import apply, sample

T = pytest.importorskip("transformers")


def t5_tokenizer():
    """Unigram (SentencePiece-style) with ``<pad>`` = 0, ``</s>`` = 1 and T5's ``x </s>`` post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus(200).splitlines(), trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def t5(path, tok, seed=0):
    torch.manual_seed(seed)
    cfg = T.T5Config(vocab_size=len(tok), d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
                     num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    T.T5ForConditionalGeneration(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def pairs_file(path, n=12, seed=0):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            src = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            f.write(json.dumps({"source": f"reverse: {src}", "target": " ".join(src.split()[::-1])}) + "\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return t5_tokenizer()


def _load(path):
    from symalign.jobs.interpolate import load_hf_model

    return load_hf_model(path)


def test_objective_equals_hf_loss(tmp_path, tok):
    a = t5(tmp_path / "A", tok)
    data = pairs_file(tmp_path / "pairs.jsonl")
    model = _load(a)
    ev = build_eval(a, model, str(data), EvalOptions(batch_size=5))
    assert ev.objective == "seq2seq" and len(ev.batches) == 3 and ev.items == 12
    # HF's own loss on the same pairs, batched the same way by the tokenizer itself
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, 12, 5):
            chunk = rows[s:s + 5]
            enc = tok([r["source"] for r in chunk], padding=True, return_tensors="pt")
            lab = tok([r["target"] for r in chunk], padding=True, return_tensors="pt")["input_ids"]
            lab[lab == tok.pad_token_id] = -100
            assert lab[:, -1].eq(-100).any() or (lab[:, -1] == tok.eos_token_id).all()
            loss = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=lab).loss
            n = int((lab != -100).sum())
            total, count = total + float(loss) * n, count + n
    m = evaluate_model(model, ev)
    assert m.count == count == ev.info["tokens"]
    assert m.loss == pytest.approx(total / count, rel=1e-6)
    assert 0.0 <= m.accuracy <= 1.0 and m.perplexity is None


def _interp(monkeypatch, capsys, a, b, data, out, *extra):
    return run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", data, "--points", "3",
                        "--out", out, "--no-progress", "--json", *extra)


@pytest.mark.slow
def test_interpolate_end_to_end(tmp_path, tok, monkeypatch, capsys):
    a, c = t5(tmp_path / "A", tok, 0), t5(tmp_path / "C", tok, 1)
    data = pairs_file(tmp_path / "pairs.jsonl")
    code, out, err = _interp(monkeypatch, capsys, a, c, data, tmp_path / "o1")
    assert code == 0, err
    res = json.loads(out)
    assert res["task"] == "seq2seq" and len(res["curve"]["loss"]) == 3
    for path, loss in ((a, res["curve"]["loss"][0]), (c, res["curve"]["loss"][-1])):
        model = _load(path)
        own = evaluate_model(model, build_eval(a, model, str(data))).loss
        assert loss == pytest.approx(own, rel=1e-6)
    assert abs(res["curve"]["loss"][0] - res["curve"]["loss"][-1]) > 1e-3  # two different models
    code, out, err = _interp(monkeypatch, capsys, a, c, data, tmp_path / "o1s", "--stream")
    assert code == 0, err
    assert json.loads(out)["curve"]["loss"] == pytest.approx(res["curve"]["loss"], rel=1e-9)

    # B = a planted head permutation of A (A's function); symalign align undoes it; the curve A -> B' is flat
    model = _load(a)
    spec = get_adapter(model).spec(model)
    (tmp_path / "B").mkdir()
    moved = model.__class__(model.config)
    moved.load_state_dict(apply(spec, sample(spec, 3), model.state_dict()))
    moved.save_pretrained(tmp_path / "B")
    tok.save_pretrained(tmp_path / "B")
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, tmp_path / "B", "-o", tmp_path / "B2")
    assert code == 0, err
    code, out, err = _interp(monkeypatch, capsys, a, tmp_path / "B2", data, tmp_path / "o2")
    assert code == 0, err
    loss = json.loads(out)["curve"]["loss"]
    assert max(loss) - min(loss) <= 1e-6 * max(1.0, abs(loss[0])), loss
    # ... while the unaligned B gives a different midpoint (the test can fail)
    code, out, err = _interp(monkeypatch, capsys, a, tmp_path / "B", data, tmp_path / "o3")
    assert code == 0, err
    naive = json.loads(out)["curve"]["loss"]
    assert naive[0] == pytest.approx(loss[0], rel=1e-6) and abs(naive[1] - loss[1]) > 1e-3


@pytest.mark.parametrize("name,content,msg", [
    ("bad.jsonl", '{"text": "hello there"}\n', "no 'source' and 'target' fields (found: text)"),
    ("bad.csv", "src,tgt\nhello,there\n", "no 'source' and 'target' columns (found: src, tgt)"),
    ("plain.txt", "the king speaks\nthe queen speaks\n", "not a .jsonl or .csv file"),
    (None, "synthetic", "source/target pairs"),
])
def test_data_without_pairs_is_refused(tmp_path, tok, monkeypatch, capsys, name, content, msg):
    a = t5(tmp_path / "A", tok)
    data = content if name is None else tmp_path / name
    if name is not None:
        data.write_text(content)
    code, out, err = _interp(monkeypatch, capsys, a, a, data, tmp_path / "o")
    assert code == 2 and msg in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_csv_pairs_match_jsonl(tmp_path, tok):
    import csv

    a = t5(tmp_path / "A", tok)
    data = pairs_file(tmp_path / "pairs.jsonl")
    with open(tmp_path / "pairs.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["id", "source", "target"])
        w.writeheader()
        for i, line in enumerate(data.read_text().splitlines()):
            w.writerow({"id": i, **json.loads(line)})
    model = _load(a)
    m1 = evaluate_model(model, build_eval(a, model, str(data)))
    m2 = evaluate_model(model, build_eval(a, model, str(tmp_path / "pairs.csv")))
    assert m1 == m2


def test_headless_encoder_decoder_refused_before_loading(tmp_path, tok, monkeypatch, capsys):
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=len(tok), d_model=16, d_kv=4, d_ff=24, num_layers=1, num_heads=4)
    T.T5Model(cfg).save_pretrained(tmp_path / "A")
    (tmp_path / "A" / "model.safetensors").write_bytes(b"not weights")  # loading them would fail differently
    data = pairs_file(tmp_path / "pairs.jsonl")
    code, _, err = _interp(monkeypatch, capsys, tmp_path / "A", tmp_path / "A", data, tmp_path / "o")
    assert code == 2 and "T5Model is an encoder-decoder (sequence-to-sequence) model" in err, err
    assert len(err.strip().splitlines()) == 1
