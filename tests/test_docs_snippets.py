"""Examples in docs/ run as written (issue 33, item 13): the whole-model snippet defines what it uses,
and the two `--stream` examples of docs/scaling.md write different folders."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def test_whole_model_snippet_runs_as_written():
    (code,) = [b for b in _blocks(ROOT / "docs" / "whole-model.md", "python") if "align_whole(a, b)" in b]
    scope: dict = {}
    exec(compile(code.replace("print(res.distances)", ""), "docs/whole-model.md", "exec"), scope)
    assert scope["res"].distances[-1] <= scope["res"].distances[0]


def test_scaling_stream_examples_write_different_folders():
    text = (ROOT / "docs" / "scaling.md").read_text()
    section = text.split("# Checkpoints larger than memory: `symalign align --stream`", 1)[1]
    block = re.search(r"```console\n(.*?)```", section, re.S).group(1)  # the section's first example
    outs = re.findall(r"^\$ symalign align .*? -o (\S+)", block, flags=re.M)
    assert len(outs) == 2 and len(set(outs)) == 2, outs


def _probe_rows(text: str) -> dict[str, str]:
    """quantity -> value of the probe's table as printed: a line with an empty first cell continues the
    value above; one whose first cell starts with "(" continues the label above (e.g. "(rad)")."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        left, right = (c.strip() for c in line.strip("│").split("│"))
        if rows and (not left or left.startswith("(")):
            rows[-1] = [f"{rows[-1][0]} {left}".strip(), f"{rows[-1][1]} {right}".strip()]
        else:
            rows.append([left, right])
    return dict((k, v) for k, v in rows)


def test_readme_probe_output_is_what_the_command_prints(monkeypatch, capsys):
    """README's probe block shows every row the command prints now, with the same machine-independent
    values (the gap, near-null spectrum and seconds vary with the machine; their rows must be there)."""
    from _cli_util import run_symalign

    readme = (ROOT / "README.md").read_text()
    command = "symalign probe --pe rope --d-model 16 --heads 2 --head-dim 8 --bias"
    shown = readme.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_symalign(monkeypatch, capsys, *command.split()[1:])
    assert code == 0, err
    want, have = _probe_rows(out), _probe_rows(shown)
    assert list(have) == list(want)
    for key in ("nullity (measured)", "nullity (predicted)", "parameters / outputs", "method", "tol",
                "declared group", "head permutations preserved", "verdict"):
        assert have[key] == want[key], key
