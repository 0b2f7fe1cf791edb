"""Merging models of different hidden widths: :func:`symalign.tracing.widths.merge_widths` and
``symalign merge --module pkg.mod:factory A.pt B.pt -o OUT.pt --widths 6,4``."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import _trace_models as M
from _cli_util import run_symalign
from symalign.errors import MatchError
from symalign.match.widen import merge_units, split_spec, widen
from symalign.spec import apply, sample
from symalign.tracing import trace
from symalign.tracing.widths import merge_widths

FACTORY = textwrap.dedent("""
    import torch, _trace_models as M

    def relu(width):
        return M.mlp((8, width, width, 3), ("relu",)), torch.randn(16, 8)

    def gelu(width):
        return M.mlp((8, width, 3), ("gelu",)), torch.randn(16, 8)

    def normed(width):
        return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3)), \\
            torch.randn(16, 8)

    def fixed():
        return M.mlp((8, 4, 3))
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    pkg = tmp_path / "usermods"
    pkg.mkdir()
    (pkg / "wfacts.py").write_text(FACTORY)
    monkeypatch.chdir(pkg)
    monkeypatch.syspath_prepend(str(pkg))
    yield "wfacts"
    sys.modules.pop("wfacts", None)


def _model(widths, acts=("relu",), seed=0):
    torch.manual_seed(seed)
    return M.mlp(widths, acts)


@pytest.mark.slow
def test_planted_widening_merges_back_to_the_wide_model():
    """A = a split of B with its units shuffled: matched splitting and alignment give back A exactly, so the
    merge is A; the left inverse merges A's copies back into B."""
    narrow, wide = _model((8, 4, 5, 3), seed=1), _model((8, 7, 9, 3), seed=2)
    x = torch.randn(16, 8)
    tn, tw = trace(narrow, x), trace(wide, x)
    spl = split_spec(tn.spec, tw.spec)
    sb = {k: v.detach().double() for k, v in narrow.state_dict().items()}
    splits = {n: g.sample(5 + i) for i, (n, g) in enumerate(spl.spaces.items())}
    shuffle = {n: torch.randperm(g.n, generator=torch.Generator().manual_seed(9)) for n, g in tw.spec.spaces.items()}
    sa = apply(tw.spec, shuffle, widen(spl, splits, sb))
    res = merge_widths(wide.double(), narrow.double(), sa, sb, x.double())
    assert res.widen_check.passed and res.widen_check.exact.passed
    assert res.alignment.distance_after <= 1e-10
    assert all(float((res.state[k] - sa[k]).abs().max()) <= 1e-10 for k in sa)
    back = merge_units(spl, splits, widen(spl, splits, sb))
    assert all(float((back[k] - sb[k]).abs().max()) <= 1e-12 for k in sb)


@pytest.mark.slow
def test_planted_transformer_ff_widths_are_recovered():
    """A ViT whose FF is wider: A = g . split(B) with g a random element of every traced space (residual
    stream, heads, QK, VO, FF units). The matched split (after aligning B's equal-width spaces) recovers A;
    the uniform split cannot."""
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    wide = M.EncoderViT(d_ff=48).double().eval()
    narrow = M.randomise(M.EncoderViT(d_ff=32), 2).double().eval()
    tn, tw = trace(narrow, x), trace(wide, x)
    spl = split_spec(tn.spec, tw.spec)
    assert sorted(spl.spaces) == ["ff.0", "ff.1"]
    sb = {k: v.detach() for k, v in narrow.state_dict().items()}
    splits = {n: g.sample(5 + i) for i, (n, g) in enumerate(spl.spaces.items())}
    sa = apply(tw.spec, sample(tw.spec, 11), widen(spl, splits, sb))
    matched = merge_widths(wide, narrow, sa, sb, x)
    assert matched.widen_check.exact.rel <= 1e-10
    assert matched.alignment.distance_after <= 1e-7
    uniform = merge_widths(wide, narrow, sa, sb, x, split="uniform")
    assert uniform.alignment.distance_after > 0.1


