"""Experiment configs: every shipped config parses; bad keys and values fail before any training."""

from __future__ import annotations

from pathlib import Path

import pytest

from symalign.errors import ConfigError, SymalignError
from symalign.experiments.config import load_experiment_config, parse_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_parse(path):
    cfg = load_experiment_config(path)
    assert cfg.name == path.stem
    assert cfg.protocol.points == 25


BASE = {"name": "x", "data": "digits", "model": {"family": "vit", "pe": "rope"}}


@pytest.mark.parametrize("patch, msg", [
    ({"extra": 1}, "unknown key 'extra'"),
    ({"model": {"family": "vit", "pe": "rope", "widht": 3}}, r"unknown key \[model\] 'widht'"),
    ({"train": {"stpes": 3}}, r"\[train\] 'stpes'"),
    ({"protocol": {"scopes": ["all-attention", "some-attention"]}}, "unknown scope 'some-attention'"),
    ({"protocol": {"scopes": []}}, "scopes is empty"),
    ({"protocol": {"variants": ["fancy"]}}, "unknown stage-2 variant"),
    ({"protocol": {"seeds": [1, 1]}}, "two different seeds"),
    ({"data": "cifar-1000"}, "unknown dataset"),
    ({"train": {"steps": 0}}, "steps must be a positive integer"),
    ({"protocol": {"scopes": ["full"], "methods": ["weight", "magic"]}}, "unknown method 'magic'"),
    ({"protocol": {"scopes": ["all-attention"], "methods": ["learned"]}}, "applies to the 'full' scope"),
    ({"protocol": {"scopes": ["full"], "methods": ["learned"], "learned_steps": -1}}, "learned_steps must be"),
    ({"protocol": {"learned_lambda": [0.6, 0.4]}}, r"learned_lambda must be \[lo, hi\]"),
    ({"protocol": {"learned_lambda": [0.4]}}, "learned_lambda must be"),
    ({"protocol": {"learned_lambda": [-0.1, 0.5]}}, "learned_lambda must be"),
    ({"protocol": {"eval_split": "holdout"}}, r"protocol.eval_split='holdout'; use one of test, val, train"),
])
def test_bad_configs_name_the_key(patch, msg):
    with pytest.raises(SymalignError, match=msg):
        parse_config({**BASE, **patch})


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config"):
        load_experiment_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_experiment_config(bad)


def test_model_scope_is_full_and_methods_default_off():
    cfg = parse_config({**BASE, "protocol": {"scopes": ["model"], "methods": ["weight", "learned"]}})
    assert cfg.protocol.scopes == ["full"] and cfg.protocol.methods == ["weight", "learned"]
    assert "methods" in cfg.to_dict()["protocol"]
    plain = parse_config(BASE).to_dict()["protocol"]  # defaults are left out (sweep stores compare equal)
    assert not {"methods", "learned_steps", "method_batch_size", "learned_lambda", "eval_split"} & set(plain)


def test_train_and_model_configs_refuse_unknown_keys_alike():
    from dataclasses import asdict

    from symalign.models.config import ModelConfig
    from symalign.train import TrainConfig

    tc = TrainConfig(steps=3)
    assert TrainConfig.from_dict(asdict(tc)) == tc
    with pytest.raises(ConfigError, match="unknown train config key"):
        TrainConfig.from_dict({**asdict(tc), "stepz": 4})
    with pytest.raises(ConfigError, match="unknown model config key"):
        ModelConfig.from_dict({"family": "vit", "d_modle": 8})


def test_hf_families_without_activation_sites_refuse_activation_matching_before_training():
    """Activation matching reads the family's activation sites: an hf: family whose adapter declares none
    (BERT) is refused by parse_config, before anything trains; a decoder family (Llama) declares them and
    parses, and weight / learned matching (which read only the spec) parse for both."""
    def cfg(family: str, methods: list[str]) -> dict:
        return {"name": "x", "data": "synthetic", "model": {"family": family, "hidden_size": 16,
                                                            "num_hidden_layers": 1, "num_attention_heads": 2},
                "train": {"steps": 1}, "protocol": {"scopes": ["full"], "methods": methods}}

    with pytest.raises(ConfigError, match="protocol.methods: activation: hf:bert declares no activation sites"):
        parse_config(cfg("hf:bert", ["activation"]))
    assert parse_config(cfg("hf:llama", ["activation"])).protocol.methods == ["activation"]
    for family in ("hf:bert", "hf:llama"):
        assert parse_config(cfg(family, ["weight", "learned"])).protocol.methods == ["weight", "learned"]
