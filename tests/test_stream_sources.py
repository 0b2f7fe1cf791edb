"""Tensor sources and sinks: a resident checkpoint reads what a lazy one reads, the one attention engine gives
bit-identical OUT over either source and any residency, and a sink keeps what it is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_families import make
from symalign.checkpoint.hf import load_checkpoint
from symalign.checkpoint.lazy import ResidentCheckpoint, open_checkpoint
from symalign.errors import ConfigError, SymalignError
from symalign.families import FAMILIES
from symalign.stream.attention import align_attention, attention_units
from symalign.stream.sink import StateSink


def _pair(tmp: Path, family: str, dtype=torch.float32, shard: str | None = "20KB") -> tuple[Path, Path]:
    out = []
    for seed, name in ((0, "A"), (1, "B")):
        m = make(family, dtype=dtype, seed=seed)
        kw = {"max_shard_size": shard} if shard else {}
        m.save_pretrained(tmp / name, **kw)
        out.append(tmp / name)
    return out[0], out[1]


def test_resident_and_lazy_sources_read_the_same(tmp_path):
    _, b_dir = _pair(tmp_path, "llama")
    lazy = open_checkpoint(b_dir)
    assert len(lazy.shards) > 1
    res = ResidentCheckpoint.of(load_checkpoint(b_dir))
    assert res.keys == lazy.keys and res.shapes == lazy.shapes
    assert (res.dtype, res.nbytes, res.numel) == (lazy.dtype, lazy.nbytes, lazy.numel)
    assert res.config.to_dict() == lazy.config.to_dict() and res.adapter.family == lazy.adapter.family
    for n in lazy.keys:
        x, y = lazy.tensors[n], res.tensors[n]
        assert (x.dtype, x.shape, x.numel, x.nbytes) == (y.dtype, y.shape, y.numel, y.nbytes), n
    names = lazy.keys[:5]
    for dtype in (None, torch.float64):
        got, want = res.read(names, dtype), lazy.read(names, dtype)
        assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in names)
    big = max(lazy.keys, key=lambda n: lazy.tensors[n].numel)
    assert torch.equal(res.read_rows(big, 1, 3), lazy.read_rows(big, 1, 3))
    assert res.bytes_read == lazy.bytes_read > 0
    copy = res.read([big])[big]
    copy.zero_()  # reads are copies: the resident state is untouched
    assert not torch.equal(res.state[big], copy)


# plain; fused Q|K|V (Conv1D); per-head QK-norm (the first registered family declaring it: a q_norm, over the
# head; qk_norm_over alone is "head" by default, which picked GPT-2 and left the one-piece QK-norm path out)
QK_NORM = next(f.model_types[0] for f in FAMILIES
               if getattr(f.decl, "q_norm", None) and getattr(f.decl, "qk_norm_over", None) == "head")


@pytest.mark.parametrize("family", ["llama", "gpt2", QK_NORM])
def test_in_memory_and_streamed_attention_are_bit_identical(family, tmp_path):
    """One engine: lazy sources one layer at a time with per-layer checks (streamed), and resident sources with
    every layer in one unit and no layer check (in memory), put the same bits into the sink."""
    a_dir, b_dir = _pair(tmp_path, family)
    la, lb = open_checkpoint(a_dir), open_checkpoint(b_dir)
    streamed = StateSink(lb)
    s = align_attention(la, lb, streamed, progress=False, return_transform=True)
    ra, rb = ResidentCheckpoint.of(load_checkpoint(a_dir)), ResidentCheckpoint.of(load_checkpoint(b_dir))
    units = attention_units(s.spec, {n: t.numel for n, t in rb.tensors.items()}, 10 ** 9)
    assert len(units) == 1 and len(units[0][0]) == rb.config.num_hidden_layers > 1
    memory = StateSink(rb)
    m = align_attention(ra, rb, memory, progress=False, return_transform=True, check_layers=False,
                        block_params=10 ** 9)
    assert len(s.checks) == 2 * rb.config.num_hidden_layers and not m.checks
    assert list(streamed.state) != [] and set(streamed.state) == set(memory.state) == set(rb.keys)
    for k in rb.keys:
        assert torch.equal(streamed.state[k], memory.state[k]), k
        assert streamed.state[k].dtype == rb.tensors[k].dtype
    assert set(s.transform) == set(m.transform)
    assert all(torch.equal(s.transform[k], m.transform[k]) for k in s.transform)
    assert s.rel("after") < s.rel("before")
    moved = [k for k in rb.keys if not torch.equal(memory.state[k], rb.state[k])]
    assert moved  # a real alignment, not a copy


def test_state_sink_round_trip(tmp_path):
    _, b_dir = _pair(tmp_path, "llama", shard=None)
    b = ResidentCheckpoint.of(load_checkpoint(b_dir))
    big = max(b.keys, key=lambda n: b.tensors[n].numel)
    extra = {"head.extra": (torch.float32, (4, 3))}
    sink = StateSink(b, extra=extra)
    rows = b.state[big].shape[0]
    sink.put_rows(big, 0, b.state[big][: rows // 2].double())
    sink.put_rows(big, rows // 2, b.state[big][rows // 2:].double())
    for n in b.keys:
        if n != big:
            sink.copy(n)
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    sink.put_rows("head.extra", 0, x)
    assert set(sink.state) == set(b.keys) | {"head.extra"}
    assert all(torch.equal(sink.state[n], b.state[n]) and sink.state[n].dtype == b.state[n].dtype for n in b.keys)
    assert sink.state["head.extra"].dtype == torch.float32 and torch.equal(sink.state["head.extra"], x.float())
    assert sink.bytes_written == b.nbytes + 48  # as stored, whatever dtype the rows arrived in
    sink.put(big, b.state[big].double())  # cast to B's dtype
    assert sink.state[big].dtype == b.tensors[big].dtype
    with pytest.raises(SymalignError, match="shape"):
        sink.put(big, torch.zeros(1))
    with pytest.raises(SymalignError, match="no tensor"):
        sink.put_rows("nowhere", 0, torch.zeros(1))
    sink.abort()
    assert sink.state == {}
    lazy_sink = StateSink(open_checkpoint(b_dir))  # over a lazy source, a copy is a read
    lazy_sink.copy(big)
    assert torch.equal(lazy_sink.state[big], b.state[big])


def test_layers_that_share_a_space_are_one_unit_and_not_checked_per_layer(tmp_path):
    """T5: one head permutation per stack, so its attention is one unit; asking for per-layer checks is refused."""
    a_dir, b_dir = _pair(tmp_path, "t5", shard=None)
    a, b = ResidentCheckpoint.of(load_checkpoint(a_dir)), ResidentCheckpoint.of(load_checkpoint(b_dir))
    spec = b.adapter.spec(b.config, b.keys)
    units = attention_units(spec, {n: t.numel for n, t in b.tensors.items()}, 0)
    assert len(units) == 1 and units[0][0] == [] and set(units[0][1]) == set(spec.spaces)
    with pytest.raises(ConfigError, match="without --stream"):
        align_attention(a, b, StateSink(b), progress=False)


@pytest.mark.slow
def test_whole_model_pass_over_resident_sources_into_a_state_sink_equals_streamed_out(tmp_path):
    """:class:`StreamedWhole` and :func:`write_aligned` take any source and sink: resident checkpoints into a
    state dict give the bits ``align --stream --scope model`` writes."""
    from safetensors.torch import load_file

    from symalign.align_result import PhaseClock
    from symalign.match.whole import CHECKPOINT_SETTINGS
    from symalign.stream.fold import added_tensors
    from symalign.stream.model import StreamedWhole, run_stream_model, write_aligned

    a_dir, b_dir = _pair(tmp_path, "llama")
    res = run_stream_model(a_dir, b_dir, tmp_path / "OUT", progress=False, max_sweeps=2)
    written: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "OUT").glob("*.safetensors")):
        written.update(load_file(str(f)))
    ra, rb = ResidentCheckpoint.of(load_checkpoint(a_dir)), ResidentCheckpoint.of(load_checkpoint(b_dir))
    w = StreamedWhole(ra, rb)
    w.match(True, "full", 2, CHECKPOINT_SETTINGS["rtol"], False)
    assert w.distances == res.match["distances"]
    sink = StateSink(rb, extra=added_tensors(rb, w.prep_b))
    checks = write_aligned(w, sink, PhaseClock(), progress=False)
    assert len(checks) == 2 * rb.config.num_hidden_layers and all(c.passed for c in checks)
    assert set(sink.state) == set(written)
    for k, v in written.items():
        assert torch.equal(sink.state[k], v), k


def test_sweep_reads_layers_ahead_only_where_enabled_and_consumes_them(tmp_path, monkeypatch):
    """Read-ahead off (the CPU default): the sweep never holds a layer as stored beside the prepared ones (no
    ``raw_pair`` call; each layer is read tensor by tensor as it is prepared). On: every stored tensor read ahead is
    consumed (popped) as it is prepared, so the pair is empty once both layers are. The match is the same bit for
    bit either way."""
    from symalign.io.prefetch import ENV
    from symalign.match.whole import CHECKPOINT_SETTINGS
    from symalign.stream.model import StreamedWhole

    a_dir, b_dir = _pair(tmp_path, "llama")
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(ENV, setting)
        w = StreamedWhole(ResidentCheckpoint.of(load_checkpoint(a_dir)), ResidentCheckpoint.of(load_checkpoint(b_dir)))
        pairs, read = [], w.raw_pair

        def spy(i, read=read, pairs=pairs):
            pair = read(i)
            pairs.append(pair)
            return pair

        w.raw_pair = spy
        w.match(True, "full", 2, CHECKPOINT_SETTINGS["rtol"], False)
        runs[setting] = (w.distances, w.transform())
        if setting == "0":
            assert pairs == []
        else:
            assert len(pairs) == 2 * w.L and all(not ra and not rb for ra, rb in pairs)
    assert runs["0"][0] == runs["1"][0]
    assert all(torch.equal(runs["0"][1][k], runs["1"][1][k]) for k in runs["0"][1])
