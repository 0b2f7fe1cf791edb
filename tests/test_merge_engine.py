"""The in-memory merge: each model aligned in memory (never written and read back), added to a running sum."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import make_model  # noqa: E402

from symalign.checkpoint.average import RunningAverage, weighted_average  # noqa: E402
from symalign.families import get_adapter  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_running_average_is_the_batch_average_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(33, 5, generator=g).to(dtype) for _ in range(5)]
    w = [0.05, 0.15, 0.2, 0.25, 0.35]
    run = RunningAverage()
    for x, wk in zip(xs, w):
        run.add({"w": x, "ids": torch.arange(4)}, wk)
    got = run.result()
    assert list(got) == ["w", "ids"] and torch.equal(got["ids"], torch.arange(4))
    assert got["w"].dtype == dtype and torch.equal(got["w"], weighted_average(xs, w, dtype))
    with pytest.raises(ValueError, match="different tensors"):
        run.add({"w": xs[0]}, 0.1)


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_merge_aligns_in_memory_and_stages_only_out(scope, tmp_path, monkeypatch):
    """Three planted copies of A merge back to A, and the only folder ever staged is OUT itself."""
    from symalign.commands.merge import run_merge
    from symalign.io import folder

    a = make_model("llama", dtype=torch.float32, seed=0)
    spec = get_adapter(a).spec(a)
    dirs = []
    for k in range(3):
        m = make_model("llama", dtype=torch.float32, seed=0)
        if k:
            m.load_state_dict(apply(spec, sample(spec, 10 + k), a.state_dict()))
        m.save_pretrained(tmp_path / f"M{k}")
        dirs.append(tmp_path / f"M{k}")
    staged = []
    real = folder.stage_tensors
    monkeypatch.setattr(folder, "stage_tensors", lambda out, *x, **kw: staged.append(out) or real(out, *x, **kw))
    monkeypatch.setattr("symalign.checkpoint.output.stage_tensors", folder.stage_tensors)
    res = run_merge(dirs, tmp_path / "OUT", scope=scope, stream=False, progress=False)
    assert [str(p) for p in staged] == [str((tmp_path / "OUT").resolve())]
    assert len(res["aligned"]) == 2 and all(r["check"]["passed"] for r in res["aligned"])
    m = type(a).from_pretrained(str(tmp_path / "OUT"), dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.randint(0, a.config.vocab_size, (2, 7))
    with torch.no_grad():
        ya, ym = a(x).logits, m(x).logits
    assert (ya - ym).norm() / ya.norm() <= 1e-5
