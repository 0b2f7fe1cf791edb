"""Activation matching through the activation-site protocol (symalign.nn.sites) on an ``hf:`` family.

A rewritten tiny Llama (GQA, RMSNorm folded: residual ``O(D)``) as model A, model B = g . A for a
random g of the whole-model group: activation matching, which reads the activations through the
family's declared sites (no module names in the matcher), recovers g^-1 on the FF units, the heads
and the stream, and B aligned computes B's function through transformers' own forward. The protocol
runs the ``activation`` method on ``hf:llama`` end to end, and a family without sites is refused by
``parse_config`` before anything trains.

GPT-2 (Conv1D output projections, LayerNorm folded: the centred ``O_1(D)`` stream) runs the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import randomize  # noqa: E402
from test_hf_protocol import TINY, batch, experiment, fitted  # noqa: E402

from symalign.errors import ConfigError, MatchError  # noqa: E402
from symalign.experiments import parse_config, run_experiment  # noqa: E402
from symalign.experiments.metrics import relative_output_change  # noqa: E402
from symalign.lmc import full_state  # noqa: E402
from symalign.match.activations import activation_sites, match_activations  # noqa: E402
from symalign.models import build_model  # noqa: E402
from symalign.models.hf import FAMILIES, activation_refusal  # noqa: E402
from symalign.spec import apply, invert, sample  # noqa: E402


def _pair(family: str):
    model = build_model(fitted(family), 0)
    randomize(model.hf, 4)
    a = model.double().eval().rewritten_model()[0].eval()
    spec = a.symmetry_spec()
    g = sample(spec, 7)
    b = copy.deepcopy(a)
    b.load_state_dict(apply(spec, g, a.state_dict()))
    return a, b, spec, g


def test_sites_name_spec_spaces_and_modules_of_the_model():
    model = build_model(fitted("llama"), 0)
    sites = model.activation_sites()
    spec = model.rewritten_model()[0].symmetry_spec()
    n = model.cfg.n_layers
    assert [s.space for s in sites] == [x for i in range(n) for x in ("residual", f"ff.{i}", f"heads.{i}")] \
        + ["residual"]
    assert {s.space for s in sites} <= set(spec.spaces)
    mods = set(map(id, model.modules()))
    assert all(id(s.module) in mods for s in sites)
    hf = model.hf.model
    assert sites[0].module is hf.layers[0] and sites[1].module is hf.layers[0].mlp.down_proj
    assert sites[2].module is hf.layers[0].self_attn.o_proj and sites[-1].module is hf.norm


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_planted_recovery_from_activations_on_hf(family):
    """Llama (GQA, RMSNorm folded: O(D)) and GPT-2 (LayerNorm folded: O_1(D), Conv1D output projections)."""
    a, b, spec, g = _pair(family)
    x = batch(family, a, n=8)
    res = match_activations(a, b, x)
    ginv = invert(spec, g)
    for i in range(a.cfg.n_layers):
        assert torch.equal(res.transform[f"ff.{i}"], ginv[f"ff.{i}"])
        assert torch.equal(res.transform[f"heads.{i}"], ginv[f"heads.{i}"])
    # transformers' RMSNorm normalises in float32 whatever the weights: the stream statistics carry ~1e-7 error;
    # GPT-2's rewritten stream is mean-free, so O is determined on 1^perp only (the centred group fixes 1)
    r = g["residual"]
    centre = torch.eye(r.shape[0], dtype=torch.float64) - 1.0 / r.shape[0]
    assert float(((res.transform["residual"] - ginv["residual"]) @ r @ centre).abs().max()) <= 1e-6
    sa, sb = full_state(a), full_state(b)
    sb2 = {**sb, **res.apply(sb)}
    assert all(float((sb2[t] - sa[t]).abs().max()) <= 1e-6 * (1 + float(sa[t].abs().max())) for t in spec.tensors)
    # through transformers' forward: B aligned computes B's function (Llama's RMSNorm runs in float32)
    assert relative_output_change(a, sb2, sb, x, b) <= 1e-6


ALL = ["weight", "activation", "learned"]


@pytest.mark.slow
@pytest.mark.parametrize("family, methods", [("llama", ALL), ("gpt2", ALL), ("modernbert", ["weight", "learned"])])
def test_hf_methods_end_to_end(family, methods, tmp_path):
    """``protocol.methods`` on hf: families: weight, activation (through the sites) and learned matching
    of two independent trainings, each aligned B' checked to compute B's function (ModernBERT: fused
    ``Wqkv``, no sites: weight and learned only)."""
    cfg = experiment(family, scopes=["full"], variants=["full"], methods=methods, learned_steps=2,
                     method_batch_size=4)
    (res,) = run_experiment(parse_config(cfg), tmp_path, progress=False)
    assert list(res["methods"]) == methods
    for method, entry in res["methods"].items():
        assert entry["function_change"] <= 1e-4
        assert entry["match"]["method"] == method
        assert entry["curve"]["loss"][-1] == pytest.approx(res["naive"]["loss"][-1], rel=1e-4)
    assert res["methods"]["learned"]["match"]["steps"] == 2


@pytest.mark.parametrize("family", sorted(TINY))
def test_families_without_sites_are_refused_at_parse_time(family, tmp_path):
    """One place (parse_config) decides: a family whose adapter declares no sites is refused before anything
    trains; one that declares them parses."""
    cfg = experiment(family, scopes=["full"], methods=["activation"])
    why = activation_refusal(FAMILIES[family])
    if why is None:
        assert parse_config(cfg).protocol.methods == ["activation"]
        return
    with pytest.raises(ConfigError, match=rf"protocol.methods: activation: hf:{family} declares no activation sites"):
        parse_config(cfg)
    parse_config(experiment(family, scopes=["full"], methods=["weight", "learned"]))  # these read only the spec


def test_decoder_families_declare_sites_and_a_model_without_them_is_refused():
    for family in ("llama", "mistral", "qwen2", "gpt2"):
        assert activation_refusal(FAMILIES[family]) is None
    with pytest.raises(MatchError, match="declares no activation sites"):
        activation_sites(torch.nn.Linear(2, 2))
