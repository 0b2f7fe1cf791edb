"""The in-memory ``--scope model`` holds no float64 copy of a whole model (issue #32): it runs the streamed
passes (:class:`symalign.stream.model.StreamedWhole`) over the resident checkpoints, one layer of each in float64
at a time, and what it adds to memory beyond that is OUT in B's dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_stream import _write_llama

ROOT = Path(__file__).resolve().parents[1]

# In a fresh Python: both checkpoints loaded, the heap's peak reset (Linux: clear_refs 5 resets VmHWM), then the
# engine's prepare and match (the passes and the aligned state dict; not the whole-model check or the write).
SCRIPT = r"""
import gc, json, sys
from pathlib import Path
from symalign.align_result import PhaseClock
from symalign.checkpoint.hf import load_checkpoint
from symalign.pipeline import AlignJob, InMemoryModel

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

a_dir, b_dir = Path(sys.argv[1]), Path(sys.argv[2])
engine = InMemoryModel(AlignJob(a_dir, b_dir, b_dir, scope="model", max_sweeps=2), b_dir, PhaseClock())
engine.a, engine.b = load_checkpoint(a_dir), load_checkpoint(b_dir)
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
engine.prepare()
engine.match()
print(json.dumps({"grow": status("VmHWM") - base, "resident": engine.whole is not None}))
"""


def _match_growth(a_dir: Path, b_dir: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(a_dir), str(b_dir)], capture_output=True, text=True,
                         env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["resident"]  # a Llama pair: the streamed passes over resident sources, not match_whole
    return info["grow"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_in_memory_model_scope_holds_no_float64_copy_of_the_models(tmp_path):
    """Peak RSS growth of the in-memory model scope's matching, 16 layers against 2 (float32 Llama pairs):
    at most the 14 extra layers of OUT in B's dtype plus one layer in float64. (``match_whole`` on float64 copies
    of both folded models and of the aligned one, then rounded: 28 bytes per parameter, 7 times OUT's 4.)"""
    params = 2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048 + 2 * 512  # q,o + k,v + FF + norms
    stored, float64 = 4 * params, 8 * params
    grow = {}
    for layers in (2, 16):
        d = tmp_path / f"L{layers}"
        _write_llama(d / "A", layers, 0, "6MB")
        _write_llama(d / "B", layers, 1, "6MB")
        grow[layers] = _match_growth(d / "A", d / "B")
    extra = grow[16] - grow[2]
    print(f"in-memory model scope, matching: peak growth 2 layers {grow[2] / 2**20:.1f} MiB, 16 layers "
          f"{grow[16] / 2**20:.1f} MiB; 14 layers of OUT {14 * stored / 2**20:.1f} MiB, one float64 layer "
          f"{float64 / 2**20:.1f} MiB")
    assert extra < 14 * stored + float64
