"""symalign.checkpoint: one package reads and writes every checkpoint; the older module names still resolve."""

from __future__ import annotations

import json

import pytest
import torch

from hf_tiny import make_model
from symalign.errors import CheckpointError


def test_older_names_are_the_package_objects():
    from symalign import hf_io, merge
    from symalign.checkpoint import hf, lazy, layout, output, shards
    from symalign.stream import reader, writer

    assert hf_io.load_checkpoint is hf.load_checkpoint and hf_io.Checkpoint is hf.HFCheckpoint
    assert hf_io.stage_checkpoint is output.stage_checkpoint is merge.stage_like
    assert reader.open_checkpoint is lazy.open_checkpoint and reader.read_header is layout.read_header
    assert writer.ShardWriter is shards.ShardWriter and merge.shard_map is layout.shard_map


def test_loaded_and_lazy_checkpoints_agree_and_staging_keeps_the_shard_layout(tmp_path):
    from symalign.checkpoint.config import check_same_architecture
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.checkpoint.output import read_marker, write_checkpoint

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
    from symalign.checkpoint.statedict import load_state_file, save_state_file

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
