"""``symalign align --scope model`` on the tiny float64 models of the tests: planted and independent pairs.

For each model class (``tests/test_whole_hf_more.py``'s CLI cases: ViT, BERT, RoFormer, ModernBERT; the
families' tiny configs, eager attention, float64, O(1)-scale random weights from ``tests/hf_tiny.randomize``):

* **planted**: A (seed 0), B = a random element (``sample(spec, 11)``) of the declared group applied to A's
  prepared (rewritten) state; ``align A B`` should return B to A (relative distance ~ rounding);
* **independent**: A (seed 0) and an independently drawn B (seed 1); no exact answer, the distance falls.

Each pair is aligned in-process by the CLI (``symalign align A B -o OUT --scope model --json --stage2 full``).
Recorded per pair: the relative distance ``||A - B'|| / ||A||`` over the labelled tensors before and after
(``distance``), the sweeps, and the output change ``||f_B'(x) - f_B(x)|| / ||f_B(x)||`` that ``align``
checked before writing (``check.rel``). About a minute at one thread::

    python benchmarks/whole_hf_tiny.py --threads 1 --out results/whole-hf-tiny.json
    symalign docs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

CASES = (("vit", "ViTForImageClassification"), ("bert", "BertForMaskedLM"), ("roformer", "RoFormerForMaskedLM"),
         ("modernbert", "ModernBertForMaskedLM"))
"""(family, model class): the CLI cases of tests/test_whole_hf_more.py."""
FLOOR_NOTE = {"modernbert": "RoPE floor"}
"""ModernBERT rotates Q and K in float32 even in a float64 model: its output change sits at that rounding."""


def tiny(family: str, cls: str, seed: int):
    """The tests' tiny float64 model of ``cls`` (family tiny config, eager attention, ``randomize(seed)``)."""
    import torch
    from hf_tiny import T, config, randomize

    m = getattr(T, cls)._from_config(config(family), attn_implementation="eager").to(torch.float64)
    randomize(m, seed)
    return m.eval()


def align(a: Path, b: Path, out: Path, threads: int) -> dict:
    """``symalign align A B -o OUT --scope model --json --stage2 full`` in this process; its JSON."""
    from typer.testing import CliRunner

    from symalign.cli import app

    r = CliRunner().invoke(app, ["align", str(a), str(b), "-o", str(out), "--scope", "model", "--json",
                                 "--stage2", "full", "--threads", str(threads), "--force"])
    if r.exit_code != 0:
        raise SystemExit(f"align {a} {b} failed (exit {r.exit_code}): {r.output.strip()[-500:]}")
    return json.loads(r.stdout)


def summary(info: dict) -> dict:
    return {"before": info["distance"]["before"]["total"], "after": info["distance"]["after"]["total"],
            "sweeps": info["match"]["sweeps"], "converged": info["match"]["converged"],
            "output_change": info["check"]["rel"], "check_dtype": info["check"]["dtype"],
            "residual_group": info["match"]["spaces"].get("residual")}


def measure(family: str, cls: str, tmp: Path, threads: int) -> dict:
    from symalign.checkpoint import hf as hf_io, output as hf_out
    from symalign.families import prepare
    from symalign.spec import apply, sample

    tiny(family, cls, 0).save_pretrained(tmp / "A")
    tiny(family, cls, 1).save_pretrained(tmp / "B")
    ck = hf_io.load_checkpoint(tmp / "A")
    pa = prepare(ck.config, ck.state, ck.adapter.spec(ck.config, ck.state.keys()))
    hf_out.write_checkpoint(tmp / "P", apply(pa.spec, sample(pa.spec, 11), pa.state), tmp / "A")
    return {"family": family, "model": cls, "planted": summary(align(tmp / "A", tmp / "P", tmp / "OP", threads)),
            "independent": summary(align(tmp / "A", tmp / "B", tmp / "OB", threads))}


def tables(rows: list[dict]) -> dict:
    from symalign.experiments.docs_tables import make_table

    shown = []
    for r in rows:
        p, i = r["planted"], r["independent"]
        change = max(p["output_change"], i["output_change"])
        note = FLOOR_NOTE.get(r["family"])
        shown.append({"model": f"`{r['model']}`", "group": f"`{i['residual_group']}`",
                      "planted": f"{p['before']:.3f} -> {p['after']:.0e}",
                      "independent": f"{i['before']:.3f} -> {i['after']:.3f} ({i['sweeps']})",
                      "change": f"{change:.0e}" + (f" ({note})" if note else "")})
    return {"pairs": make_table(shown, [
        ("model", "model"), ("group", "residual group"), ("planted", "planted: before -> after"),
        ("independent", "independent pair: before -> after (sweeps)"), ("change", "output change (largest)")])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "whole-hf-tiny.json"))
    args = ap.parse_args()
    import torch

    from symalign.atomic import write_json
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/whole_hf_tiny.py", *sys.argv[1:]], threads=args.threads,
                      seed_pairs=1)  # one independent pair (seeds 0, 1) per model
    rows = []
    for family, cls in CASES:
        with tempfile.TemporaryDirectory(prefix="symalign-whole-tiny-") as d:
            rows.append(measure(family, cls, Path(d), args.threads))
        p, i = rows[-1]["planted"], rows[-1]["independent"]
        change = max(p["output_change"], i["output_change"])
        print(f"{cls}: planted {p['before']:.3f} -> {p['after']:.1e}; independent {i['before']:.3f} -> "
              f"{i['after']:.3f} ({i['sweeps']} sweeps); output change {change:.1e}", flush=True)
    write_json(args.out, {"provenance": prov, "stage2": "full", "planted_sample_seed": 11, "seeds": [0, 1],
                          "pairs": rows, "tables": tables(rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
