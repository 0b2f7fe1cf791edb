"""``symalign probe``: measure the symmetry group of one attention layer and compare with theory.

Two subjects: the reference layer (``--pe``, ``--d-model``, ...), compared with the
predicted dimension; or a Hugging Face family's real layer (``--hf``), compared with
the dimension its adapter declares.
"""

from __future__ import annotations

import json

import typer

from symalign.commands import checks
from symalign.errors import ConfigError
from symalign.nn.attention import POSITIONAL_ENCODINGS

REFERENCE_DEFAULTS = {"--pe": "none", "--d-model": 8, "--heads": 2, "--head-dim": None, "--kv-heads": None,
                      "--rotary-fraction": None, "--pairing": None, "--bias": False, "--causal": False,
                      "--seq-len": 8, "--batch": None}
"""The reference-layer options and their defaults (``--hf`` refuses any of them set)."""


def build_config(pe: str, d_model: int, heads: int, head_dim: int | None, kv_heads: int | None,
                 rotary_fraction: float | None, pairing: str | None, bias: bool, causal: bool, seq_len: int):
    """The :class:`AttentionConfig` of a probe (``max_len = seq_len``: no unused learned PE rows).

    Every option is checked here, before any work: positive sizes, RoPE-only options
    only with ``--pe rope`` (never silently ignored).
    """
    from symalign.nn.attention import AttentionConfig

    for flag, value in (("--d-model", d_model), ("--heads", heads), ("--head-dim", head_dim),
                        ("--kv-heads", kv_heads)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if pe != "rope":
        for flag, value in (("--rotary-fraction", rotary_fraction), ("--pairing", pairing)):
            if value is not None:
                raise ConfigError(f"{flag} applies only to RoPE; add --pe rope or drop {flag} (--pe is {pe!r})")
    pairing = "half" if pairing is None else pairing
    rotary_fraction = 1.0 if rotary_fraction is None else rotary_fraction
    if pairing not in ("half", "interleaved"):
        raise ConfigError(f"unknown --pairing {pairing!r}; use half or interleaved")
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be at least 2 (softmax over one key is constant), got {seq_len}")
    return AttentionConfig(d_model=d_model, n_heads=heads, head_dim=head_dim, n_kv_heads=kv_heads, pe=pe,
                           rope_pairing=pairing, rotary_fraction=rotary_fraction, bias=bias, causal=causal,
                           max_len=seq_len)


def parse_layer(text: str) -> tuple[str | None, int]:
    """``--layer``: ``I`` -> ``(None, I)``; ``STACK.I`` (``encoder.2``, ``decoder.0``) -> ``(STACK, I)``.

    Whether the stack exists, and ``I`` is in range, is the family's to say
    (:func:`symalign.probe.hf.probe_site`); here only the form and ``I >= 0`` are checked.
    """
    stack, _, index = text.strip().rpartition(".")
    try:
        value = int(index)
    except ValueError:
        raise ConfigError(f"--layer must be a layer index I or STACK.I (e.g. 2, encoder.2, decoder.2), "
                          f"got {text!r}") from None
    if value < 0:
        raise ConfigError(f"--layer must be >= 0, got {text}")
    if "." in text and not stack:
        raise ConfigError(f"--layer {text!r} names no stack before the dot; use STACK.I (e.g. decoder.2)")
    return (stack or None), value


def _spectrum_rows(table, result) -> None:
    """Near-null spectrum and RoPE planes (dense results)."""
    if result.near_null is not None:
        table.add_row("near-null singular values", ", ".join(f"{n} below {k}" for k, n in result.near_null.items())
                      + " of the largest (approximate symmetries, counted as rank)")
    if result.largest_null is not None or result.smallest_kept is not None:
        kept = "-" if result.smallest_kept is None else f"{result.smallest_kept:.1e}"
        null = "-" if result.largest_null is None else f"{result.largest_null:.1e}"
        table.add_row("smallest kept / largest null", f"{kept} / {null} (relative)")
    if result.rope_planes:
        planes = ", ".join(f"{p['angle']:.3g}{'*' if p['slow'] else ''}" for p in result.rope_planes)
        table.add_row("RoPE plane rotation over the context (rad)",
                      f"{planes}  (* slow: < 0.1 rad, {result.slow_planes} of {len(result.rope_planes)})")
    if result.upcasts:
        table.add_row("computed in float64", ", ".join(result.upcasts) + " (lower precision inside the module)")


def render(result, cfg) -> None:
    """Print a probe result as a rich table."""
    from rich.table import Table

    table = Table(title=f"symmetry probe: pe={cfg.pe}, D={cfg.d_model}, h={cfg.n_heads}, d_h={cfg.head_dim}, "
                        f"h_kv={cfg.n_kv_heads}, bias={cfg.bias}")
    table.add_column("quantity")
    table.add_column("value", overflow="fold")
    if result.method == "dense":
        table.add_row("nullity (measured)", str(int(result.nullity)))
    else:
        table.add_row("nullity (measured)", f"{result.nullity:.1f} ± {result.stderr:.1f} ({result.probes} probes)")
    terms = " + ".join(f"{k} {v}" for k, v in (result.breakdown or {}).items() if v)
    table.add_row("nullity (predicted)", f"{result.predicted}  ({terms})")
    table.add_row("parameters / outputs", f"{result.parameters} / {result.outputs}")
    table.add_row("method", result.method + (f", {result.iterations} CGLS iterations" if result.iterations else ""))
    tol = f"{result.tol:g} (relative singular value)" if result.method == "dense" else f"{result.tol:g} (CGLS residual)"
    table.add_row("tol", tol)
    if result.singular_value_gap is not None:
        table.add_row("singular value gap s_r/s_r+1", f"{result.singular_value_gap:.2e}")
    _spectrum_rows(table, result)
    table.add_row("declared group", ", ".join(f"{k}: {v}" for k, v in (result.group or {}).items()))
    table.add_row("head permutations preserved", str(result.head_permutations_preserved))
    for w in result.warnings:
        table.add_row("warning", w)
    table.add_row("verdict", "[green]match[/green]" if result.match else "[red]mismatch[/red]")
    table.add_row("seconds", f"{result.seconds:.2f}")
    checks.console().print(table)


def render_hf(rows) -> None:
    """Print Hugging Face probes (attention, block) as one rich table each."""
    from rich.markup import escape
    from rich.table import Table

    for row in rows:
        res = row.result
        where = f"{row.stack} layer {row.layer}" if row.stack else f"layer {row.layer}"
        table = Table(title=f"symmetry probe: {row.family} ({row.model_type}) {where} {row.site} "
                            + escape(f"[{row.module}]") + ", float64")  # not a rich markup tag
        table.add_column("quantity")
        table.add_column("value", overflow="fold")
        table.add_row("nullity (measured)", str(int(res.nullity)) if res.method == "dense"
                      else f"{res.nullity:.1f} ± {res.stderr:.1f} ({res.probes} probes)")
        if row.declared is not None:
            extra = " + ".join(f"{k} {v}" for k, v in row.undeclared.items())
            table.add_row("declared by the adapter", f"{row.declared}  ({', '.join(row.group.values())})")
            table.add_row("exact but undeclared", extra or "none")
        table.add_row("parameters / outputs", f"{res.parameters} / {res.outputs}")
        table.add_row("method", res.method + (f", Jacobian by {res.ad} mode" if res.ad else ""))
        if res.singular_value_gap is not None:
            table.add_row("singular value gap s_r/s_r+1", f"{res.singular_value_gap:.2e}")
        _spectrum_rows(table, res)
        verdict = {True: "[green]match[/green]", False: "[red]mismatch[/red]",
                   None: "measured only (no block-level group is declared)"}[row.match]
        table.add_row("verdict", verdict)
        table.add_row("seconds", f"{res.seconds:.2f}")
        checks.console().print(table)


def register(app: typer.Typer) -> None:
    app.command("probe")(probe_cmd)


def probe_cmd(
    hf: str = typer.Option(None, "--hf", metavar="DIR_OR_MODEL_TYPE",
                           help="probe a Hugging Face family's real attention layer instead: a checkpoint folder "
                                "or a model_type (a tiny random config), beside its adapter's declared group"),
    layer: str = typer.Option("0", "--layer", metavar="[STACK.]I",
                              help="--hf: which layer: its index I, or STACK.I in an encoder-decoder "
                                   "(T5: encoder.I, decoder.I; a bare I is the encoder's)"),
    cross: bool = typer.Option(False, "--cross",
                               help="--hf: the decoder layer's cross-attention (keys/values from the encoder's "
                                    "output) instead of its self-attention; needs --layer decoder.I"),
    block: bool = typer.Option(False, "--block", help="--hf: also probe the whole block (every parameter)"),
    pe: str = typer.Option("none", "--pe", help=f"positional encoding: {', '.join(POSITIONAL_ENCODINGS)}"),
    d_model: int = typer.Option(8, "--d-model", help="model width D"),
    heads: int = typer.Option(2, "--heads", help="number of query heads h"),
    head_dim: int = typer.Option(None, "--head-dim", help="head width d_h (default D / h)"),
    kv_heads: int = typer.Option(None, "--kv-heads", help="K/V heads for grouped-query attention (default h)"),
    rotary_fraction: float = typer.Option(None, "--rotary-fraction",
                                          help="RoPE: rotated fraction of d_h (default 1; --pe rope only)"),
    pairing: str = typer.Option(None, "--pairing", help="RoPE pairing: half (default) | interleaved"),
    bias: bool = typer.Option(False, "--bias", help="biases on the Q/K/V/O projections"),
    causal: bool = typer.Option(False, "--causal", help="causal mask"),
    seq_len: int = typer.Option(8, "--seq-len", help="sequence length T of the probe inputs"),
    batch: int = typer.Option(None, "--batch", help="batch size (default: outputs >= 2x parameters)"),
    method: str = typer.Option("auto", "--method", help="auto | dense | matrix-free"),
    probes: int = typer.Option(16, "--probes", help="Hutchinson probes (matrix-free)"),
    seed: int = typer.Option(0, "--seed", help="seed of the weights, inputs and probes"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    threads: int = checks.threads_option(),
    device: str = checks.device_option(),
) -> None:
    """Measure the Jacobian nullity (the continuous symmetry group) of one generic attention layer in
    float64 and whether a head swap is a symmetry; compare with the predicted group dimension. With
    --hf, the real layer of a Hugging Face family against the dimension its adapter declares; an
    encoder-decoder (T5) has three attention sites: --layer encoder.I (encoder self-attention),
    --layer decoder.I (decoder self-attention, causal) and --layer decoder.I --cross (cross-attention).
    Refuses (exit 2) a spectrum without a clean gap rather than print a nullity that depends on the cut."""
    checks.use_threads(threads)
    dev = checks.use_device(device)
    _check_measurement(method, probes, batch)
    if hf is not None:
        given = {"--pe": pe, "--d-model": d_model, "--heads": heads, "--head-dim": head_dim,
                 "--kv-heads": kv_heads, "--rotary-fraction": rotary_fraction, "--pairing": pairing,
                 "--bias": bias, "--causal": causal, "--seq-len": seq_len, "--batch": batch}
        return _probe_hf_layer(hf, given, layer, cross, block, seed, method, probes, dev, as_json)
    if layer != "0" or block or cross:
        raise ConfigError("--layer, --cross and --block apply only with --hf")
    cfg = build_config(pe, d_model, heads, head_dim, kv_heads, rotary_fraction, pairing, bias, causal, seq_len)
    _probe_reference(cfg, seq_len, batch, seed, method, probes, dev, as_json)


def _check_measurement(method: str, probes: int, batch: int | None) -> None:
    """``--method`` known, at least two ``--probes`` (for a standard error), a positive ``--batch``."""
    if method not in ("auto", "dense", "matrix-free"):
        raise ConfigError(f"unknown --method {method!r}; use auto, dense or matrix-free")
    if probes < 2:
        raise ConfigError(f"--probes must be at least 2 (for a standard error), got {probes}")
    if batch is not None and batch <= 0:
        raise ConfigError(f"--batch must be positive, got {batch}")


def _probe_hf_layer(hf: str, given: dict, layer: str, cross: bool, block: bool, seed: int, method: str,
                    probes: int, dev, as_json: bool) -> None:
    """``probe --hf``: refuse a reference-layer option set away from its default (``given``), probe the family's
    layer (and block) with :func:`symalign.probe.hf.probe_hf`, print JSON or the tables."""
    clash = [flag for flag, value in given.items() if value != REFERENCE_DEFAULTS[flag]]
    if clash:
        raise ConfigError(f"{clash[0]} describes the reference layer; with --hf the layer comes from the "
                          f"model's config (drop {clash[0]})")
    stack, index = parse_layer(layer)
    from symalign.probe.hf import probe_hf

    rows = probe_hf(hf, index, stack=stack, cross=cross, block=block, seed=seed, method=method, probes=probes,
                    device=dev)
    if as_json:
        typer.echo(json.dumps({"hf": hf, "probes": [r.to_dict() for r in rows]}))
    else:
        render_hf(rows)


def _probe_reference(cfg, seq_len: int, batch: int | None, seed: int, method: str, probes: int, dev,
                     as_json: bool) -> None:
    """Probe the reference layer ``cfg`` (:func:`symalign.probe.probe_attention`), print JSON or the table."""
    from symalign.probe import probe_attention

    result = probe_attention(cfg, seq_len, batch, seed=seed, method=method, probes=probes, device=dev)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "config": cfg.to_dict()}))
    else:
        render(result, cfg)
