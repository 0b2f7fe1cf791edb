"""Print the families table of docs/symmetry.md: each family's layer-0 attention, measured vs declared.

Usage: ``.venv/bin/python benchmarks/families_table.py [--out results/families-probe.json]`` (about 30 s);
``--out`` writes both tables (``tables.attention``, ``tables.moe``) with provenance to a result file that
``symalign docs`` writes into docs/symmetry.md. One row per declared row of every registered family
(``Case.row`` in its module, :mod:`symalign.families.declared`): the family's tiny model at probe widths (D=16,
2 heads, head_dim 4 or 8, one K/V head where the family has GQA; its own ``probe_kw``), O(1) random weights,
dense float64 Jacobian of the real attention module (``symalign.probe.families.probe_layer``) at the row's layer;
T5: each of its three kinds of attention layer; mixture-of-experts blocks at D = 8 (``probe_moe_block``).
"""

from __future__ import annotations

import torch
import transformers as T

from symalign.families import FAMILIES, get_adapter
from symalign.families.declared import PROBE
from symalign.probe.families import probe_layer, probe_moe_block

# every registered family's declared rows (``Case.row``): (label, family, case), the MoE blocks apart
ROWS = [(c.row, f, c) for f in FAMILIES for c in f.cases if c.row and not c.moe]
MOE_ROWS = [(c.row, f, c) for f in FAMILIES for c in f.cases if c.row and c.moe]


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") and "Gemma" not in type(model).__name__ else 0.0
            scale = 1.5 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.2
            p.copy_(base + scale * torch.randn(p.shape, generator=g, dtype=torch.float64))


def _random_model(fam, case):
    """The family's tiny model at probe widths (its ``tiny`` config, :data:`PROBE`, its ``probe_kw``, the
    case's overrides) in float64, eager kernels, generic random weights."""
    cls, config = fam.tiny.classes()
    cfg = config(**{**fam.tiny.kwargs, **PROBE, **fam.probe_kw, **case.kw})
    model = cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    model = model.to(torch.float64).eval()
    randomize(model)
    return model


def _row(name: str, r) -> dict:
    """One table row (cells) of a probe result (:class:`symalign.probe.families` row)."""
    return {"family": name, "parameters": r.parameters,
            "nullity": f"{r.nullity}" + ("" if r.match else " **MISMATCH**"), "declared": r.declared,
            "group": f"{r.group}: " + ", ".join(f"{k.split('.')[0]} {v}" for k, v in r.describe.items()),
            "gauge": ", ".join(f"{k} {v}" for k, v in r.gauge.items()) or "-", "gap": f"{r.gap:.0e}",
            "match": bool(r.match)}


def main() -> None:
    import argparse
    import shlex
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the result file for `symalign docs`")
    args = ap.parse_args()
    T.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    attention = []
    for name, fam, case in ROWS:
        model = _random_model(fam, case)
        attention.append(_row(name, probe_layer(get_adapter(model), model, case.layer)))
    moe = []
    for name, fam, case in MOE_ROWS:
        model = _random_model(fam, case)
        moe.append(_row(name, probe_moe_block(get_adapter(model), model, case.layer)))
    cols = [("family", "family (config)"), ("parameters", "params"), ("nullity", "measured nullity"),
            ("declared", "declared"), ("group", "group terms"), ("gauge", "bias gauges"), ("gap", "gap")]
    moe_cols = [("family", "MoE block (config)"), ("parameters", "params"), ("nullity", "measured nullity"),
                ("declared", "declared"), ("group", "group"), ("gauge", "undeclared, named"), ("gap", "gap")]
    for rows, c in ((attention, cols), (moe, moe_cols)):
        print("| " + " | ".join(h for _, h in c) + " |")
        print("|" + "---|" * len(c))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k, _ in c) + " |")
        print()
    if args.out:
        from symalign.atomic import write_json
        from symalign.experiments.docs_tables import make_table
        from symalign.provenance import provenance

        command = shlex.join(["python", "benchmarks/families_table.py", *sys.argv[1:]])
        write_json(args.out, {"provenance": provenance(command, 1),
                              "tables": {"attention": make_table(attention, cols), "moe": make_table(moe, moe_cols)},
                              "rows": {"attention": attention, "moe": moe}})
    if not all(r["match"] for r in attention + moe):
        sys.exit("some rows do not match (marked **MISMATCH**)")


if __name__ == "__main__":
    main()
