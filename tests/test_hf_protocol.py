"""``hf:`` model families inside the experiment protocol (symalign.models.hf).

Each family is built from config, trained a few steps by symalign's trainer, checkpointed
(bit-exact round trip), re-initialised per scope (exactly the scope's tensors, checked
against hand-written name patterns of the transformers layouts), aligned through its
adapter (planted recovery: B = g . A for a random g of the declared group), and run end
to end by ``run_experiment``; bad input fails before any training.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import randomize  # noqa: E402
from _whole_util import check_whole_model_scopes  # noqa: E402
from _match_util import rel  # noqa: E402

from symalign.checkpoint import load_model, save_run  # noqa: E402
from symalign.data import load_dataset  # noqa: E402
from symalign.errors import ConfigError  # noqa: E402
from symalign.experiments import parse_config, run_experiment  # noqa: E402
from symalign.experiments.config import load_experiment_config  # noqa: E402
from symalign.experiments.protocol import match_scope, relative_output_change, scope_spaces, summary_row  # noqa: E402
from symalign.lmc import full_state  # noqa: E402
from symalign.models import HFConfig, build_model  # noqa: E402
from symalign.families import FAMILIES as REGISTERED  # noqa: E402
from symalign.models.hf import FAMILIES, HFModel, fit_hf_config, whole_model_refusal  # noqa: E402
from symalign.models.config import SCOPES  # noqa: E402
from symalign.reinit import reinit  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402
from symalign.train import TrainConfig, train  # noqa: E402

ROOT = Path(__file__).parent.parent
CONTEXT = 16
SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
LM, TEXT, IMAGE = ("synthetic", {"kind": "lm"}), ("synthetic", {"kind": "text"}), ("synthetic", {"kind": "image"})
TINY = {  # family -> ([model] section, (data, data_options))
    "gpt2": ({"n_embd": 16, "n_layer": 2, "n_head": 4, "n_inner": 32}, LM),
    "llama": ({**SMALL, "num_key_value_heads": 2}, LM),  # grouped-query attention
    "mistral": ({**SMALL, "num_key_value_heads": 2}, LM),
    "qwen2": ({**SMALL, "num_key_value_heads": 2}, LM),
    "bert": (dict(SMALL), TEXT),
    "roformer": ({**SMALL, "embedding_size": 16}, TEXT),
    "modernbert": (dict(SMALL), TEXT),
    "vit": ({**SMALL, "patch_size": 4}, IMAGE),
}
# hand-written patterns of the transformers 5.x names (independent of the adapters)
ATTENTION = {"gpt2": r"\.h\.(\d+)\.attn\.", "llama": r"\.layers\.(\d+)\.self_attn\.",
             "mistral": r"\.layers\.(\d+)\.self_attn\.", "qwen2": r"\.layers\.(\d+)\.self_attn\.",
             "bert": r"\.layer\.(\d+)\.attention\.(self\.|output\.dense\.)",
             "roformer": r"\.layer\.(\d+)\.attention\.(self\.|output\.dense\.)",
             "modernbert": r"\.layers\.(\d+)\.attn\.", "vit": r"\.layers\.(\d+)\.attention\."}
BLOCK0 = r"\.(h|layers|layer)\.0\."
PE = {"gpt2": "learned", "bert": "learned", "vit": "learned", "llama": "rope", "mistral": "rope", "qwen2": "rope",
      "roformer": "rope", "modernbert": "rope"}


def model_section(family: str, **kw) -> dict:
    return {"family": f"hf:{family}", **TINY[family][0], **kw}


def fitted(family: str, **kw) -> HFConfig:
    data, opts = TINY[family][1]
    return fit_hf_config(model_section(family, **kw), load_dataset(data, **opts), CONTEXT)


def whole_supported(family: str) -> bool:
    return whole_model_refusal(FAMILIES[family], fitted(family).hf) is None


def function_tol(family: str) -> float:
    """float64 check: Llama-style RMSNorm and ModernBERT's RoPE compute in float32 whatever the weights."""
    from symalign.families import get_adapter

    floor = get_adapter({"model_type": family}).precision_floor
    return max(1e-9, floor, 1e-6 if family in ("llama", "mistral", "qwen2") else 0.0)


def batch(family: str, model, n: int = 4):
    from symalign.data import eval_batches

    data, opts = TINY[family][1]
    ds = load_dataset(data, **opts)
    x, _ = next(eval_batches(ds, "test", n, CONTEXT))
    return x.to(next(model.parameters()).dtype) if x.is_floating_point() else x


