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


@pytest.mark.parametrize("how", [pytest.param(["--no-stream"], id="in-memory"),
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
