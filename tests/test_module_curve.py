"""LMC curves of any torch module: BatchNorm reset at every point, REPAIR, ``symalign interpolate --module``."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

import _trace_models as M
from _cli_util import run_symalign
from symalign import lmc
from symalign.errors import SymalignError
from symalign.jobs.module_curve import Repair, module_curve, repair_sites, reset_batchnorm


def _data(n=96, shape=(1, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def _batches(x, y, size=32):
    def gen():
        for lo in range(0, len(y), size):
            yield x[lo:lo + size], y[lo:lo + size]
    return gen


def _states(model, seeds=(1, 2)):
    return [{k: v.detach().clone() for k, v in M.randomise(model, s).state_dict().items()} for s in seeds]


def test_reset_recomputes_the_running_statistics_of_every_batchnorm_layer():
    model = M.ResNet()
    sa, _ = _states(model)
    model.load_state_dict(sa)
    x, y = _data()
    seen_in = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen_in.setdefault(n, []).append(i[0].detach()))
             for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    reset_batchnorm(model, _batches(x, y, size=len(y)))  # one batch: the statistics of that batch
    for h in hooks:
        h.remove()
    assert not model.training and len(seen_in) == 9
    for n, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            z = seen_in[n][0].transpose(0, 1).reshape(m.num_features, -1).double()
            torch.testing.assert_close(m.running_mean.double(), z.mean(1), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(m.running_var.double(), z.var(1, unbiased=True), rtol=1e-5, atol=1e-6)
            assert m.momentum == 0.1  # restored


def test_bn_reset_is_on_by_default_only_where_there_is_batchnorm_and_changes_the_curve():
    x, y = _data()
    test, train = _batches(x[:48], y[:48]), _batches(x[48:], y[48:])
    model = M.ResNet()
    sa, sb = _states(model)
    on = module_curve(model, sa, sb, test, train, points=3)
    off = module_curve(model, sa, sb, test, train, points=3, bn_reset=False)
    assert on.bn_reset and not off.bn_reset and len(on.batchnorm) == 9 and on.reset_items == 48
    assert on.to_dict()["bn_reset"] is True
    # without the reset the curve is lmc.curve's (stored, interpolated statistics)
    plain = lmc.curve(model, sa, sb, test, points=3)
    assert off.curve.loss == pytest.approx(plain.loss, rel=1e-12)
    assert on.curve.loss[1] != pytest.approx(off.curve.loss[1], rel=1e-3)
    # the endpoints with the reset: the model with its statistics recomputed, measured as it is then
    model.load_state_dict(sb)
    reset_batchnorm(model, train)
    assert on.curve.loss[-1] == pytest.approx(lmc.evaluate(model, lmc.full_state(model), test)[0], rel=1e-12)
    mlp = M.mlp((64, 16, 10), ("relu",))
    a, b = _states(mlp)
    flat = _batches(x.reshape(len(x), -1), y)
    assert not module_curve(mlp, a, b, flat, None, points=3).bn_reset
    with pytest.raises(SymalignError, match="training batches"):
        module_curve(model, sa, sb, test, None, points=3)


def test_repair_renormalises_each_site_to_the_interpolated_endpoint_statistics():
    x, y = _data(shape=(64,))
    train = _batches(x, y, size=len(y))  # one batch: calibration is exact
    model = M.mlp((64, 24, 16, 10), ("relu",))
    sa, sb = _states(model)
    sites = repair_sites(model, x[:4])
    assert sites == ["0", "2"]  # the hidden Linear layers; the classifier "4" is left alone
    model.load_state_dict(sa)
    rep = Repair(model, sites)
    rep.record_endpoint(0.0, train)
    goal_a = [tuple(t.clone() for t in s) for s in rep.ends[0.0]]
    model.load_state_dict(sb)
    rep.record_endpoint(1.0, train)
    t = 0.3
    model.load_state_dict(lmc.interpolate(sa, sb, t))
    rep.calibrate(t, train)
    outs = {}
    hooks = [dict(model.named_modules())[n].register_forward_hook(lambda m, i, o, n=n: outs.__setitem__(n, o))
             for n in sites]  # registered after REPAIR's hooks: they see the renormalised outputs
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    rep.close()
    for n, (ma, sda), (mb, sdb) in zip(sites, goal_a, rep.ends[1.0]):
        o = outs[n].double()
        torch.testing.assert_close(o.mean(0), (1 - t) * ma + t * mb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.std(0, unbiased=False), (1 - t) * sda + t * sdb, rtol=1e-5, atol=1e-5)


def test_repair_leaves_the_endpoints_and_lowers_a_collapsing_midpoint():
    x, y = _data(shape=(64,), n=128)
    test, train = _batches(x[:64], y[:64]), _batches(x[64:], y[64:])
    model = M.mlp((64, 32, 32, 10), ("relu",))
    sa, sb = _states(model)
    plain = module_curve(model, sa, sb, test, train, points=5)
    rep = module_curve(model, sa, sb, test, train, points=5, repair=True)
    assert rep.repair == ["0", "2"] and plain.repair is None and rep.to_dict()["repair"] is True
    assert rep.curve.loss[0] == pytest.approx(plain.curve.loss[0], rel=1e-12)
    assert rep.curve.loss[-1] == pytest.approx(plain.curve.loss[-1], rel=1e-12)
    assert rep.curve.loss[2] != pytest.approx(plain.curve.loss[2], rel=1e-6)
    # the hooks are gone afterwards: the model computes A's function again
    with torch.no_grad():
        ref = torch.func.functional_call(model, sa, (x,))
        torch.testing.assert_close(model(x), ref)


FACTORY = textwrap.dedent("""
    import torch, _trace_models as M

    def resnet():
        return M.ResNet(), torch.randn(2, 1, 8, 8)

    def mlp():
        return M.mlp((64, 16, 10), ("relu",)), torch.randn(2, 64)

    def wide():
        return M.mlp((50, 16, 10), ("relu",)), torch.randn(2, 50)
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "curvefacts.py").write_text(FACTORY)
    monkeypatch.chdir(pkg)
    monkeypatch.syspath_prepend(str(pkg))
    yield "curvefacts"
    sys.modules.pop("curvefacts", None)