def test_every_adapted_family_is_available():
    from symalign.families import model_types

    # every hf: protocol family has an adapter; the later families of symalign.families (GPT-NeoX, Qwen3,
    # Gemma...) are available to align / interpolate / probe but not (yet) as hf: experiment families
    assert set(FAMILIES) <= set(model_types()) and set(FAMILIES) == set(TINY)
    for name, fam in FAMILIES.items():
        assert fam.pe == PE[name]


@pytest.mark.parametrize("family", list(TINY))
def test_config_fits_the_data_and_round_trips(family):
    cfg = fitted(family)
    data, opts = TINY[family][1]
    ds = load_dataset(data, **opts)
    hc = cfg.hf_config()
    assert cfg.family == f"hf:{family}" and cfg.pe == PE[family] and cfg.n_layers == 2
    if ds.modality in ("lm", "text"):
        assert hc.vocab_size == 256 and hc.max_position_embeddings == (CONTEXT if ds.modality == "lm" else 16)
    if ds.modality in ("text", "image"):
        assert hc.num_labels == ds.n_classes
    if ds.modality == "image":
        assert (hc.image_size, hc.num_channels, hc.patch_size) == (8, 1, 4)
    back = HFConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.to_dict() == cfg.to_dict()
    from symalign.models.hf import _normalised

    assert _normalised(back.hf_config()) == cfg.hf  # the stored transformers config rebuilds itself


@pytest.mark.parametrize("family", list(TINY))
def test_seeded_build_trains_and_checkpoint_round_trips_exactly(family, tmp_path):
    cfg = fitted(family)
    a, a2, b = build_model(cfg, 0), build_model(cfg, 0), build_model(cfg, 1)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(v, a2.state_dict()[k]) for k, v in sa.items())
    assert any(not torch.equal(v, sb[k]) for k, v in sa.items() if v.is_floating_point())
    assert all(v.dtype == torch.float32 for v in sa.values() if v.is_floating_point())

    data, opts = TINY[family][1]
    tc = TrainConfig(steps=4, batch_size=8, lr=3e-3, eval_every=0, eval_items=16, context=CONTEXT, seed=0)
    meta = train(model_section(family), data, tc, tmp_path / "run", data_options=opts, progress=False)
    assert meta["step"] == 4 and all(torch.isfinite(torch.tensor(h["train_loss"])) for h in meta["history"])
    m, ck = load_model(tmp_path / "run")
    assert isinstance(m, HFModel) and ck.config.to_dict() == cfg.to_dict()
    trained = m.state_dict()
    assert any(not torch.equal(v, sa[k]) for k, v in trained.items() if v.is_floating_point())  # it trained
    save_run(tmp_path / "again", m, {**ck.meta, "step": 4})
    m2, _ = load_model(tmp_path / "again")
    assert trained.keys() == m2.state_dict().keys()
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in trained.items())
    x = batch(family, m)
    m.eval(), m2.eval()
    with torch.no_grad():
        assert torch.equal(m(x), m2(x))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("family", list(TINY))
def test_reinit_touches_exactly_the_scope(family, scope):
    cfg = fitted(family)
    base, fresh = build_model(cfg, 0), build_model(cfg, 5)
    model, names = reinit(base, scope, 5, freeze=True)
    params = dict(model.named_parameters())
    if scope == "full":
        expect = set(params)
    elif scope == "first-block":
        expect = {n for n in params if re.search(BLOCK0, n)}
    else:
        layers = {"0"} if scope == "first-attention" else {"0", "1"}
        expect = {n for n in params if (m := re.search(ATTENTION[family], n)) and m.group(1) in layers}
    assert set(names) == expect and expect
    bp, fp = dict(base.named_parameters()), dict(fresh.named_parameters())
    for n, p in params.items():
        assert torch.equal(p, fp[n] if n in expect else bp[n]), n
        built_trainable = fp[n].requires_grad  # e.g. RoFormer's sinusoidal table is fixed
        assert p.requires_grad == (built_trainable and n in expect), n


@pytest.mark.parametrize("family", list(TINY))
def test_planted_recovery_through_the_adapter(family):
    """B = g . A for a random g of the all-attention group: B computes A's function, and
    matching B to A recovers A (<= 1e-8 relative in float64)."""
    model = build_model(fitted(family), 0)
    randomize(model.hf, 3)  # O(1) weights and biases: every part of the group is exercised
    model = model.double().eval()
    spec = model.symmetry_spec()
    spec = spec.restrict(scope_spaces(spec, "all-attention", model.cfg.n_layers))
    assert set(spec.spaces) == {f"{k}.{i}" for k in ("heads", "qk", "vo") for i in range(2)}
    sa = full_state(model)
    sb = {**sa, **apply(spec, sample(spec, 11), sa)}
    x = batch(family, model)
    tol = function_tol(family)
    assert rel(sa, sb, list(spec.tensors)) > 0.1
    assert relative_output_change(model, sb, sa, x) <= tol  # g is an exact symmetry
    m = match_scope(spec, sa, sb, True, "full")
    sb2 = {**sb, **apply(spec, m.transform, sb)}
    assert rel(sa, sb2, list(spec.tensors)) <= 1e-8
    assert relative_output_change(model, sb2, sb, x) <= tol  # B' computes B's function


