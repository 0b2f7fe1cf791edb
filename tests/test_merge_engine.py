"""The one merge (:func:`symalign.stream.merge.merge_into`): each model aligned in memory or on its own thread, never
written and read back, averaged as its tensors arrive."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import make_model  # noqa: E402

from symalign.checkpoint.average import weighted_average  # noqa: E402
from symalign.families import get_adapter  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_merge_into_is_the_batch_average_bit_for_bit(dtype, monkeypatch):
    """The one merge: five models, items whole, in row ranges and as copies, in another order per model, averaged
    in row chunks of a few rows -- bit for bit the batch average; integer tensors are the first model's."""
    import symalign.stream.merge as smerge
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.stream.sink import StateSink

    chunks = smerge.row_chunks
    monkeypatch.setattr(smerge, "row_chunks", lambda shape: chunks(shape, 10))
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(33, 5, generator=g).to(dtype), "s": torch.randn((), generator=g).to(dtype),
               "ids": torch.arange(4) + k} for k in range(5)]
    w = [0.05, 0.15, 0.2, 0.25, 0.35]
    srcs = [ResidentCheckpoint(f"M{k}", s) for k, s in enumerate(states)]

    def items(k):
        s = states[k]
        if k % 2:
            return [("ids", None, None), ("s", None, None), ("w", 0, s["w"][:20]), ("w", 20, s["w"][20:])]
        return [("w", 0, s["w"][:20]), ("ids", None, None), ("w", 20, s["w"][20:]), ("s", None, s["s"])]

    sink = StateSink(srcs[0])
    smerge.merge_into(sink, srcs[0], srcs[1:], [items(k) for k in range(1, 5)], w)
    got = sink.state
    assert torch.equal(got["ids"], torch.arange(4))
    for n in ("w", "s"):
        assert got[n].dtype == dtype and torch.equal(got[n], weighted_average([s[n] for s in states], w, dtype)), n


def test_merge_into_names_a_model_that_misses_a_tensor():
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.errors import SymalignError
    from symalign.stream.merge import merge_into
    from symalign.stream.sink import StateSink

    states = [{"w": torch.ones(3), "v": torch.ones(2)} for _ in range(3)]
    srcs = [ResidentCheckpoint(f"M{k}", s) for k, s in enumerate(states)]
    with pytest.raises(SymalignError, match="model 3 never put 'v'"):
        merge_into(StateSink(srcs[0]), srcs[0], srcs[1:], [[("w", None, None), ("v", None, None)],
                                                          [("w", None, None)]], [0.2, 0.3, 0.5])


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
