"""Start-up: `zeroplan --help` lists the commands without importing them (each pulls in pydantic and
the estimator), and its listing is what the commands' own help says. The time itself is measured
by bench/estimate_speed.py, as a ratio to importing the libraries (tests assert no wall-clock time)."""

import json
import subprocess
import sys

import click

from zeroplan.cli import COMMANDS, cli
from tests.paths import REPO


# A fresh interpreter: this test process has imported every command already.
HELP = """
import json, sys
from click.testing import CliRunner
from zeroplan.cli import cli
result = CliRunner().invoke(cli, ["--help"])
print(json.dumps([result.exit_code, result.output, sorted(m for m in sys.modules if m.startswith(("zeroplan", "pydantic", "tabulate")))]))
"""


def test_help_imports_no_command_nor_pydantic():
    done = subprocess.run([sys.executable, "-c", HELP], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    exit_code, output, imported = json.loads(done.stdout)
    assert exit_code == 0 and "Commands:" in output
    assert imported == ["zeroplan", "zeroplan.cli", "zeroplan.cli.group", "zeroplan.errors"]


def test_each_summary_is_the_first_sentence_of_the_command_s_help():
    context = click.Context(cli)
    for name, summary in COMMANDS.items():
        command = cli.get_command(context, name)
        assert " ".join(command.help.split()).startswith(summary), name
        assert summary.endswith(".") and ". " not in summary, name


def test_help_lists_what_the_commands_would_at_every_width():
    context = click.Context(cli)
    for name, summary in COMMANDS.items():
        command = cli.get_command(context, name)
        for limit in range(20, 300, 7):
            assert click.Command(name, help=summary).get_short_help_str(limit) == command.get_short_help_str(limit), (name, limit)