@pytest.mark.parametrize("scope", ["first-block", "full"])
@pytest.mark.parametrize("family", list(TINY))
def test_planted_whole_model_recovery(family, scope):
    """first-block / full through symalign.families.prepare's whole-model spec (full: in its rewritten
    coordinates, where the residual stream has its group: O(D), O_1(D) or S_D)."""
    assert whole_supported(family)
    model = build_model(fitted(family), 0)
    randomize(model.hf, 4)
    model = model.double().eval()
    arch = model.rewritten_model()[0] if scope == "full" else model
    x = batch(family, model)
    tol = function_tol(family)
    assert relative_output_change(arch, full_state(arch), full_state(model), x, model) <= tol  # the rewrite is exact
    spec = arch.symmetry_spec()
    spec = spec.restrict(scope_spaces(spec, scope, 2))
    assert ("residual" in spec.spaces) == (scope == "full") and "ff.0" in spec.spaces
    sa = full_state(arch)
    sb = {**sa, **apply(spec, sample(spec, 12), sa)}
    assert rel(sa, sb, list(spec.tensors)) > 0.1
    m = match_scope(spec, sa, sb, True, "full")
    sb2 = {**sb, **apply(spec, m.transform, sb)}
    assert rel(sa, sb2, list(spec.tensors)) <= 1e-8
    assert relative_output_change(arch, sb2, sb, x) <= tol


# ----------------------------------------------------------------------------
# run_experiment end to end
# ----------------------------------------------------------------------------

TRAIN = {"steps": 4, "batch_size": 8, "lr": 3e-3, "eval_every": 0, "eval_items": 16, "context": CONTEXT}
PROTOCOL = {"scopes": ["all-attention"], "points": 3, "eval_items": 16, "variants": ["orthogonal", "full"]}


def experiment(family: str, name: str | None = None, **protocol) -> dict:
    data, opts = TINY[family][1]
    return {"name": name or f"hf-{family}", "data": data, "data_options": opts, "model": model_section(family),
            "train": TRAIN, "protocol": {**PROTOCOL, **protocol}}


@pytest.fixture(scope="module")
def builtin_result(tmp_path_factory):
    """A built-in model through the same protocol: the reference for the results' layout."""
    cfg = {"name": "builtin", "data": "synthetic", "data_options": {"kind": "image"},
           "model": {"family": "vit", "pe": "rope", "d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 32,
                     "patch_size": 4}, "train": TRAIN, "protocol": PROTOCOL}
    return run_experiment(parse_config(cfg), tmp_path_factory.mktemp("builtin"), progress=False)[0]


def _keys(res: dict) -> tuple:
    v = next(iter(res["variants"].values()))
    return (sorted(res), sorted(res["naive"]), sorted(v), sorted(v["curve"]), sorted(res["stage1"][0]),
            sorted(summary_row("x", res)))


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "vit", "roformer", "modernbert"])
@pytest.mark.slow
def test_run_experiment_writes_the_builtin_results(family, builtin_result, tmp_path):
    device = "auto" if family == "vit" else "cpu"  # auto: the GPU when there is one (here: the CPU)
    (res,) = run_experiment(parse_config(experiment(family, device=device)), tmp_path, progress=False)
    on_disk = json.loads((tmp_path / f"hf-{family}" / "all-attention" / "results.json").read_text())
    assert on_disk["family"] == f"hf:{family}" and on_disk["pe"] == PE[family] and on_disk["scope"] == "all-attention"
    assert _keys(on_disk) == _keys(builtin_result)
    assert set(on_disk["variants"]) == {"orthogonal", "full"}
    for v in on_disk["variants"].values():
        assert v["function_change"] <= 1e-4
        assert v["curve"]["loss"][0] == pytest.approx(on_disk["naive"]["loss"][0], rel=1e-9)  # same A
        assert v["curve"]["loss"][-1] == pytest.approx(on_disk["naive"]["loss"][-1], rel=1e-4)  # B' ~ B
        assert len(v["curve"]["t"]) == 3
    assert on_disk["layers_aligned"] == [0, 1]
    assert (tmp_path / f"hf-{family}" / "all-attention" / "curves.png").stat().st_size > 1000
    assert f"hf-{family}" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_run_experiment_whole_model_scopes(family, tmp_path):
    """first-block and full through run_experiment: Llama (GQA, RMSNorm folded: O(D)) and GPT-2 (LayerNorm
    folded, head untied: O_1(D)); the other families' whole-model specs are covered by the planted tests."""
    cfg = experiment(family, scopes=["first-block", "full"], variants=["full"])
    check_whole_model_scopes(run_experiment(parse_config(cfg), tmp_path, progress=False))


