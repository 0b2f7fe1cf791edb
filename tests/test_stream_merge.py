"""``symalign merge --stream``: tensor-by-tensor averages, bit-identical to the in-memory merge, bounded memory."""

from __future__ import annotations

import json

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import make_model
from test_stream import _nothing_written, _pair, _run_cli_rss, _state, _write_llama


def _merge(monkeypatch, capsys, *args):
    return run_symalign(monkeypatch, capsys, "merge", *map(str, args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_streamed_merge_bit_identical_to_in_memory(dtype, tmp_path, capsys, monkeypatch):
    """Same aligned checkpoints, same float64 sums: the streamed output equals the in-memory one bit for bit,
    laid out like the first checkpoint (shard names, index), in its dtype (the attention scope: one alignment
    engine on both paths)."""
    _, _, da, db = _pair(tmp_path, dtype=dtype)
    args = [da, db, "--weights", "0.3,0.7", "--json", "--scope", "attention"]
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "STR", "--stream")
    assert code == 0, err
    info = json.loads(out)
    assert info["loads"]["class"] == "LlamaForCausalLM" and info["aligned"][0]["check"]["exact"]["rel"] < 1e-8
    mem, st = _state(tmp_path / "MEM"), _state(tmp_path / "STR")
    assert set(mem) == set(st)
    for k in mem:
        assert st[k].dtype == dtype and torch.equal(mem[k], st[k]), k
    assert sorted(p.name for p in (tmp_path / "STR").glob("*.safetensors")) == \
        sorted(p.name for p in da.glob("*.safetensors"))
    assert json.loads((tmp_path / "STR" / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((da / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((tmp_path / "STR" / "symalign.json").read_text())["streamed"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


def test_streamed_naive_merge_is_the_average(tmp_path, capsys, monkeypatch):
    """--no-align --stream: every float tensor is round(w_A A + w_B B) (float64 sum), checked against a direct
    average."""
    _, _, da, db = _pair(tmp_path, shard=None)
    code, out, err = _merge(monkeypatch, capsys, da, db, "--no-align", "--stream", "--weights", "1,3",
                            "-o", tmp_path / "OUT", "--json")
    assert code == 0, err
    a, b, m = _state(da), _state(db), _state(tmp_path / "OUT")
    for k in a:
        want = (0.25 * a[k].double() + 0.75 * b[k].double()).to(a[k].dtype)
        assert torch.equal(m[k], want), k


@pytest.mark.parametrize("extra", [["--universe"], ["--scope", "residual"]])
def test_streamed_merge_refusals_write_nothing(extra, tmp_path, capsys, monkeypatch):
    _, _, da, db = _pair(tmp_path)
    code, out, err = _merge(monkeypatch, capsys, da, db, "--stream", *extra, "-o", tmp_path / "OUT")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert _nothing_written(tmp_path)


def test_streamed_merge_refuses_different_shapes(tmp_path, capsys, monkeypatch):
    _, _, da, _ = _pair(tmp_path)
    make_model("llama", seed=1, intermediate_size=48).save_pretrained(tmp_path / "C", max_shard_size="20KB")
    code, out, err = _merge(monkeypatch, capsys, da, tmp_path / "C", "--stream", "-o", tmp_path / "OUT")
    assert code == 2, err
    assert _nothing_written(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_streamed_merge_peak_memory_independent_of_depth(scope, tmp_path):
    """Peak RSS of a 16-layer streamed merge exceeds the 2-layer merge's by less than one layer (float32, sharded)."""
    layer_bytes = 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048 + 2 * 512)
    peaks = {}
    for layers in (2, 16):
        d = tmp_path / f"L{layers}"
        _write_llama(d / "A", layers, 0, "6MB")
        _write_llama(d / "B", layers, 1, "6MB")
        peaks[layers], _ = _run_cli_rss(["merge", str(d / "A"), str(d / "B"), "-o", str(d / "OUT"), "--stream",
                                         "--scope", scope, "--max-sweeps", "2"])
        assert (d / "OUT" / "model.safetensors.index.json").is_file()
    grow = peaks[16] - peaks[2]
    print(f"merge --scope {scope}: peak RSS 2 layers {peaks[2] / 2**20:.1f} MiB, "
          f"16 layers {peaks[16] / 2**20:.1f} MiB, "
          f"difference {grow / 2**20:.1f} MiB, one layer {layer_bytes / 2**20:.1f} MiB")
    assert grow < layer_bytes


def test_streamed_merge_names_a_non_finite_input(tmp_path, capsys, monkeypatch):
    """A NaN in the second model's tensor (found from the average): one line naming that model's file, exit 2."""
    from safetensors.torch import load_file, save_file

    _, _, da, db = _pair(tmp_path, shard=None, dtype=torch.bfloat16)
    f = db / "model.safetensors"
    st = load_file(str(f))
    k = next(n for n in st if n.endswith("mlp.up_proj.weight"))
    st[k][3, 5] = float("nan")
    save_file(st, str(f), metadata={"format": "pt"})
    code, out, err = _merge(monkeypatch, capsys, da, db, "--no-align", "--stream", "-o", tmp_path / "OUT")
    assert code == 2 and len(err.strip().splitlines()) == 1 and k in err and str(db) in err, err
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
@pytest.mark.slow
def test_streamed_model_scope_merge_matches_in_memory(dtype, tol, tmp_path, capsys, monkeypatch):
    """merge --stream --scope model = the in-memory merge --scope model: A averaged in its folded form, B aligned by
    the streamed passes. The passes are the in-memory sweeps up to float64 rounding (amplified by the polar factor
    over the sweeps: 1e-9 on a float64 checkpoint, as the streamed align test); float32 storage rounds the
    aligned weights, so an O(1e-12) move can flip a last bit: 1e-6 relative to the largest weight (~8 float32 ulps).
    The output loads with from_pretrained and keeps A's layout; the aligned check is the AlignResult entry."""
    from symalign.jobs.interpolate import load_hf_model

    _, _, da, db = _pair(tmp_path, dtype=dtype, tie_word_embeddings=False)
    args = [da, db, "--scope", "model", "--weights", "0.4,0.6", "--json"]
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    mem_info = json.loads(out)
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "STR", "--stream")
    assert code == 0, err
    info = json.loads(out)
    assert info["scope"] == "model" and info["loads"]["class"] == "LlamaForCausalLM"
    check = info["aligned"][0]["check"]
    assert set(check) == set(mem_info["aligned"][0]["check"]) and check["passed"] and check["exact"]["rel"] < 1e-6
    mem, st = _state(tmp_path / "MEM"), _state(tmp_path / "STR")
    assert set(mem) == set(st)
    scale = max(float(v.abs().max()) for v in mem.values())
    worst = max(float((mem[k].double() - st[k].double()).abs().max()) for k in mem)
    print(f"{dtype}: worst |streamed - in-memory| = {worst:.3g} (largest weight {scale:.3g})")
    assert all(st[k].dtype == dtype for k in st) and worst <= tol * scale, worst
    marker = json.loads((tmp_path / "STR" / "symalign.json").read_text())
    assert marker["folded"] is True and marker["streamed"] is True and marker["scope"] == "model"
    assert sorted(p.name for p in (tmp_path / "STR").glob("*.safetensors")) == \
        sorted(p.name for p in da.glob("*.safetensors"))
    load_hf_model(tmp_path / "STR")  # from_pretrained reads it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


def test_streamed_model_scope_merge_missing_shard_writes_nothing(tmp_path, capsys, monkeypatch):
    _, _, da, db = _pair(tmp_path)
    victim = sorted(db.glob("model-*.safetensors"))[1]
    victim.unlink()
    code, out, err = _merge(monkeypatch, capsys, da, db, "--stream", "--scope", "model", "-o", tmp_path / "OUT")
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and victim.name in lines[0], err
    assert _nothing_written(tmp_path)


def test_streamed_model_scope_merge_refuses_other_families(tmp_path, capsys, monkeypatch):
    """A family declaring no streamed model scope (T5: its layers share a head space): --stream --scope model is
    refused with one line before anything is written."""
    from hf_tiny import make_model
    from symalign.families import FAMILIES

    family = next(f.model_types[0] for f in FAMILIES if f.tiny is not None and "model" not in f.scopes.stream)
    da, db = tmp_path / "A", tmp_path / "B"
    for seed, d in ((0, da), (1, db)):
        make_model(family, dtype=torch.float32, seed=seed).save_pretrained(d)
    code, out, err = _merge(monkeypatch, capsys, da, db, "--stream", "--scope", "model", "-o", tmp_path / "OUT")
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "without --stream" in lines[0], err
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("scope", ["attention", "model"])
def test_three_model_streamed_merge_aligns_in_lockstep_and_equals_in_memory(scope, tmp_path, capsys, monkeypatch):
    """Three checkpoints: the streamed merge aligns models 2 and 3 on their own threads at once and averages their
    tensors as they arrive (nothing staged but OUT, no thread left); it equals the in-memory merge of the same
    three (bit for bit with the attention scope, to float64 rounding of the passes with the model scope)."""
    import threading

    import symalign.stream.merge as smerge

    _, _, da, db = _pair(tmp_path, dtype=torch.float64)
    dc = tmp_path / "C"
    make_model("llama", dtype=torch.float64, seed=2).save_pretrained(dc, max_shard_size="20KB")
    args = [da, db, dc, "--weights", "0.2,0.3,0.5", "--scope", scope, "--max-sweeps", "3", "--json"]
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    staged = []
    real = smerge.ShardWriter
    monkeypatch.setattr(smerge, "ShardWriter", lambda out, *x, **kw: staged.append(out) or real(out, *x, **kw))
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "STR", "--stream")
    assert code == 0, err
    info = json.loads(out)
    assert info["stream"]["aligned_in_lockstep"] == 2 and [r["model"] for r in info["aligned"]] == [str(db), str(dc)]
    assert all(r["check"]["passed"] for r in info["aligned"])
    assert [str(p) for p in staged] == [str((tmp_path / "STR").resolve())]  # no folder for the aligned models
    assert not [t for t in threading.enumerate() if t.name.startswith("symalign-merge")]
    mem, st = _state(tmp_path / "MEM"), _state(tmp_path / "STR")
    assert set(mem) == set(st)
    worst = max(float((mem[k] - st[k]).abs().max()) for k in mem)
    assert worst == 0.0 if scope == "attention" else worst <= 1e-9, worst
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_streamed_merge_stops_on_a_failing_alignment_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """A NaN in the third model's attention: its alignment thread fails while the second's runs; the merge stops
    with one line naming that file and tensor, both threads end, nothing is left."""
    import threading

    from safetensors.torch import load_file, save_file

    _, _, da, db = _pair(tmp_path, shard=None)
    dc = tmp_path / "C"
    make_model("llama", seed=2).save_pretrained(dc)
    f = dc / "model.safetensors"
    st = load_file(str(f))
    k = next(n for n in st if n.endswith("layers.1.self_attn.q_proj.weight"))
    st[k][0, 0] = float("nan")
    save_file(st, str(f), metadata={"format": "pt"})
    code, out, err = _merge(monkeypatch, capsys, da, db, dc, "--stream", "--scope", "attention", "-o",
                            tmp_path / "OUT")
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and k in lines[0] and str(dc) in lines[0], err
    assert _nothing_written(tmp_path)
    for t in threading.enumerate():
        if t.name.startswith("symalign-merge"):
            t.join(timeout=10)
    assert not [t for t in threading.enumerate() if t.name.startswith("symalign-merge") and t.is_alive()]


def test_one_layer_models_are_built_one_at_a_time(tmp_path, monkeypatch):
    """Building a check model sets process-wide state (the default dtype: float64 for a float64 checkpoint; the
    RNG seed) and restores it; merge producers build them on threads, so builds take turns and the default dtype
    is float32 afterwards."""
    import threading
    import time

    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.stream.layercheck import LayerChecker

    _, _, da, _ = _pair(tmp_path, dtype=torch.float64, shard=None)
    ck = open_checkpoint(da)
    cls = ck.adapter.model_class(ck.config)
    real = cls._from_config.__func__
    inside, most = [0], [0]

    def slow(klass, *a, **kw):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        try:
            return real(klass, *a, **kw)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(cls, "_from_config", classmethod(slow))
    errors = []

    def build():
        try:
            LayerChecker(ck.config, ck.adapter, "model.layers.0.", shrink_ff=False, layer_params=10_000)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert most[0] == 1 and torch.get_default_dtype() == torch.float32
