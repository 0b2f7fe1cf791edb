"""Falcon with ``alibi=True``: heads pinned by their slopes, ``GL(d)`` on Q-K and V-O per K/V head.

All three fused layouts (multi-query ``[Q | k | v]``, ``new_decoder_architecture`` with
grouped K/V, per-head ``[q | k | v]``) on tiny random models (D=32, 4 heads, 2 layers):

* the declared spec has no head space and ``GL(d)`` per K/V head on Q-K and V-O; a random
  element of it (and of the whole-model spec: LayerNorms folded, residual ``O_1(D)``)
  leaves transformers' forward unchanged through both kernels, eager and SDPA (which
  differ with ALiBi: eager adds the bias twice), <= 1e-10 in float64;
* a head swap -- a symmetry of the same model without ALiBi -- changes the function;
* ``symalign align`` recovers a planted element in both scopes (float64: <= 1e-8, the
  weights), and its output, loaded with ``from_pretrained``, computes B's function
  (<= 1e-10 float64, <= 1e-5 float32);
* ``symalign probe --hf DIR`` measures the real layer's Jacobian nullity equal to the
  declared dimension (plus the named key-bias directions).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_families import make, plant_checkpoints
from hf_tiny import output, rel
from _cli_util import run_symalign

from symalign.families import get_adapter, prepare
from symalign.probe.heads import head_swap
from symalign.spec import apply, sample

LAYOUTS = {
    "multi-query": {},
    "new-decoder": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "per-head": {"multi_query": False, "bias": True},
}
KV = {"multi-query": 1, "new-decoder": 2, "per-head": 4}


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _loaded(model, state):
    m = copy.deepcopy(model)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    return m


def _rel_state(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_alibi_group_is_declared_and_exact(layout, attn):
    model = make("falcon", alibi=True, attn=attn, **LAYOUTS[layout])
    fam = get_adapter(model)
    att = fam.spec(model)
    kv = KV[layout]
    assert att.describe() == {f"{r}.{i}": f"GL(8)^{kv}" for i in range(2) for r in ("qk", "vo")}
    assert not att.couplings and att.dim == 2 * 2 * kv * 64
    prep = prepare(model.config, model.state_dict(), fam.spec(model.config, model.state_dict().keys()),
                   type(model).__name__)
    assert prep.spec.describe()["residual"] == "O_1(32)" and "heads.0" not in prep.spec.spaces
    x = _ids()
    y = output(model, x)
    for seed in (1, 2):
        for name, spec, state in (("attention", att, model.state_dict()), ("model", prep.spec, prep.state)):
            moved = apply(spec, sample(spec, seed), state)
            assert rel(output(_loaded(model, moved), x), y) <= 1e-10, (name, seed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_head_permutations_change_the_alibi_function(layout):
    """A head swap (two K/V groups, or two query heads of the one multi-query group), labelled by the spec of
    the same model without ALiBi, where it is a symmetry: with ALiBi it moves heads under other slopes."""
    rope = make("falcon", **LAYOUTS[layout])
    alibi = make("falcon", alibi=True, **LAYOUTS[layout])
    assert torch.equal(rope.state_dict()["transformer.h.0.self_attention.query_key_value.weight"],
                       alibi.state_dict()["transformer.h.0.self_attention.query_key_value.weight"])
    spec = get_adapter(rope).spec(rope).restrict(["heads.0"])
    swap = {"heads.0": head_swap(spec.spaces["heads.0"])}
    x = _ids()
    for model, changed in ((rope, False), (alibi, True)):
        moved = _loaded(model, apply(spec, swap, model.state_dict()))
        r = rel(output(moved, x), output(model, x))
        assert (r >= 1e-3) if changed else (r <= 1e-10), (layout, changed, r)


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow
def test_alibi_planted_recovery_cli(layout, dtype, scope, tmp_path, capsys, monkeypatch):
    """B = g . A (g a random element of the attention spec, or of the whole-model spec of A's rewrite) as
    saved checkpoints; OUT recovers A (or its rewrite) and computes B's function after ``from_pretrained``."""
    from symalign.checkpoint.hf import load_checkpoint

    a = make("falcon", dtype=torch.float64, alibi=True, **LAYOUTS[layout])
    p = plant_checkpoints(a, scope, dtype, tmp_path)
    spec, target = p.spec, p.target
    if scope == "model":
        assert "residual" in spec.spaces and not p.untied
    assert not any(spec.role(s) == "heads" for s in spec.spaces)
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    exact = 1e-8 if dtype == torch.float64 else 1e-4
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= exact
    out = load_checkpoint(tmp_path / "OUT").state
    assert _rel_state({k: target[k] for k in spec.tensors}, {k: out[k] for k in spec.tensors}) <= exact
    cls = type(a)
    o = cls.from_pretrained(tmp_path / "OUT", dtype=dtype, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=dtype, attn_implementation="eager").eval()
    assert o.config.alibi and b.config.alibi
    assert rel(output(o, _ids()), output(b, _ids())) <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow
def test_probe_hf_alibi_nullity_equals_declared(layout, tmp_path, capsys, monkeypatch):
    """``symalign probe --hf DIR`` on a checkpoint folder whose config has ``alibi=True``: the real layer's
    Jacobian nullity equals the declared ``2 h_kv d^2`` (per-head fused with biases: plus the key-bias
    directions ``h_kv d``, named)."""
    import transformers as T

    kw = dict(LAYOUTS[layout])
    if "num_kv_heads" in kw:
        kw["num_kv_heads"] = 1  # one K/V head of two query heads: the grouped layout with g = 2
    T.FalconConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32, alibi=True,
                   **kw).save_pretrained(tmp_path)
    code, stdout, err = run_symalign(monkeypatch, capsys, "probe", "--hf", tmp_path, "--json")
    assert code == 0, err
    row = json.loads(stdout)["probes"][0]
    kv = 2 if layout == "per-head" else 1
    assert row["group"] == {"qk.0": f"GL(8)^{kv}", "vo.0": f"GL(8)^{kv}"}
    assert row["declared"] == 2 * kv * 64
    assert row["undeclared"] == ({"key_bias": kv * 8} if kw.get("bias") else {})
    assert row["nullity"] == row["expected"] and row["match"] is True


@pytest.mark.slow
def test_alibi_interpolate_reads_the_aligned_model(tmp_path, capsys, monkeypatch):
    """``symalign interpolate A OUT`` after a whole-model alignment of a planted pair (grouped K/V layout,
    a vocabulary that covers the synthetic data): OUT is B in A's coordinates, so the path is flat."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint

    a = make("falcon", alibi=True, vocab_size=256, **LAYOUTS["new-decoder"])
    a.save_pretrained(tmp_path / "A")
    ck = load_checkpoint(tmp_path / "A")
    prep = prepare(ck.config, ck.state, ck.adapter.spec(ck.config, ck.state.keys()), type(a).__name__)
    write_checkpoint(tmp_path / "B", apply(prep.spec, sample(prep.spec, 7), prep.state), tmp_path / "A")
    out = tmp_path / "OUT"
    code, _, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                "--scope", "model")
    assert code == 0, err
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", out, "--data", "synthetic",
                                     "--data-option", "kind=lm", "--points", "3", "--eval-items", "8", "--context",
                                     "16", "--json", "-o", tmp_path / "lmc")  # not the repository's runs/
    assert code == 0, err
    assert abs(json.loads(stdout)["naive"]["loss_barrier"]) <= 1e-6
