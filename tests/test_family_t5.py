"""T5 (:mod:`symalign.families.t5`): shared head permutations per stack, cross-attention, tied embedding.

Tiny random float64 T5 models (D=16, 4 heads of d_kv=4, 2 encoder and 3 decoder blocks):

* a random element of the declared attention group and of the whole-model group leaves
  the model's own forward (encoder + decoder logits) unchanged, for every option that
  changes the symmetry (``feed_forward_proj``, ``tie_word_embeddings``, ``d_kv``) and for
  ``T5Model`` / ``T5EncoderModel``;
* larger groups are not symmetries: one head permutation per encoder layer, or the shared
  one without the bias table's columns, or a rotated stream, change the function;
* planted pairs are recovered exactly (permutations exact, weights <= 1e-8), in memory
  and through ``symalign align`` (both scopes; OUT loads with ``from_pretrained`` and
  computes B's function);
* the declared dimension of every attention layer (encoder, decoder self-, cross-)
  equals the Jacobian nullity of the real transformers layer;
* ``align --stream`` refuses T5 with the reason (exit 2); ``interpolate`` evaluates it on source/target
  pairs only (tests/test_t5_interpolate.py) and refuses other data with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import output, randomize, rel

from symalign.arch import layout_spec
from symalign.arch.base import find_prefix
from symalign.families import get_adapter
from symalign.families import prepare
from symalign.families.t5 import T5Family
from symalign.groups import Orthogonal, PositiveMonomial
from symalign.match import match_attention
from symalign.match.whole import match_whole
from symalign.probe.families import float64_numerics, probe_layer
from symalign.spec import apply, sample

T = pytest.importorskip("transformers")
BASE = dict(T5Family.tiny.kwargs)  # the tiny T5 its family module declares


def make(cls=None, dtype=torch.float64, seed=0, **kw):
    cls = cls or T.T5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls._from_config(T.T5Config(**{**BASE, **kw}), attn_implementation="eager").to(dtype)
    randomize(model, seed)
    return model.eval()


def _x(model, seed=0):
    return get_adapter(model).dummy_inputs(model.config, seed=seed)


def _loaded(model, state):
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    return m


def _prepared(model):
    st = dict(model.state_dict())
    return prepare(model.config, st, get_adapter(model).spec(model.config, st.keys()), type(model).__name__)


VARIANTS = [({}, None), ({"feed_forward_proj": "gated-gelu"}, None), ({"feed_forward_proj": "gelu"}, None),
            ({"tie_word_embeddings": False}, None), ({"d_kv": 8}, None), ({"num_decoder_layers": 2}, None),
            ({}, "T5Model"), ({"feed_forward_proj": "gated-gelu"}, "T5EncoderModel")]
IDS = ["-".join([c or "LM"] + [f"{k}={v}" for k, v in kw.items()]) for kw, c in VARIANTS]


@pytest.mark.parametrize("kw,cls", VARIANTS, ids=IDS)
def test_declared_groups_are_exact(kw, cls):
    model = make(getattr(T, cls) if cls else None, **kw)
    fam = get_adapter(model)
    assert isinstance(fam, T5Family)
    x = _x(model)
    y, y64 = output(model, x), output(float64_numerics(copy.deepcopy(model)), x)
    att, prep = fam.spec(model), _prepared(model)
    assert ("residual" in prep.spec.spaces) == (cls is None)
    gated = kw.get("feed_forward_proj", "relu").startswith("gated")
    relu = kw.get("feed_forward_proj", "relu") == "relu"
    assert isinstance(prep.spec.spaces["ff.0"], PositiveMonomial) == relu
    assert len(prep.spec.tensors_of("ff.0")) == (3 if gated else 2)
    for seed in (1, 2):
        for name, spec, state in (("attention", att, model.state_dict()), ("model", prep.spec, prep.state)):
            moved = _loaded(model, apply(spec, sample(spec, seed), state))
            assert rel(output(float64_numerics(copy.deepcopy(moved)), x), y64) <= 1e-10, (name, seed)
            # transformers' T5LayerNorm takes the mean of squares in float32: a permuted stream changes its rounding
            assert rel(output(moved, x), y) <= (1e-10 if name == "attention" else fam.precision_floor), (name, seed)


def test_attention_spec_shares_one_permutation_per_stack():
    model = make()
    spec = get_adapter(model).spec(model)
    enc, dec = spec.couplings["heads.encoder"], spec.couplings["heads.decoder"]
    assert enc == ("qk.0", "vo.0", "qk.1", "vo.1") and dec == ("qk.2", "vo.2", "qk.3", "vo.3", "qk.4", "vo.4")
    assert spec.layer("heads.encoder") is None and spec.role("heads.encoder") == "heads"
    for stack in ("encoder", "decoder"):
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        (act,) = spec.tensors[table]
        assert (act.space, act.axis, act.rep) == (f"heads.{stack}", 1, "head")
    # cross-attention: free per layer; layer numbers L_e + L_d + j
    assert [spec.layer(f"heads.{i}") for i in (5, 6, 7)] == [5, 6, 7]
    assert spec.tensors["decoder.block.2.layer.1.EncDecAttention.q.weight"][0].space == "heads.7"


def _layouts(model):
    fam = get_adapter(model)
    keys = set(model.state_dict())
    return fam.layouts(model.config, find_prefix(keys, fam.probe, fam.family), keys)


def test_larger_groups_are_not_symmetries():
    model = float64_numerics(make())
    x = _x(model)
    y = output(model, x)
    lays = _layouts(model)
    # (a) a head permutation per encoder layer: layers 0 and 1 permuted differently (bias table untouched)
    own = layout_spec([dataclasses.replace(lay, heads=None) for lay in lays])
    t = {"heads.0": torch.arange(4), "heads.1": torch.tensor([1, 0, 3, 2])}
    assert rel(output(_loaded(model, apply(own, t, model.state_dict())), x), y) >= 1e-3
    # (b) the shared permutation on every layer of a stack, the bias table's columns left in place
    bare = layout_spec(lays)
    for stack in ("encoder", "decoder"):
        moved = apply(bare, {f"heads.{stack}": torch.tensor([1, 0, 3, 2])}, model.state_dict())
        assert rel(output(_loaded(model, moved), x), y) >= 1e-3, stack
    # ... and with the table's columns, exact (the declared spec)
    full = get_adapter(model).spec(model)
    moved = apply(full, {"heads.encoder": torch.tensor([1, 0, 3, 2]), "heads.decoder": torch.tensor([2, 3, 0, 1])},
                  model.state_dict())
    assert rel(output(_loaded(model, moved), x), y) <= 1e-12
    # (c) a rotated stream instead of a permuted one (the tied embedding is the head; gains do not rotate)
    prep = _prepared(model)
    spec = dataclasses.replace(prep.spec, spaces={**prep.spec.spaces, "residual": Orthogonal(16)})
    spec = spec.restrict(["residual"])
    rot = Orthogonal(16).sample(torch.Generator().manual_seed(3))
    assert rel(output(_loaded(model, apply(spec, {"residual": rot}, prep.state)), x), y) >= 1e-3


def _rel_state(a, b, names):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in names)
    return (num / sum(float(a[k].double().pow(2).sum()) for k in names)) ** 0.5


@pytest.mark.parametrize("ff,cls", [("relu", None), ("gated-gelu", None), ("relu", "T5EncoderModel")])
def test_planted_recovery_in_memory(ff, cls):
    model = make(getattr(T, cls) if cls else None, feed_forward_proj=ff)
    att = get_adapter(model).spec(model)
    sa = dict(model.state_dict())
    t = sample(att, 5)
    res = match_attention(att, sa, apply(att, t, sa))
    heads = [h for h in ("heads.encoder", "heads.decoder", "heads.5", "heads.7") if h in att.spaces]
    assert len(heads) == (1 if cls else 4)
    for space in heads:
        assert res.transform[space].tolist() == torch.argsort(t[space]).tolist(), space
    assert _rel_state(sa, res.apply(apply(att, t, sa)), att.tensors) <= 1e-8
    prep = _prepared(model)
    t = sample(prep.spec, 6)
    sb = apply(prep.spec, t, prep.state)
    whole = match_whole(prep.spec, prep.state, sb)
    assert _rel_state(prep.state, whole.apply(sb), prep.spec.tensors) <= 1e-8
    if not cls:
        assert whole.transform["residual"].tolist() == torch.argsort(t["residual"]).tolist()
    assert whole.transform["heads.encoder"].tolist() == torch.argsort(t["heads.encoder"]).tolist()


def _save_pair(tmp_path, scope, dtype, **kw):
    from safetensors.torch import load_file, save_file

    a = make(dtype=torch.float64, **kw)
    a.to(dtype).save_pretrained(tmp_path / "A")
    disk = load_file(str(tmp_path / "A" / "model.safetensors"))
    fam = get_adapter(a.config)
    spec, target = fam.spec(a.config, disk.keys()), disk
    if scope == "model":
        prep = prepare(a.config, disk, spec, type(a).__name__)
        spec, target = prep.spec, prep.state
    t = sample(spec, 7)
    make(dtype=dtype, **kw).save_pretrained(tmp_path / "B")
    save_file({k: v.contiguous() for k, v in apply(spec, t, target).items()},
              str(tmp_path / "B" / "model.safetensors"), metadata={"format": "pt"})
    return target, t, load_file


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_planted_recovery_cli(scope, tmp_path, capsys, monkeypatch):
    target, t, load_file = _save_pair(tmp_path, scope, torch.float64, feed_forward_proj="gated-gelu")
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["family"] == "T5" and info["distance"]["after"]["total"] <= 1e-8
    assert _rel_state(target, load_file(str(out / "model.safetensors")), target) <= 1e-8
    if scope == "attention":
        perms = [lay["permutation"] for lay in info["match"]["layers"]]
        assert perms[0] == perms[1] == torch.argsort(t["heads.encoder"]).tolist()  # one per stack
        assert perms[2] == perms[3] == perms[4] == torch.argsort(t["heads.decoder"]).tolist()
    cls = T.T5ForConditionalGeneration
    o = cls.from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    x = _x(b)
    assert rel(output(float64_numerics(o), x), output(float64_numerics(b), x)) <= 1e-10
    if scope == "attention":
        o = cls.from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
        b = cls.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
        assert rel(output(o, x), output(b, x)) <= 1e-10  # unmodified forward: the stream is not moved


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_float32_pair_stays_exact(scope, tmp_path, capsys, monkeypatch):
    _save_pair(tmp_path, scope, torch.float32)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    cls = T.T5ForConditionalGeneration
    o = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=torch.float32, attn_implementation="eager").eval()
    x = _x(b)
    assert rel(output(o, x), output(b, x)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("ff", ["relu", "gated-gelu"])
def test_model_scope_is_the_one_loop_and_equals_match_whole(ff, tmp_path):
    """``--scope model`` in memory runs the one whole-model loop (:class:`symalign.stream.model.StreamedWhole`,
    each stack's self-attention layers solved together for their shared head space) and its squared distance
    after every pass is that of :func:`~symalign.match.whole.match_whole` on the folded float64 models (the
    reference loop, which solves the whole attention at once); OUT computes B's function."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.commands.align import run_align
    from symalign.match.whole import CHECKPOINT_SETTINGS
    from symalign.stream.model import StreamedWhole, attention_groups

    for seed, name in ((0, "A"), (1, "B")):
        m = T.T5ForConditionalGeneration(T.T5Config(**{**T5Family.tiny.kwargs, "feed_forward_proj": ff}))
        randomize(m.double(), seed)
        m.save_pretrained(tmp_path / name)
    res = run_align(tmp_path / "A", tmp_path / "B", tmp_path / "M", scope="model", stream=False, max_sweeps=4)
    ca, cb = load_checkpoint(tmp_path / "A"), load_checkpoint(tmp_path / "B")
    pa, pb = (prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys())) for c in (ca, cb))
    ref = match_whole(pa.spec, pa.state, pb.state, spec_b=pb.spec, max_sweeps=4, **CHECKPOINT_SETTINGS)
    dm, dr = res.match["distances"], ref.to_dict()["distances"]
    assert len(dm) == len(dr) and all(abs(x - y) <= 1e-10 * dr[0] for x, y in zip(dm, dr)), (dm, dr)
    assert dm[-1] < dm[0] and res.check.to_dict()["passed"]
    from symalign.checkpoint.lazy import ResidentCheckpoint
    w = StreamedWhole(ResidentCheckpoint.of(ca), ResidentCheckpoint.of(cb))
    assert w.prefixes == ["encoder.block.0.", "encoder.block.1.", "decoder.block.0.", "decoder.block.1.",
                          "decoder.block.2."]
    assert w.groups == [(0, 1), (0, 1), (2, 3, 4), (2, 3, 4), (2, 3, 4)]
    assert attention_groups(w.spec, [["qk.0"], ["qk.1"]]) == [(0,), (1,)]
    cls = T.T5ForConditionalGeneration
    o = cls.from_pretrained(tmp_path / "M", dtype=torch.float64, attn_implementation="eager").eval()
    b = cls.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    x = _x(b)
    assert rel(output(float64_numerics(o), x), output(float64_numerics(b), x)) <= 1e-10


