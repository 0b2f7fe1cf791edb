"""Reading and writing checkpoints: the one place that knows checkpoint files.

* :mod:`~symalign.checkpoint.native`: symalign's own run checkpoints (``ckpt-*/model.safetensors`` +
  ``config.json`` + ``optim.pt``, a ``latest`` pointer); its names are re-exported here
  (``from symalign.checkpoint import load_model, save_checkpoint``).
* :mod:`~symalign.checkpoint.layout`: the safetensors files of a Hugging Face checkpoint (single or
  sharded), header and index checks, no tensor data.
* :mod:`~symalign.checkpoint.config`: ``config.json``, the shapes it predicts, same-architecture checks.
* :mod:`~symalign.checkpoint.lazy`: :class:`LazyCheckpoint`, headers first and tensors on demand.
* :mod:`~symalign.checkpoint.hf`: :class:`HFCheckpoint`, a whole checkpoint in memory (opened lazily,
  then every tensor read).
* :mod:`~symalign.checkpoint.output`: output folders (checks, the ``symalign.json`` marker, staging in
  the reference's shard layout with its non-weight files, the function check before the atomic commit).
* :mod:`~symalign.checkpoint.shards`: :class:`ShardWriter`, streamed atomic writing in B's exact shard
  layout.
* :mod:`~symalign.checkpoint.statedict`: plain ``torch.save`` state-dict files (``align --module``).
* :mod:`~symalign.checkpoint.merged`: a universe merge in rewritten form (``save_merged`` / ``load_merged``).
"""

from symalign.checkpoint.native import (CONFIG_FILE, FORMAT, LATEST, MODEL_FILE, OPTIM_FILE, VERSION, Checkpoint,
                                        RunCheckpoint, dedupe_state, has_checkpoint, load_checkpoint, load_model,
                                        load_state_into, resolve_checkpoint, save_checkpoint)

__all__ = ["CONFIG_FILE", "FORMAT", "LATEST", "MODEL_FILE", "OPTIM_FILE", "VERSION", "Checkpoint", "RunCheckpoint",
           "dedupe_state", "has_checkpoint", "load_checkpoint", "load_model", "load_state_into",
           "resolve_checkpoint", "save_checkpoint"]
