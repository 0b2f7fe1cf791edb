r"""The ``symalign align`` pipeline: read -> prepare -> match -> verify -> write, for every scope and path.

:func:`align` takes an :class:`AlignJob`, checks it (scope, ``--stage2``, sweeps, output folder),
decides whether to stream (:func:`symalign.stream.auto.should_stream`) and runs the scope's engine over
resident sources (in memory) or lazily opened ones (streamed, one layer in memory at a time):

* ``--scope attention``: the one attention engine, :func:`symalign.stream.attention.align_attention` --
  in memory :class:`ResidentAttention` (resident sources, units of :data:`IN_MEMORY_BLOCK_PARAMS`, into a state
  dict, then the whole model checked), streamed :func:`symalign.stream.attention.run_stream_attention` (lazy
  sources, one layer per unit, each layer checked, into OUT's shards);
* ``--scope model``: the one whole-model loop, :class:`~symalign.stream.model.StreamedWhole` then
  :func:`~symalign.stream.model.write_aligned` -- in memory :class:`InMemoryModel` (resident sources, into a
  state dict, then the whole model checked), streamed :func:`symalign.stream.model.run_stream_model` (lazy
  sources, each layer checked, into OUT's shards), decoders and encoders alike, with a residual space or without
  (a bare model: each layer's FF units and attention); in memory, what it refuses (T5, whose layers share a head
  space per stack) is matched by :func:`symalign.match.whole.match_whole` instead.

Each engine goes through the same phases, timed by one :class:`~symalign.align_result.PhaseClock`:

1. **read**: both checkpoints, validated (files, shapes against the config, NaN/Inf), and refused
   unless they have the same architecture (:mod:`symalign.checkpoint`);
2. **prepare**: the symmetry spec from the family adapter; for ``--scope model`` both checkpoints
   rewritten exactly in folded form (:func:`symalign.families.prepare`);
3. **match**: the group element ``g`` bringing B closest to A (attention: :func:`symalign.match.match_attention`;
   model: the passes of :class:`~symalign.stream.model.StreamedWhole`, or :func:`symalign.match.whole.match_whole`),
   and ``B' = g . B``;
4. **verify**: B' must compute B's function within the tolerance table (:mod:`symalign.tolerance`) --
   whole model through ``from_pretrained`` (in memory) or layer by layer through the family's code
   (streamed);
5. **write**: OUT staged next to its final place in B's layout with B's other files and the
   ``symalign.json`` marker, and renamed into place only after the check passed.

A streamed engine interleaves match, verify and write layer by layer; the clock sums each phase
over the layers. Every engine returns an :class:`~symalign.align_result.AlignResult`, so the
JSON is the same for every scope and path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from symalign.align_result import AlignResult, CheckReport, PhaseClock, new_result
from symalign.checkpoint.config import check_same_architecture
from symalign.checkpoint.hf import HFCheckpoint, load_checkpoint
from symalign.checkpoint.output import stage_checkpoint, verify_and_commit
from symalign.io.folder import check_output_dir
from symalign.io.hub import marker_fields
from symalign.errors import ConfigError
from symalign.match.experts import expert_units
from symalign.provenance import provenance
from symalign.tolerance import FunctionCheck

SCOPES = ("attention", "model")
STAGE2 = ("none", "orthogonal", "full")
EXPERTS = ("exact", "paired")  # --experts: symalign.match.experts.match_experts methods offered by the CLI


def check_experts(experts: str | None, scope: str, a_dir: Path) -> None:
    """Refuse ``--experts`` (given: not ``None``) where it means nothing: an unknown method, a scope other
    than ``model``, or a checkpoint (A's config) whose family has no mixture-of-experts layers."""
    if experts is None:
        return
    if experts not in EXPERTS:
        raise ConfigError(f"unknown --experts {experts!r}; use one of {', '.join(EXPERTS)}")
    if scope != "model":
        raise ConfigError(f"--experts applies to --scope model (it chooses how mixture-of-experts layers are "
                          f"matched); drop it with --scope {scope}")
    from symalign.checkpoint.config import load_config
    from symalign.families import get_adapter
    from symalign.families.moe import MoEFamily

    try:
        config = load_config(a_dir)
        family = get_adapter(config)
    except Exception:  # an unreadable config or an unknown family: the read phase reports it
        return
    if not isinstance(family, MoEFamily):
        refuse_experts(repr(config.model_type))


def refuse_experts(what: str) -> None:
    """The one-line refusal of ``--experts`` on a model without mixture-of-experts layers."""
    raise ConfigError(f"--experts applies to mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, OLMoE); "
                      f"{what} has no expert layers -- drop --experts")


@dataclass
class AlignJob:
    """What to align: B (``b_dir``) to A (``a_dir``), written to ``out_dir``, and how.

    ``max_sweeps``: sweeps of the whole-model solver (``--scope model``); ``write_reference``: also
    write A's folded form there (``--scope model``, in memory); ``stream``: ``None`` decides by size;
    ``say``: receives progress lines; ``progress``: rich progress bars (streamed);
    ``return_transform``: keep the group element in :attr:`AlignResult.transform`; ``experts``: how
    mixture-of-experts layers are matched (``--scope model``; ``None``: ``"exact"``, see :data:`EXPERTS`
    and :func:`symalign.match.experts.match_experts`), refused elsewhere (:func:`check_experts`); ``device``:
    where the matching computes (:mod:`symalign.device`; ``None``: the CPU) -- reading, checking and writing stay
    on the CPU (``--scope model``: the passes of :class:`~symalign.stream.model.StreamedWhole` on the device, or
    ``match_whole`` there for the families it refuses).
    """

    a_dir: Path
    b_dir: Path
    out_dir: Path
    scope: str = "attention"
    stage1: bool = True
    stage2: str = "full"
    max_sweeps: int = 20
    force: bool = False
    write_reference: Path | None = None
    stream: bool | None = None
    progress: bool = True
    say: Callable[[str], None] | None = None
    return_transform: bool = False
    experts: str | None = None
    device: torch.device | None = None

    def check(self) -> None:
        """Refuse a bad option with one line naming it."""
        if self.scope not in SCOPES:
            raise ConfigError(f"unknown scope {self.scope!r}; use one of {', '.join(SCOPES)}")
        if self.stage2 not in STAGE2:
            raise ConfigError(f"unknown --stage2 {self.stage2!r}; use one of {', '.join(STAGE2)}")
        if self.max_sweeps < 1:
            raise ConfigError(f"--max-sweeps must be at least 1, got {self.max_sweeps}")
        if self.write_reference is not None and self.scope != "model":
            raise ConfigError("--write-reference applies to --scope model (attention alignment keeps A's format: "
                              "interpolate with A itself)")
        check_experts(self.experts, self.scope, self.a_dir)

    def tell(self, line: str) -> None:
        if self.say is not None:
            self.say(line)


def align(job: AlignJob) -> AlignResult:
    """Run the pipeline for ``job`` (module docstring) and return its result."""
    from symalign.stream.auto import should_stream

    job.check()
    clock = PhaseClock()
    streamed = should_stream(job.a_dir, job.b_dir, job.scope, job.stream)
    if streamed and job.write_reference is not None:
        raise ConfigError("--write-reference is not available with --stream yet; align without --stream, "
                          "or let `symalign interpolate` fold A itself (OUT is marked folded)")
    out_path = check_output_dir(job.out_dir, [job.a_dir, job.b_dir], job.force)
    if streamed and job.scope == "attention":
        from symalign.stream.attention import run_stream_attention

        res = run_stream_attention(job.a_dir, job.b_dir, out_path, stage2=job.stage2, stage1=job.stage1,
                                   force=job.force, progress=job.progress, return_transform=job.return_transform,
                                   clock=clock, device=job.device)
    elif streamed:
        from symalign.stream.model import run_stream_model

        res = run_stream_model(job.a_dir, job.b_dir, out_path, stage2=job.stage2, stage1=job.stage1,
                               force=job.force, progress=job.progress, max_sweeps=job.max_sweeps, clock=clock,
                               experts=job.experts or "exact", device=job.device)
    else:
        engine = ResidentAttention if job.scope == "attention" else InMemoryModel
        res = engine(job, out_path, clock).run()
    return finish(res, job, out_path, clock)


def finish(res: AlignResult, job: AlignJob, out_path: Path, clock: PhaseClock) -> AlignResult:
    """The fields every path shares: paths, options, threads, provenance, timings."""
    res.a, res.b, res.out = str(job.a_dir), str(job.b_dir), str(out_path)
    res.scope, res.stage1, res.stage2 = job.scope, job.stage1, job.stage2
    if job.scope == "model":
        res.max_sweeps = job.max_sweeps
    res.threads = torch.get_num_threads()
    res.provenance = provenance(threads=res.threads, device=job.device)
    res.provenance.update(marker_fields({"inputs": [str(job.a_dir), str(job.b_dir)]}))  # Hub ids: their snapshots
    res.timings = clock.timings()
    from symalign.device import peak_memory

    res.memory = peak_memory(job.device)
    return res


class InMemoryEngine:
    """Both checkpoints in memory: the phases one after the other. ``talks``: progress lines go to
    ``job.say`` (the model scope's sweeps take a while; the attention scope is quiet)."""

    talks = False

    def __init__(self, job: AlignJob, out_path: Path, clock: PhaseClock):
        self.job, self.out_path, self.clock = job, out_path, clock
        self.a: HFCheckpoint
        self.b: HFCheckpoint

    def run(self) -> AlignResult:
        with self.clock("read"):
            self.tell("loading A and B")
            self.a = load_checkpoint(self.job.a_dir)
            self.b = load_checkpoint(self.job.b_dir)
            check_same_architecture(self.a, self.b)
        with self.clock("prepare"):
            self.prepare()
        with self.clock("match"):
            self.match()
        return self.write()

    def tell(self, line: str) -> None:
        if self.talks:
            self.job.tell(line)

    def marker(self) -> dict[str, Any]:
        return {"command": "align", "scope": self.job.scope, "a": str(Path(self.job.a_dir).resolve()),
                "b": str(Path(self.job.b_dir).resolve())}

    def stage_and_commit(self, state: dict, edits: dict | None, marker: dict, culprit: str):
        """Stage OUT (write), check it computes B's function and commit it (verify)."""
        with self.clock("write"):
            tmp = stage_checkpoint(self.out_path, state, self.job.b_dir, edits, marker=marker)
        with self.clock("verify"):
            self.tell("checking that OUT computes B's function")
            return verify_and_commit(tmp, self.out_path, self.b, self.job.b_dir, culprit)

    def prepare(self) -> None:
        raise NotImplementedError

    def match(self) -> None:
        raise NotImplementedError

    def write(self) -> AlignResult:
        raise NotImplementedError


IN_MEMORY_BLOCK_PARAMS = 16_000_000  # in memory, the attention engine matches layers in units of this size


class ResidentAttention(InMemoryEngine):
    """``--scope attention`` in memory: the one attention engine (:func:`symalign.stream.attention.align_attention`)
    over both checkpoints as resident sources (:class:`~symalign.checkpoint.lazy.ResidentCheckpoint`) into a
    :class:`~symalign.stream.sink.StateSink`, in units of up to :data:`IN_MEMORY_BLOCK_PARAMS` attention
    parameters; the whole model is then checked through ``from_pretrained`` (not layer by layer)."""

    def prepare(self) -> None:
        self.spec = self.b.adapter.spec(self.b.config, self.b.state.keys())
        self.spec.check(self.a.state)
        self.spec.check(self.b.state)

    def match(self) -> None:
        from symalign.checkpoint.lazy import ResidentCheckpoint
        from symalign.match.distance import attention_distance
        from symalign.stream.attention import align_attention
        from symalign.stream.sink import StateSink

        a, b = ResidentCheckpoint.of(self.a), ResidentCheckpoint.of(self.b)
        sink = StateSink(b)
        self.run_ = align_attention(a, b, sink, stage1=self.job.stage1, stage2=self.job.stage2, progress=False,
                                    return_transform=self.job.return_transform, device=self.job.device,
                                    check_layers=False, block_params=IN_MEMORY_BLOCK_PARAMS)
        self.out_state = sink.state
        self.before = attention_distance(self.spec, self.a.state, self.b.state)
        self.after = attention_distance(self.spec, self.a.state, self.out_state)
        del self.a

    def edits(self) -> dict[str, Any] | None:
        return None

    def write(self) -> AlignResult:
        check = self.stage_and_commit(self.out_state, None, {**self.marker(), "folded": False},
                                      f"the {self.b.adapter.family} adapter or the matcher")
        del self.out_state
        return self.result_with(check)

    def result_with(self, check: FunctionCheck) -> AlignResult:
        return new_result(self.b, self.spec, "in-memory", self.before, self.after, 1, True, CheckReport.whole(check),
                          match=self.run_.match(),
                          transform=dict(self.run_.transform) if self.job.return_transform else None)


class InMemoryModel(InMemoryEngine):
    """``--scope model`` in memory: residual stream, FF units and attention of both checkpoints rewritten exactly
    in folded form (norm gains folded where the residual group needs it; the group per family -- ``O(D)``,
    ``O_1(D)`` or ``S_D`` -- is tabled in :mod:`symalign.families`) and matched. OUT is written in folded form
    (GPT-2: ``tie_word_embeddings = false``) and checked whole through ``from_pretrained``;
    ``--write-reference`` also writes A's folded form.

    The matcher is the one whole-model loop, :class:`~symalign.stream.model.StreamedWhole`, over both checkpoints
    as resident sources (:class:`~symalign.checkpoint.lazy.ResidentCheckpoint`; one block of each in float64 at a
    time -- T5's stacks, whose self-attention layers share a head space, one stack), then
    :func:`~symalign.stream.model.write_aligned` into a :class:`~symalign.stream.sink.StateSink`: the passes and the
    bits of ``--stream``, only the source differs (no float64 copy of either model)."""

    talks = True

    def run(self) -> AlignResult:
        self.ref_path = None
        if self.job.write_reference is not None:
            self.ref_path = check_output_dir(self.job.write_reference, [self.job.a_dir, self.job.b_dir],
                                             self.job.force)
            if self.ref_path == self.out_path:
                raise ConfigError("--write-reference must differ from --out")
        return super().run()

    def prepare(self) -> None:
        from symalign.checkpoint.lazy import ResidentCheckpoint
        from symalign.stream.model import StreamedWhole

        self.whole = StreamedWhole(ResidentCheckpoint.of(self.a), ResidentCheckpoint.of(self.b),
                                   self.job.experts or "exact", self.job.device)
        self.spec, self.notes, self.untied = self.whole.spec, self.whole.prep_b.notes, self.whole.prep_b.untied
        if self.job.experts is not None and not expert_units(self.spec):
            refuse_experts(f"this {self.a.config.model_type!r} checkpoint")

    def tell_sweep(self, k: int, d: float, d0: float) -> None:
        """The progress line after sweep (pass) ``k``: its distance ``d`` relative to the unaligned ``d0``."""
        self.job.tell(f"sweep {k}/{self.job.max_sweeps}: squared distance {d / max(d0, 1e-300):.4f} of unaligned")

    def match(self) -> None:
        n = self.job.max_sweeps
        self.job.tell(f"matching the whole model ({self.spec.dim} group dimensions; up to {n} sweeps)")
        self.match_resident()
        self.job.tell(f"matched in {self.iterations} sweeps" + ("" if self.converged else " (not converged)"))

    def match_resident(self) -> None:
        """:class:`~symalign.stream.model.StreamedWhole`'s passes, then :func:`~symalign.stream.model.write_aligned`
        into a state dict in B's dtypes (the whole model is checked when OUT is staged, not layer by layer)."""
        from symalign.match.whole import CHECKPOINT_SETTINGS
        from symalign.stream.fold import added_tensors
        from symalign.stream.memory import bound_heap
        from symalign.stream.model import write_aligned
        from symalign.stream.sink import StateSink

        w = self.whole
        bound_heap()  # freed layers go back to the system (symalign.stream.memory), as streamed
        self.converged = w.match(self.job.stage1, self.job.stage2, self.job.max_sweeps, CHECKPOINT_SETTINGS["rtol"],
                                 False, report=lambda k, d: self.tell_sweep(k, d, w.distances[0]))
        sink = StateSink(w.b, extra=added_tensors(w.b, w.prep_b))
        write_aligned(w, sink, PhaseClock(), progress=False, check_layers=False, measure=True)
        self.out_state = sink.state
        self.iterations = len(w.distances) - 1
        # the distance after, formed from what was written (not the passes' cancelling formula), as match_whole's
        self.before, self.after = w.relative(w.distances[0]), w.relative(w.written_distance)
        self.summary = w.summary(self.converged)
        self.transform = w.transform() if self.job.return_transform else None

    def edits(self) -> dict[str, Any] | None:
        return {"tie_word_embeddings": False} if self.untied else None

    def write(self) -> AlignResult:
        marker = {**self.marker(), "folded": True, "untied_head": self.untied,
                  "reference": str(self.ref_path) if self.ref_path is not None else None}
        check = self.stage_and_commit(self.out_state, self.edits(), marker, "whole-model alignment")
        del self.out_state
        reference = None
        if self.ref_path is not None:
            from symalign.checkpoint.folded import write_folded

            self.job.tell("writing A's folded form (--write-reference)")
            with self.clock("write"):
                reference = {"path": str(self.ref_path), "check": write_folded(self.a, self.ref_path).to_dict()}
        return self.result_with(check, reference)

    def result_with(self, check: FunctionCheck, reference: dict | None = None) -> AlignResult:
        notes = list(self.notes)
        if not self.converged:
            notes.append(f"matching did not converge in {self.job.max_sweeps} sweeps (the distance was still "
                         "falling); raise --max-sweeps for a closer alignment -- OUT is exact either way")
        notes.append("OUT is in folded form (norm gains folded" + (", head untied" if self.untied else "")
                     + "): interpolate it with A's folded form (--write-reference DIR, or let `symalign "
                     "interpolate` fold A, which it does when OUT is marked folded)")
        return new_result(self.b, self.spec, "in-memory", {"total": self.before}, {"total": self.after},
                          self.iterations, self.converged, CheckReport.whole(check), notes=notes, folded=True,
                          untied_head=self.untied, reference=reference, match=self.summary,
                          transform=self.transform)


@dataclass
class Aligned:
    """B aligned to A in memory and checked, never written: ``state`` under the names ``save_pretrained``
    writes, ``edits`` to B's config that go with it (``tie_word_embeddings`` of a folded model), and the
    :class:`~symalign.align_result.AlignResult` an ``align`` of the same pair would report (no paths)."""

    state: dict[str, Tensor]
    edits: dict[str, Any]
    result: AlignResult


def align_loaded(a: HFCheckpoint, b: HFCheckpoint, scope: str = "attention", stage1: bool = True,
                 stage2: str = "full", max_sweeps: int = 20, experts: str | None = None,
                 say: Callable[[str], None] | None = None, device: torch.device | None = None) -> Aligned:
    """B aligned to A, both already in memory, by the in-memory engine of ``scope`` -- the same prepare and
    match as ``symalign align`` -- and checked to compute B's function (:func:`symalign.arch.check.
    check_state_function`: ``from_pretrained`` of the weights in memory; the same tolerance as a written OUT).
    Nothing is written or read back: ``merge`` averages :attr:`Aligned.state` directly."""
    from symalign.arch.check import check_state_function
    from symalign.checkpoint.config import saved_names

    job = AlignJob(Path(a.path), Path(b.path), Path(b.path), scope=scope, stage1=stage1, stage2=stage2,
                   max_sweeps=max_sweeps, say=say, experts=experts, device=device)
    job.check()
    engine = (ResidentAttention if scope == "attention" else InMemoryModel)(job, Path(b.path), PhaseClock())
    engine.a, engine.b = a, b
    engine.prepare()
    engine.match()
    edits = engine.edits() or {}
    config = copy.deepcopy(b.config)
    for k, v in edits.items():
        setattr(config, k, v)
    state = saved_names(config, engine.out_state)
    check = check_state_function(b, b.path, config, state)
    culprit = "whole-model alignment" if scope == "model" else f"the {b.adapter.family} adapter or the matcher"
    check.require(f"refusing to write the merge: {b.path} aligned computes another function than {b.path}",
                  culprit)
    del engine.out_state
    return Aligned(state, edits, engine.result_with(check))
