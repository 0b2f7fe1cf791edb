"""``--scope model`` on the encoder families (ViT: ``O_1(D)``; BERT, RoFormer, ModernBERT: ``S_D``) goes through the
one whole-model loop, :class:`symalign.stream.model.StreamedWhole`, in memory (resident sources) and with
``--stream`` (lazy sources): the same distances and the same tensors bit for bit, OUT computes B's function
through transformers' own forward, a planted element is recovered, and the loop's distances are those of the
reference loop :func:`symalign.match.whole.match_whole` on the float64 copies of the folded models.

An MLM transform (BERT, RoFormer, ModernBERT's ``head.dense``) writes into the embedding's coordinates: the residual
acts on both of its axes (``O W O^T``), which the loop keeps out of its linear distance formula
(:meth:`~symalign.stream.model.StreamedWhole.twice_distance`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import T, config, inputs, randomize, rel
from test_stream import _state

# family, model class, config overrides, residual group (float64 function floor: ModernBERT's rotary in float32)
CASES = [
    ("vit", "ViTForImageClassification", {}, "O_1(16)"),
    ("bert", "BertForMaskedLM", {}, "S_16"),
    ("roformer", "RoFormerForMaskedLM", {"embedding_size": 16}, "S_32"),
    ("modernbert", "ModernBertForMaskedLM", {"tie_word_embeddings": False, "norm_bias": True}, "S_32"),
]
IDS = [f"{f}-{c}" + "".join(f"-{k}={v}" for k, v in kw.items()) for f, c, kw, _ in CASES]
FLOOR = {"modernbert": 1e-6}


def _model(family: str, cls: str, seed: int, dtype=torch.float64, **kw):
    m = getattr(T, cls)._from_config(config(family, **kw), attn_implementation="eager").to(torch.float64)
    randomize(m, seed)
    return m.to(dtype).eval()


def _pair(tmp: Path, family: str, cls: str, dtype=torch.float64, shard: str | None = "20KB", **kw):
    for seed, name in ((0, "A"), (1, "B")):
        m = _model(family, cls, seed, dtype, **kw)
        m.save_pretrained(tmp / name, **({"max_shard_size": shard} if shard else {}))
    return tmp / "A", tmp / "B"


def _planted(tmp: Path, family: str, cls: str, **kw):
    """``A`` and ``B = g . prepare(A)`` (``g`` a random element of the whole-model group): A's folded state."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint
    from symalign.families import prepare
    from symalign.spec import apply, sample

    _model(family, cls, 0, **kw).save_pretrained(tmp / "A", max_shard_size="20KB")
    ck = load_checkpoint(tmp / "A")
    pa = prepare(ck.config, ck.state, ck.adapter.spec(ck.config, ck.state.keys()))
    write_checkpoint(tmp / "B", apply(pa.spec, sample(pa.spec, 11), pa.state), tmp / "A")
    return tmp / "A", tmp / "B", pa


def _same(x: dict, y: dict) -> None:
    assert set(x) == set(y)
    bad = [k for k in y if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    assert not bad, bad[:3]


def _function_change(family: str, b_dir: Path, out: Path, dtype=torch.float64) -> float:
    """``||f_OUT - f_B|| / ||f_B||``, both loaded by ``from_pretrained`` with the Auto class and run by
    transformers' forward."""
    auto = T.AutoModelForImageClassification if family == "vit" else T.AutoModelForMaskedLM
    b = auto.from_pretrained(b_dir, dtype=dtype, attn_implementation="eager").eval()
    o = auto.from_pretrained(out, dtype=dtype, attn_implementation="eager").eval()
    x = inputs(b)
    with torch.no_grad():
        y0, y1 = b(**x).logits.double(), o(**x).logits.double()
    return rel(y1, y0)


@pytest.mark.parametrize("family,cls,kw,group", CASES, ids=IDS)
@pytest.mark.slow
def test_encoder_model_scope_in_memory_equals_streamed(family, cls, kw, group, tmp_path):
    """A random float64 pair, sharded: in memory and ``--stream`` are the same passes (the same distances, every
    tensor bit for bit); each streamed layer passes its check and OUT computes B's function."""
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, family, cls, **kw)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=3)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=3)
    assert (s.path, m.path) == ("streamed", "in-memory")
    assert s.group["spaces"]["residual"] == m.group["spaces"]["residual"] == group
    ds, dm = s.match["distances"], m.match["distances"]
    assert ds == dm and ds[-1] < ds[0]
    assert s.distance["before"] == m.distance["before"]
    assert abs(s.distance["after"]["total"] - m.distance["after"]["total"]) <= 1e-9 * m.distance["after"]["total"]
    assert s.check.to_dict()["passed"] and m.check.to_dict()["passed"]
    _same(_state(tmp_path / "S"), _state(tmp_path / "M"))
    assert _function_change(family, db, tmp_path / "S") <= FLOOR.get(family, 1e-10)


@pytest.mark.parametrize("family,cls,kw,group", CASES, ids=IDS)
@pytest.mark.slow
def test_encoder_resident_loop_equals_match_whole(family, cls, kw, group, tmp_path):
    """The resident loop's distances are those of :func:`~symalign.match.whole.match_whole` on float64 copies of the
    folded models (the reference loop): the same sweeps, the same squared distance after each (to rounding)."""
    from symalign.commands.align import run_align
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.families import prepare
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole

    da, db = _pair(tmp_path, family, cls, shard=None, **kw)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=4)
    pa, pb = (prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys()))
              for c in (load_checkpoint(da), load_checkpoint(db)))
    ref = match_whole(pa.spec, pa.state, pb.state, spec_b=pb.spec, max_sweeps=4, **CHECKPOINT_SETTINGS)
    dm, dr = m.match["distances"], ref.to_dict()["distances"]
    assert len(dm) == len(dr) and all(abs(x - y) <= 1e-10 * dr[0] for x, y in zip(dm, dr)), (dm, dr)


