"""Compatibility names: the lazy checkpoint reader lives in :mod:`symalign.checkpoint.lazy`
(safetensors layout and header checks: :mod:`symalign.checkpoint.layout`)."""

from symalign.checkpoint.config import check_same_architecture  # noqa: F401
from symalign.checkpoint.layout import (DTYPES, INDEX_NAME, ST_NAMES, WEIGHTS_NAME, ShardHeader,  # noqa: F401
                                        TensorInfo, read_header, read_index, weight_layout)
from symalign.checkpoint.lazy import LazyCheckpoint, check_against_config, open_checkpoint  # noqa: F401

__all__ = ["DTYPES", "INDEX_NAME", "ST_NAMES", "WEIGHTS_NAME", "LazyCheckpoint", "ShardHeader", "TensorInfo",
           "check_against_config", "check_same_architecture", "open_checkpoint", "read_header", "read_index",
           "weight_layout"]
