"""Streamed ``symalign align`` (``--stream``): sharded I/O, bounded memory, exactness, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import T, make_model

ROOT = Path(__file__).resolve().parents[1]


def _save(model, path: Path, shard: str | None = None) -> Path:
    if shard:
        model.save_pretrained(path, max_shard_size=shard)
    else:
        model.save_pretrained(path)
    return path


def _pair(tmp: Path, family="llama", dtype=torch.float32, shard: str | None = "20KB", **kw):
    a = make_model(family, dtype=dtype, seed=0, **kw)
    b = make_model(family, dtype=dtype, seed=1, **kw)
    return a, b, _save(a, tmp / "A", shard), _save(b, tmp / "B", shard)


def _state(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _nothing_written(parent: Path, name: str = "OUT") -> bool:
    return not (parent / name).exists() and not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def _align(monkeypatch, capsys, *args):
    return run_symalign(monkeypatch, capsys, "align", *map(str, args))


@pytest.mark.slow
def test_sharded_run_bit_identical_to_unsharded_and_to_in_memory(tmp_path, capsys, monkeypatch):
    _, mb, da, db = _pair(tmp_path)
    assert len(list(db.glob("*.safetensors"))) > 2
    (db / "tokenizer.json").write_text('{"model": "stand-in"}')
    _save(make_model("llama", dtype=torch.float32, seed=0), tmp_path / "A1")
    _save(mb, tmp_path / "B1")
    code, out, err = _align(monkeypatch, capsys, da, db, "-o", tmp_path / "OUT", "--stream", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["stream"]["shards"] == len(list(db.glob("*.safetensors")))
    assert info["check"]["kind"] == "per-layer" and info["check"]["passed"] and info["path"] == "streamed"
    assert info["check"]["exact"]["rel"] < 1e-12 and len(info["check"]["layers"]) == 2 * mb.config.num_hidden_layers
    code, _, err = _align(monkeypatch, capsys, tmp_path / "A1", tmp_path / "B1", "-o", tmp_path / "OUT1", "--stream")
    assert code == 0, err
    code, _, err = _align(monkeypatch, capsys, tmp_path / "A1", tmp_path / "B1", "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    sharded, single, mem = _state(tmp_path / "OUT"), _state(tmp_path / "OUT1"), _state(tmp_path / "MEM")
    assert set(sharded) == set(single) == set(mem)
    for k in single:
        assert torch.equal(sharded[k], single[k]), k
        assert torch.equal(single[k], mem[k]), k  # the streamed engine computes what the in-memory one does
    # B's layout: the same shard names, the same index, the same header bytes
    assert sorted(p.name for p in (tmp_path / "OUT").glob("*.safetensors")) == sorted(p.name for p in db.glob(
        "*.safetensors"))
    assert (tmp_path / "OUT" / "model.safetensors.index.json").read_text() == (
        db / "model.safetensors.index.json").read_text()
    for f in db.glob("*.safetensors"):
        n = int.from_bytes(f.read_bytes()[:8], "little")
        assert (tmp_path / "OUT" / f.name).read_bytes()[:8 + n] == f.read_bytes()[:8 + n]
    assert (tmp_path / "OUT" / "config.json").is_file() and (tmp_path / "OUT" / "generation_config.json").is_file()
    assert (tmp_path / "OUT" / "tokenizer.json").read_text() == '{"model": "stand-in"}'


@pytest.mark.slow
def test_streamed_output_loads_and_computes_b(tmp_path, capsys, monkeypatch):
    """Through transformers' own loading and forward, float64: OUT computes B's function."""
    _, mb, da, db = _pair(tmp_path, dtype=torch.float64)
    for scope in ("attention", "model"):
        out = tmp_path / f"OUT-{scope}"
        code, text, err = _align(monkeypatch, capsys, da, db, "-o", out, "--stream", "--scope", scope,
                                 "--max-sweeps", "3", "--json")
        assert code == 0, err
        info = json.loads(text)
        m2 = T.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            y0, y1 = mb(input_ids=ids).logits, m2(input_ids=ids).logits
        rel = float((y1 - y0).norm() / y0.norm())
        assert rel < (1e-10 if scope == "attention" else 1e-6), (scope, rel)  # RMSNorm runs in float32
        assert info["distance"]["after"]["total"] < info["distance"]["before"]["total"]
        if scope == "model":
            assert info["stream"]["passes"] == info["match"]["iterations"] <= 3
            assert info["stream"]["reads"] == {"A": info["stream"]["passes"], "B": info["stream"]["passes"] + 1}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: Q/K/V biases, on which no residual acts
@pytest.mark.slow
def test_streamed_model_scope_matches_in_memory_sweeps(family, tmp_path):
    """The streamed passes are match_whole's sweeps: the same distance after every pass."""
    from symalign.commands.align import run_align

    _pair(tmp_path, family=family, dtype=torch.float64, shard="20KB", tie_word_embeddings=False)
    s = run_align(tmp_path / "A", tmp_path / "B", tmp_path / "S", scope="model", stream=True, max_sweeps=4)
    m = run_align(tmp_path / "A", tmp_path / "B", tmp_path / "M", scope="model", stream=False, max_sweeps=4)
    assert (s.path, m.path) == ("streamed", "in-memory") and s.sweeps == m.sweeps == 4
    assert set(s.to_dict()) == set(m.to_dict())  # one JSON shape for both paths
    ds, dm = s.match["distances"], m.match["distances"]
    assert len(ds) == len(dm) == 5
    for x, y in zip(ds, dm):
        assert abs(x - y) <= 1e-9 * dm[0]
    a, b = _state(tmp_path / "S"), _state(tmp_path / "M")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-9


