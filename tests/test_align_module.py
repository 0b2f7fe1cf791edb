"""``symalign align --module pkg.mod:factory A.pt B.pt -o OUT`` and :func:`symalign.tracing.align.align_states`."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import _trace_models as M
from _cli_util import run_symalign
from symalign.errors import CheckpointError
from symalign.spec import apply, sample
from symalign.tracing import trace
from symalign.tracing.align import align_states

FACTORY = textwrap.dedent("""
    import torch, _trace_models as M

    def vit():
        torch.manual_seed(0)
        return M.EncoderViT(), torch.randn(3, 1, 8, 8)

    def mlp():
        m = M.mlp((8, 16, 12, 3), ("relu", "tanh"))
        m.example_inputs = torch.randn(4, 8)
        return m

    def nothing():
        return M.mlp((8, 4))

    def vgg():
        return M.randomise(M.VGG(), 0).eval(), torch.randn(3, 1, 8, 8)

    def convnext():
        return M.randomise(M.ConvNeXtTiny(), 0).eval(), torch.randn(3, 1, 8, 8)
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    pkg = tmp_path / "usermods"
    pkg.mkdir()
    (pkg / "facts.py").write_text(FACTORY)
    monkeypatch.chdir(pkg)
    monkeypatch.syspath_prepend(str(pkg))
    yield "facts"
    sys.modules.pop("facts", None)


def planted(model, x, seed=3):
    """A (random weights) and B = g . A + small noise, float32."""
    M.randomise(model, seed)
    res = trace(model, x)
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b64 = apply(res.spec, sample(res.spec, seed + 1), {k: v.double() for k, v in a.items()})
    b = {k: v.float() for k, v in b64.items()}
    return a, b


