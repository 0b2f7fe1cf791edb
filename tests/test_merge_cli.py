"""``symalign merge``: aligned weighted averages written as loadable checkpoints; refusals write nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _cli_util import run_symalign  # noqa: E402
from _tok_util import TOKENIZERS, corpus  # noqa: E402
from hf_tiny import inputs, make_model, output, rel  # noqa: E402

from symalign.families import get_adapter  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402

T = transformers


@pytest.fixture(scope="module")
def tok():
    return TOKENIZERS["bpe"](corpus(300, seed=1), vocab=64 + 256)


def _save(model, path, tok=None, **kw):
    model.save_pretrained(path, **kw)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def _planted(family, tmp_path, tok=None, dtype=torch.float32, seed=0, **overrides):
    """A and B = g . A (g a random element of the adapter's group), saved with the tokenizer."""
    if tok is not None and family in ("gpt2", "bert"):
        overrides.setdefault("vocab_size", len(tok))
    a = make_model(family, dtype=dtype, seed=seed, **overrides)
    spec = get_adapter(a).spec(a)
    b = make_model(family, dtype=dtype, seed=seed, **overrides)
    b.load_state_dict(apply(spec, sample(spec, seed + 7), a.state_dict()))
    return a, b, _save(a, tmp_path / "A", tok), _save(b, tmp_path / "B", tok)


def _nothing_written(parent, name):
    return not (parent / name).exists() and not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def _load(model, path):
    return type(model).from_pretrained(str(path), dtype=model.dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("family, scope", [("gpt2", "attention"), ("bert", "attention"), ("vit", "attention"),
                                           ("llama", "attention"), ("gpt2", "model")])
@pytest.mark.slow
def test_merge_of_a_and_transformed_a_is_a(family, scope, tmp_path, monkeypatch, capsys, tok):
    a, b, da, db = _planted(family, tmp_path, tok if family == "gpt2" else None)
    x = inputs(a)
    assert rel(output(b, x), output(a, x)) <= 1e-5  # B computes A's function ...
    sa, sb = a.state_dict(), b.state_dict()
    assert max(rel(sb[k].double(), sa[k].double()) for k in sa if sa[k].dim() == 2) > 0.1  # ... with other weights
    naive = tmp_path / "naive"
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", naive, "--no-align")
    assert code == 0, err
    naive_rel = rel(output(_load(a, naive), x), output(a, x))
    out_dir = tmp_path / "M"
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", out_dir, "--scope", scope, "--json")
    assert code == 0, err
    res = json.loads(out)
    merged = _load(a, out_dir)
    assert rel(output(merged, x), output(a, x)) <= 1e-5, "merge(A, g.A) must compute A"
    assert naive_rel > 1e-2, "the naive average of A and g.A is another function (the test can fail)"
    assert res["weights"] == [0.5, 0.5] and res["aligned"][0]["distance"]["after"]["total"] <= 1e-5
    if family == "gpt2":  # the tokenizer and config travel with the weights
        assert T.AutoTokenizer.from_pretrained(str(out_dir)).get_vocab() == tok.get_vocab()
    assert _nothing_written(tmp_path, "M.align") and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_merge_of_two_copies_returns_the_model_dtype_and_shards(tmp_path, monkeypatch, capsys, tok):
    a = make_model("gpt2", dtype=torch.bfloat16, seed=3, vocab_size=len(tok), n_embd=32, n_layer=2)
    da = _save(a, tmp_path / "A", tok, max_shard_size="20KB")
    db = tmp_path / "B"
    import shutil

    shutil.copytree(da, db)
    index = json.loads((da / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    out_dir = tmp_path / "M"
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", out_dir, "--scope", "attention")
    assert code == 0, err
    got = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert got["weight_map"] == index["weight_map"]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([p.name for p in da.iterdir()] + ["symalign.json"])
    m = T.GPT2LMHeadModel.from_pretrained(str(out_dir)).eval()
    assert m.dtype == torch.bfloat16
    sa, sm = a.state_dict(), m.state_dict()
    assert all(torch.equal(sa[k], sm[k]) for k in sa)


@pytest.mark.slow
def test_merge_float32_function_and_weights(tmp_path, monkeypatch, capsys, tok):
    a, b, da, db = _planted("gpt2", tmp_path, tok, seed=1)
    c = make_model("gpt2", seed=5, vocab_size=len(tok))
    dc = _save(c, tmp_path / "C", tok)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, dc, "-o", tmp_path / "M", "--weights",
                                  "1,1,1e-12", "--json")  # weights must be positive: C all but left out
    assert code == 0, err
    x = inputs(a)
    assert rel(output(_load(a, tmp_path / "M"), x), output(a, x)) <= 1e-5
    assert json.loads(out)["weights"] == pytest.approx([0.5, 0.5, 5e-13], rel=1e-12, abs=0)


@pytest.mark.slow
def test_merge_eval_prints_losses(tmp_path, monkeypatch, capsys, tok):
    a = make_model("gpt2", seed=0, vocab_size=len(tok))
    b = make_model("gpt2", seed=1, vocab_size=len(tok))
    da, db = _save(a, tmp_path / "A", tok), _save(b, tmp_path / "B", tok)
    text = tmp_path / "t.txt"
    text.write_text(corpus(60, seed=4))
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M", "--eval", text,
                                  "--context", "16", "--json")
    assert code == 0, err
    ev = json.loads(out)["eval"]
    assert ev["objective"] == "causal-lm" and set(ev["models"]) == {str(da), str(db)}
    assert ev["merged"]["loss"] > 0 and ev["models"][str(da)]["loss"] != ev["merged"]["loss"]
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M2", "--eval", text,
                                  "--context", "16")
    assert code == 0 and "merged:" in out and str(da) in out


def _refusal_pair(kind, tmp_path, tok):
    if kind == "family":
        return (_save(make_model("gpt2", vocab_size=len(tok)), tmp_path / "A", tok),
                _save(make_model("bert"), tmp_path / "B")), "same architecture"
    if kind == "shape":
        return (_save(make_model("gpt2", vocab_size=len(tok)), tmp_path / "A", tok),
                _save(make_model("gpt2", vocab_size=len(tok), n_embd=32), tmp_path / "B", tok)), "head structure"
    other = TOKENIZERS["bpe"](corpus(300, seed=8) + "zq zq xj\n", vocab=64 + 256)
    assert len(other) == len(tok) and other.get_vocab() != tok.get_vocab()
    return (_save(make_model("gpt2", vocab_size=len(tok)), tmp_path / "A", tok),
            _save(make_model("gpt2", seed=1, vocab_size=len(tok)), tmp_path / "B", other)), "tokenizers of"


@pytest.mark.parametrize("kind", ["family", "shape", "vocabulary"])
def test_refusals_one_line_nothing_written(kind, tmp_path, monkeypatch, capsys, tok):
    (da, db), msg = _refusal_pair(kind, tmp_path, tok)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and msg in lines[0] and "Traceback" not in err, err
    assert _nothing_written(tmp_path, "M")


def test_bad_arguments(tmp_path, monkeypatch, capsys, tok):
    a, b, da, db = _planted("gpt2", tmp_path, tok)
    for args, msg in ((["--weights", "1,2,3"], "3 values for 2 models"), (["--weights", "-1,2"], "positive"),
                      (["--scope", "heads"], "unknown scope"), (["--eval", tmp_path / "missing.txt"], "missing.txt")):
        code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M", *args)
        assert code == 2 and msg in err and "Traceback" not in err, err
        assert _nothing_written(tmp_path, "M")
    (tmp_path / "M").mkdir()
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M")
    assert code == 2 and "--force" in err and os.listdir(tmp_path / "M") == []


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.slow
def test_universe_merge_of_transformed_copies_is_a(family, tmp_path, monkeypatch, capsys, tok):
    a, b, da, db = _planted(family, tmp_path, tok if family == "gpt2" else None)
    spec = get_adapter(a).spec(a)
    c = make_model(family, seed=0, **({"vocab_size": len(tok)} if family == "gpt2" else {}))
    c.load_state_dict(apply(spec, sample(spec, 99), a.state_dict()))
    dc = _save(c, tmp_path / "C", tok if family == "gpt2" else None)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, dc, "-o", tmp_path / "M", "--universe",
                                  "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["scope"] == "model" and len(res["universe"]["spread"]) == 3 and res["universe"]["spread"][-1] <= 1e-8
    x = inputs(a)
    assert rel(output(_load(a, tmp_path / "M"), x), output(a, x)) <= 1e-5
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M2", "--universe",
                                  "--scope", "attention")
    assert code == 2 and "--universe" in err and _nothing_written(tmp_path, "M2")