def test_a_norm_over_the_units_is_refused():
    def normed(w):
        torch.manual_seed(w)
        return torch.nn.Sequential(torch.nn.Linear(8, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                                   torch.nn.LayerNorm(w), torch.nn.Linear(w, 3))

    wide, narrow = normed(6), normed(4)
    x = torch.randn(16, 8)
    with pytest.raises(MatchError):
        merge_widths(wide, narrow, wide.state_dict(), narrow.state_dict(), x)


@pytest.mark.parametrize("fn,order", [("relu", "6,4"), ("relu", "4,6"), ("gelu", "6,4")])
def test_cli_merges_different_widths(factory, tmp_path, monkeypatch, capsys, fn, order):
    wa, wb = map(int, order.split(","))
    mods = __import__(factory)
    ma, x = getattr(mods, fn)(wa)
    mb, _ = getattr(mods, fn)(wb)
    M.randomise(ma, 1), M.randomise(mb, 2)
    torch.save(ma.state_dict(), tmp_path / "a.pt")
    torch.save(mb.state_dict(), tmp_path / "b.pt")
    code, out, err = run_symalign(monkeypatch, capsys, "merge", "--module", f"{factory}:{fn}", tmp_path / "a.pt",
                                  tmp_path / "b.pt", "-o", tmp_path / "out.pt", "--widths", order, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["width"] == 6 and res["widen_check"]["passed"] and res["check"]["passed"]
    assert res["spaces"] and all("->6" in s for s in res["spaces"].values())
    merged = torch.load(tmp_path / "out.pt")
    wide, _ = getattr(mods, fn)(6)
    wide.load_state_dict(merged)  # a state dict of the wide model
    first_wide = wa > wb
    ref = merge_widths(*(((ma, mb) if first_wide else (mb, ma))),
                       *(((ma.state_dict(), mb.state_dict())) if first_wide else (mb.state_dict(), ma.state_dict())),
                       x)
    assert all(torch.equal(merged[k], ref.state[k]) for k in merged)


@pytest.mark.parametrize("args,match", [
    (["--widths", "64"], "two positive integers"),
    (["--widths", "a,b"], "two positive integers"),
    (["--widths", "0,4"], "two positive integers"),
    (["--widths", "6,6"], "two different"),
    ([], "give --widths"),
    (["--widths", "4,6"], "checkpoint A (width 4 by --widths): tensor '0.weight' has shape (6, 8)"),
    (["--widths", "6,4", "--split-units", "random"], "unknown --split"),
])
def test_cli_refuses_bad_widths(factory, tmp_path, monkeypatch, capsys, args, match):
    mods = __import__(factory)
    torch.save(mods.relu(6)[0].state_dict(), tmp_path / "a.pt")
    torch.save(mods.relu(4)[0].state_dict(), tmp_path / "b.pt")
    code, out, err = run_symalign(monkeypatch, capsys, "merge", "--module", f"{factory}:relu", tmp_path / "a.pt",
                                  tmp_path / "b.pt", "-o", tmp_path / "out.pt", *args)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists()


def test_cli_refusals_without_module_or_width_factory(factory, tmp_path, monkeypatch, capsys):
    mods = __import__(factory)
    torch.save(mods.relu(6)[0].state_dict(), tmp_path / "a.pt")
    torch.save(mods.relu(4)[0].state_dict(), tmp_path / "b.pt")
    base = ["merge", tmp_path / "a.pt", tmp_path / "b.pt", "-o", tmp_path / "out.pt"]
    for extra, match in [(["--widths", "6,4"], "needs --module"),
                         (["--module", f"{factory}:fixed", "--widths", "6,4"], "takes no width"),
                         (["--module", f"{factory}:normed", "--widths", "6,4"], "not elementwise")]:
        if "normed" in extra[1]:
            torch.save(mods.normed(6)[0].state_dict(), tmp_path / "a.pt")
            torch.save(mods.normed(4)[0].state_dict(), tmp_path / "b.pt")
        code, _, err = run_symalign(monkeypatch, capsys, *base, *extra)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_benchmark_writes_its_tables(tmp_path, monkeypatch):
    """benchmarks/merge_widths.py on two tiny pairs: every method's summary is the mean of its rows, and the
    paired differences are those of the rows."""
    import importlib.util
    import statistics
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("merge_widths_bench", root / "benchmarks" / "merge_widths.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "mw.json"
    monkeypatch.setattr(sys, "argv", ["merge_widths.py", "--pairs", "2", "--wide", "12", "--narrow", "8",
                                      "--epochs", "1", "--learned-steps", "3", "--out", str(out)])
    bench.main()
    res = json.loads(out.read_text())
    assert res["provenance"]["seed_pairs"] == 2
    rows = res["rows"]
    assert len(rows) == 2 * len(bench.METHODS)
    assert all(r["widened_change_f64"] <= 1e-10 and r["widened_change_f32"] <= 1e-5 for r in rows)
    for s in res["summary"]:
        sel = [r["loss_barrier"] for r in rows if r["method"] == s["method"]]
        assert s["pairs"] == 2 and abs(s["loss_barrier"] - statistics.mean(sel)) <= 1e-12
    diff = {d["alignment"]: d for d in res["tables"]["difference"]["rows"]}
    by = {(r["pair"], r["split"], r["aligned"]): r["loss_barrier"] for r in rows}
    want = statistics.mean(by[p, "matched", "weight"] - by[p, "uniform", "weight"] for p in (0, 1))
    assert abs(diff["weight-matched"]["barrier_diff"] - want) <= 1e-12
