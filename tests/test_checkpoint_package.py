"""symalign.checkpoint: one package reads and writes every checkpoint; the older module names still resolve."""

from __future__ import annotations

import json

import pytest
import torch

from hf_tiny import make_model
from symalign.errors import CheckpointError


def test_io_knows_no_family_and_its_sources_agree(tmp_path):
    """The bottom layer reads a checkpoint folder without a config's family: the same tensors as the
    family-aware reader, and a state dict in memory is a source of the same interface."""
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.io.tensors import StateTensors, open_tensors

    make_model("llama", dtype=torch.float32, seed=0).save_pretrained(tmp_path / "A", max_shard_size="20KB")
    raw, ck = open_tensors(tmp_path / "A"), open_checkpoint(tmp_path / "A")
    assert raw.shapes == ck.shapes and raw.files == ck.files and not hasattr(raw, "adapter")
    names = raw.keys[:3]
    got = raw.read(names)
    mem = StateTensors(got).read(names, dtype=torch.float64)
    for n in names:
        assert torch.equal(got[n], ck.read([n])[n]) and torch.equal(mem[n], got[n].double())
    bad = dict(got)
    bad[names[0]] = bad[names[0]].clone().fill_(float("nan"))
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        StateTensors(bad, "mem").read(names)


def test_loaded_and_lazy_checkpoints_agree_and_staging_keeps_the_shard_layout(tmp_path):
    from symalign.checkpoint.config import check_same_architecture
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.checkpoint.output import write_checkpoint
    from symalign.io.folder import read_marker

    make_model("llama", dtype=torch.float32, seed=0).save_pretrained(tmp_path / "A", max_shard_size="20KB")
    full, lazy = load_checkpoint(tmp_path / "A"), open_checkpoint(tmp_path / "A")
    assert full.shapes == lazy.shapes and full.files == lazy.files and len(full.files) > 2
    assert full.numel == lazy.numel and full.dtype == lazy.dtype == torch.float32
    check_same_architecture(full, lazy)  # one check for loaded and lazily opened checkpoints
    state = {k: v + 1 for k, v in full.state.items()}
    write_checkpoint(tmp_path / "OUT", state, tmp_path / "A")
    out = load_checkpoint(tmp_path / "OUT")
    assert sorted(p.name for p in out.files) == sorted(p.name for p in full.files)  # B's shard files
    index = json.loads((tmp_path / "OUT" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == json.loads((tmp_path / "A" / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(torch.equal(out.state[k], state[k]) for k in state)
    assert read_marker(tmp_path / "OUT")["tool"] == "symalign"


def test_state_dict_files(tmp_path):
    from symalign.io.statedict import load_state_file, save_state_file

    state = {"w": torch.randn(3, 2)}
    save_state_file(state, tmp_path / "s.pt")
    assert torch.equal(load_state_file(tmp_path / "s.pt")["w"], state["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["s.pt"]  # no temporary file left
    with pytest.raises(CheckpointError, match="is not a file"):
        load_state_file(tmp_path / "none.pt", "checkpoint B")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list, not a state dict"):
        load_state_file(tmp_path / "list.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_state_file(tmp_path / "junk.pt")


def test_every_read_is_an_aligned_copy_so_blas_sums_alike(tmp_path):
    """Every tensor a source hands out owns contiguous memory starting at a 64-byte boundary, in every dtype and
    row range, from shards and from a state in memory (a view at an odd 8-byte offset too): BLAS kernels may sum
    in an order set by the operand's alignment (MKL's float64 ``W @ b`` on an AMD EPYC), so the same values read
    from two residencies must give the same bits in a fold."""
    from symalign.io.tensors import ALIGNMENT, StateTensors, aligned_copy, open_tensors

    make_model("gpt2", dtype=torch.float64, seed=0).save_pretrained(tmp_path / "A", max_shard_size="20KB")
    raw = open_tensors(tmp_path / "A")
    state = raw.read(raw.keys)
    odd = torch.empty(65 * 32 + 1, dtype=torch.float64)[1:].view(65, 32)  # 8 bytes past an aligned start
    odd.copy_(torch.randn(65, 32, dtype=torch.float64))
    state["odd"] = odd
    mem = StateTensors(state)

    def ok(t: torch.Tensor, src: torch.Tensor) -> None:
        assert t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 and torch.equal(t, src.to(t.dtype))
        assert t.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()  # a copy

    for n in raw.keys:
        for dtype in (None, torch.float64, torch.float32):
            ok(raw.read([n], dtype)[n], state[n])
            ok(mem.read([n], dtype)[n], state[n])
        if state[n].dim():
            ok(raw.read_rows(n, 1, state[n].shape[0]), state[n][1:])
    ok(mem.read(["odd"])["odd"], odd)
    ok(mem.read_rows("odd", 3, 60), odd[3:60])
    ok(aligned_copy(odd.t()), odd.t())
