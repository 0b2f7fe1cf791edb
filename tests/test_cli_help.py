"""Every command has --help (exit 0), and usage errors exit 2 without a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from symalign.cli import COMMAND_MODULES, app

runner = CliRunner()
COMMANDS = sorted(c.name for c in app.registered_commands)


def test_every_command_module_registered():
    assert set(COMMANDS) == set(COMMAND_MODULES)


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command):
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_top_level_help():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and all(c in res.output for c in COMMANDS)
    flat = " ".join(res.output.split())
    assert "SYMALIGN_THREADS=N" in flat and "SYMALIGN_ARITHMETIC=portable" in flat  # the environment it reads
