"""End to end: ``symalign align`` on saved tiny checkpoints of every family.

Planted pairs (B = g . A for a random element g of the adapter's group): OUT
computes B's function, equals A, and the reported distance falls to ~0. A
not-planted pair: OUT still computes B's function and the distance falls.
Bad inputs: exit 2, one line naming the problem, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_tiny import FAMILIES, inputs, make_model, output, rel

from symalign.families import get_adapter
from symalign.spec import apply, sample

from _cli_util import run_symalign  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """``symalign align ARGS`` in-process: (exit code, stdout, stderr)."""
    return run_symalign(monkeypatch, capsys, "align", *args)


def save_pair(tmp: Path, family: str, dtype=torch.float32, planted: bool = True, seed: int = 0):
    """Save A and B; B = g . A (planted) or an independent init. Returns (A model, B model, dirs)."""
    a = make_model(family, dtype=dtype, seed=seed)
    if planted:
        spec = get_adapter(a).spec(a)
        b = make_model(family, dtype=dtype, seed=seed)
        b.load_state_dict(apply(spec, sample(spec, seed + 7), a.state_dict()))
    else:
        b = make_model(family, dtype=dtype, seed=seed + 1)
    da, db = tmp / f"{family}_A", tmp / f"{family}_B"
    a.save_pretrained(da)
    b.save_pretrained(db)
    return a, b, da, db


def reload(model, path):
    return type(model).from_pretrained(path, dtype=model.dtype, attn_implementation="eager").eval()


def _state_rel(m1, m2) -> float:
    s1, s2 = m1.state_dict(), m2.state_dict()
    num = sum(float((s1[k].double() - s2[k].double()).pow(2).sum()) for k in s1)
    den = sum(float(s2[k].double().pow(2).sum()) for k in s1)
    return (num / den) ** 0.5


def _nothing_written(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_recovery(family, tmp_path, capsys, monkeypatch):
    a, b, da, db = save_pair(tmp_path, family)
    out = tmp_path / f"{family}_OUT"
    code, stdout, err = run_cli([da, db, "-o", out, "--json"], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    o = reload(b, out)
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= 1e-4
    assert _state_rel(o, a) <= 1e-6, _state_rel(o, a)
    assert info["distance"]["before"]["total"] > 0.1
    assert info["distance"]["after"]["total"] <= 1e-6
    assert sorted(set(os.listdir(out)) - {"symalign.json"}) == sorted(os.listdir(db))  # + the output marker
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(db / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())


@pytest.mark.slow
def test_float64_subprocess_exact(tmp_path):
    """One true subprocess run, float64 Llama (GQA + RoPE): OUT == B to 1e-9, == A to 1e-9."""
    a, b, da, db = save_pair(tmp_path, "llama", dtype=torch.float64)
    out = tmp_path / "OUT"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "symalign.cli", "align", str(da), str(db), "-o", str(out), "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["check"]["dtype"] == "float64" and info["check"]["rel"] <= 1e-9 and info["check"]["passed"]
    o = reload(b, out)
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= 1e-9
    assert _state_rel(o, a) <= 1e-9


@pytest.mark.parametrize("family,stage2", [("gpt2", "full"), ("llama", "orthogonal")])
def test_not_planted_pair(family, stage2, tmp_path, capsys, monkeypatch):
    a, b, da, db = save_pair(tmp_path, family, planted=False)
    out = tmp_path / "OUT"
    code, stdout, err = run_cli([da, db, "-o", out, "--json", "--stage2", stage2], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    o = reload(b, out)
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= 1e-4
    d0, d1 = info["distance"]["before"]["total"], info["distance"]["after"]["total"]
    print(f"{family} not planted: attention distance {d0:.4f} -> {d1:.4f} ({100 * (1 - d1 / d0):.1f}% lower); "
          f"timing {info['timings']}")
    assert d1 < 0.95 * d0


def test_stage_options_and_force(tmp_path, capsys, monkeypatch):
    a, b, da, db = save_pair(tmp_path, "gpt2")
    out = tmp_path / "OUT"
    code, stdout, err = run_cli([da, db, "-o", out, "--stage2", "none", "--no-stage1"], capsys, monkeypatch)
    assert code == 0, err
    assert "attention distance" in stdout
    first = (out / "model.safetensors").read_bytes()
    code, _, err = run_cli([da, db, "-o", out], capsys, monkeypatch)
    assert code == 2 and "--force" in err
    assert (out / "model.safetensors").read_bytes() == first  # the refusal left OUT untouched
    code, stdout, err = run_cli([da, db, "-o", out, "--force", "--json", "--stage2", "orthogonal"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(stdout)["stage2"] == "orthogonal"
    assert (out / "model.safetensors").read_bytes() != first  # replaced by the new alignment
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".OUT.")]  # no temporary folder left


def _corrupt(kind: str, da: Path, db: Path, tmp: Path) -> tuple[list, str]:
    """Damage the pair in one way; return (extra CLI args, text the error must contain)."""
    wb = db / "model.safetensors"
    if kind == "missing":
        wb.unlink()
        return [], "model.safetensors is missing"
    if kind == "truncated":
        data = wb.read_bytes()
        wb.write_bytes(data[: len(data) // 2])
        return [], "truncated"
    if kind == "config":
        cfg = json.loads((db / "config.json").read_text())
        cfg["vocab_size"] = cfg["vocab_size"] + 1
        (db / "config.json").write_text(json.dumps(cfg))
        return [], "transformer.wte.weight"
    if kind == "nan":
        from safetensors.torch import load_file, save_file

        st = load_file(str(wb))
        st["transformer.h.1.attn.c_attn.weight"][0, 0] = float("nan")
        save_file(st, str(wb), metadata={"format": "pt"})
        return [], "transformer.h.1.attn.c_attn.weight"
    if kind == "scope":
        return ["--scope", "layer"], "unknown scope"
    if kind == "stage2":
        return ["--stage2", "bogus"], "stage2"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "truncated", "config", "nan", "scope", "stage2"])
def test_bad_input(kind, tmp_path, capsys, monkeypatch):
    _, _, da, db = save_pair(tmp_path, "gpt2")
    extra, needle = _corrupt(kind, da, db, tmp_path)
    code, stdout, err = run_cli([da, db, "-o", tmp_path / "OUT", *extra], capsys, monkeypatch)
    assert code == 2, (stdout, err)
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert _nothing_written(tmp_path, "OUT")


def test_bad_pairs_and_paths(tmp_path, capsys, monkeypatch):
    _, _, da, db = save_pair(tmp_path, "gpt2")
    _, _, dl, _ = save_pair(tmp_path, "llama")
    code, _, err = run_cli([da, dl, "-o", tmp_path / "OUT"], capsys, monkeypatch)
    assert code == 2 and "gpt2" in err and "llama" in err
    big = make_model("gpt2", dtype=torch.float32, n_layer=3)
    big.save_pretrained(tmp_path / "big")
    code, _, err = run_cli([da, tmp_path / "big", "-o", tmp_path / "OUT"], capsys, monkeypatch)
    assert code == 2 and "differ" in err
    assert _nothing_written(tmp_path, "OUT")
    code, _, err = run_cli([da, db, "-o", da / "sub"], capsys, monkeypatch)
    assert code == 2 and "inside" in err and not (da / "sub").exists()
    code, _, err = run_cli([da / "sub", db, "-o", tmp_path / "OUT"], capsys, monkeypatch)
    assert code == 2 and "not a directory" in err
    assert _nothing_written(tmp_path, "OUT")


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_output_that_changes_b_is_refused_and_old_out_kept(scope, tmp_path, capsys, monkeypatch):
    """The check before writing: if OUT would not compute B's function (here: the check is told
    it differs by 0.5), nothing is written and an existing OUT survives a --force run."""
    _, _, da, db = save_pair(tmp_path, "gpt2")
    out = tmp_path / "OUT"
    code, _, err = run_cli([da, db, "-o", out, "--scope", scope], capsys, monkeypatch)
    assert code == 0, err
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr("symalign.arch.check.output_change", lambda *a, **k: (0.5, 0.5))
    code, _, err = run_cli([da, db, "-o", out, "--scope", scope, "--force"], capsys, monkeypatch)
    assert code != 0 and "refusing to write" in err and "5.00e-01" in err, err
    assert (out / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".OUT.")]
