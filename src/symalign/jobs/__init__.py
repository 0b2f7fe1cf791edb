"""Jobs: what a command does, over tensor sources (:mod:`symalign.io.tensors`), below the CLI that parses and prints.

* :mod:`~symalign.jobs.interpolate`: LMC curves of two Hugging Face checkpoints -- one engine; ``--stream`` only
  chooses whether A and B are read from disk chunk by chunk or held in memory.
"""
