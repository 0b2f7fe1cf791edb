"""``symalign tour``: a short tour of the symmetry probe over every positional encoding.

The tour itself lives in :func:`symalign.probe.tour.probe_tour`; ``symalign demo`` prints it
before its LMC experiment.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from symalign.atomic import write_json as write_json_atomic
from symalign.commands import checks, interrupt
from symalign.errors import ConfigError


def check_out_folder(out: Path) -> None:
    """Refuse ``--out`` when it, or a folder on its path, exists as something other than a folder (before any work)."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                what = "--out" if path == out else f"{path} (on the path of --out)"
                raise ConfigError(f"{what} is an existing file, not a folder; pass a folder for symmetry.json")
            break


def render_tour(rows: list[dict]) -> None:
    """Print the tour as a rich table."""
    from rich.table import Table

    table = Table(title="symmetry probe tour (dense Jacobian, float64)")
    for col in ("variant", "bias", "params", "nullity", "predicted", "declared group", "head swap", "near-null <1e-3",
                "slow planes", "verdict"):
        table.add_column(col)
    for r in rows:
        group = " x ".join(r["group"].values())
        slow = "-" if r.get("slow_planes") is None else f"{r['slow_planes']} of {len(r['rope_planes'])}"
        table.add_row(r["variant"], "yes" if r["bias"] else "no", str(r["parameters"]), str(r["nullity"]),
                      str(r["predicted"]), group, str(r["head_permutations_preserved"]),
                      str((r.get("near_null") or {}).get("1e-3", "-")), slow,
                      "[green]match[/green]" if r["match"] else "[red]mismatch[/red]")
    checks.console().print(table)


def register(app: typer.Typer) -> None:
    @app.command("tour")
    def tour_cmd(
        out: Path = typer.Option(Path("runs/tour"), "--out", "-o", help="folder for symmetry.json"),
        as_json: bool = typer.Option(False, "--json", help="print the tour as JSON instead of a table"),
        seed: int = typer.Option(0, "--seed", help="seed of the weights and inputs"),
        threads: int = checks.threads_option(),
    ) -> None:
        """Probe every positional encoding (none, sinusoidal, learned, RoPE half/interleaved, partial RoPE,
        ALiBi, GQA), with and without biases: measured Jacobian nullity vs predicted group dimension,
        and whether head swaps are symmetries. Writes OUT/symmetry.json."""
        check_out_folder(out)
        checks.output_dir(out)  # and writable, before the tour runs
        checks.use_threads(threads)
        interrupt.keep_output(out / "symmetry.json")
        from symalign.probe import probe_tour

        rows = probe_tour(seed=seed)
        write_json_atomic(out / "symmetry.json", {"tour": rows})
        if as_json:
            typer.echo(json.dumps({"tour": rows, "path": str(out / "symmetry.json")}))
        else:
            render_tour(rows)
            bad = sum(not r["match"] for r in rows)
            typer.echo(f"{len(rows)} variants, {bad} mismatches; wrote {out / 'symmetry.json'}")