def test_planted_vit_cli_recovers_a_and_keeps_b(factory, tmp_path, capsys, monkeypatch):
    from facts import vit

    model, x = vit()
    a, b = planted(model, x)
    torch.save(a, tmp_path / "A.pt")
    torch.save(b, tmp_path / "B.pt")
    code, out, err = run_symalign(monkeypatch, capsys, "align", "--module", f"{factory}:vit", tmp_path / "A.pt",
                                  tmp_path / "B.pt", "-o", tmp_path / "out" / "B_aligned.pt", "--scope", "model",
                                  "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["distance"]["before"]["total"] > 0.5 and info["distance"]["after"]["total"] < 1e-5
    assert info["path"] == "module" and info["check"]["exact"]["dtype"] == "float64"
    assert info["check"]["exact"]["rel"] <= 1e-10 and info["check"]["passed"]
    bp = torch.load(tmp_path / "out" / "B_aligned.pt", weights_only=True)
    with torch.no_grad():  # independently: B' computes B's function through the module's own forward
        model.load_state_dict(b)
        yb = model(x)
        model.load_state_dict(bp)
        assert float((model(x) - yb).abs().max() / yb.abs().max()) <= 1e-5
    assert {"heads.0", "qk.0", "vo.0", "residual", "ff.0"} <= set(info["group"]["spaces"])


def test_mlp_attention_scope_refused_and_the_default_aligns_the_whole_module(factory, tmp_path, capsys, monkeypatch):
    """--module defaults to --scope model (an MLP or a CNN has no attention) and says so; --scope attention on a
    module without attention is one line, exit 2, nothing written."""
    from facts import mlp

    model = mlp()
    a, b = planted(model, model.example_inputs)
    torch.save(a, tmp_path / "A.pt")
    torch.save(b, tmp_path / "B.pt")
    args = ["align", "--module", f"{factory}:mlp", tmp_path / "A.pt", tmp_path / "B.pt", "-o", tmp_path / "O.pt"]
    code, out, err = run_symalign(monkeypatch, capsys, *args, "--scope", "attention")
    assert code == 2 and "no attention layer" in err and "--scope model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "O.pt").exists()
    code, out, err = run_symalign(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "whole-model distance to A" in out and "note: scope: model, the default for --module" in out
    explicit = ["align", "--module", f"{factory}:mlp", tmp_path / "A.pt", tmp_path / "B.pt", "-o", tmp_path / "E.pt"]
    code, out2, err = run_symalign(monkeypatch, capsys, *explicit, "--scope", "model")
    assert code == 0, err
    assert torch.equal(torch.cat([v.flatten() for v in torch.load(tmp_path / "O.pt").values()]),
                       torch.cat([v.flatten() for v in torch.load(tmp_path / "E.pt").values()]))
    code, out, err = run_symalign(monkeypatch, capsys, *args)
    assert code == 2 and "already exists" in err


@pytest.mark.parametrize("kind", ["spec", "no-inputs", "bad-state", "missing"])
def test_bad_input_one_line_exit_2_nothing_written(kind, factory, tmp_path, capsys, monkeypatch):
    from facts import mlp

    model = mlp()
    torch.save(model.state_dict(), tmp_path / "A.pt")
    torch.save({"0.weight": torch.zeros(3)} if kind == "bad-state" else model.state_dict(), tmp_path / "B.pt")
    module = {"spec": "facts.mlp", "no-inputs": f"{factory}:nothing"}.get(kind, f"{factory}:mlp")
    b = tmp_path / ("nope.pt" if kind == "missing" else "B.pt")
    code, out, err = run_symalign(monkeypatch, capsys, "align", "--module", module, tmp_path / "A.pt", b, "-o",
                                  tmp_path / "O.pt", "--scope", "model")
    assert code == 2 and err.startswith("symalign: error:") and len(err.strip().splitlines()) == 1
    want = {"spec": "package.module:factory", "no-inputs": "example inputs", "bad-state": "does not fit",
            "missing": "is not a file"}[kind]
    assert want in err
    assert not (tmp_path / "O.pt").exists()


def test_align_states_api_rejects_foreign_state():
    model = M.mlp((4, 6, 2), ("relu",))
    with pytest.raises(CheckpointError, match="does not fit"):
        align_states(model, model.state_dict(), {"x": torch.zeros(1)}, torch.randn(2, 4))


def test_attention_scope_recovers_a_planted_attention_element_through_fused_segments():
    model = M.randomise(M.EncoderViT(), 4)
    x = torch.randn(2, 1, 8, 8)
    res = trace(model, x)
    att = [k for k in res.spec.spaces if k.split(".")[0] in ("heads", "qk", "vo")]
    sub = res.spec.restrict(att)
    a = {k: v.detach().double() for k, v in model.state_dict().items()}
    b = apply(sub, sample(sub, 11), a)
    out = align_states(model.double(), a, b, x.double(), scope="attention", traced=res)
    assert out.distance_before > 0.3 and out.distance_after < 1e-8
    assert out.verify.exact.rel <= 1e-10 and out.verify.passed
    assert set(out.match.transform) == set(att)


def _pair(tmp_path, model, seeds=(1, 2)):
    for name, seed in zip(("A.pt", "B.pt"), seeds):
        torch.save({k: v.clone() for k, v in M.randomise(model, seed).state_dict().items()}, tmp_path / name)


def test_coverage_in_summary_and_json(factory, tmp_path, capsys, monkeypatch):
    from facts import vgg

    model, _ = vgg()
    _pair(tmp_path, model)
    args = ["align", "--module", f"{factory}:vgg", tmp_path / "A.pt", tmp_path / "B.pt", "--scope", "model"]
    code, out, err = run_symalign(monkeypatch, capsys, *args, "-o", tmp_path / "O.pt", "--strict")
    assert code == 0, err
    assert "of the parameters" in out and "left unchanged: nothing but the model's output axes" in out
    code, out, err = run_symalign(monkeypatch, capsys, *args, "-o", tmp_path / "O2.pt", "--json")
    cov = json.loads(out)["coverage"]
    assert cov["left"] == [] and cov["unchanged"] == ["classifier.3.bias"] and 0.99 < cov["fraction"] < 1
    assert cov["aligned"] + 10 == cov["total"]


def test_strict_refuses_partial_alignment(factory, tmp_path, capsys, monkeypatch):
    from facts import convnext

    model, _ = convnext()
    _pair(tmp_path, model)
    args = ["align", "--module", f"{factory}:convnext", tmp_path / "A.pt", tmp_path / "B.pt", "-o",
            tmp_path / "O.pt", "--scope", "model"]
    code, out, err = run_symalign(monkeypatch, capsys, *args, "--strict")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "left unchanged" in err and "grouped" in err
    assert not (tmp_path / "O.pt").exists()
    code, out, err = run_symalign(monkeypatch, capsys, *args)  # without --strict: aligned, and said so
    assert code == 0, err
    assert "left unchanged: 1 part: " in out and "grouped convolution" in out
    code, out, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A.pt", tmp_path / "B.pt", "-o",
                                  tmp_path / "O3", "--strict")
    assert code == 2 and "--strict applies to --module" in err