@pytest.mark.slow
def test_failed_alignment_writes_nothing_and_keeps_old_out(tmp_path, monkeypatch, capsys, tok):
    """If an aligned model would not compute its input's function, the merge stops: no OUT, no scratch
    folders, and an existing OUT survives a --force run."""
    a, b, da, db = _planted("gpt2", tmp_path, tok)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M")
    assert code == 0, err
    before = (tmp_path / "M" / "model.safetensors").read_bytes()
    monkeypatch.setattr("symalign.arch.check.output_change", lambda *a, **k: (0.5, 0.5))
    for target, extra in (("M2", []), ("M", ["--force"])):
        code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / target, *extra)
        assert code == 2 and "refusing to write" in err, err
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not (tmp_path / "M2").exists()
    assert (tmp_path / "M" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("family, scope, why", [("gpt2", "model", "whole-model alignment"),
                                                ("bert", "model", "whole-model alignment")])
def test_merge_aligns_the_whole_model_by_default_and_says_so(family, scope, why, tmp_path, monkeypatch, capsys,
                                                             tok):
    """No --scope: the whole model where the family supports it (here in memory), named in the output; the merge of
    A and g.A is still A's function."""
    a, b, da, db = _planted(family, tmp_path, tok if family == "gpt2" else None)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M")
    assert code == 0, err
    assert f"aligned: {scope}" in out and f"scope: {scope} (" in out and why in out
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "J", "--json")
    res = json.loads(out)
    assert res["scope"] == scope and why in res["scope_default"]
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "K", "--json", "--scope",
                                  "attention")
    assert json.loads(out)["scope"] == "attention" and json.loads(out)["scope_default"] is None
    merged = type(a).from_pretrained(str(tmp_path / "M"), attn_implementation="eager").eval()
    x = inputs(a)
    assert rel(output(merged, x), output(a, x)) <= 1e-5


def test_default_scope_is_attention_where_the_family_has_no_streamed_model_scope(tmp_path):
    """A family declaring no streamed model scope (T5); a bare encoder (``BertModel``, no residual space) streams
    its layers' FF units and attention."""
    from symalign.commands.merge import default_scope
    from symalign.families import FAMILIES

    family = next(f.model_types[0] for f in FAMILIES if f.tiny is not None and "model" not in f.scopes.stream)
    make_model(family, dtype=torch.float32, seed=0).save_pretrained(tmp_path / "A")
    assert default_scope(tmp_path / "A", streamed=False)[0] == "model"
    scope, why = default_scope(tmp_path / "A", streamed=True)
    assert scope == "attention" and "in memory" in why
    make_model("bert", dtype=torch.float32, seed=0).save_pretrained(tmp_path / "E")
    assert default_scope(tmp_path / "E", streamed=False)[0] == "model"
    assert default_scope(tmp_path / "E", streamed=True)[0] == "model"
