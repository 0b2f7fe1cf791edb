"""Compatibility names: the streamed shard writer lives in :mod:`symalign.checkpoint.shards`."""

from symalign.checkpoint.shards import ShardWriter, tensor_bytes  # noqa: F401

__all__ = ["ShardWriter", "tensor_bytes"]
