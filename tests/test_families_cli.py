"""``symalign align`` on the families of :mod:`symalign.families`, both scopes, through saved checkpoints.

Planted pairs: B = g . A for a random element g of the declared group (attention spec,
or the whole-model spec of A's exact rewrite). The aligned OUT must recover A's
weights (<= 1e-8 relative, float64; the exact head permutations), load with
``from_pretrained`` and compute B's function through the model's own forward
(<= the family's precision floor in float64 -- transformers normalises RMSNorm in
float32 --, <= 1e-5 in float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_families import FAMILIES, make
from hf_tiny import output, rel
from _cli_util import run_symalign

from symalign.families import get_adapter
from symalign.families import prepare
from symalign.spec import apply, sample


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _rel_state(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


def _planted(family, scope, dtype, tmp_path):
    a = make(family, dtype=torch.float64, seed=0)
    (tmp_path / "A").mkdir()
    a.to(dtype).save_pretrained(tmp_path / "A")
    disk = _load(tmp_path / "A")  # the names as saved (e.g. GPT-NeoX's embed_out)
    fam = get_adapter(a.config)
    spec = fam.spec(a.config, disk.keys())
    target = disk
    if scope == "model":
        prep = prepare(a.config, disk, spec, type(a).__name__)
        spec, target = prep.spec, prep.state
    t = sample(spec, 7)
    b_state = apply(spec, t, target)
    b = make(family, dtype=dtype, seed=0)
    (tmp_path / "B").mkdir()
    b.save_pretrained(tmp_path / "B")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in b_state.items()}, str(tmp_path / "B" / "model.safetensors"),
              metadata={"format": "pt"})
    return fam, target, t


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_planted_recovery_cli(family, scope, tmp_path, capsys, monkeypatch):
    fam, target, t = _planted(family, scope, torch.float64, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["before"]["total"] > 0.1
    assert info["distance"]["after"]["total"] <= 1e-8
    assert _rel_state(target, _load(out)) <= 1e-8
    perms = [lay["permutation"] for lay in info["match"]["layers"]] if scope == "attention" else None
    if perms:  # the recovered head permutation inverts the planted one exactly
        assert perms[0] == torch.argsort(t["heads.0"]).tolist()
    cls = type(make(family))
    o = cls.from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    assert rel(output(o, _ids()), output(b, _ids())) <= max(1e-10, fam.precision_floor)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_float32_pair_stays_exact(family, tmp_path, capsys, monkeypatch):
    _planted(family, "model", torch.float32, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", "model", "--json")
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    cls = type(make(family))
    o = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=torch.float32, attn_implementation="eager").eval()
    assert rel(output(o, _ids()), output(b, _ids())) <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit", "roformer", "modernbert"])
@pytest.mark.slow
def test_older_families_planted_recovery_float64(family, tmp_path, capsys, monkeypatch):
    """GPT-2 and the encoders as hf_tiny builds them (BERT, RoFormer: bare), attention scope, float64."""
    from hf_tiny import inputs, make_model

    a = make_model(family, dtype=torch.float64, seed=0)
    spec = get_adapter(a).spec(a)
    t = sample(spec, 7)
    b = make_model(family, dtype=torch.float64, seed=0)
    b.load_state_dict(apply(spec, t, a.state_dict()))
    a.save_pretrained(tmp_path / "A")
    b.save_pretrained(tmp_path / "B")
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= 1e-8
    assert [lay["permutation"] for lay in info["match"]["layers"]][0] == torch.argsort(t["heads.0"]).tolist()
    o = type(b).from_pretrained(tmp_path / "OUT", dtype=torch.float64, attn_implementation="eager").eval()
    sa, so = a.state_dict(), o.state_dict()
    assert _rel_state({k: sa[k] for k in spec.tensors}, {k: so[k] for k in spec.tensors}) <= 1e-8
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= max(1e-10, get_adapter(b).precision_floor)


OLDER = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "vit": "ViTForImageClassification",
         "roformer": "RoFormerForMaskedLM", "modernbert": "ModernBertForMaskedLM"}


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", list(OLDER))
@pytest.mark.slow
def test_gpt2_and_encoders_planted_both_scopes(family, dtype, scope, tmp_path, capsys, monkeypatch):
    """GPT-2 and the encoders (tiny configs of tests/hf_tiny.py, with a head that reads the stream): B = g . A
    (g in the attention spec, or in the whole-model spec of A's rewrite) as saved checkpoints; OUT recovers
    A's weights and, loaded with ``from_pretrained``, computes B's function through the model's own forward
    (float64: <= 1e-10, or the family's floor; float32: <= 1e-5). GPT-2 with an untied head, so that A and B
    share the layout (a tied A and an independent B: tests/test_whole_hf.py)."""
    from hf_tiny import T, config, inputs, randomize

    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint

    cls = getattr(T, OLDER[family])
    kw = {"tie_word_embeddings": False} if family == "gpt2" else {}
    a = cls._from_config(config(family, **kw), attn_implementation="eager").to(torch.float64)
    randomize(a, 0)
    a.to(dtype).save_pretrained(tmp_path / "A")
    ck = load_checkpoint(tmp_path / "A")
    spec, target = ck.adapter.spec(ck.config, ck.state.keys()), ck.state
    if scope == "model":
        prep = prepare(ck.config, ck.state, spec)
        spec, target = prep.spec, prep.state
        assert "residual" in spec.spaces and not prep.untied
    t = sample(spec, 7)
    b_state = {k: v.to(dtype) for k, v in apply(spec, t, target).items()}
    write_checkpoint(tmp_path / "B", b_state, tmp_path / "A")
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    exact = 1e-8 if dtype == torch.float64 else 1e-4
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= exact
    assert _rel_state({k: target[k] for k in spec.tensors}, {k: v for k, v in _load(tmp_path / "OUT").items()
                                                             if k in spec.tensors}) <= exact
    if scope == "attention":
        assert info["match"]["layers"][0]["permutation"] == torch.argsort(t["heads.0"]).tolist()
    o = cls.from_pretrained(tmp_path / "OUT", dtype=dtype, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=dtype, attn_implementation="eager").eval()
    x = inputs(b)
    floor = get_adapter(b).precision_floor
    assert rel(output(o, x), output(b, x)) <= (max(1e-10, floor) if dtype == torch.float64 else max(1e-5, floor))
