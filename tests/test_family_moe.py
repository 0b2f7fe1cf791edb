"""Mixture-of-experts families (Mixtral, Qwen2-MoE, OLMoE): experts permuted with the router, units inside each.

Tiny random float64 models (D=16, 2 layers, E=4 experts, top-2, F=8):

* a random element of the attention spec and of the whole-model spec (experts, per-expert
  units, shared expert, residual ``O(D)``, attention) leaves the model's own forward
  unchanged: <= 1e-10 with float64-faithful numerics (transformers takes the router's
  softmax and RMSNorm in float32 otherwise), <= the family's precision floor as is;
* a planted element is recovered exactly by whole-model matching (the expert and unit
  permutations identical, the weights to <= 1e-8);
* through the CLI (checkpoints saved per expert, as ``save_pretrained`` writes them): both
  scopes recover A and write a checkpoint that ``from_pretrained`` loads and that computes
  B's function (<= 1e-10 float64-faithful, <= 1e-5 float32); ``interpolate`` reads it;
* larger groups (experts permuted without the router rows, different unit permutations
  on the gate and up halves) change the function;
* the declared dimension equals the Jacobian nullity of the real attention layer and of
  the real MoE block (routing is discrete: 0, plus the named router-shift and gated-unit
  rescaling directions), with a generic, stable top-k on the probe's inputs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_tiny import output, randomize, rel
from _cli_util import run_symalign

from symalign.errors import MatchError
from symalign.families import get_adapter
from symalign.families import prepare
from symalign.families.moe import MoEFamily
from symalign.groups import BlockPermutations, Permutation
from symalign.match.whole import match_whole
from symalign.probe.families import float64_numerics
from symalign.spec import SymmetrySpec, apply, invert, sample

T = pytest.importorskip("transformers")

def _configs():
    """``model_type -> (model class, config(**overrides))`` of the registered mixtures of experts (their tiny
    models, declared by symalign.families.moe)."""
    from symalign.families import FAMILIES as REGISTERED

    def config(tiny):
        return lambda **kw: tiny.classes()[1](**{**tiny.kwargs, **kw})

    return {f.model_types[0]: (f.tiny.classes()[0], config(f.tiny)) for f in REGISTERED if isinstance(f, MoEFamily)}


FAMILIES = tuple(_configs())


def make(name: str, dtype=torch.float64, seed: int = 0, **kw):
    cls, cfg = _configs()[name]
    torch.manual_seed(seed)
    model = cls._from_config(cfg(**kw), attn_implementation="eager", experts_implementation="eager").to(dtype)
    randomize(model, seed)
    return model.eval()


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _loaded(model, state):
    m = copy.deepcopy(model)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return m


def _state(model):
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        st.pop("lm_head.weight", None)
    return st


def _prepared(model):
    st = _state(model)
    fam = get_adapter(model)
    return prepare(model.config, st, fam.spec(model.config, st.keys()), type(model).__name__)


def _scope_spec(model, scope):
    """The scope's spec and the state it acts on: the rewritten whole model, or the attention spec on the
    model's own state."""
    if scope == "model":
        prep = _prepared(model)
        return prep.spec, prep.state
    return get_adapter(model).spec(model), model.state_dict()


VARIANTS = [("mixtral", {}), ("mixtral", {"tie_word_embeddings": True}), ("mixtral", {"sliding_window": 4}),
            ("qwen2_moe", {}), ("qwen2_moe", {"norm_topk_prob": True}), ("qwen2_moe", {"qkv_bias": False}),
            ("qwen2_moe", {"mlp_only_layers": [1]}), ("olmoe", {}), ("olmoe", {"norm_topk_prob": True}),
            ("olmoe", {"attention_bias": True})]
IDS = [f + "".join(f"-{k}={v}" for k, v in kw.items()) for f, kw in VARIANTS]


