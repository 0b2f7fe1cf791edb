"""Out-of-core alignment of sharded safetensors checkpoints, one layer at a time.

* :mod:`symalign.checkpoint.lazy`: lazy, validated reading (headers first, tensors on demand);
* :mod:`symalign.io.shards`: atomic writing in B's shard layout;
* :mod:`~symalign.stream.layercheck`: the per-layer function check (the family's own code);
* :mod:`~symalign.stream.attention`: ``align --scope attention``, one pass;
* :mod:`~symalign.stream.fold`: the exact rewrite of ``--scope model`` on one layer, row chunk or expert;
* :mod:`~symalign.stream.model`: ``align --scope model`` (decoders and encoders, with one residual stream or
  none), alternating passes.

See docs/scaling.md (memory model, error bounds).
"""