@pytest.mark.slow
def test_interpolate_module_cli_records_the_reset_and_repair(factory, tmp_path, monkeypatch, capsys):
    from curvefacts import mlp, resnet

    for name, make in (("resnet", resnet), ("mlp", mlp)):
        model, _ = make()
        for tag, seed in (("A", 1), ("B", 2)):
            torch.save(M.randomise(model, seed).state_dict(), tmp_path / f"{name}{tag}.pt")
    out = tmp_path / "curve"
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", "--module", f"{factory}:resnet",
                                     tmp_path / "resnetA.pt", tmp_path / "resnetB.pt", "--data", "digits",
                                     "--points", "3", "--eval-items", "40", "--repair", "-o", out, "--no-progress")
    assert code == 0, err
    res = json.loads((out / "results.json").read_text())
    assert res["bn_reset"] is True and res["repair"] is True and len(res["batchnorm"]) == 9
    assert res["evaluation"]["items"] == 40 and len(res["curve"]["loss"]) == 3 and (out / "curves.png").exists()
    assert "BatchNorm statistics recomputed at every point; REPAIR" in stdout
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", "--module", f"{factory}:mlp",
                                     tmp_path / "mlpA.pt", tmp_path / "mlpB.pt", "--data", "digits", "--points", "3",
                                     "--eval-items", "40", "-o", tmp_path / "c2", "--no-progress", "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["bn_reset"] is False and res["batchnorm"] == [] and res["repair"] is False


@pytest.mark.parametrize("case", ["repair-without-module", "wrong-size", "missing-file", "state-mismatch"])
def test_interpolate_module_bad_input_exits_2(factory, tmp_path, monkeypatch, capsys, case):
    from curvefacts import mlp

    model, _ = mlp()
    torch.save(M.randomise(model, 1).state_dict(), tmp_path / "A.pt")
    torch.save(M.randomise(model, 2).state_dict(), tmp_path / "B.pt")
    torch.save(M.ResNet().state_dict(), tmp_path / "R.pt")
    from curvefacts import wide

    torch.save(wide()[0].state_dict(), tmp_path / "W.pt")
    args = {"repair-without-module": ["interpolate", tmp_path / "A.pt", tmp_path / "B.pt", "--data", "digits",
                                      "--repair"],
            "wrong-size": ["interpolate", "--module", f"{factory}:wide", tmp_path / "W.pt", tmp_path / "W.pt",
                           "--data", "digits"],
            "missing-file": ["interpolate", "--module", f"{factory}:mlp", tmp_path / "A.pt", tmp_path / "nope.pt",
                             "--data", "digits"],
            "state-mismatch": ["interpolate", "--module", f"{factory}:mlp", tmp_path / "A.pt", tmp_path / "R.pt",
                               "--data", "digits"]}[case]
    want = {"repair-without-module": "apply to --module", "wrong-size": "64 values but the module's input takes 50",
            "missing-file": "no such file", "state-mismatch": "does not fit the module"}[case]
    code, out, err = run_symalign(monkeypatch, capsys, *args, "-o", tmp_path / "o", "--no-progress")
    assert code == 2 and want in err, (code, err)
    assert not (tmp_path / "o" / "results.json").exists()
