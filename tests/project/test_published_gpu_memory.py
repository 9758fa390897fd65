"""Published GPU memory figures of training runs (tests/data/published_gpu_memory.toml) against the estimate.

Each run's configuration must be expressible as `zeroplan estimate` options; each says which counter it
published (reserved, active, allocated, device, device at out of memory, unstated, or only whether it ran out of
memory) with the source's words. bench/published_gpu_memory.py compares each with the estimate's matching figure
(its docstring says which and why) and commits the table, bench/results/published_gpu_memory.md; these tests read
the same comparison:

- every out-of-memory/fits fact is asserted where the estimate agrees, and is a strict xfail with the row's
  `off_because` where it does not (so a fix shows up as an unexpected pass);
- no single figure row has a tolerance a source would justify (the published figures are one run each, rounded
  to 0.1 GiB, and the estimate models no run-to-run spread), so they are held as distributions, with bounds taken
  from the committed table, and every row off by more than 10% must say why (and no row within it keeps a reason).
"""

from __future__ import annotations

import statistics
import sys

import pytest
from tests.paths import REPO

sys.path.insert(0, str(REPO / "bench"))

import published_gpu_memory as table  # noqa: E402  bench/published_gpu_memory.py: the one comparison

RUNS = table.RUNS
FIGURES = {*table.COMPARED, *table.FACTS}
FACT_RUNS = [run for run in RUNS if run["figure"] in table.FACTS]
FIGURE_RUNS = [run for run in RUNS if run["figure"] not in table.FACTS]


def row(run: dict) -> table.Row:
    data, refusal = table.estimate_here(run["id"])
    return table.Row(run, data, refusal)


def test_figures_and_facts_are_there():
    assert len([r for r in RUNS if "not_expressible" not in r]) >= 40
    assert len({r["id"] for r in RUNS}) == len(RUNS)
    assert {r["figure"] for r in RUNS} <= FIGURES
    assert len(FACT_RUNS) >= 11  # the 11 facts
    for run in RUNS:
        assert run["source"].startswith("https://") and run["quote"].strip(), run["id"]
        assert ("value" in run) == (run["figure"] not in table.FACTS), run["id"]
        if "value" in run:
            assert run["unit"] in table.UNITS and run["value"] > 0, run["id"]


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_every_configuration_is_expressible(run):
    # `zeroplan estimate MODEL ARGS --format json` accepts it and gives its three figures on a named GPU memory; a
    # run zeroplan cannot express yet says so in the data, and is refused with that message (it fails here once it can)
    data, refusal = table.estimate_here(run["id"])
    if "not_expressible" in run:
        assert data is None and run["not_expressible"] in refusal, refusal
        return
    assert data is not None, refusal
    assert data["fits"] is not None  # every row names its GPU's memory
    per_gpu = data["per_gpu"]
    assert 0 < per_gpu["allocated"] <= per_gpu["reserved"] < per_gpu["device"]


def _fact_param(run: dict):
    if "off_because" in run:
        return pytest.param(run, id=run["id"], marks=pytest.mark.xfail(reason=run["off_because"], strict=True))
    return pytest.param(run, id=run["id"])


@pytest.mark.parametrize("run", [_fact_param(run) for run in FACT_RUNS])
def test_out_of_memory_and_fits_facts(run):
    # the estimate's `fits` (the allocator replay against the GPU's capacity, device bytes within its memory) says
    # what the run did; where it does not, the row says why and the test is a strict xfail
    found = row(run)
    assert found.now is not None, found.now_refusal
    assert found.agrees, f"{run['id']}: published {run['figure']}, estimated fits={found.now['fits']}"


@pytest.mark.parametrize("run", FIGURE_RUNS, ids=[r["id"] for r in FIGURE_RUNS])
def test_a_figure_off_by_more_than_ten_percent_says_why(run):
    # bench/results/published_gpu_memory.md prints the reason beside the row; a row that comes within 10% drops it
    error = row(run).error
    off = error is None or abs(error) > table.WITHIN
    assert off == ("off_because" in run), f"{run['id']}: error {table.percent(error)}"


def _errors(kinds) -> list[float]:
    return [row(run).error for run in FIGURE_RUNS if run["figure"] in kinds and row(run).error is not None]


def test_reserved_and_device_figures_as_the_table_has_them():
    # The targets are on the published reserved and nvidia-smi figures (device, and device at an
    # out-of-memory error): at least 80% within 10%, median |error| at most 7%. The table at this commit: 26 rows,
    # median 8.3%, 15 within 10% (65b353f's peak on its 24: 12.8%, 4 within); the misses say why in the data. These
    # bounds are that table's, so that a change that loses ground shows here; they are not the targets.
    errors = _errors(table.TARGETS)
    assert len(errors) == 26
    assert statistics.median(abs(e) for e in errors) <= 0.085, errors
    assert sum(abs(e) <= table.WITHIN for e in errors) >= 15, errors


def test_active_figures_no_worse_than_before_the_device_figures():
    # "allocated figures no worse than today" (issue 22): torchtune's optimization-flags table publishes peak
    # active bytes (allocated blocks and those waiting on another stream's event; the estimate's stream has no such
    # wait, so its allocated stands for active). The unpacked baseline is left out (its sequence length is not
    # stated). 65b353f's peak on the 9 rows: median |error| 14.7%; the table at this commit: 12.6%.
    errors = [row(run).error for run in FIGURE_RUNS if run["figure"] == "active" and "baseline" not in run["id"]]
    assert len(errors) == 9
    assert statistics.median(abs(e) for e in errors) <= 0.13, errors
