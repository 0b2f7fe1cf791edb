"""Compatibility names for Hugging Face checkpoint I/O, which lives in :mod:`symalign.checkpoint`.

``hf_io.X`` is ``symalign.checkpoint.{hf, config, layout, output}.X``; new code imports from there.
"""

from symalign.checkpoint.config import (check_same_architecture, check_same_heads, check_same_layout,  # noqa: F401
                                        check_shapes, expected_shapes, head_config, load_config)
from symalign.checkpoint.hf import HFCheckpoint, load_checkpoint, validate  # noqa: F401
from symalign.checkpoint.layout import INDEX_NAME, WEIGHTS_NAME, weight_files  # noqa: F401
from symalign.checkpoint.output import (MARKER_NAME, check_output_dir, commit, copy_non_weights,  # noqa: F401
                                        discard, is_symalign_output, read_marker, stage_checkpoint,
                                        verify_and_commit, write_checkpoint)

Checkpoint = HFCheckpoint

__all__ = ["Checkpoint", "HFCheckpoint", "INDEX_NAME", "MARKER_NAME", "WEIGHTS_NAME", "check_output_dir",
           "check_same_architecture", "check_same_heads", "check_same_layout", "check_shapes", "commit",
           "copy_non_weights", "discard", "expected_shapes", "head_config", "is_symalign_output", "load_checkpoint",
           "load_config", "read_marker", "stage_checkpoint", "validate", "verify_and_commit", "weight_files",
           "write_checkpoint"]
