r"""What the protocol measures: the function check, the LMC curves, stage-1 metrics, summary rows.

* :func:`relative_output_change`: ``||f_{B'}(x) - f_B(x)|| / ||f_B(x)||``, the check that an
  aligned B' computes B's function;
* :func:`curve_runner` / :func:`naive_curves`: the interpolation curves
  ``(1 - t) theta_A + t theta_B`` (on the configured device), naive and aligned;
* :func:`stage1_metrics`: per layer, the stage-1 objective of the chosen head permutation,
  its rank among all ``h!`` and ``Lhat``;
* :func:`summary_row`: one line of the summary table for a scope's results, keyed by
  :func:`run_columns` (config hash, evaluation split, seed pair).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign import lmc
from symalign.spec import SymmetrySpec


def relative_output_change(model: nn.Module, state: dict[str, Tensor], state_b: dict[str, Tensor], x: Tensor,
                           model_b: nn.Module | None = None) -> float:
    """``||f(x) - f_B(x)|| / ||f_B(x)||``: the aligned B (``model`` with ``state``, possibly in
    rewritten coordinates) against B itself (``model_b`` with ``state_b``; default ``model``)."""
    with torch.no_grad():
        yb = lmc._logits(functional_call(model_b or model, state_b, (x,))).double()
        y2 = lmc._logits(functional_call(model, state, (x,))).double()
    return float((y2 - yb).norm() / yb.norm().clamp_min(1e-30))



def curve_runner(batches: list, task: str, points: int, device: str = "cpu"
                 ) -> Callable[[nn.Module, dict, dict], lmc.Curve]:
    """``run(model, state_a, state_b)``: :func:`symalign.lmc.curve` on ``device`` (``protocol.device``).

    On the CPU the model and states are used as they are; on a GPU a copy of the model, the
    two states and the batches are moved there (the caller's tensors stay on the CPU, where
    matching and the function check run).
    """
    from symalign.train import resolve_device

    dev = resolve_device(device)
    if dev.type == "cpu":
        return lambda model, a, b: lmc.curve(model, a, b, lambda: batches, task, points)
    on_dev = [(x.to(dev), y.to(dev)) for x, y in batches]

    def run(model: nn.Module, a: dict, b: dict) -> lmc.Curve:
        m = copy.deepcopy(model).to(dev)
        return lmc.curve(m, {k: v.to(dev) for k, v in a.items()}, {k: v.to(dev) for k, v in b.items()},
                         lambda: on_dev, task, points)

    return run



def naive_curves(curve: Callable[[nn.Module, dict, dict], lmc.Curve], model_a: nn.Module, arch_a: nn.Module,
                 states: tuple[dict, dict], rewritten: tuple[dict, dict]) -> tuple[lmc.Curve, lmc.Curve | None]:
    """The naive curve ``(1 - t) theta_A + t theta_B`` in the coordinates the aligned curves use, and
    (when the models were rewritten for alignment, the ``full`` scope) the one in their own coordinates.

    Interpolation is not invariant under the rewrite (gains folded into weights, writers centred),
    so a barrier ratio compares like with like only when both curves interpolate in the same
    coordinates: the first curve (``rewritten`` states on ``arch_a``) is the one the ratios use;
    the second (``states`` on ``model_a``; ``None`` when ``arch_a is model_a``) is reported beside it.
    """
    if arch_a is model_a:
        return curve(model_a, *states), None
    return curve(arch_a, *rewritten), curve(model_a, *states)



def stage1_metrics(spec: SymmetrySpec, state_a: dict, state_b: dict, transform: dict) -> list[dict]:
    """Per layer: the stage-1 objective of the chosen head permutation, of the identity, and
    (``h <= 8``) its rank among all admissible permutations and ``Lhat`` (the paper's metrics)."""
    from symalign.match.heads import best_and_identity, head_cost, lhat, objective, permutation_rank
    from symalign.match.views import find_layers

    rows = []
    for layer in find_layers(spec, state_a):
        space = layer.heads
        if space is None or space not in transform:
            continue
        group = spec.spaces[space]
        cost = head_cost(layer, state_a, state_b)
        pi = transform[space]
        entry = {"layer": layer.tag, "objective": objective(cost, pi),
                 "identity_objective": objective(cost, torch.arange(group.n_heads))}
        if group.n_heads <= 8:
            best, ident = best_and_identity(cost, group)
            entry.update(rank=permutation_rank(cost, pi, group), n_permutations=group.order(), best_objective=best,
                         lhat=lhat(entry["objective"], best, ident))
        rows.append(entry)
    return rows



def run_columns(res: dict, config: dict | None = None, seeds: tuple[int, ...] | None = None) -> dict:
    """What tells one run's rows from another's: the config hash
    (:func:`~symalign.experiments.config.config_hash` of ``res["config"]``, else of ``config``, the run
    folder's ``config.json``; ``?`` when neither was recorded), the evaluation split (older results
    without one: the test split) and the seed pair (``res["seeds"]``, else ``seeds``)."""
    from symalign.experiments.config import config_hash

    recorded = res.get("config") or config
    pair = res.get("seeds") or seeds
    return {"config": config_hash(recorded) if isinstance(recorded, dict) else "?",
            "eval_split": res.get("eval_split", "test"),
            "seeds": "-".join(str(int(s)) for s in pair) if pair else "?"}



def summary_row(name: str, res: dict, run: dict | None = None) -> dict:
    """One line of the summary table for a scope's results, keyed by :func:`run_columns` (or ``run``,
    the columns a report computed, e.g. with the run folder)."""
    row = {"experiment": name, **(run if run is not None else run_columns(res)),
           "family": res["family"], "data": res["data"], "pe": res["pe"], "scope": res["scope"],
           "acc_A": res["endpoints"]["A"]["acc"], "acc_B": res["endpoints"]["B"]["acc"],
           "naive_loss_barrier": res["naive"]["loss_barrier"], "naive_acc_barrier": res["naive"]["acc_barrier"]}
    for key, v in res["variants"].items():
        row[f"{key}_loss_barrier"] = v["curve"]["loss_barrier"]
        row[f"{key}_acc_barrier"] = v["curve"]["acc_barrier"]
        row[f"{key}_ratio_percent"] = v["loss_barrier_ratio_percent"]
    for key, v in res.get("methods", {}).items():
        row[f"{key}-matching_loss_barrier"] = v["curve"]["loss_barrier"]
        row[f"{key}-matching_acc_barrier"] = v["curve"]["acc_barrier"]
        row[f"{key}-matching_ratio_percent"] = v["loss_barrier_ratio_percent"]
    return row