# ----------------------------------------------------------------------------
# bad input: refused before any training
# ----------------------------------------------------------------------------


# registered families without an hf: experiment model (they align, interpolate and probe)
NOT_EXPERIMENT = [f.model_types[0] for f in REGISTERED if f.experiment is None]


@pytest.mark.parametrize("model, msg", [
    ({"family": "hf:mamba"}, r"no adapter for 'mamba'; supported: hf:gpt2, hf:llama"),
    *[({"family": f"hf:{mt}"}, rf"'{mt}' has an adapter.*not an hf: experiment family; supported: hf:gpt2")
      for mt in NOT_EXPERIMENT],
    ({"family": "hf:bloom"}, r"ALiBi.*supported: hf:gpt2"),
    ({"family": "hf:gpt2", "n_embed": 16}, r"unknown key \[model\] 'n_embed'.*GPT2Config"),
    ({"family": "hf:llama", "hidden_size": 16, "num_hidden_layer": 2}, r"'num_hidden_layer'"),
    ({"family": "hf:gpt2", "dtype": "float64"}, r"'dtype' cannot be set.*float32"),
    ({"family": "hf:gpt2", "attn_implementation": "flash"}, r"attn_implementation='flash'"),
])
def test_bad_model_sections_fail_at_parse_time(model, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config({"name": "x", "data": "synthetic", "model": model})


def test_protocol_device_is_validated_and_recorded_only_when_set():
    with pytest.raises(ConfigError, match=r"protocol.device='gpu'; use one of auto, cpu, cuda"):
        parse_config(experiment("gpt2", device="gpu"))
    assert "device" not in parse_config(experiment("gpt2")).to_dict()["protocol"]  # older stores compare equal
    cfg = parse_config(experiment("gpt2", device="auto"))
    assert parse_config(json.loads(json.dumps(cfg.to_dict()))).protocol.device == "auto"


def test_unsupported_scopes_refused_at_parse_time(monkeypatch):
    """A family symalign.families does not map (simulated) and a tied Llama get only the attention scopes."""
    import symalign.families as families

    parse_config(experiment("bert", scopes=["all-attention", "full"]))
    mapped = families.model_types()
    monkeypatch.setattr(families, "model_types", lambda: [s for s in mapped if s != "bert"])
    with pytest.raises(ConfigError, match=r"protocol.scopes \['full'\]: hf:bert supports the scopes "
                                          r"first-attention, all-attention; .*hf:gpt2"):
        parse_config(experiment("bert", scopes=["all-attention", "full"]))
    parse_config(experiment("bert", scopes=["first-attention", "all-attention"]))
    with pytest.raises(ConfigError, match="tie_word_embeddings = false"):
        parse_config({**experiment("llama", scopes=["first-block"]),
                      "model": model_section("llama", tie_word_embeddings=True)})


@pytest.mark.parametrize("family, patch, data, msg", [
    ("gpt2", {"vocab_size": 100}, LM, r"vocab_size=100 does not fit.*vocabulary of 256.*vocab_size >= 256"),
    ("llama", {"max_position_embeddings": 8}, LM, r"max_position_embeddings=8 .*training context 16"),
    ("gpt2", {"n_positions": 8}, LM, r"n_positions=8 .*set n_positions >= 16"),
    ("bert", {"num_labels": 3}, TEXT, r"num_labels=3 does not fit .*classes: 4.*set num_labels = 4"),
    ("bert", {"vocab_size": 128}, TEXT, r"vocab_size=128"),
    ("vit", {"image_size": 16}, IMAGE, r"image_size=16 does not fit .*image size 8"),
    ("vit", {"num_channels": 3}, IMAGE, r"num_channels=3 .*channels: 1"),
    ("vit", {"patch_size": 3}, IMAGE, r"patch_size=3 must divide the image size 8"),
    ("gpt2", {}, IMAGE, r"is an image dataset, but hf:gpt2 is built for a language-modelling corpus; use a "
                        r"family among hf:vit"),
    ("bert", {}, LM, r"hf:bert is built for a labelled text dataset; use a family among hf:gpt2"),
    ("bert", {"hidden_size": 18}, TEXT, r"hf:bert: transformers cannot build this model"),
])
def test_dataset_head_mismatch_fails_before_training(family, patch, data, msg, tmp_path):
    cfg = {**experiment(family), "data": data[0], "data_options": data[1], "model": model_section(family, **patch)}
    with pytest.raises(ConfigError, match=msg):
        run_experiment(parse_config(cfg), tmp_path, progress=False)
    assert not any(tmp_path.rglob("latest")) and not any(tmp_path.rglob("model.safetensors"))


def test_scope_override_is_checked_before_training(tmp_path):
    """``symalign experiment --scope full`` replaces the parsed scopes: run_experiment checks them again."""
    from symalign.experiments.config import Protocol

    cfg = parse_config({**experiment("llama"), "model": model_section("llama", tie_word_embeddings=True)})
    cfg.protocol = Protocol(**{**vars(cfg.protocol), "scopes": ["full"]})
    with pytest.raises(ConfigError, match="tie_word_embeddings = false"):
        run_experiment(cfg, tmp_path, progress=False)
    assert not any(tmp_path.rglob("model.safetensors"))


# ----------------------------------------------------------------------------
# shipped configs
# ----------------------------------------------------------------------------

PAPER = sorted((ROOT / "configs" / "paper").glob("*.toml"))


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_configs_parse(path):
    cfg = load_experiment_config(path)  # every key, and the scopes against the family
    assert cfg.name == path.stem and cfg.protocol.points == 25
    assert {"first-attention", "all-attention"} <= set(cfg.protocol.scopes)


def test_paper_grid_expands():
    from symalign.experiments.sweep import load_grid

    grid = load_grid(ROOT / "configs" / "grids" / "paper.toml")
    assert {r.config.model["family"] for r in grid.runs} >= {"hf:vit", "hf:gpt2", "hf:llama", "hf:bert"}
    assert len(grid.runs) == 4 * len(PAPER)
    for run in grid.runs:  # each case is its configs/paper file, one scope per run
        paper = load_experiment_config(ROOT / "configs" / "paper" / f"{run.overrides['case']}.toml")
        got = run.config
        assert (got.data, got.model, got.train, got.data_options) == (paper.data, paper.model, paper.train,
                                                                     paper.data_options)
        assert {**vars(got.protocol), "scopes": paper.protocol.scopes} == vars(paper.protocol)
        assert got.protocol.scopes == [run.overrides["protocol.scopes"][0]]


def test_shakespeare_pair_configs_match_the_builtin_budget():
    builtin = load_experiment_config(ROOT / "configs" / "gpt-shakespeare-rope.toml")
    for name in ("hf-gpt2-shakespeare", "hf-llama-shakespeare"):
        cfg = load_experiment_config(ROOT / "configs" / f"{name}.toml")
        assert cfg.train == builtin.train and cfg.data == builtin.data == "shakespeare"
        assert cfg.protocol.scopes == ["all-attention"] and cfg.protocol.variants == ["none", "orthogonal", "full"]
        hc = HFConfig(cfg.model["family"], "lm", {k: v for k, v in cfg.model.items() if k != "family"}).hf_config()
        assert (hc.hidden_size, hc.num_hidden_layers, hc.num_attention_heads) == (128, 2, 4)
        assert (getattr(hc, "n_inner", None) or hc.intermediate_size) == 512


@pytest.mark.parametrize("family", ["gpt2", "modernbert"])
@pytest.mark.slow
def test_learned_variant_on_fused_families(family, tmp_path):
    """GPT-2's ``c_attn`` and ModernBERT's ``Wqkv`` hold Q|K|V side by side: the ``learned`` variant refines
    the ``full`` result through the segments (it used to raise after training the models)."""
    cfg = experiment(family, scopes=["all-attention", "full"], variants=["full", "learned"], learned_steps=3,
                     method_batch_size=8)
    results = {r["scope"]: r for r in run_experiment(parse_config(cfg), tmp_path, progress=False)}
    assert set(results) == {"all-attention", "full"}
    for r in results.values():
        learned = r["variants"]["learned"]
        assert learned["function_change"] <= 1e-4
        assert learned["match"]["method"] == "learned" and learned["match"]["steps"] == 3
        assert learned["match"]["selected"] in ("learned", "weight")
        assert learned["curve"]["loss"][-1] == pytest.approx(r["naive"]["loss"][-1], rel=1e-4)
