"""The main job (``symalign demo``, ``make demo``): LMC of ViTs on the embedded digits data.

What it measures (all on 449 held-out test images: digits split 65/10/25, one seed pair):

* **The paper's protocol** (``first-attention``): a base ViT (seed 0) is trained, its first
  attention layer re-initialised with seeds 1 and 2 and retrained with the rest frozen
  (models A and B); B is aligned to A through the exact attention symmetries and the
  naive (A -> B) and aligned (A -> B') interpolation barriers are compared.
* The same with **every attention layer** re-initialised (``all-attention``).
* For both scopes the data-free stages of the matcher -- stage 2 ``none`` (head
  permutation only), ``orthogonal``, ``full`` -- beside the ``learned`` refinement (the
  ``full`` result refined on training batches inside the same group).
* **Whole-model alignment** (``full`` scope, RoPE): two ViTs trained from scratch (seeds 1
  and 2), aligned through the residual stream, FF units and attention (data-free, then
  refined by learned matching), and the merged model (the midpoint ``t = 1/2`` of the
  path) scored beside A and B.

Both positional encodings (sinusoidal, RoPE) run the two attention scopes. The main row
of ``results.json`` (``encodings[pe]``) is the paper's protocol with stage 2 ``full``;
every other row is under ``rows``. Writes ``results.json``, ``report.md`` and one
``curves.png`` (naive and aligned curves of every scope).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from symalign.arithmetic import describe
from symalign.experiments.config import parse_config
from symalign.experiments.protocol import run_experiment, write_json_atomic
from symalign.experiments.report import _write_text_atomic, markdown_table, plot_curves

ENCODINGS = ("sinusoidal", "rope")
SCOPES = ("first-attention", "all-attention")
VARIANTS = ("none", "orthogonal", "full", "learned")
MAIN = ("first-attention", "full")
WHOLE_MODEL_PE = "rope"
SEEDS = (1, 2)
MODEL = {"family": "vit", "d_model": 48, "n_layers": 2, "n_heads": 4, "d_ff": 96, "patch_size": 2,
         "pooling": "cls"}
DATA_OPTIONS = {"test_fraction": 0.25}  # 449 test images (the default split keeps 180)


def demo_config(pe: str, steps: int = 300, scopes: tuple[str, ...] = SCOPES,
                variants: tuple[str, ...] = VARIANTS, learned_steps: int = 100, suffix: str = "") -> dict:
    """The experiment config of one encoding (see the module docstring). Named ``demo-vit-digits-<pe>``:
    its D=48 model is not the one of ``configs/vit-digits-<pe>.toml`` (D=32), and reports across run
    folders name experiments by these names."""
    return {
        "name": f"demo-vit-digits-{pe}{suffix}",
        "data": "digits",
        "data_options": dict(DATA_OPTIONS),
        "model": {**MODEL, "pe": pe},
        "train": {"steps": steps, "batch_size": 64, "lr": 3e-3, "eval_every": 0},
        "protocol": {"scopes": list(scopes), "seeds": list(SEEDS), "base_seed": 0, "freeze": True,
                     "points": 25, "eval_items": None, "variants": list(variants),
                     "learned_steps": learned_steps, "method_batch_size": 128},
    }


def _row(pe: str, res: dict, key: str) -> dict:
    v = res["variants"][key]
    return {"encoding": pe, "scope": res["scope"], "stage2": key,
            "naive_loss_barrier": res["naive"]["loss_barrier"], "aligned_loss_barrier": v["curve"]["loss_barrier"],
            "barrier_ratio_percent": v["loss_barrier_ratio_percent"],
            "naive_acc_barrier": res["naive"]["acc_barrier"], "aligned_acc_barrier": v["curve"]["acc_barrier"]}


def _midpoint(curve: dict, what: str) -> float:
    t = curve["t"]
    return curve[what][min(range(len(t)), key=lambda i: abs(t[i] - 0.5))]


def run_demo(out: str | Path = "runs/demo", steps: int = 300, progress: bool = True,
             log: Callable[[str], None] | None = None, fresh: bool = False, learned_steps: int = 100,
             whole_model: bool = True, device: str | None = None) -> dict:
    """Run the demo (resumable; refuses runs recorded with other settings unless ``fresh``) and
    write its three outputs; returns the ``results.json`` object.

    ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``): train and evaluate every run there (as
    :func:`~symalign.experiments.protocol.run_experiment`'s; recorded as each config's ``protocol.device``);
    ``None``: training on CUDA where it exists, the curves on the CPU."""
    out = Path(out)
    t0 = time.perf_counter()
    per_pe: dict[str, dict] = {}
    rows: list[dict] = []
    plotted: list[dict] = []
    for pe in ENCODINGS:
        cfg = parse_config(demo_config(pe, steps, learned_steps=learned_steps))
        results = run_experiment(cfg, out / "runs", progress=progress, log=log, fresh=fresh, device=device)
        by_scope = {r["scope"]: r for r in results}
        for r in results:
            rows += [_row(pe, r, k) for k in r["variants"]]
            plotted.append({**r, "variants": {k: v for k, v in r["variants"].items() if k in ("full", "learned")}})
        main = by_scope[MAIN[0]]
        full = main["variants"][MAIN[1]]
        per_pe[pe] = {
            **{k: v for k, v in _row(pe, main, MAIN[1]).items() if k not in ("encoding", "scope", "stage2")},
            "acc_A": main["endpoints"]["A"]["acc"], "acc_B": main["endpoints"]["B"]["acc"],
            "stage2_ablation_ratio_percent": {k: v["loss_barrier_ratio_percent"] for k, v in main["variants"].items()},
            "all_attention_ratio_percent": {k: v["loss_barrier_ratio_percent"]
                                            for k, v in by_scope["all-attention"]["variants"].items()},
            "function_change": full["function_change"],
        }
    summary: dict[str, Any] = {
        "data": "digits", "data_options": dict(DATA_OPTIONS), "family": "vit", "model": dict(MODEL),
        "steps": steps, "learned_steps": learned_steps, "seeds": list(SEEDS), "seed_pairs": 1,
        "main_row": {"scope": MAIN[0], "stage2": MAIN[1]},
        "encodings": per_pe, "rows": rows, "threads": torch.get_num_threads(), "arithmetic": describe(),
        "device": training_device(device),
    }
    if whole_model:
        cfg = parse_config(demo_config(WHOLE_MODEL_PE, steps, scopes=("full",), variants=("full", "learned"),
                                       learned_steps=learned_steps, suffix="-whole-model"))
        res = run_experiment(cfg, out / "runs", progress=progress, log=log, fresh=fresh, device=device)[0]
        aligned, learned = res["variants"]["full"]["curve"], res["variants"]["learned"]["curve"]
        summary["whole_model"] = {
            "encoding": WHOLE_MODEL_PE, "acc_A": res["endpoints"]["A"]["acc"], "acc_B": res["endpoints"]["B"]["acc"],
            "merged_naive_acc": _midpoint(res["naive"], "acc"), "merged_aligned_acc": _midpoint(aligned, "acc"),
            "merged_learned_acc": _midpoint(learned, "acc"),
            "loss_A": res["endpoints"]["A"]["loss"], "loss_B": res["endpoints"]["B"]["loss"],
            "merged_naive_loss": _midpoint(res["naive"], "loss"), "merged_aligned_loss": _midpoint(aligned, "loss"),
            "merged_learned_loss": _midpoint(learned, "loss"),
            **{k: v for k, v in _row(WHOLE_MODEL_PE, res, "full").items() if k not in ("encoding", "stage2")},
            "learned_loss_barrier": learned["loss_barrier"],
            "learned_ratio_percent": res["variants"]["learned"]["loss_barrier_ratio_percent"],
        }
        rows += [_row(WHOLE_MODEL_PE, res, k) for k in ("full", "learned")]
        plotted.append(res)
    from symalign.data import load_dataset

    summary["test_items"] = int(load_dataset("digits", **DATA_OPTIONS).y_test.shape[0])
    summary["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "results.json", summary)
    plot_curves(plotted, out / "curves.png", title="ViT on digits: naive (dashed) vs aligned curves")
    _write_text_atomic(out / "report.md", report_markdown(summary))
    return summary


def training_device(device: str | None) -> dict[str, str]:
    """Where the demo's models train (:func:`symalign.device.describe`): ``device``, or CUDA where it exists."""
    from symalign.device import describe as describe_device, resolve

    return describe_device(resolve(device or "auto"))


def report_markdown(summary: dict) -> str:
    """``report.md``: the tables of the demo."""
    parts = ["# symalign demo: LMC of ViTs on digits\n",
             f"ViT D={summary['model']['d_model']}, {summary['model']['n_layers']} layers, "
             f"{summary['model']['n_heads']} heads; {summary['test_items']} held-out test images; one seed pair "
             f"(A: seed {summary['seeds'][0]}, B: seed {summary['seeds'][1]}); torch threads "
             f"{summary['threads']}, {summary['arithmetic']['mode']} arithmetic. "
             "Ratio = aligned / naive loss barrier (%).\n",
             "## Barriers (every scope and stage 2)\n", markdown_table(summary["rows"])]
    if "whole_model" in summary:
        w = summary["whole_model"]
        parts += ["\n## Whole-model alignment: the merged model (t = 1/2)\n",
                  markdown_table([{k: w[k] for k in ("encoding", "acc_A", "acc_B", "merged_naive_acc",
                                                     "merged_aligned_acc", "merged_learned_acc",
                                                     "barrier_ratio_percent", "learned_ratio_percent")}])]
    parts.append("\n![curves](curves.png)\n")
    return "\n".join(parts)
