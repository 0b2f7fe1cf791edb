"""A finished protocol scope read back: its config, trained pair, evaluation batches and attention spec.

Used by the measurements that revisit a run (``benchmarks/stage1_rank.py``,
``benchmarks/stage2_descent.py``): the pair is the scope's two seeds (as recorded in its
``results.json``, else the config's), evaluated on the split the scope was measured on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from symalign.checkpoint import load_model
from symalign.data import eval_batches, load_dataset
from symalign.experiments.config import parse_config
from symalign.experiments.protocol import attention_spec, scope_layers
from symalign.spec import SymmetrySpec


@dataclass
class RunPair:
    """``cfg`` (parsed config), ``seeds``, ``split``, models ``a`` and ``b`` (eval mode), the dataset's
    ``task``, the fixed evaluation ``batches`` and the re-initialised layers' attention ``spec``."""

    cfg: Any
    seeds: list[int]
    split: str
    a: nn.Module
    b: nn.Module
    task: str
    batches: list
    spec: SymmetrySpec


def load_run_pair(root: Path, scope: str, batch_size: int = 256) -> RunPair:
    """The pair of experiment folder ``root`` (holding ``config.json``) for ``scope``."""
    cfg = parse_config(json.loads((root / "config.json").read_text()))
    res_path = root / scope / "results.json"
    done = json.loads(res_path.read_text()) if res_path.exists() else {}
    seeds = list(done.get("seeds") or cfg.protocol.seeds)
    split = done.get("eval_split", cfg.protocol.eval_split)
    a, _ = load_model(root / scope / f"seed{seeds[0]}")
    b, _ = load_model(root / scope / f"seed{seeds[1]}")
    ds = load_dataset(cfg.data, **cfg.data_options)
    context = int(cfg.train.get("context", 128))
    batches = list(eval_batches(ds, split, batch_size, context, cfg.protocol.eval_items))
    spec = attention_spec(a, scope_layers(scope, a.cfg.n_layers))
    return RunPair(cfg, seeds, split, a.eval(), b.eval(), ds.task, batches, spec)