@pytest.mark.parametrize("family,kw", VARIANTS, ids=IDS)
def test_declared_groups_are_exact(family, kw):
    model = make(family, **kw)
    fam = get_adapter(model)
    assert isinstance(fam, MoEFamily)
    x = _ids()
    y, y64 = output(model, x), output(float64_numerics(copy.deepcopy(model)), x)
    att = fam.spec(model)
    prep = _prepared(model)
    spec = prep.spec
    sparse = [i for i in range(2) if f"experts.{i}" in spec.spaces]
    assert sparse == ([0] if kw.get("mlp_only_layers") else [0, 1])
    for i in sparse:
        assert spec.role(f"experts.{i}") == "experts" and spec.couplings[f"experts.{i}"] == (f"expert_ff.{i}",)
        assert isinstance(spec.spaces[f"expert_ff.{i}"], BlockPermutations)
        assert (f"shared_ff.{i}" in spec.spaces) == (family == "qwen2_moe")
    assert spec.describe()["residual"] == ("S_16" if kw.get("tie_word_embeddings") else "O(16)")
    for seed in (1, 2):
        for name, sp, st in (("attention", att, model.state_dict()), ("model", spec, prep.state)):
            moved = apply(sp, sample(sp, seed), st)
            assert rel(output(float64_numerics(_loaded(model, moved)), x), y64) <= 1e-10, (name, seed)
            assert rel(output(_loaded(model, moved), x), y) <= fam.precision_floor, (name, seed)


@pytest.mark.parametrize("family,kw", [("mixtral", {}), ("mixtral", {"sliding_window": 4}), ("qwen2_moe", {}),
                                       ("olmoe", {})])
def test_float64_numerics_is_the_models_function(family, kw):
    """The float64-faithful path computes the model's own function (causal, sliding-window mask included):
    it differs from the unmodified forward only by the float32 rounding of the router softmax and RMSNorm.
    (Before the mask function was registered with the attention, transformers built no mask for it and
    the path attended both ways: ~1 relative.)"""
    model = make(family, **kw)
    x = _ids()
    assert rel(output(float64_numerics(copy.deepcopy(model)), x), output(model, x)) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_element_is_recovered_exactly(family):
    """B = g . A (g random in the whole-model group): matching finds g^{-1}, permutations identical."""
    prep = _prepared(make(family))
    spec, a = prep.spec, prep.state
    g = sample(spec, 5)
    b = apply(spec, g, a)
    res = match_whole(spec, a, b, max_sweeps=5)
    got = res.apply(b)
    assert rel(torch.cat([got[t].flatten() for t in spec.tensors]), torch.cat([a[t].flatten() for t in spec.tensors])) \
        <= 1e-8
    inv = invert(spec, g)
    for name in spec.select(("experts", "ff")):
        assert torch.equal(res.transform[name], inv[name]), name
    assert not torch.equal(g["experts.0"], torch.arange(4))  # the planted element did move the experts


def _save(model, path, dtype):
    model.to(dtype).save_pretrained(path)
    model.to(torch.float64)


def _planted_dirs(family, scope, dtype, tmp_path):
    """A saved; B = g . A (g in the scope's group) saved the same way (per-expert tensors on disk)."""
    a = make(family)
    _save(a, tmp_path / "A", dtype)
    fam = get_adapter(a)
    spec, target = _scope_spec(a, scope)
    b = _loaded(a, apply(spec, sample(spec, 7), target))
    _save(b, tmp_path / "B", dtype)
    return fam, b