def test_declared_dimension_equals_probe_nullity_every_site():
    """Every attention layer of a tiny model (encoder 0-1, decoder self 2-3, cross 4-5): the real
    ``T5Attention`` with its stack's position bias (decoder: causal) or generic encoder states, float64."""
    model = make(d_model=8, num_heads=2, num_decoder_layers=2)
    fam = get_adapter(model)
    for i in range(6):
        res = probe_layer(fam, copy.deepcopy(model), i)
        assert res.group == 2 * 2 * 4 * 4 and res.match and res.gap > 1e6, (i, res)


@pytest.mark.slow
def test_probe_hf_cli_layer(capsys, monkeypatch):
    code, stdout, err = run_symalign(monkeypatch, capsys, "probe", "--hf", "t5", "--layer", "1", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    (row,) = info["probes"]
    assert row["module"] == "encoder.block.1.layer.0.SelfAttention"
    assert row["declared"] == 2 * 4 * 16 and row["nullity"] == row["declared"] and row["match"] is True


@pytest.mark.parametrize("stack,layer,cross,module,spaces", [
    ("encoder", 1, False, "encoder.block.1.layer.0.SelfAttention", ["qk.1", "vo.1"]),
    ("decoder", 2, False, "decoder.block.2.layer.0.SelfAttention", ["qk.3", "vo.3"]),
    ("decoder", 2, True, "decoder.block.2.layer.1.EncDecAttention", ["heads.6", "qk.6", "vo.6"]),
])
@pytest.mark.slow
def test_probe_hf_every_site(stack, layer, cross, module, spaces):
    """``probe_hf`` reaches every attention site of a T5 (2 encoder, 3 decoder blocks: the decoder's last block
    is out of the encoder's range), through the model's real call (decoder: causal mask and the stack's
    position bias; cross: generic encoder states). The probe builds blocks 0..I of the stack and one of the
    other, so the layer numbers of the spaces are 1 + I (decoder self) and 1 + 3 + I (cross)."""
    from symalign.probe.hf import probe_hf

    (row,) = probe_hf(T.T5Config(**BASE), layer, stack=stack, cross=cross, ad="forward")
    assert row.stack == stack and row.layer == layer and row.module == module
    assert row.site == ("cross-attention" if cross else "attention") and sorted(row.group) == spaces
    res = row.result
    assert row.declared == 2 * 4 * 16 and row.undeclared == {} and res.nullity == row.declared and row.match
    assert res.largest_null < 1e-12 and res.singular_value_gap > 1e8 and res.outputs >= 2 * res.parameters


def test_probe_hf_decoder_of_an_encoder_only_checkpoint_is_refused(tmp_path):
    from symalign.errors import ConfigError
    from symalign.probe.hf import probe_hf

    make(T.T5EncoderModel).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"T5EncoderModel\) has no decoder"):
        probe_hf(str(tmp_path), 0, stack="decoder")


def test_stream_is_refused(tmp_path, capsys, monkeypatch):
    for d in ("A", "B"):
        make().save_pretrained(tmp_path / d)
    code, _, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                tmp_path / "OUT", "--stream")
    assert code == 2 and "without --stream" in err and "relative position bias" in err
    assert not (tmp_path / "OUT").exists()


def test_interpolate_without_pairs_is_refused(tmp_path, capsys, monkeypatch):
    for d in ("A", "B"):
        make().save_pretrained(tmp_path / d)
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", tmp_path / "B", "--data",
                                "synthetic", "-o", tmp_path / "OUT", "--no-progress")
    assert code == 2 and "sequence-to-sequence model is evaluated on source/target pairs" in err, err
    assert not (tmp_path / "OUT").exists()
