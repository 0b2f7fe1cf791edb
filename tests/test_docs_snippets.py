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