def _from(path, family, dtype):
    cls = _configs()[family][0]
    return cls.from_pretrained(path, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_cli_align_recovers_a_and_keeps_b_function(family, scope, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    fam, _ = _planted_dirs(family, scope, torch.float64, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= 1e-8
    assert info["match"].get("experts") == ("exact" if scope == "model" else None)  # the default ran
    disk = load_file(str(out / "model.safetensors"))
    assert set(disk) == set(load_file(str(tmp_path / "B" / "model.safetensors")))  # saved per expert, as B
    o, b = _from(out, family, torch.float64), _from(tmp_path / "B", family, torch.float64)
    x = _ids()
    assert rel(output(float64_numerics(o), x), output(float64_numerics(b), x)) <= 1e-10
    if scope == "model":  # OUT is B in A's coordinates: interpolating A and OUT stays flat
        code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", tmp_path / "A", out, "--data",
                                         "synthetic", "--data-option", "kind=lm", "--points", "3", "--eval-items",
                                         "8", "--context", "16", "-o", tmp_path / "curves", "--json")
        assert code == 0, err
        curve = json.loads(stdout)
        assert abs(curve["naive"]["loss_barrier"]) <= 1e-6, curve["naive"]


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_float32_pair_stays_exact(family, tmp_path, capsys, monkeypatch):
    _planted_dirs(family, "model", torch.float32, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", "model", "--json")
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    o, b = _from(out, family, torch.float32), _from(tmp_path / "B", family, torch.float32)
    assert rel(output(o, _ids()), output(b, _ids())) <= 1e-5


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_match_whole_paired_experts_recovers_a_planted_element(family):
    """``experts="paired"`` (approximate, ``E`` products) still recovers a planted element exactly, and the
    result records which method ran; an unknown method is refused."""
    prep = _prepared(make(family))
    spec, a = prep.spec, prep.state
    g = sample(spec, 5)
    b = apply(spec, g, a)
    res = match_whole(spec, a, b, max_sweeps=5, experts="paired")
    assert res.experts == "paired" and res.to_dict()["experts"] == "paired"
    inv = invert(spec, g)
    for name in spec.select(("experts", "ff")):
        assert torch.equal(res.transform[name], inv[name]), name
    assert not torch.equal(g["experts.0"], torch.arange(4))
    with pytest.raises(MatchError, match="unknown expert matching method 'greedy'"):
        match_whole(spec, a, b, experts="greedy")


@pytest.mark.slow
def test_cli_align_experts_paired(tmp_path, capsys, monkeypatch):
    """``symalign align --scope model --experts paired`` on a planted Mixtral pair: the planted element is
    recovered (distance to A ~ 0), OUT computes B's function through from_pretrained, --json says paired."""
    import symalign.match.whole as whole

    ran, solve = [], whole.match_experts

    def spy(*args, method="exact", **kw):
        ran.append(method)
        return solve(*args, method=method, **kw)

    monkeypatch.setattr(whole, "match_experts", spy)
    _planted_dirs("mixtral", "model", torch.float64, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", "model", "--experts", "paired", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["match"]["experts"] == "paired" and ran and set(ran) == {"paired"}  # what really ran
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= 1e-8
    o, b = _from(out, "mixtral", torch.float64), _from(tmp_path / "B", "mixtral", torch.float64)
    x = _ids()
    assert rel(output(float64_numerics(o), x), output(float64_numerics(b), x)) <= 1e-10


def test_cli_experts_refused_where_meaningless(tmp_path, capsys, monkeypatch):
    """--experts with --scope attention, an unknown method, a checkpoint without experts, --no-align or
    --module: one line, exit 2, nothing written."""
    from hf_tiny import make_model

    _planted_dirs("mixtral", "attention", torch.float64, tmp_path)
    make_model("llama").save_pretrained(tmp_path / "L")
    make_model("llama", seed=1).save_pretrained(tmp_path / "M")
    A, B, L, M, out = tmp_path / "A", tmp_path / "B", tmp_path / "L", tmp_path / "M", tmp_path / "OUT"
    cases = [
        (("align", A, B, "-o", out, "--experts", "paired"), "--experts applies to --scope model"),
        (("align", A, B, "-o", out, "--scope", "attention", "--experts", "exact"), "drop it with --scope attention"),
        (("align", A, B, "-o", out, "--scope", "model", "--experts", "greedy"), "unknown --experts 'greedy'"),
        (("align", L, M, "-o", out, "--scope", "model", "--experts", "paired"), "'llama' has no expert layers"),
        (("align", L, M, "-o", out, "--scope", "model", "--experts", "paired", "--stream"),
         "'llama' has no expert layers"),
        (("align", A, B, "-o", out, "--module", "x:y", "--experts", "paired"), "drop it with --module"),
        (("merge", A, B, "-o", out, "--scope", "attention", "--experts", "paired"),
         "--experts applies to --scope model"),
        (("merge", L, M, "-o", out, "--scope", "model", "--experts", "paired"), "'llama' has no expert layers"),
        (("merge", A, B, "-o", out, "--scope", "model", "--experts", "paired", "--no-align"), "--no-align"),
    ]
    for argv, msg in cases:
        code, stdout, err = run_symalign(monkeypatch, capsys, *argv)
        assert code == 2, (argv, err)
        assert msg in " ".join(err.split()), (argv, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists(), argv


@pytest.mark.slow
def test_cli_merge_experts_paired(tmp_path, capsys, monkeypatch):
    """``symalign merge --scope model --experts paired`` of a planted Mixtral pair: B is aligned onto A, so the
    merge is A's function (folded form); the JSON says paired."""
    _planted_dirs("mixtral", "model", torch.float64, tmp_path)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "merge", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", "model", "--experts", "paired", "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["experts"] == "paired" and res["aligned"][0]["experts"] == "paired"
    o, a = _from(out, "mixtral", torch.float64), _from(tmp_path / "A", "mixtral", torch.float64)
    x = _ids()
    assert rel(output(float64_numerics(o), x), output(float64_numerics(a), x)) <= 1e-8


def _spec_on(state, i, spaces):
    """A spec with ``spaces`` = ``{name: (group, [(tensor, axis, segment), ...])}`` on layer ``i``'s block."""
    spec = SymmetrySpec()
    p = f"model.layers.{i}.mlp."
    for name, (group, acts) in spaces.items():
        spec.add_space(name, group)
        for t, axis, seg in acts:
            spec.act_on(p + t, name, axis, "co", None, seg)
    spec.check(state)
    return spec


@pytest.mark.parametrize("family", FAMILIES)
def test_larger_groups_are_not_symmetries(family):
    model = float64_numerics(make(family))
    st = model.state_dict()
    x = _ids()
    y = output(model, x)
    gu, dn = "experts.gate_up_proj", "experts.down_proj"
    cases = {
        # the experts permuted, the router rows not
        "experts without router": {"x": (Permutation(4), [(gu, 0, None), (dn, 0, None)])},
        # the router rows permuted, the experts not
        "router without experts": {"x": (Permutation(4), [("gate.weight", 0, None)])},
        # one unit permutation on the gate half, another on the up half (down follows the up half)
        "gate and up apart": {"g": (BlockPermutations(4, 8), [(gu, 1, (0, 8))]),
                              "u": (BlockPermutations(4, 8), [(gu, 1, (8, 8)), (dn, 2, None)])},
    }
    for how, spaces in cases.items():
        spec = _spec_on(st, 0, spaces)
        moved = apply(spec, sample(spec, 3), st)
        assert rel(output(_loaded(model, moved), x), y) >= 1e-3, how


CLIP = 0.5  # below most |q|, |k|, |v| entries of the tiny random OLMoE on _ids(): the clamp bites (asserted)


def _clamped_fraction(model, x) -> dict[str, float]:
    """Per Q/K/V site: the fraction of entries the ``clip_qkv`` clamp changes on ``x`` (pre-clamp values)."""
    seen: dict[str, float] = {}
    sites = [(n, m) for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm", "v_proj"))]
    hooks = [m.register_forward_hook(lambda _m, _i, o, n=n: seen.__setitem__(n, float((o.abs() > CLIP).double()
                                                                                         .mean())))
             for n, m in sites]
    output(model, x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("scope", ["attention", "model"])
def test_olmoe_clip_qkv_group_is_exact_and_recovered(scope):
    """``clip_qkv`` keeps the signed coordinate permutations: heads (gains permuted with them), plane signs on
    Q-K, a signed permutation of each head's value coordinates on V-O, no gain scales. A random element keeps
    the function with the clamp active (float64, through the HF forward) and is recovered exactly."""
    from symalign.groups import PerHead, PlaneSigns, SignedPermutations

    model = make("olmoe", clip_qkv=CLIP)
    x = _ids()
    frac = _clamped_fraction(model, x)
    assert len(frac) == 6 and all(0.1 <= f <= 0.9 for f in frac.values()), frac  # the clamp bites, not everywhere
    spec, st = _scope_spec(model, scope)
    assert not [n for n in spec.spaces if n.startswith("qkgain")]
    for i in range(2):
        assert isinstance(spec.spaces[f"vo.{i}"], PerHead) and isinstance(spec.spaces[f"vo.{i}"].inner,
                                                                           SignedPermutations)
        assert isinstance(spec.spaces[f"qk.{i}"].inner, PlaneSigns)
    y64 = output(float64_numerics(copy.deepcopy(model)), x)
    g = sample(spec, 5)
    b = apply(spec, g, st)
    assert rel(output(float64_numerics(_loaded(model, b)), x), y64) <= 1e-10
    res = match_whole(spec, st, b, max_sweeps=5)
    got = res.apply(b)
    assert rel(torch.cat([got[t].flatten() for t in spec.tensors]),
               torch.cat([st[t].flatten() for t in spec.tensors])) <= 1e-8
    inv = invert(spec, g)
    for name in spec.spaces:
        if name.split(".")[0] in ("heads", "qk", "vo"):
            assert torch.equal(res.transform[name].to(inv[name].dtype), inv[name]), name
    assert not torch.equal(g["vo.0"], spec.spaces["vo.0"].identity())


def test_olmoe_clip_qkv_larger_groups_break_the_function():
    """What the clamp removes: ``GL(d)`` on V-O and the QK-norm gain scales keep the unclipped model's function
    and change the clipped one's."""
    x = _ids()
    plain, clipped = make("olmoe"), make("olmoe", clip_qkv=CLIP)
    full = get_adapter(plain).spec(plain)  # the unclipped group: GL(d) on V-O, gain scales qkgain.i
    assert full.describe()["vo.0"] == "GL(4)^2" and "qkgain.0" in full.spaces
    for name in ("vo.0", "qkgain.0"):
        sp = full.restrict([name])
        g = sample(sp, 3)
        for model, kept in ((plain, True), (clipped, False)):
            y = output(float64_numerics(copy.deepcopy(model)), x)
            r = rel(output(float64_numerics(_loaded(model, apply(sp, g, model.state_dict()))), x), y)
            assert (r <= 1e-10) if kept else (r >= 1e-3), (name, kept, r)


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_cli_aligns_olmoe_with_clip_qkv(scope, tmp_path, capsys, monkeypatch):
    a = make("olmoe", clip_qkv=CLIP)
    _save(a, tmp_path / "A", torch.float64)
    spec, target = _scope_spec(a, scope)
    _save(_loaded(a, apply(spec, sample(spec, 7), target)), tmp_path / "B", torch.float64)
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= 1e-8
    o, b = _from(out, "olmoe", torch.float64), _from(tmp_path / "B", "olmoe", torch.float64)
    assert o.config.clip_qkv == CLIP
    assert rel(output(float64_numerics(o), _ids()), output(float64_numerics(b), _ids())) <= 1e-10


def test_olmoe_clip_qkv_probe_nullity():
    """The declared group is discrete (dimension 0); where the clamp bites at the probe's inputs the real layer's
    nullity is 0 too. With a clamp that never bites there (``clip_qkv=1e3``) the Jacobian sees the unclipped
    layer's 18 directions (local), and the probe says it does not match."""
    from symalign.probe.hf import probe_hf

    (row,) = (r.to_dict() for r in probe_hf(_configs()["olmoe"][1](**SMALL, clip_qkv=CLIP)))
    assert row["declared"] == 0 and row["nullity"] == 0 and row["match"], row
    assert "signed-perm(4)^1" in row["group"].values() and "qkgain.0" not in row["group"]
    (loose,) = (r.to_dict() for r in probe_hf(_configs()["olmoe"][1](**SMALL, clip_qkv=1e3)))
    assert loose["nullity"] == 18 and not loose["match"], loose


SMALL = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=4, rms_norm_eps=1e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_dimension_equals_probe_nullity(family):
    """Layer 0 of the real model, float64: its attention (as every family) and its MoE block, whose declared
    group is discrete (dimension 0) beside the router's softmax shift and the gated units' rescalings."""
    from symalign.probe.families import probe_layer, probe_moe_block

    kw = dict(SMALL, moe_intermediate_size=4, shared_expert_intermediate_size=4) if family == "qwen2_moe" else SMALL
    model = make(family, **kw)
    fam = get_adapter(model)
    res = probe_layer(fam, model, 0)  # converts the model to float64 numerics (router included)
    assert res.match and res.gap > 1e4, res
    block = probe_moe_block(fam, model, 0)
    assert block.group == 0 and {"experts.0", "expert_ff.0"} <= set(block.describe)
    E, F, Fs = 4, 4, (4 if family == "qwen2_moe" else 0)
    assert block.gauge == {"router softmax shift": 8, "gated unit rescaling (up row, down column)": E * F + Fs}
    assert block.match and block.gap > 1e4, block


def test_block_probe_refuses_degenerate_routing():
    """Saturated routing (one router row scaled by 1e3: its expert takes probability 1 where it scores
    positive, the others tie at 0) adds null directions that are not symmetries: refused, not miscounted."""
    from symalign.errors import SymalignError
    from symalign.probe.families import probe_moe_block

    model = make("mixtral", **SMALL)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[3] *= 1e3
    with pytest.raises(SymalignError, match="routing is not generic"):
        probe_moe_block(get_adapter(model), model, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_hf_matches_on_the_real_attention_layer(family):
    """``symalign probe --hf`` (its API): the declared attention group of layer 0, QK-norm gains included (OLMoE),
    equals the measured nullity."""
    from symalign.probe.hf import probe_hf

    kw = dict(SMALL, moe_intermediate_size=4, shared_expert_intermediate_size=4) if family == "qwen2_moe" else SMALL
    (row,) = probe_hf(_configs()[family][1](**kw))
    assert row.family == get_adapter(make(family)).family and row.match, row.to_dict()
    assert ("qkgain.0" in row.group) == (family == "olmoe")


def test_streamed_attention_alignment(tmp_path, capsys, monkeypatch):
    """``align --stream`` (layer by layer, each layer checked in a one-layer model of the family, in float64
    with RMSNorm, QK-norm and router kept in float64): OLMoE's planted attention element is recovered."""
    fam, _ = _planted_dirs("olmoe", "attention", torch.float64, tmp_path)
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--stream", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["after"]["total"] <= 1e-8 and info["check"]["rel"] <= 1e-12
    o, b = _from(tmp_path / "OUT", "olmoe", torch.float64), _from(tmp_path / "B", "olmoe", torch.float64)
    assert rel(output(float64_numerics(o), _ids()), output(float64_numerics(b), _ids())) <= 1e-10


def test_compose_and_invert_reindex_the_experts_blocks():
    """``W'[e] = sigma_e W[pi(e)]``: composing two elements re-indexes the per-expert unit permutations by the
    expert permutation, so compose/invert are exact on the coupled pair."""
    from symalign.spec import compose

    prep = _prepared(make("qwen2_moe"))
    spec, st = prep.spec, prep.state
    g, h = sample(spec, 11), sample(spec, 12)
    names = [t for t in spec.tensors if "experts" in t or "mlp.gate." in t]

    def dist(x, y):
        return max(float((x[t] - y[t]).abs().max()) for t in names)

    assert dist(apply(spec, compose(spec, g, h), st), apply(spec, g, apply(spec, h, st))) <= 1e-12
    assert dist(apply(spec, invert(spec, g), apply(spec, g, st)), st) <= 1e-12
    assert not torch.equal(g["expert_ff.0"][g["experts.0"]], g["expert_ff.0"])  # the re-indexing matters here


@pytest.mark.parametrize("universe", [False, True], ids=["pairwise", "universe"])
@pytest.mark.slow
def test_merge_of_a_planted_pair_is_a(universe, tmp_path, capsys, monkeypatch):
    """``symalign merge --scope model``: B = g . A merged with A computes A's function (saved per expert)."""
    _planted_dirs("qwen2_moe", "model", torch.float64, tmp_path)
    out = tmp_path / "M"
    code, _, err = run_symalign(monkeypatch, capsys, "merge", tmp_path / "A", tmp_path / "B", "-o", out, "--scope",
                                "model", *(["--universe"] if universe else []))
    assert code == 0, err
    m, a = _from(out, "qwen2_moe", torch.float64), _from(tmp_path / "A", "qwen2_moe", torch.float64)
    assert rel(output(float64_numerics(m), _ids()), output(float64_numerics(a), _ids())) <= 1e-10
