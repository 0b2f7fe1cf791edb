"""The residual rotations left by a fixed sinusoidal table (docs/whole-model.md), per model, as a result file.

For each sinusoidal config (the shipped ``configs/*-sinusoidal.toml``, completed from their datasets by
``symalign.train.fit_config``, and the tests' small models of ``tests/_whole_util.py``: ``D = 32``,
``max_len = 10``) it builds the :class:`~symalign.models.ModelConfig` and asks
:func:`symalign.rewrite.residual_group` for the rewritten model's residual group: the rotations fixing every
row of the ``n_positions x D`` table (and, under LayerNorm, the all-ones vector). Recorded: positions, the
dimension of the fixed span ``D - k``, the free ``k`` and the group (``O(k)``, or none when ``k = 0``), and
the largest relative displacement of a fixed vector (``FixingOrthogonal.error``). Seconds (no training; the
datasets are read only for their shapes)::

    python benchmarks/sinusoidal_residual.py --out results/sinusoidal-residual.json
    symalign docs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS = ("vit-fmnist-sinusoidal", "vit-digits-sinusoidal", "gpt-shakespeare-sinusoidal",
           "encoder-wordnet-sinusoidal")
"""Shipped configs (``configs/NAME.toml``) with a sinusoidal table."""
TEST_MODELS = ("gpt", "encoder")
"""Families of the tests' small sinusoidal models (``tests/test_whole_sinusoidal.py``: D=32, max_len=10)."""


def shipped(name: str):
    """``configs/NAME.toml``'s model config, completed from its dataset (shapes only)."""
    from symalign.data import load_dataset
    from symalign.experiments.config import load_experiment_config
    from symalign.train import TrainConfig, fit_config

    cfg = load_experiment_config(ROOT / "configs" / f"{name}.toml")
    ds = load_dataset(cfg.data, **(cfg.data_options or {}))
    return fit_config(cfg.model, ds, TrainConfig(**cfg.train).context)


def row(label: str, cfg) -> dict:
    from symalign.groups import FixingOrthogonal
    from symalign.rewrite import residual_group

    g = residual_group(cfg)
    k = 0 if g is None else (g.k if isinstance(g, FixingOrthogonal) else cfg.d_model)
    return {"model": label, "family": cfg.family, "D": cfg.d_model, "norm": cfg.norm,
            "positions": cfg.n_positions, "fixed": cfg.d_model - k, "free": k,
            "group": "none declared" if g is None else f"`O({k})`",
            "error": float(g.error) if isinstance(g, FixingOrthogonal) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "sinusoidal-residual.json"))
    args = ap.parse_args()
    import torch

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/sinusoidal_residual.py", *sys.argv[1:]], threads=args.threads)
    rows = []
    for name in CONFIGS:
        cfg = shipped(name)
        rows.append(row(f"`{name}` (D={cfg.d_model}, {cfg.norm})", cfg))
    from _whole_util import config

    for family in TEST_MODELS:
        cfg = config(family, "sinusoidal", norm="layernorm", d_model=32, max_len=10)
        rows.append(row(f"test {family} (D={cfg.d_model}, `max_len` 10, {cfg.norm})", cfg))
    table = make_table(rows, [("model", "model"), ("positions", "positions"), ("fixed", "fixed span `D - k`"),
                              ("free", "free `k`"), ("group", "group"), ("error", "fixed vectors move by", ".0e")])
    write_json(args.out, {"provenance": prov, "models": rows, "tables": {"residual": table}})
    for r in rows:
        print(r["model"], r["positions"], r["fixed"], r["free"], r["group"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