@pytest.mark.parametrize("family,cls,kw,group", CASES, ids=IDS)
@pytest.mark.slow
def test_encoder_planted_recovery_in_memory_and_streamed(family, cls, kw, group, tmp_path):
    """``B = g . prepare(A)``: in memory and streamed both return A's folded state (to 1e-8), bit for bit alike."""
    from symalign.commands.align import run_align

    da, db, pa = _planted(tmp_path, family, cls, **kw)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True)
    assert m.distance["before"]["total"] > 0.1 and m.distance["after"]["total"] <= 1e-8
    out = _state(tmp_path / "M")
    num = sum(float((pa.state[k].double() - out[k].double()).pow(2).sum()) for k in pa.spec.tensors)
    den = sum(float(pa.state[k].double().pow(2).sum()) for k in pa.spec.tensors)
    assert (num / den) ** 0.5 <= 1e-8
    assert s.check.to_dict()["passed"]
    _same(_state(tmp_path / "S"), out)


@pytest.mark.slow
def test_encoder_float32_single_file_equals_in_memory(tmp_path):
    """float32, one file: OUT stays float32, in memory and streamed alike bit for bit, B's function to 1e-5."""
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, "bert", "BertForMaskedLM", dtype=torch.float32, shard=None)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=2)
    run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=2)
    out = _state(tmp_path / "S")
    assert s.check.to_dict()["passed"] and all(v.dtype == torch.float32 for v in out.values() if v.is_floating_point())
    _same(out, _state(tmp_path / "M"))
    assert _function_change("bert", db, tmp_path / "S", torch.float32) <= 1e-5


@pytest.mark.slow
def test_encoder_big_tensor_path_equals_in_memory(monkeypatch, tmp_path):
    """ViT (LayerNorms folded into their readers, a patch convolution and a CLS token on the stream): every weight
    folded on its own and the globals in row chunks, streamed, against the in-memory run."""
    import symalign.stream.model as sm
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, "vit", "ViTForImageClassification", shard=None)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=2)
    monkeypatch.setattr(sm, "SMALL_ELEMENTS", 200)
    monkeypatch.setattr(sm, "CHUNK_ELEMENTS", 100)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=2)
    assert all(abs(x - y) <= 1e-11 * m.match["distances"][0] for x, y in zip(s.match["distances"],
                                                                              m.match["distances"]))
    x, y = _state(tmp_path / "S"), _state(tmp_path / "M")
    scale = max(float(v.double().abs().max()) for v in y.values() if v.numel())
    assert max(float((x[k].double() - y[k].double()).abs().max()) for k in y if y[k].numel()) <= 1e-10 * scale


@pytest.mark.parametrize("family,cls", [("bert", "BertForMaskedLM"), ("vit", "ViTForImageClassification")])
def test_encoder_merge_streamed_equals_in_memory(family, cls, tmp_path, capsys, monkeypatch):
    """merge --scope model in memory and --stream (A read through the fold in row chunks): the same bits."""
    import symalign.stream.merge as smerge

    chunks = smerge.row_chunks
    monkeypatch.setattr(smerge, "row_chunks", lambda shape: chunks(shape, 100))
    da, db = _pair(tmp_path, family, cls)
    args = [da, db, "--scope", "model", "--weights", "0.4,0.6", "--max-sweeps", "2", "--json"]
    for flag, name in (("--no-stream", "MEM"), ("--stream", "STR")):
        code, out, err = run_symalign(monkeypatch, capsys, "merge", *map(str, args), "-o", str(tmp_path / name), flag)
        assert code == 0, err
    info = json.loads(out)
    assert info["scope"] == "model" and info["path"] == "streamed" and info["aligned"][0]["check"]["passed"]
    _same(_state(tmp_path / "STR"), _state(tmp_path / "MEM"))


BARE = [("bert", "BertModel", {}), ("vit", "ViTModel", {}), ("gpt2", "GPT2Model", {}),
        ("bert", "BertLMHeadModel", {"add_cross_attention": True, "is_decoder": True})]


@pytest.mark.parametrize("family,cls,kw", BARE, ids=[f"{f}-{c}" for f, c, _ in BARE])
def test_models_without_a_residual_space_in_memory_equal_streamed_and_match_whole(family, cls, kw, tmp_path):
    """A bare model outputs the stream (and a cross-attention one reads another stream through it): no residual
    space, each layer's FF units and attention alone. The one loop takes them too: in memory and ``--stream`` give
    the same bits, the distances of :func:`~symalign.match.whole.match_whole` on the copies, B's function."""
    from symalign.commands.align import run_align
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.families import prepare
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole

    da, db = _pair(tmp_path, family, cls, **kw)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=3)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=3)
    assert "residual" not in m.group["spaces"] and any("residual stream not aligned" in n for n in m.notes)
    assert s.match["distances"] == m.match["distances"] and s.check.to_dict()["passed"] and m.check.to_dict()["passed"]
    _same(_state(tmp_path / "S"), _state(tmp_path / "M"))
    pa, pb = (prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys()))
              for c in (load_checkpoint(da), load_checkpoint(db)))
    ref = match_whole(pa.spec, pa.state, pb.state, spec_b=pb.spec, max_sweeps=3, **CHECKPOINT_SETTINGS).to_dict()
    dm, dr = m.match["distances"], ref["distances"]
    assert len(dm) == len(dr) and all(abs(x - y) <= 1e-10 * dr[0] for x, y in zip(dm, dr)), (dm, dr)
    assert dm[-1] < dm[0]
