"""The bottom I/O layer: tensors, headers and files, knowing no model family.

* :mod:`~symalign.io.layout`: the safetensors files of a ``save_pretrained`` folder (single or sharded), header
  and index checks, no tensor data.
* :mod:`~symalign.io.tensors`: tensor sources -- :class:`~symalign.io.tensors.ShardedTensors` (headers first,
  tensors on demand, NaN/Inf checked) and :class:`~symalign.io.tensors.StateTensors` (a state dict in memory)
  behind one interface, :class:`~symalign.io.tensors.TensorSource`.
* :mod:`~symalign.io.folder`: output folders -- checks, the ``symalign.json`` marker, staging in a reference's
  shard layout with its non-weight files, the atomic commit.
* :mod:`~symalign.io.shards`: :class:`~symalign.io.shards.ShardWriter`, streamed atomic writing in a
  reference's exact shard layout.
* :mod:`~symalign.io.statedict`: plain ``torch.save`` state-dict files (``align --module``).

Family lookups, the shapes a config predicts and function checks live above, in :mod:`symalign.checkpoint`
and the jobs; an import-linter contract keeps this package below them.
"""
