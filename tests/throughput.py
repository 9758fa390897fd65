"""The published throughput table (tests/data/throughput.toml) priced by `zeroplan estimate --gpu`: shared by
tests/project/test_published_throughput.py and bench/throughput_table.py (which writes the table of docs/throughput.md)."""

from __future__ import annotations

import json
import statistics
import tomllib
from pathlib import Path
from typing import NamedTuple

from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.importers.options import model_from_options

TABLE = Path(__file__).resolve().parent / "data" / "throughput.toml"
WITHIN = 0.20  # issue 24's targets: at least 70% of the runs within 20%, the median |error| at most 12%
SHARE_TARGET = 0.70
MEDIAN_TARGET = 0.12


class Priced(NamedTuple):
    run: dict
    published: float  # tokens per second per GPU
    predicted: float
    step: dict  # `step` of `zeroplan estimate --format json`

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def runs() -> list[dict]:
    return tomllib.loads(TABLE.read_text(encoding="utf-8"))["run"]


def published_tokens_per_s(run: dict) -> float:
    """The run's figure in tokens per second per GPU: as published, or Narayanan et al. 2021's TFLOP/s per GPU
    through the paper's Eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration of B sequences of s tokens."""
    if run["unit"] == "tokens/s/GPU":
        return float(run["figure"])
    model = model_from_options(run["model"], None, None, None, None)
    layers, hidden, vocab = model.num_layers, model.hidden_size, model.vocab_size
    seq = int(run["args"][run["args"].index("--seq-len") + 1])
    per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return run["figure"] * 1e12 / per_token


def price(run: dict) -> Priced:
    result = CliRunner().invoke(cli, ["estimate", run["model"], "--gpu", run["gpu"], *run["args"], "--format", "json"])
    if result.exit_code:
        raise AssertionError(f"{run['id']}: {result.output}")
    step = json.loads(result.stdout)["step"]
    return Priced(run, published_tokens_per_s(run), step["tokens_per_s_per_gpu"], step)


def price_all() -> list[Priced]:
    return [price(run) for run in runs()]


class Distribution(NamedTuple):
    runs: int
    within: float  # share of runs within WITHIN
    median_abs: float
    median: float


def distribution(priced: list[Priced]) -> Distribution:
    errors = [p.error for p in priced]
    return Distribution(len(errors), sum(abs(e) <= WITHIN for e in errors) / len(errors),
                        statistics.median(abs(e) for e in errors), statistics.median(errors))