def test_bf16_stays_bf16_and_is_the_rounded_exact_transform(tmp_path):
    """Each stored weight is round_bf16 of the float64 transform: |w - x| <= 2^-8 |x| (bf16 unit roundoff,
    8-bit significand)."""
    from symalign.families import get_adapter
    from symalign.spec import apply
    from symalign.stream.attention import run_stream_attention

    _, mb, da, db = _pair(tmp_path, dtype=torch.bfloat16)
    info = run_stream_attention(da, db, tmp_path / "OUT", progress=False, return_transform=True)
    out = _state(tmp_path / "OUT")
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    sb = {k: v.to(torch.float64) for k, v in _state(db).items()}
    spec = get_adapter(mb.config).spec(mb.config, sb.keys())
    exact = apply(spec, info.transform, sb)  # float64 products, the in-memory apply
    worst = 0.0
    for k in spec.tensors:
        x, w = exact[k], out[k].to(torch.float64)
        assert torch.equal(out[k], x.to(torch.bfloat16)), k
        err = (w - x).abs()
        assert bool((err <= 2.0 ** -8 * x.abs() + 1e-38).all()), k
        worst = max(worst, float((err / x.abs().clamp_min(1e-30)).max()))
    assert 0.99 * 2.0 ** -8 <= worst <= 2.0 ** -8  # the documented bound, and it is attained
    assert info.check.exact.rel < 1e-12 and not info.check.exact.stored  # the unrounded transform, float64
    assert info.check.rel < 5e-2 and info.check.tolerance == 8 * torch.finfo(torch.bfloat16).eps


def _shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _index(d: Path) -> Path:
    return d / "model.safetensors.index.json"


@pytest.mark.parametrize("kind", ["missing_shard", "truncated_shard", "duplicate_in_index", "tensor_in_two_shards",
                                  "index_wrong_shard", "nan_b", "nan_a_attention", "garbage_shard"])
