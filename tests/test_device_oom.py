"""A device (or the host) out of memory: one line naming the remedies, exit 2, and a previous OUT left whole."""

from __future__ import annotations

import pytest
import torch

from _cli_util import run_symalign
from symalign.device import is_out_of_memory, oom_device
from symalign.errors import CheckpointError

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 139.72 GiB of which "
            "1.00 GiB is free.")


def _cuda_oom() -> BaseException:
    cls = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return cls(CUDA_OOM)


@pytest.mark.parametrize("exc, device", [
    (_cuda_oom(), "cuda:1"),
    (RuntimeError("CUDA error: out of memory"), "the device"),
    (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), "mps"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 8 bytes."), "the CPU"),
])
def test_out_of_memory_is_recognised_and_its_device_named(exc, device):
    assert is_out_of_memory(exc) and oom_device(exc) == device


def test_other_errors_are_not_out_of_memory():
    assert not is_out_of_memory(None)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not torch's
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError as inner:
            raise CheckpointError("wrapped") from inner
    except CheckpointError as outer:
        assert is_out_of_memory(outer)  # raised from one


def _vit(path, seed, layers=2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                 intermediate_size=32, image_size=8, patch_size=4, num_channels=1, num_labels=10)
    transformers.ViTForImageClassification(cfg).save_pretrained(path)
    return path


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", [pytest.param(["--no-stream"], id="in-memory", marks=pytest.mark.slow),
                                 pytest.param(["--stream"], id="streamed")])
@pytest.mark.parametrize("raised", ["torch", "runtime"])
def test_oom_inside_align_is_one_line_exit_2_and_out_untouched(how, raised, tmp_path, monkeypatch, capsys):
    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    out = tmp_path / "O"
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, *how)
    assert code == 0, err
    before = _files(out)
    calls = []

    def oom(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 2 or how == ["--no-stream"]:  # streamed: the second layer, after the first was written
            raise _cuda_oom() if raised == "torch" else RuntimeError("CUDA error: out of memory")
        return real(*args, **kwargs)

    if how == ["--stream"]:
        from symalign.stream.layercheck import LayerChecker

        real = LayerChecker.check
        monkeypatch.setattr(LayerChecker, "check", lambda self, *a, **k: oom(self, *a, **k))
    else:
        import symalign.arch.check as check

        real = check.check_function
        monkeypatch.setattr(check, "check_function", oom)
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, "--force", *how)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "ran out of memory" in lines[0] and all(o in lines[0] for o in ("--stream", "--max-device-memory",
                                                                          "--batch-size")), lines[0]
    assert calls and "Traceback" not in err
    assert _files(out) == before  # the previous OUT, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B", "O"]  # no staged folder left behind


# -- --max-device-memory ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, n", [("8GiB", 8 << 30), ("512M", 512 << 20), ("512MiB", 512 << 20),
                                     ("20GB", 20 * 10 ** 9), ("1073741824", 1 << 30), ("1.5gib", 3 << 29),
                                     (" 64 k ", 64 << 10), ("7b", 7)])
def test_sizes_parse(text, n):
    from symalign.device import parse_size

    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "8XB", "GiB", "-1GiB", "0", "8 GiB x", "1e9"])
def test_bad_sizes_are_refused_in_one_line(bad):
    from symalign.device import parse_size
    from symalign.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-device-memory") as exc:
        parse_size(bad)
    assert "\n" not in str(exc.value)


def test_cap_on_the_cpu_is_recorded_and_bounds_nothing():
    from symalign.device import cap_memory, peak_memory

    assert cap_memory("cpu", 1 << 30) == {"max_device_memory_bytes": 1 << 30, "device_memory_fraction": None}
    assert cap_memory("cpu", None) == {"max_device_memory_bytes": None, "device_memory_fraction": None}
    mem = peak_memory("cpu")
    assert mem["host_peak_rss_bytes"] > 0 and mem["device_peak_bytes"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cap_on_cuda_sets_the_fraction_and_an_allocation_past_it_is_out_of_memory():
    from symalign.device import cap_memory

    total = torch.cuda.get_device_properties(0).total_memory
    try:
        rec = cap_memory("cuda:0", 1 << 30)
        assert rec["device_memory_fraction"] == pytest.approx((1 << 30) / total)
        with pytest.raises(Exception) as exc:
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
        assert is_out_of_memory(exc.value)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["align", "merge"])
def test_max_device_memory_on_the_cpu_is_recorded_in_the_json_and_changes_nothing(command, tmp_path, monkeypatch,
                                                                                  capsys):
    import json

    a, b = _vit(tmp_path / "A", 0, layers=1), _vit(tmp_path / "B", 1, layers=1)
    extra = ["--scope", "attention"] + (["--no-progress"] if command == "merge" else [])
    code, out, err = run_symalign(monkeypatch, capsys, command, a, b, "-o", tmp_path / "R", "--json", *extra)
    assert code == 0, err
    ref = json.loads(out)["memory"]
    assert ref["max_device_memory_bytes"] is None and ref["device_peak_bytes"] is None
    code, out, err = run_symalign(monkeypatch, capsys, command, a, b, "-o", tmp_path / "C", "--json", *extra,
                                  "--device", "cpu", "--max-device-memory", "512MiB")
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["max_device_memory_bytes"] == 512 << 20 and mem["device_memory_fraction"] is None
    assert mem["host_peak_rss_bytes"] > 0 and mem["device_peak_bytes"] is None
    assert _files(tmp_path / "R").keys() == _files(tmp_path / "C").keys()
    for k, v in _files(tmp_path / "R").items():
        if k.suffix == ".safetensors":
            assert _files(tmp_path / "C")[k] == v, k


@pytest.mark.parametrize("command", ["align", "merge"])
def test_bad_max_device_memory_exits_2_before_any_weight_loads(command, tmp_path, monkeypatch, capsys):
    a, b = _vit(tmp_path / "A", 0, layers=1), _vit(tmp_path / "B", 1, layers=1)

    def boom(*args, **kwargs):
        raise AssertionError("weights were loaded before --max-device-memory was checked")

    monkeypatch.setattr("symalign.checkpoint.hf.load_checkpoint", boom)
    code, out, err = run_symalign(monkeypatch, capsys, command, a, b, "-o", tmp_path / "O", "--max-device-memory",
                                  "lots")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--max-device-memory 'lots'" in lines[0], err
    assert not (tmp_path / "O").exists()
