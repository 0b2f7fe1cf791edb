"""Training: determinism, resume, checkpoints, NaN stop, re-init scopes, CLI errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from symalign.checkpoint import load_run, load_model, save_run
from symalign.errors import CheckpointError, SymalignError
from symalign.models import build_model
from symalign.models.config import SCOPES
from symalign.reinit import reinit
from symalign.train import TrainConfig, train

VIT = dict(family="vit", d_model=16, n_layers=2, n_heads=2, d_ff=32, pe="rope", patch_size=4)
GPT = dict(family="gpt", d_model=16, n_layers=1, n_heads=2, d_ff=32, pe="learned")


@pytest.fixture(autouse=True)
def _setup(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMALIGN_CACHE", str(tmp_path / "cache"))


def _run(out, steps=6, stop_at=None, resume=False, model=VIT, data="synthetic", lr=3e-3, **opts):
    tc = TrainConfig(steps=steps, batch_size=16, lr=lr, eval_every=3, context=16, seed=7, warmup=2)
    return train(dict(model), data, tc, out, data_options=opts, resume=resume, device="cpu", stop_at=stop_at,
                 progress=False)


def _weights(out):
    return load_run(out).state


def test_determinism_and_resume_equal_uninterrupted(tmp_path):
    _run(tmp_path / "a")
    _run(tmp_path / "b")
    _run(tmp_path / "c", stop_at=3)
    assert load_run(tmp_path / "c").meta["step"] == 3
    _run(tmp_path / "c", resume=True)
    a, b, c = _weights(tmp_path / "a"), _weights(tmp_path / "b"), _weights(tmp_path / "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert not torch.equal(a["head.weight"], build_model(load_run(tmp_path / "a").config, 7).head.weight)


def test_lm_resume_and_checkpoint_logits(tmp_path):
    meta = _run(tmp_path / "g", model=GPT, kind="lm")
    _run(tmp_path / "h", model=GPT, kind="lm", stop_at=4)
    _run(tmp_path / "h", model=GPT, kind="lm", resume=True)
    g, h = _weights(tmp_path / "g"), _weights(tmp_path / "h")
    assert all(torch.equal(g[k], h[k]) for k in g)
    assert "val_loss" in meta["metrics"] and "test_loss" in meta["metrics"]
    model, ck = load_model(tmp_path / "g")
    assert model.head.weight is model.tok_emb.weight  # tying survives the round trip
    x = torch.randint(0, 256, (2, 16))
    again, _ = load_model(ck.path)
    assert torch.equal(model(x), again(x))
    # save/load round trip of an arbitrary model gives identical logits
    path = save_run(tmp_path / "rt", model, {**ck.meta, "step": 1})
    third, _ = load_model(path)
    assert torch.equal(model(x), third(x))


def test_nan_loss_stops_with_step_and_keeps_checkpoint(tmp_path):
    with pytest.raises(SymalignError, match=r"at step \d+"):
        _run(tmp_path / "n", steps=40, lr=1e30)
    # a first good checkpoint (if any) is still loadable
    if (tmp_path / "n" / "latest").exists():
        load_run(tmp_path / "n")


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    _run(tmp_path / "a", steps=3)
    ck = load_run(tmp_path / "a")
    f = ck.path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        load_run(tmp_path / "a")
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_run(tmp_path / "a", verify=False)
    (ck.path / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="config.json.*JSON"):
        load_run(tmp_path / "a")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_run(tmp_path / "empty")
    # mismatched: weights of another shape under a config
    _run(tmp_path / "b", steps=3)
    ckb = load_run(tmp_path / "b")
    meta = json.loads((ckb.path / "config.json").read_text())
    meta["model"]["d_ff"] = 64
    (ckb.path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"fc_in\.(weight|bias).*shape"):
        load_model(tmp_path / "b")
    with pytest.raises(CheckpointError, match="differ"):
        _run(tmp_path / "b", steps=4, resume=True)


def test_reinit_scopes(tmp_path):
    base = build_model(dict(VIT, image_size=8, channels=1, n_classes=4), seed=0)
    expect = {
        "first-attention": lambda n: n.startswith("blocks.0.attn."),
        "all-attention": lambda n: ".attn." in n,
        "first-block": lambda n: n.startswith("blocks.0."),
        "full": lambda n: True,
    }
    fresh = dict(build_model(base.cfg, seed=5).named_parameters())
    for scope in SCOPES:
        model, names = reinit(base, scope, seed=5, freeze=True)
        params = dict(model.named_parameters())
        base_p = dict(base.named_parameters())
        assert set(names) == {n for n in params if expect[scope](n)} and names
        for n, p in params.items():
            if n in names:
                assert torch.equal(p, fresh[n]) and p.requires_grad
            else:
                assert torch.equal(p, base_p[n]) and not p.requires_grad


def _cli(monkeypatch, capsys, *args):
    from symalign.cli import main

    monkeypatch.setattr(sys, "argv", ["symalign", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr()


@pytest.mark.parametrize("args,word", [
    (["--pe", "nope"], "pe="),
    (["--data", "no-such-dataset"], "unknown dataset"),
    (["--d-model", "18", "--heads", "4"], "divisible"),
    (["--d-model", "12", "--heads", "4"], "even"),
    (["--family", "gpt", "--data", "digits"], "--family vit"),
])
def test_cli_bad_input_exit_2(monkeypatch, capsys, tmp_path, args, word):
    code, out = _cli(monkeypatch, capsys, "train", "--out", str(tmp_path / "x"), "--steps", "1", *args)
    assert code == 2
    assert word in out.err and len(out.err.strip().splitlines()) == 1


def test_cli_trains_and_prints_json(monkeypatch, capsys, tmp_path):
    from symalign.cli import main

    monkeypatch.setattr(sys, "argv", ["symalign", "train", "--family", "encoder", "--data", "synthetic", "--d-model",
                                      "16", "--heads", "2", "--layers", "1", "--steps", "3", "--batch-size", "8",
                                      "--out", str(tmp_path / "e"), "--json", "--threads", "1"])
    # the synthetic dataset defaults to images; the encoder needs text -> exit 2 with the fix
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "--family vit" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["symalign", "train", "--family", "vit", "--data", "synthetic", "--d-model",
                                      "16", "--heads", "2", "--layers", "1", "--steps", "3", "--batch-size", "8",
                                      "--out", str(tmp_path / "v"), "--json", "--threads", "1"])
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None)
    meta = json.loads(capsys.readouterr().out)
    assert meta["step"] == 3 and "test_accuracy" in meta["metrics"]


def test_cli_head_dim_decouples_heads_from_width(monkeypatch, capsys, tmp_path):
    """--head-dim: a width-24 model with 2 heads of 8 (the width-heterogeneous pairs need it)."""
    from symalign.cli import main

    monkeypatch.setattr(sys, "argv", ["symalign", "train", "--family", "vit", "--data", "synthetic", "--d-model",
                                      "24", "--heads", "2", "--head-dim", "8", "--layers", "1", "--steps", "2",
                                      "--batch-size", "8", "--out", str(tmp_path / "w"), "--json", "--threads", "1"])
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None)
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["d_model"] == 24 and model["n_heads"] == 2 and model["head_dim"] == 8