def test_bad_input_one_line_exit_2_nothing_written(kind, tmp_path, capsys, monkeypatch):
    _pair(tmp_path)
    a, b = tmp_path / "A", tmp_path / "B"
    shards = _shard_files(b)
    if kind == "missing_shard":
        shards[1].unlink()
        want = shards[1].name
    elif kind in ("truncated_shard", "garbage_shard"):
        data = shards[-1].read_bytes()
        shards[-1].write_bytes(data[: len(data) - 7] if kind == "truncated_shard" else b"\x00" * 3 + data[:40])
        want = shards[-1].name
    elif kind == "duplicate_in_index":
        text = _index(b).read_text()
        first = json.loads(text)["weight_map"]
        name = next(iter(first))
        _index(b).write_text(text.replace('"weight_map": {', f'"weight_map": {{\n    "{name}": "{first[name]}",', 1))
        want = "twice"
    elif kind == "tensor_in_two_shards":
        from safetensors.torch import load_file, save_file

        s0, s1 = load_file(str(shards[0])), load_file(str(shards[1]))
        k = next(iter(s0))
        save_file({**s1, k: s0[k]}, str(shards[1]), metadata={"format": "pt"})
        want = k
    elif kind == "index_wrong_shard":
        idx = json.loads(_index(b).read_text())
        k = next(iter(idx["weight_map"]))
        idx["weight_map"][k] = shards[-1].name if idx["weight_map"][k] != shards[-1].name else shards[0].name
        _index(b).write_text(json.dumps(idx))
        want = "index"
    else:
        from safetensors.torch import load_file, save_file

        d = b if kind == "nan_b" else a
        target = "mlp.down_proj" if kind == "nan_b" else "self_attn.k_proj"
        for f in _shard_files(d):
            st = load_file(str(f))
            hit = [k for k in st if target in k and "layers.1." in k]
            if hit:
                st[hit[0]][0, 0] = float("nan")
                save_file(st, str(f), metadata={"format": "pt"})
                want = hit[0]
                break
    code, out, err = _align(monkeypatch, capsys, a, b, "-o", tmp_path / "OUT", "--stream")
    assert code == 2, (code, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and want in lines[0], err
    assert _nothing_written(tmp_path)


def test_stream_refuses_unsupported_model_scope(tmp_path, capsys, monkeypatch):
    """A family declaring no streamed model scope (T5: its layers share a head space) is refused in one line,
    nothing written. (A bare model, without a residual space, streams: tests/test_stream_encoders.py.)"""
    from hf_tiny import make_model
    from symalign.families import FAMILIES

    family = next(f.model_types[0] for f in FAMILIES if f.tiny is not None and "model" not in f.scopes.stream)
    for seed, name in ((0, "A"), (1, "B")):
        make_model(family, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    code, _, err = _align(monkeypatch, capsys, tmp_path / "A", tmp_path / "B", "-o", tmp_path / "OUT", "--stream",
                          "--scope", "model")
    assert code == 2 and "without --stream" in err and len(err.strip().splitlines()) == 1, err
    assert _nothing_written(tmp_path)


def _cfg(layers: int, width: int = 512):
    return T.LlamaConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
                         tie_word_embeddings=False)


def _write_llama(path: Path, layers: int, seed: int, shard: str) -> None:
    torch.manual_seed(seed)
    m = T.LlamaForCausalLM(_cfg(layers))
    m.save_pretrained(path, max_shard_size=shard)


def _run_cli_rss(args: list[str]) -> tuple[int, str]:
    """Run ``symalign ARGS`` in a fresh Python; returns (its peak RSS in bytes, stderr)."""
    code = ("import resource, subprocess, sys, json; "
            "r = subprocess.run([sys.executable, '-m', 'symalign.cli'] + sys.argv[1:], capture_output=True, "
            "text=True); "
            "print(json.dumps([r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.stderr]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    rc, kb, err = json.loads(res.stdout)
    assert rc == 0, err
    return kb * 1024, err


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_peak_memory_independent_of_depth(scope, tmp_path):
    """Peak RSS of a 16-layer run exceeds the 2-layer run's by less than one layer (float32, sharded)."""
    layer_bytes = 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048 + 2 * 512)  # q,o + k,v + FF + norms
    peaks = {}
    for layers in (2, 16):
        d = tmp_path / f"L{layers}"
        _write_llama(d / "A", layers, 0, "6MB")
        _write_llama(d / "B", layers, 1, "6MB")
        assert len(list((d / "B").glob("*.safetensors"))) >= 2
        peaks[layers], _ = _run_cli_rss(["align", str(d / "A"), str(d / "B"), "-o", str(d / "OUT"), "--stream",
                                         "--scope", scope, "--max-sweeps", "2"])
        assert (d / "OUT" / "model.safetensors.index.json").is_file()
    grow = peaks[16] - peaks[2]
    print(f"{scope}: peak RSS 2 layers {peaks[2] / 2**20:.1f} MiB, 16 layers {peaks[16] / 2**20:.1f} MiB, "
          f"difference {grow / 2**20:.1f} MiB, one layer {layer_bytes / 2**20:.1f} MiB")
    assert grow < layer_bytes


@pytest.mark.slow
def test_killed_run_leaves_nothing(tmp_path):
    """SIGKILL while shards are being written: no OUT, no temporary folder, no stray shard."""
    for name, seed in (("A", 0), ("B", 1)):
        _write_llama(tmp_path / name, 8, seed, "6MB")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "symalign.cli", "align", str(tmp_path / "A"), str(tmp_path / "B"),
                             "-o", str(tmp_path / "OUT"), "--stream"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    writing = False
    t0 = time.time()
    while time.time() - t0 < 120 and proc.poll() is None and not writing:
        try:  # anonymous (O_TMPFILE) shards show as "(deleted)" links in /proc/PID/fd
            writing = any("(deleted)" in os.readlink(f"/proc/{proc.pid}/fd/{fd}") and str(tmp_path) in
                          os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd"))
        except OSError:
            pass
        time.sleep(0.05)
    assert writing, "the run never started writing"
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B"]
