"""The prepared paper-scale run: one row of seed 000's table (default: ViT on CIFAR-10, learned positions and
RoPE) at the shipped paper size, all four scopes, on a CUDA GPU, within a time budget.

What it does, in order:

1. refuses in one line (exit 2) before any training when there is no CUDA device (unless ``--smoke``), when a
   config is missing, or when its dataset is not on disk (``$SYMALIGN_DATA/<name>``; the GPU machine reaches
   no network, so the files must be carried there: docs/paper-setting.md, "Datasets");
2. runs ``symalign experiment CONFIG --scope S --device DEVICE`` for every config and scope
   (``first-attention``, ``all-attention``, ``first-block``, ``full``), one process each, under what is left
   of ``--budget-min`` (a scope that runs out of time is recorded as ``timeout``; the experiment resumes
   where it stopped when the script is run again with the same ``--out``);
3. tabulates the finished scopes with ``benchmarks/results_table.py`` into ``--result`` (default
   ``results/paper-vit-cifar10.json``), with the wall time of each step beside it in ``paper_run`` (the
   provenance records the device and the GPU's name).

``--smoke`` runs the same steps on the CPU at a tiny shape on the embedded digits data (the configs are
rewritten to 2 layers, width 32, 60 training steps, 200 test items), so that ``make test`` can run the
script end to end and it cannot rot::

    python benchmarks/paper_run.py --budget-min 420                          # on a CUDA machine
    python benchmarks/paper_run.py --smoke --out /tmp/p --result /tmp/p.json  # anywhere, < 2 min
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCOPES = ("first-attention", "all-attention", "first-block", "full")
DEFAULT_CONFIGS = ("vit-cifar10", "vit-rope-cifar10")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def smoke_config(path: Path, out_dir: Path) -> Path:
    """``path`` shrunk to a CPU-sized run on the digits data (same family, encoding and protocol keys)."""
    import tomllib

    d = tomllib.loads(path.read_text())
    d["data"] = "digits"
    m = d["model"]
    if str(m.get("family", "")).startswith("hf:"):
        m.update(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64, patch_size=2)
    else:
        m.update(n_layers=2, n_heads=2, d_model=32, d_ff=64, patch_size=2)
    d["train"].update(steps=60, eval_every=30, eval_items=200, warmup=0)
    d["protocol"].update(eval_items=200, points=5, stage1_ablation=False)
    out = out_dir / path.name
    out.write_text(_toml(d))
    return out


def _toml(d: dict) -> str:
    """A flat two-level TOML writer for experiment configs (top-level scalars, then one table per section)."""
    def val(v: object) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = [f"{k} = {val(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {val(vv)}" for kk, vv in v.items())]
    return "\n".join(lines) + "\n"


def check_data(config: Path) -> None:
    """Refuse (exit 2) when the config's dataset cannot be loaded here."""
    from symalign.data import load_dataset
    from symalign.errors import SymalignError
    from symalign.experiments.config import load_experiment_config

    cfg = load_experiment_config(config)
    try:
        load_dataset(cfg.data, **cfg.data_options)
    except SymalignError as exc:
        fail(f"{config.name}: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", help="configs/paper/NAME.toml (repeatable; default: "
                    + ", ".join(DEFAULT_CONFIGS) + ")")
    ap.add_argument("--budget-min", type=float, default=420.0, help="wall-clock budget of all runs, minutes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "paper", help="runs directory (resumable)")
    ap.add_argument("--result", type=Path, default=ROOT / "results" / "paper-vit-cifar10.json")
    ap.add_argument("--scope", action="append", choices=SCOPES, help="run only these scopes (default: all four)")
    ap.add_argument("--smoke", action="store_true", help="the same steps on the CPU at a tiny shape (digits)")
    args = ap.parse_args()
    names = args.config or list(DEFAULT_CONFIGS)
    configs = [ROOT / "configs" / "paper" / f"{n}.toml" for n in names]
    for c in configs:
        if not c.is_file():
            fail(f"no config {c.relative_to(ROOT)}; choose one of configs/paper/*.toml")
    device = "cpu" if args.smoke else args.device
    if not args.smoke:
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            fail("no CUDA device here; this run is sized for a GPU (use --smoke to check the script on the CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        configs = [smoke_config(c, args.out) for c in configs]
    for c in configs:
        check_data(c)
    symalign = str(Path(sys.executable).with_name("symalign"))
    deadline = time.monotonic() + 60.0 * args.budget_min
    steps, experiments = [], []
    for c in configs:
        experiments.append(c.stem)  # each config's name is its file's stem (the smoke copies keep both)
        for scope in args.scope or SCOPES:
            left = deadline - time.monotonic()
            cmd = [symalign, "experiment", str(c), "--scope", scope, "--device", device, "--threads",
                   str(args.threads), "--out", str(args.out)]
            if left <= 0:
                steps.append({"config": c.stem, "scope": scope, "status": "not started (budget spent)"})
                continue
            t0 = time.monotonic()
            try:
                rc = subprocess.run(cmd, timeout=left).returncode
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                status = "timeout"
            steps.append({"config": c.stem, "scope": scope, "status": status,
                          "wall_s": round(time.monotonic() - t0, 1)})
            print(f"{c.stem} {scope}: {status} ({steps[-1]['wall_s']} s)", flush=True)
    table = [sys.executable, str(ROOT / "benchmarks" / "results_table.py"), *experiments, "--runs", str(args.out),
             "--threads", str(args.threads), "--command", shlex.join(["python", *sys.argv]),
             "--out", str(args.result)]
    if not any(s["status"] == "ok" for s in steps):
        fail(f"no scope finished within {args.budget_min} min; nothing written (rerun to resume)")
    subprocess.run(table, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(args.result.read_text())
    result["paper_run"] = {"device": device, "budget_min": args.budget_min, "smoke": args.smoke, "steps": steps}
    from symalign.atomic import write_json

    write_json(args.result, result)
    print(f"wrote {args.result}")
    if any(s["status"] != "ok" for s in steps):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
