"""`--units` means the same in every command: GiB, GB, MiB and MB (spec/units.py REPORT_UNITS),
each figure the JSON's bytes divided by the unit's power of 2 or 10 and labelled with it."""

from __future__ import annotations

import json
import re

import click
import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.spec.units import REPORT_UNITS

UNIT_BYTES = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _in(size_bytes: int, unit: str) -> str:
    return f"{size_bytes / UNIT_BYTES[unit]:,.2f}"


def test_every_command_offers_the_same_units():
    context = click.Context(cli)
    for name in ("estimate", "compare", "plan", "measure", "validate"):
        (units,) = [p for p in cli.get_command(context, name).params if p.name == "units"]
        assert tuple(units.type.choices) == REPORT_UNITS == tuple(UNIT_BYTES), name


@pytest.mark.parametrize("unit", ["MiB", "MB"])
def test_estimate_in_mib_and_mb(unit):
    args = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"]
    peak = json.loads(run(*args, "--format", "json"))["per_gpu"]["peak"]
    table = run(*args, "--units", unit)
    assert re.search(rf"^category\s+{unit}$", table, re.MULTILINE)
    assert re.search(rf"^peak\s+{re.escape(_in(peak, unit))}$", table, re.MULTILINE)
    csv = run(*args, "--units", unit, "--format", "csv").splitlines()
    assert csv[0].endswith(f"overhead_{unit},total_{unit},is_peak")
    (peak_row,) = [row for row in csv[1:] if row.endswith(",1")]
    assert peak_row.split(",")[-2] == f"{peak / UNIT_BYTES[unit]:.4f}"


@pytest.mark.parametrize(("unit", "power"), [("MiB", "2^20"), ("MB", "10^6")])
def test_compare_in_mib_and_mb(unit, power):
    args = ["compare", "llama-2-7b", "--gpus", "8"]
    rows = json.loads(run(*args, "--format", "json"))["rows"]
    table = run(*args, "--units", unit)
    assert table.startswith(f"llama-2-7b: per-GPU memory at the peak, {unit} ({power} bytes);")
    assert f"peak ({unit})" in table
    for row in rows:
        line = next(line for line in table.splitlines() if line.startswith(f"{row['config']} "))
        assert _in(row["per_gpu"]["peak"], unit) in line.split()


@pytest.mark.parametrize("unit", ["MiB", "MB"])
def test_plan_in_mib_and_mb(unit):
    args = ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
    best = json.loads(run(*args, "--format", "json"))["top"][0]
    table = run(*args, "--units", unit)
    assert table.startswith(f"llama-2-7b: {_in(80 * 2**30, unit)} {unit} per GPU")  # an H100 has 80 GiB
    assert f"peak ({unit})" in table
    first = next(line for line in table.splitlines() if re.match(r"^\s+1\s", line))
    assert _in(best["per_gpu"]["peak"], unit) in first.split()


def test_an_unknown_unit_names_the_choices():
    result = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--units", "TiB"])
    assert result.exit_code == 2
    assert "Invalid value for '--units': 'TiB' is not one of 'GiB', 'GB', 'MiB', 'MB'." in result.stderr
