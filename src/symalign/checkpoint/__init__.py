"""Checkpoints as models: run checkpoints, and Hugging Face folders with their config and family.

The family-free file work (safetensors layout and headers, lazy tensor sources, output folders and the atomic
commit, the streamed shard writer, state-dict files) is :mod:`symalign.io`, below this package.

* :mod:`~symalign.checkpoint.native`: symalign's own run checkpoints (``ckpt-*/model.safetensors`` +
  ``config.json`` + ``optim.pt``, a ``latest`` pointer); its names are re-exported here
  (``from symalign.checkpoint import load_model, save_run``).
* :mod:`~symalign.checkpoint.config`: ``config.json``, the shapes it predicts, same-architecture checks.
* :mod:`~symalign.checkpoint.lazy`: :class:`LazyCheckpoint`, headers first and tensors on demand.
* :mod:`~symalign.checkpoint.hf`: :class:`HFCheckpoint`, a whole checkpoint in memory (opened lazily,
  then every tensor read).
* :mod:`~symalign.checkpoint.output`: staging under the names ``save_pretrained`` writes, and the function
  check before the atomic commit.
* :mod:`~symalign.checkpoint.merged`: a universe merge in rewritten form (``save_merged`` / ``load_merged``).
"""

from symalign.checkpoint.native import (CONFIG_FILE, FORMAT, LATEST, MODEL_FILE, OPTIM_FILE, VERSION, RunCheckpoint,
                                        dedupe_state, has_checkpoint, load_run, load_model,
                                        load_state_into, resolve_checkpoint, save_run)

__all__ = ["CONFIG_FILE", "FORMAT", "LATEST", "MODEL_FILE", "OPTIM_FILE", "VERSION", "RunCheckpoint",
           "dedupe_state", "has_checkpoint", "load_run", "load_model", "load_state_into",
           "resolve_checkpoint", "save_run"]
