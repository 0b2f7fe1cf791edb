"""``symalign merge A B [C ...] -o OUT``: align every checkpoint to the first, write their weighted average.

With ``--universe`` the models are aligned to their evolving weighted average
instead (seed 002's universe matching, :func:`symalign.stream.universe.universe_states`).
``symalign merge --module pkg.mod:factory A.pt B.pt -o OUT.pt --widths 64,96`` merges two
state dicts of a traceable module at different hidden widths instead
(:mod:`symalign.commands.merge_widths`).

Steps: check OUT and the weights; load and validate every checkpoint, refuse
different families, shapes or vocabularies (one line, exit 2, nothing written);
with ``--eval DATA`` build the evaluation batches first (bad data is refused
before any work); align each checkpoint ``k >= 2`` to the first with the
``symalign align`` engine (exact symmetries, the aligned model checked to compute
checkpoint ``k``'s function) and average them tensor by tensor with the one merge
(:func:`symalign.stream.merge.merge_into`): in memory each model aligned whole and checked through
``from_pretrained`` of the weights in memory (:func:`symalign.pipeline.align_loaded`); streamed each
aligned layer by layer on its own thread, every layer checked; never written and read back; write OUT atomically,
laid out like the first checkpoint (family, dtype, shards, config and tokenizer
files); check that OUT loads with ``from_pretrained``; optionally print the
merged model's loss beside each input's.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer

from symalign.commands import checks, interrupt
from symalign.io.hub import REVISION_HELP, resolve_all
from symalign.errors import ConfigError


def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--weights expects comma-separated numbers, e.g. 0.5,0.5; got {text!r}") from None


def run_merge(dirs: list[Path], out: Path, weights: list[float] | None = None, scope: str | None = None,
              stage2: str = "full", align: bool = True, force: bool = False, eval_data: str | None = None,
              eval_opts: Any = None, universe: bool = False, rounds: int = 3,
              stream: bool | None = None, progress: bool = True, max_sweeps: int = 20,
              experts: str | None = None, device: Any = None) -> dict[str, Any]:
    """Merge ``dirs`` into ``out`` (see the module docstring); returns the diagnostics.

    ``scope``: ``None`` aligns the whole model where the family supports it on the path taken (in memory or
    streamed; :func:`default_scope`), else the attention layers; the result says which (``scope``,
    ``scope_default``). ``device``: where the alignments compute (:mod:`symalign.device`).

    ``max_sweeps``: sweeps (passes) of the whole-model alignment at most (``--scope model``).
    ``experts``: how mixture-of-experts layers are matched (``"exact"`` or ``"paired"``; ``--scope model``
    on a mixture-of-experts family only, :func:`symalign.pipeline.check_experts`; ``None``: exact).

    ``stream``: align and average tensor by tensor (:mod:`symalign.stream.merge`; never a whole
    model in memory); ``None`` decides by size and scope (:func:`choose_path`); the result says which path
    (``path``, and ``path_default``: why, when chosen automatically). ``progress``: the steps on stderr
    (:func:`merge_steps`; streamed, the stream's own bars). Every argument is checked before any work."""
    from symalign.io.folder import check_output_dir
    from symalign.merge import normalise_weights
    from symalign.pipeline import SCOPES, check_experts

    if len(dirs) < 2:
        raise ConfigError(f"merge needs at least two checkpoints, got {len(dirs)}")
    if universe and scope == "attention":
        raise ConfigError("--universe matches whole models; use it with --scope model (or without --scope)")
    if universe and not align:
        raise ConfigError("--universe aligns the models; drop --no-align")
    if scope is not None and scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    streamed, path_why = choose_path(dirs, stream, universe, scope, align)
    chosen = None
    if scope is None:
        scope, chosen = ("model", "universe matching aligns whole models") if universe else \
            default_scope(dirs[0], streamed)
    if experts is not None and not align:
        raise ConfigError("--experts chooses how the models are aligned; drop it with --no-align")
    check_distinct(dirs)
    if eval_data is not None:
        from symalign.data.user import check_data_path

        check_data_path(eval_data)
    check_experts(experts, scope, dirs[0])
    w = normalise_weights(weights, len(dirs))
    out_path = check_output_dir(out, dirs, force)
    total = merge_step_count(len(dirs), align, universe, streamed, eval_data is not None)
    with merge_steps(total, progress and not streamed) as step:  # streamed: the stream's own bars
        if streamed:
            res = _merge_streamed(dirs, out_path, w, scope, stage2, align, force, eval_data, eval_opts, progress,
                                  max_sweeps, experts, step, device)
        else:
            res = _merge_in_memory(dirs, out_path, w, scope, stage2, align, eval_data, eval_opts, universe, rounds,
                                   max_sweeps, experts, step, device)
    res["scope_default"] = chosen
    res["path"] = "streamed" if streamed else "in memory"
    res["path_default"] = path_why
    from symalign.device import describe, peak_memory

    res["memory"] = peak_memory(device)
    res["device"] = describe(device)["device"]
    return res


def default_scope(a_dir: Path, streamed: bool) -> tuple[str, str]:
    """The scope a merge aligns with when none is given, and why: the whole model (residual stream, FF units and
    attention) where A's family supports it on the path taken -- measured to merge better than the attention
    layers alone (docs/evaluate-and-merge.md) --, else the attention layers."""
    from symalign.checkpoint.config import load_config
    from symalign.families import get_adapter
    from symalign.stream.auto import streamable

    family = get_adapter(load_config(a_dir))
    allowed = family.scopes.stream if streamed else family.scopes.memory
    path = "streamed" if streamed else "in memory"
    if "model" not in allowed:
        return "attention", f"{family.family} is aligned whole-model only {'in memory' if streamed else 'streamed'}"
    why = streamable(a_dir, "model") if streamed else None
    if why is not None:
        return "attention", why
    return "model", f"the default: whole-model alignment, which the {family.family} family supports {path}"


def _merge_streamed(dirs: list[Path], out_path: Path, w: list[float], scope: str, stage2: str, align: bool,
                    force: bool, eval_data: str | None, eval_opts: Any, progress: bool, max_sweeps: int,
                    experts: str | None, step: Callable[[str], None], device: Any = None) -> dict[str, Any]:
    """:func:`run_merge` tensor by tensor (:func:`symalign.stream.merge.run_stream_merge`); with ``--eval``
    the batches are built (and bad data refused) first, and one model is resident at a time."""
    from symalign.evaluate import build_eval, check_tokenizers, evaluate_model
    from symalign.jobs.interpolate import load_hf_model
    from symalign.stream.merge import run_stream_merge

    evalset = None
    if eval_data is not None:
        step("building the evaluation batches")
        evalset = build_eval(dirs[0], load_hf_model(dirs[0]), eval_data, eval_opts)
        check_tokenizers(dirs, evalset, eval_opts)
    step(f"aligning and averaging {len(dirs)} checkpoints tensor by tensor")
    res = run_stream_merge(dirs, out_path, w, scope=scope, stage2=stage2, align=align, force=force,
                           progress=progress, max_sweeps=max_sweeps, experts=experts or "exact", device=device)
    if evalset is not None:
        step(f"evaluating {len(dirs)} inputs and the merged model")
        res["eval"] = {"data": eval_data, "objective": evalset.objective, "info": evalset.info, "models": {}}
        for d in dirs:
            res["eval"]["models"][str(d)] = evaluate_model(load_hf_model(d), evalset).to_dict()
        res["eval"]["merged"] = evaluate_model(load_hf_model(res["out"]), evalset).to_dict()
    return res


def _merge_in_memory(dirs: list[Path], out_path: Path, w: list[float], scope: str, stage2: str, align: bool,
                     eval_data: str | None, eval_opts: Any, universe: bool, rounds: int, max_sweeps: int,
                     experts: str | None, step: Callable[[str], None], device: Any = None) -> dict[str, Any]:
    """:func:`run_merge` in memory (its arguments checked); ``step`` is told each step. Every checkpoint is
    checked from its headers first; then the models are loaded, each other model aligned to A in memory
    (:func:`symalign.pipeline.align_loaded`: checked whole, never written or read back) as the merge asks for
    its tensors, and averaged by the one merge (:func:`symalign.stream.merge.merge_into`) into a state dict.
    ``--universe`` aligns every model to the evolving average first (universe matching needs them all)."""
    from symalign.stream.merge import merge_into
    from symalign.stream.sink import StateSink

    ref = _open_reference(dirs, step)
    evalset = _eval_batches(dirs, eval_data, eval_opts, step)
    inputs = _universe_inputs(ref, dirs, w, rounds, stage2, max_sweeps, experts, device, step) if universe else \
        _aligned_inputs(ref, dirs, scope, stage2, align, max_sweeps, experts, device, step)
    sink = StateSink(inputs.ref)
    merge_into(sink, inputs.ref, inputs.models, inputs.items, w)
    ref.ckpt = inputs.ref = sink.like = None  # the inputs and their aligned copies can go before writing
    inputs.models, inputs.items = [], []
    step("averaging and writing")
    merged = sink.state
    _write_merged(out_path, merged, dirs, inputs.edits, {
        "command": "merge", "scope": scope, "folded": scope == "model", "weights": list(w),
        "inputs": [str(Path(d).resolve()) for d in dirs]}, step)
    res: dict[str, Any] = {
        "models": [str(d) for d in dirs], "weights": w, "out": str(out_path), "scope": scope if align else "none",
        "universe": {"rounds": rounds, "spread": inputs.spread} if universe else None,
        "aligned": inputs.aligned, "dtype": str(ref.dtype).replace("torch.", ""),
        "architecture": ref.config.model_type, "tensors": len(merged), "new_tensors": sorted(set(merged) - ref.keys),
        "experts": _experts_ran(align, scope, ref.adapter, experts),
    }
    if evalset is not None:
        step(f"evaluating {len(dirs)} inputs and the merged model")
        res["eval"] = _evaluate_merge(dirs, out_path, eval_data, evalset)
    return res


@dataclass
class _Reference:
    """Model A, which every other model is aligned to: its loaded checkpoint (``ckpt``; set to ``None`` once the
    merge is formed, so its tensors can be freed) and what the result reports of it."""

    ckpt: Any
    keys: set[str]
    config: Any
    adapter: Any
    dtype: Any


@dataclass
class _Inputs:
    """What the one merge averages in memory: the first model as it enters the sum (``ref``, a resident source),
    the others as stored (``models``) and their aligned tensors (``items``, produced as the merge asks), plus
    what building them records: config edits for the output, each alignment's summary, the universe spread."""

    ref: Any
    models: list[Any]
    items: list[Any]
    edits: dict[str, Any] = field(default_factory=dict)
    aligned: list[dict] = field(default_factory=list)
    spread: list[float] | None = None


def _open_reference(dirs: list[Path], step: Callable[[str], None]) -> _Reference:
    """Every checkpoint checked from its headers (same architecture, same vocabulary: every refusal before any
    tensor is read), then A loaded."""
    from symalign.checkpoint.config import check_same_architecture
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.evaluate import check_same_vocabulary

    step(f"reading {len(dirs)} checkpoints")
    opened = [open_checkpoint(d) for d in dirs]  # headers only: every refusal before any tensor is read
    for c in opened[1:]:
        check_same_architecture(opened[0], c)
    check_same_vocabulary(dirs)
    a_ckpt = load_checkpoint(dirs[0])
    return _Reference(a_ckpt, set(a_ckpt.state), a_ckpt.config, a_ckpt.adapter, a_ckpt.dtype)


def _eval_batches(dirs: list[Path], eval_data: str | None, eval_opts: Any, step: Callable[[str], None]):
    """The evaluation batches of ``--eval`` (built from A; every model's tokenizer checked against them), or
    ``None`` without it."""
    if eval_data is None:
        return None
    from symalign.evaluate import build_eval, check_tokenizers
    from symalign.jobs.interpolate import load_hf_model

    step("building the evaluation batches")
    evalset = build_eval(dirs[0], load_hf_model(dirs[0]), eval_data, eval_opts)
    check_tokenizers(dirs, evalset, eval_opts)
    return evalset


def _universe_inputs(ref: _Reference, dirs: list[Path], w: list[float], rounds: int, stage2: str, max_sweeps: int,
                     experts: str | None, device: Any, step: Callable[[str], None]) -> _Inputs:
    """``--universe``: every model aligned to the evolving weighted average
    (:func:`symalign.stream.universe.universe_states`, the one whole-model loop; all of them resident)."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.stream.merge import state_items
    from symalign.stream.universe import universe_states

    step(f"universe matching of {len(dirs)} checkpoints ({rounds} rounds)")
    ckpts = [ref.ckpt] + [load_checkpoint(d) for d in dirs[1:]]
    uni = universe_states(ckpts, w, rounds, stage2, experts=experts or "exact", max_sweeps=max_sweeps, device=device)
    del ckpts
    ref.ckpt = None
    sources = [ResidentCheckpoint(d, s, checked=True) for d, s in zip(dirs, uni.states)]
    return _Inputs(sources[0], sources[1:], [state_items(s) for s in uni.states[1:]],
                   edits={"tie_word_embeddings": False} if uni.untied else {}, spread=uni.spread)


def _aligned_inputs(ref: _Reference, dirs: list[Path], scope: str, stage2: str, align: bool, max_sweeps: int,
                    experts: str | None, device: Any, step: Callable[[str], None]) -> _Inputs:
    """A as it enters the sum -- itself, or in the exactly rewritten format of the aligned models under ``--scope
    model`` -- and every other model, loaded, with its tensors as stored (``--no-align``) or aligned to A
    (:func:`symalign.pipeline.align_loaded`, when the merge first asks for them; its summary recorded)."""
    from symalign.checkpoint.config import saved_names
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.stream.merge import copies

    loaded = [load_checkpoint(d) for d in dirs[1:]]
    models = [ResidentCheckpoint.of(c) for c in loaded]
    if align and scope == "model":  # A in the same exactly rewritten format as the aligned
        from symalign.families import prepare

        pa = prepare(ref.config, ref.ckpt.state, ref.adapter.spec(ref.config, ref.ckpt.state.keys()))
        inputs = _Inputs(ResidentCheckpoint(dirs[0], saved_names(ref.config, pa.state), ref.config, ref.adapter,
                                            checked=True), models, [],
                         edits={"tie_word_embeddings": False} if pa.untied else {})
    else:
        inputs = _Inputs(ResidentCheckpoint.of(ref.ckpt), models, [])
    if not align:
        inputs.items = [copies(m) for m in models]
        return inputs

    def aligned(k: int):
        step(f"aligning {Path(dirs[k]).name} to {Path(dirs[0]).name} ({k}/{len(dirs) - 1})")
        from symalign.pipeline import align_loaded

        got = align_loaded(ref.ckpt, loaded[k - 1], scope=scope, stage2=stage2, max_sweeps=max_sweeps,
                           experts=experts, device=device)
        info = got.result
        inputs.aligned.append({"model": str(dirs[k]), "distance": info.distance, "check": info.check.to_dict(),
                               "experts": info.match.get("experts"), "sweeps": info.sweeps,
                               "converged": info.converged})
        inputs.edits.update(got.edits)
        for name, t in got.state.items():
            yield name, None, t

    inputs.items = [aligned(k) for k in range(1, len(dirs))]
    return inputs


def _write_merged(out_path: Path, merged: dict[str, Any], dirs: list[Path], edits: dict[str, Any],
                  marker: dict[str, Any], step: Callable[[str], None]) -> None:
    """The merged tensors staged beside OUT laid out like A (:func:`symalign.checkpoint.output.stage_checkpoint`),
    checked to load (config and tensors agree; ``from_pretrained`` reads it), then renamed to OUT (else
    discarded)."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import stage_checkpoint
    from symalign.io.folder import commit, discard
    from symalign.jobs.interpolate import load_hf_model

    tmp = stage_checkpoint(out_path, merged, dirs[0], edits or None, marker=marker)
    step("checking that the merged checkpoint loads")
    try:
        load_checkpoint(tmp)  # config and tensors agree
        load_hf_model(tmp)  # and from_pretrained reads it
        commit(tmp, out_path)
    except BaseException:
        discard(tmp)
        raise


def _evaluate_merge(dirs: list[Path], out_path: Path, eval_data: str, evalset: Any) -> dict[str, Any]:
    """``--eval``: each input's and the merged model's loss on the evaluation batches."""
    from symalign.evaluate import evaluate_model
    from symalign.jobs.interpolate import load_hf_model

    return {"data": eval_data, "objective": evalset.objective, "info": evalset.info,
            "models": {str(d): evaluate_model(load_hf_model(d), evalset).to_dict() for d in dirs},
            "merged": evaluate_model(load_hf_model(out_path), evalset).to_dict()}


def check_distinct(dirs: list[Path]) -> None:
    """Refuse a checkpoint listed twice (``merge A B A``): give each once, and its share with ``--weights``."""
    seen: dict[Path, int] = {}
    for i, d in enumerate(dirs, 1):
        r = Path(d).resolve()
        if r in seen:
            raise ConfigError(f"{d} is listed twice (checkpoints {seen[r]} and {i}); list each checkpoint once and "
                              "weight it with --weights (e.g. --weights 2,1)")
        seen[r] = i


@contextmanager
def merge_steps(total: int, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """The merge's steps on stderr as a rich progress display (spinner, step k of ``total``, elapsed time):
    yields ``step(text)``, called as each step starts. On an error or an interrupt the display is cleared,
    so the one line that says why is all that remains."""
    if not enabled:
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("merge: {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("starting", total=total)
        done = [0]

        def step(text: str) -> None:
            bar.update(task, completed=min(done[0], total), description=text)
            done[0] += 1

        try:
            yield step
        except BaseException:
            bar.live.transient = True  # a refusal or an interrupt leaves its own one line, not the display
            raise
        bar.update(task, completed=total, description="done")


def merge_step_count(n: int, align: bool, universe: bool, streamed: bool, evaluate: bool) -> int:
    """The steps :func:`run_merge` announces: read, (evaluation batches), align each or universe matching,
    average and write, check, (evaluate); streamed: (evaluation batches), the streamed merge, (evaluate)."""
    if streamed:
        return 1 + 2 * evaluate
    aligns = 1 if universe else (n - 1 if align else 0)
    return 1 + aligns + 2 + 2 * evaluate


def _experts_ran(align: bool, scope: str, adapter: Any, experts: str | None) -> str | None:
    """The method that matched the mixture-of-experts layers (``None``: none were matched)."""
    from symalign.families.moe import MoEFamily

    return (experts or "exact") if align and scope == "model" and isinstance(adapter, MoEFamily) else None


def choose_path(dirs: list[Path], stream: bool | None, universe: bool, scope: str | None,
                align: bool) -> tuple[bool, str | None]:
    """Whether the merge streams, and why when it was chosen here (``None``: ``--stream/--no-stream`` decided).

    ``stream`` given: it decides (``--stream --universe`` refused). ``--universe`` holds every model: in memory.
    Otherwise, with ``S`` the checkpoints' safetensors bytes together:

    * ``S`` over a quarter of the physical memory: streamed (as ``symalign align``), the scope being the streamed
      default where none is given (:func:`default_scope`);
    * ``S`` over :data:`~symalign.stream.merge.AUTO_STREAM_BYTES`: streamed when the family streams the scope
      the merge would use in memory (the one asked, else the in-memory default; ``--no-align``: the averaging
      alone), so streaming never changes what is aligned; else in memory. The in-memory merge holds A, each
      model, its aligned copy and the merged state -- several times the weights --,
      where the streamed one holds a layer of two models and fixed row chunks
      (benchmarks/results/merge_peers.json measures both against mergekit);
    * else in memory (small checkpoints: streaming's fixed buffers would outweigh them)."""
    from symalign.stream.auto import STREAM_FRACTION, physical_memory, streamable, weights_bytes
    from symalign.stream.merge import AUTO_STREAM_BYTES

    if stream and universe:
        raise ConfigError("--universe holds every model in memory; drop --stream (or --universe)")
    if stream is not None:
        return stream, None
    if universe:
        return False, "auto, universe matching holds every model in memory"
    size = sum(weights_bytes(d) for d in dirs)
    mib = f"{size / 2**20:.1f} MiB"
    if size > STREAM_FRACTION * physical_memory():
        return True, f"auto, the checkpoints ({mib}) exceed a quarter of the memory; --no-stream keeps them there"
    limit = f"{AUTO_STREAM_BYTES / 2**20:g} MiB"
    if size <= AUTO_STREAM_BYTES:
        return False, f"auto, the checkpoints ({mib}) are at most {limit}; --stream streams them"
    want = "attention" if not align else scope or default_scope(dirs[0], False)[0]
    try:
        why = streamable(Path(dirs[0]), want)
        if why is None and align and scope is None and default_scope(dirs[0], True)[0] != want:
            why = default_scope(dirs[0], True)[1]
    except Exception:  # an unreadable checkpoint: the in-memory path names the problem
        why = "the checkpoint could not be read ahead"
    if why is None:
        what = f"--scope {want}" if align else "the plain average"
        return True, f"auto, the checkpoints ({mib}) exceed {limit}; streamed with {what}; --no-stream keeps them " \
                     "in memory"
    return False, f"auto, the checkpoints ({mib}) exceed {limit}, but {why.rstrip('.')}"


def _merge_module(module: str | None, widths: str | None, split: str, models: list[Path], out: Path,
                  weights: str | None, align: bool, force: bool, max_sweeps: int, device: Any, as_json: bool) -> None:
    """``merge --module ... --widths``: :func:`symalign.commands.merge_widths.run_merge_widths`, printed."""
    from symalign.commands.merge_widths import parse_widths, run_merge_widths

    if module is None:
        raise ConfigError("--widths needs --module pkg.mod:factory (factory(width) builds the model at a width)")
    pair = parse_widths(widths)
    if len(models) != 2:
        raise ConfigError(f"merge --module takes two state dicts A.pt B.pt, got {len(models)}")
    res = run_merge_widths(module, models[0], models[1], out, pair, split=split, weights=_parse_weights(weights),
                           align=align, force=force, max_sweeps=max_sweeps, device=device)
    if as_json:
        typer.echo(json.dumps(res, default=float))
        return
    narrow = min(res["widths"])
    typer.echo(f"merged {res['a']} (width {res['widths'][0]}) and {res['b']} (width {res['widths'][1]}) at width "
               f"{res['width']}: {res['split']} split of the width-{narrow} model"
               f"{', aligned' if res['aligned'] else ''} -> {res['out']}")


def register(app: typer.Typer) -> None:
    @app.command("merge")
    def merge(
        models: list[Path] = typer.Argument(..., help="Two or more save_pretrained checkpoints of one family; "
                                                      "all are aligned to the first. With --module: two "
                                                      "torch.save'd state dicts A.pt B.pt."),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory: the merged checkpoint."),
        weights: Optional[str] = typer.Option(None, "--weights", help="Comma-separated weights, one per model "
                                                                      "(normalised to sum 1; default uniform)."),
        scope: Optional[str] = typer.Option(None, help="attention | model: what is aligned before averaging "
                                            "(as in `symalign align`). Default: model (the whole model) where the "
                                            "family supports it, else attention; the output says which."),
        universe: bool = typer.Option(False, "--universe", help="Universe matching (whole model): align all models "
                                      "to their evolving weighted average instead of to the first."),
        rounds: int = typer.Option(3, "--rounds", help="Universe matching rounds."),
        stage2: str = typer.Option("full", help="Inside-head alignment: none | orthogonal | full."),
        max_sweeps: int = typer.Option(20, "--max-sweeps", min=1, help="--scope model: sweeps of the "
                                       "alternating whole-model alignment at most (as `symalign align`)."),
        no_align: bool = typer.Option(False, "--no-align", help="Average the checkpoints as they are (naive merge)."),
        eval_data: Optional[str] = typer.Option(None, "--eval", help="Also evaluate the inputs and the merged model "
                                                "on DATA (as `symalign interpolate --data`)."),
        split: Optional[str] = typer.Option(None, "--split", help="Split of the --eval data."),
        text_field: Optional[str] = typer.Option(None, "--text-field", help="Text field / column of the --eval data."),
        label_field: Optional[str] = typer.Option(None, "--label-field", help="Label field / column of the --eval "
                                                  "data."),
        eval_items: Optional[int] = typer.Option(None, "--eval-items", help="Windows or examples evaluated."),
        eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", help="LM: tokens evaluated."),
        context: Optional[int] = typer.Option(None, help="Window length in tokens (default: the model's maximum, "
                                                         "at most 512)."),
        tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer folder for checkpoints saved "
                                                "without one."),
        image_processor: Optional[str] = typer.Option(None, "--image-processor", help="Image processor folder for "
                                                      "checkpoints saved without one."),
        force: bool = typer.Option(False, "--force", help="Replace OUT if it is a previous symalign output "
                                                          "(atomically); other folders are never replaced."),
        stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Align and average tensor by "
                                              "tensor, never a whole model in memory (--scope attention; --scope "
                                              "model: decoder and encoder families). Default: streamed when the "
                                              "checkpoints exceed 8 MiB and the family streams the scope, or a "
                                              "quarter of the memory; the output says which path."),
        experts: Optional[str] = typer.Option(None, "--experts", metavar="exact|paired", help="--scope model on a "
                                              "mixture-of-experts family: how experts and their units are matched "
                                              "(as `symalign align --experts`; default exact, paired: approximate "
                                              "and much cheaper on Mixtral-like shapes)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the diagnostics."),
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress display on stderr."),
        threads: Optional[int] = checks.threads_option(),
        device: str = checks.device_option(),
        max_device_memory: Optional[str] = checks.max_device_memory_option(),
        revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
        module: Optional[str] = typer.Option(None, "--module", help="pkg.mod:factory: merge two state dicts of "
                                             "different hidden widths; factory(width) builds the model at a width "
                                             "(with --widths)."),
        widths: Optional[str] = typer.Option(None, "--widths", help="--module: the hidden widths of A and B, "
                                             "e.g. 64,96; the narrower is split onto the wider's widths, aligned "
                                             "and averaged."),
        split_units: str = typer.Option("matched", "--split-units", metavar="matched|uniform", help="--module "
                                        "--widths: how the narrower model's units are split (matched: fitted to "
                                        "the wider model's units; uniform: the first units copied)."),
    ) -> None:
        """Align checkpoints to the first and write their weighted average as a loadable checkpoint."""
        from symalign.evaluate import EvalOptions

        checks.use_threads(threads)
        dev = checks.use_device(device, None if as_json or no_progress else
                                lambda line: typer.echo(f"merge: {line}", err=True))
        cap = checks.use_max_device_memory(max_device_memory, dev)
        interrupt.keep_output(out)
        if module is not None or widths is not None:
            _merge_module(module, widths, split_units, models, out, weights, not no_align, force, max_sweeps, dev,
                          as_json)
            return

        opts = EvalOptions(split=split, text_field=text_field, label_field=label_field, eval_items=eval_items,
                           eval_tokens=eval_tokens, context=context, tokenizer=tokenizer,
                           image_processor=image_processor)
        models = resolve_all(models, revision, "checkpoint")  # Hub ids -> cached snapshots
        res = run_merge(list(models), out, _parse_weights(weights), scope=scope, stage2=stage2, align=not no_align,
                        force=force, eval_data=eval_data, eval_opts=opts, universe=universe, rounds=rounds,
                        stream=stream, max_sweeps=max_sweeps, experts=experts, progress=not no_progress,
                        device=dev)
        res["memory"] = {**(res.get("memory") or {}), **cap}
        if as_json:
            typer.echo(json.dumps(res, default=float))
            return
        typer.echo(f"merged {len(models)} {res['architecture']} checkpoints (weights "
                   f"{', '.join(f'{x:.3g}' for x in res['weights'])}; aligned: {res['scope']}"
                   f"{', universe' if res['universe'] else ''}) -> {res['out']}")
        if res.get("scope_default"):
            typer.echo(f"scope: {res['scope']} ({res['scope_default']}; --scope chooses)")
        if res.get("path_default"):
            typer.echo(f"path: {res['path']} ({res['path_default']})")
        if "eval" in res:
            ev = res["eval"]
            typer.echo(f"{ev['objective']} loss on {ev['data']}:")
            for d, m in ev["models"].items():
                typer.echo(f"  {d}: {m['loss']:.4f}  (accuracy {m['accuracy']:.3f})")
            m = ev["merged"]
            typer.echo(f"  merged: {m['loss']:.4f}  (accuracy {m['accuracy']:.3f})")
