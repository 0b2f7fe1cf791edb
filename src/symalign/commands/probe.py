"""``symalign probe``: measure the symmetry group of one attention layer and compare with theory."""

from __future__ import annotations

import json

import typer

from symalign.errors import ConfigError
from symalign.nn.attention import POSITIONAL_ENCODINGS


def build_config(pe: str, d_model: int, heads: int, head_dim: int | None, kv_heads: int | None,
                 rotary_fraction: float, pairing: str, bias: bool, causal: bool, seq_len: int):
    """The :class:`AttentionConfig` of a probe (``max_len = seq_len``: no unused learned PE rows)."""
    from symalign.nn.attention import AttentionConfig

    if pairing not in ("half", "interleaved"):
        raise ConfigError(f"unknown --pairing {pairing!r}; use half or interleaved")
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be at least 2 (softmax over one key is constant), got {seq_len}")
    return AttentionConfig(d_model=d_model, n_heads=heads, head_dim=head_dim, n_kv_heads=kv_heads, pe=pe,
                           rope_pairing=pairing, rotary_fraction=rotary_fraction, bias=bias, causal=causal,
                           max_len=seq_len)


def render(result, cfg) -> None:
    """Print a probe result as a rich table."""
    from rich.console import Console
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
    table.add_row("declared group", ", ".join(f"{k}: {v}" for k, v in (result.group or {}).items()))
    table.add_row("head permutations preserved", str(result.head_permutations_preserved))
    for w in result.warnings:
        table.add_row("warning", w)
    table.add_row("verdict", "[green]match[/green]" if result.match else "[red]mismatch[/red]")
    table.add_row("seconds", f"{result.seconds:.2f}")
    Console().print(table)


def register(app: typer.Typer) -> None:
    @app.command("probe")
    def probe_cmd(
        pe: str = typer.Option("none", "--pe", help=f"positional encoding: {', '.join(POSITIONAL_ENCODINGS)}"),
        d_model: int = typer.Option(8, "--d-model", help="model width D"),
        heads: int = typer.Option(2, "--heads", help="number of query heads h"),
        head_dim: int = typer.Option(None, "--head-dim", help="head width d_h (default D / h)"),
        kv_heads: int = typer.Option(None, "--kv-heads", help="K/V heads for grouped-query attention (default h)"),
        rotary_fraction: float = typer.Option(1.0, "--rotary-fraction", help="RoPE: rotated fraction of d_h"),
        pairing: str = typer.Option("half", "--pairing", help="RoPE pairing: half | interleaved"),
        bias: bool = typer.Option(False, "--bias", help="biases on the Q/K/V/O projections"),
        causal: bool = typer.Option(False, "--causal", help="causal mask"),
        seq_len: int = typer.Option(8, "--seq-len", help="sequence length T of the probe inputs"),
        batch: int = typer.Option(None, "--batch", help="batch size (default: outputs >= 2x parameters)"),
        method: str = typer.Option("auto", "--method", help="auto | dense | matrix-free"),
        probes: int = typer.Option(16, "--probes", help="Hutchinson probes (matrix-free)"),
        seed: int = typer.Option(0, "--seed", help="seed of the weights, inputs and probes"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    ) -> None:
        """Measure the Jacobian nullity of one generic attention layer (its continuous symmetry group)
        and whether a head swap is a symmetry; compare with the predicted group dimension."""
        from symalign.probe import probe_attention

        if method not in ("auto", "dense", "matrix-free"):
            raise ConfigError(f"unknown --method {method!r}; use auto, dense or matrix-free")
        if probes < 2:
            raise ConfigError(f"--probes must be at least 2 (for a standard error), got {probes}")
        if batch is not None and batch <= 0:
            raise ConfigError(f"--batch must be positive, got {batch}")
        cfg = build_config(pe, d_model, heads, head_dim, kv_heads, rotary_fraction, pairing, bias, causal, seq_len)
        result = probe_attention(cfg, seq_len, batch, seed=seed, method=method, probes=probes)
        if as_json:
            typer.echo(json.dumps({**result.to_dict(), "config": cfg.to_dict()}))
        else:
            render(result, cfg)
