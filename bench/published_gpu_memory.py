"""Published GPU memory of training runs against the estimate's matching figure, and against 65b353f's peak.

Each run of tests/data/published_gpu_memory.toml names the counter it published; the estimate gives three
(docs/engines/allocator.md), and each published figure is compared with its own:

- reserved (`torch.cuda.max_memory_reserved()`, torchtitan's logs) -> per_gpu.reserved;
- device (nvidia-smi, a GPU-memory chart) -> per_gpu.device;
- device at out of memory (torch's OutOfMemoryError: total capacity less free memory, when an allocation
  failed) -> device_memory.device_at_oom: the replay against the GPU's capacity, stopped at its first failed
  allocation, its reserved bytes then and the memory outside the allocator;
- allocated (`max_memory_allocated()`) -> per_gpu.allocated;
- active (`active_bytes.all.peak`, torchtune's optimization-flags table) -> per_gpu.allocated: a block is
  active while allocated and, once freed, until the events of the other streams that used it complete
  (CUDACachingAllocator.cpp `free`: a block with stream uses goes to `insert_events`, and its active bytes
  drop only in `free_block`), so active >= allocated by the blocks waiting on other streams; the estimate's
  stream records no such use, so its active equals its allocated;
- unstated (torchtune's "Peak Memory per GPU" table, the one kind here) -> per_gpu.reserved: the same
  table in torchtune's README of 2024 said "These resource requirements are based on GPU peak memory
  reserved during training"; the recipes log active, allocated and reserved alike (training/memory.py
  `get_memory_stats`), so the table's counter is one of them, and its own earlier note names reserved.

The out-of-memory and fits facts are compared with the estimate's `fits` (the replay against the GPU's
capacity and the device figure within its memory). Beside each row: what the checkout given by
--against (a worktree of 65b353f) estimated: its `per_gpu.peak`, the only figure it gave, and its `fits`.
Options that checkout lacks are translated (`OLDER_FLAGS`, `OLDER_OPTIONS`, `OLDER_VALUES`) and the table
says so. Nothing is fitted to these rows: a row that is off says why in the data (`off_because`).

    python bench/published_gpu_memory.py --against /work/wt/base65     # writes bench/results/published_gpu_memory.md
    python bench/published_gpu_memory.py --no-write                    # this checkout only, printed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
RESULT = REPO / "bench" / "results" / "published_gpu_memory.md"
RUNS: list[dict] = tomllib.loads((DATA / "published_gpu_memory.toml").read_text(encoding="utf-8"))["run"]
UNITS = {"GiB": 2**30, "GB": 10**9, "G": 2**30}  # "G": a poster's rounding, read as GiB (the row says so)
FACTS = ("out of memory", "fits")
COMPARED = {"reserved": "reserved", "device": "device", "allocated": "allocated", "active": "allocated",
            "unstated": "reserved", "device at out of memory": "device_at_oom"}  # module docstring
WITHIN = 0.10  # the "within 10%"
TARGETS = ("reserved", "device", "device at out of memory")  # the "published reserved and nvidia-smi figures"
GIB = 2**30

# What an older checkout cannot parse, and what stands for it there (each as a user of that version would have written
# the run): flags and options it lacks are dropped, values it lacks replaced; each with why.
OLDER_FLAGS = {"--paged-optimizer": "no paged optimizer: its states counted on the GPU",
               "--async-tp": "no async TP", "--float8-all-gather": "no float8", "--float8-precompute-scale": "no float8"}
OLDER_OPTIONS = {"--compile": "no torch.compile: eager", "--float8": "no float8", "--float8-saved": "no float8"}
OLDER_VALUES = {("--base-precision", "torchao-nf4"): ("nf4", "torchao's NF4 as bitsandbytes' nf4"),
                ("--gpu-memory", "rtx3090-24gb"): ("24GiB", "no RTX 3090 preset: its 24 GiB")}


def model_path(text: str) -> str:
    """A row's model or option value, with files under tests/data/ made absolute."""
    return str(DATA / text) if text.startswith("published_models/") else text


def command(run: dict) -> list[str]:
    return ["estimate", model_path(run["model"]), *map(model_path, run["args"]), "--format", "json"]


def published_bytes(run: dict) -> int:
    return int(run["value"] * UNITS[run["unit"]])


def source_of(run: dict) -> str:
    """Where a row comes from: the GitHub repository, or the web site."""
    url = urlparse(run["source"].split()[0])
    if url.netloc == "github.com":
        return "/".join(url.path.strip("/").split("/")[:2])
    return url.netloc


@lru_cache(maxsize=None)
def estimate_here(run_id: str) -> tuple[dict | None, str]:
    """This checkout's estimate of a row, in this process: (its JSON, "") or (None, zeroplan's refusal)."""
    from click.testing import CliRunner

    from zeroplan.cli import cli

    run = next(r for r in RUNS if r["id"] == run_id)
    result = CliRunner().invoke(cli, command(run))
    if result.exit_code != 0:
        return None, result.output.strip().splitlines()[-1] if result.output.strip() else repr(result.exception)
    return json.loads(result.output), ""


def older_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`args` in an older checkout's options (OLDER_FLAGS, OLDER_OPTIONS, OLDER_VALUES), and what was translated."""
    out, notes, index = [], [], 0
    while index < len(args):
        option = args[index]
        value = args[index + 1] if index + 1 < len(args) else None
        if option in OLDER_FLAGS:
            notes.append(f"`{option}` dropped ({OLDER_FLAGS[option]})")
            index += 1
        elif option in OLDER_OPTIONS:
            notes.append(f"`{option} {value}` dropped ({OLDER_OPTIONS[option]})")
            index += 2
        elif (option, value) in OLDER_VALUES:
            replacement, why = OLDER_VALUES[option, value]
            out += [option, replacement]
            notes.append(f"`{option} {value}` as `{option} {replacement}` ({why})")
            index += 2
        else:
            out.append(option)
            index += 1
    return out, notes


def estimate_there(checkout: Path, run: dict) -> tuple[dict | None, str, list[str]]:
    """An older checkout's estimate of a row, as a fresh process there: (JSON, refusal, translations). The
    row's own options first; where that checkout refuses them, the translated ones."""
    def once(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zeroplan", "estimate", model_path(run["model"]), *args,
                               "--format", "json"], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                              capture_output=True, text=True, timeout=600)
    args = [model_path(a) for a in run["args"]]
    done, notes = once(args), []
    if done.returncode != 0:
        translated, notes = older_args(args)
        if notes:
            done = once(translated)
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return None, lines[-1] if lines else f"exit {done.returncode}", notes
    return json.loads(done.stdout), "", notes


def figure_bytes(data: dict | None, name: str) -> int | None:
    """A figure of an estimate's JSON: per_gpu's, else device_memory's (None where it has none)."""
    if data is None:
        return None
    return data["per_gpu"][name] if name in data["per_gpu"] else data.get("device_memory", {}).get(name)


@dataclass(frozen=True)
class Row:
    """One published run beside the estimate now and the older checkout's."""

    run: dict
    now: dict | None
    now_refusal: str
    then: dict | None = None
    then_refusal: str = ""
    then_notes: tuple[str, ...] = ()

    @property
    def fact(self) -> bool:
        return self.run["figure"] in FACTS

    @property
    def compared(self) -> str | None:
        """The estimate's figure the published one is compared with (None for a fact)."""
        return COMPARED.get(self.run["figure"])

    @property
    def estimate_bytes(self) -> int | None:
        """The estimate's figure that matches the published one (None for a fact, or where there is none)."""
        return None if self.fact else figure_bytes(self.now, self.compared)

    @property
    def error(self) -> float | None:
        """estimate / published - 1 for the matching figure; None for a fact or a row not estimated."""
        found = self.estimate_bytes
        return None if found is None else found / published_bytes(self.run) - 1

    @property
    def then_error(self) -> float | None:
        """The older checkout's peak / published - 1."""
        if self.fact or self.then is None:
            return None
        return self.then["per_gpu"]["peak"] / published_bytes(self.run) - 1

    @property
    def agrees(self) -> bool | None:
        """For a fact: does the estimate's `fits` say what was published (None: no estimate)."""
        return None if self.now is None else self.now["fits"] == (self.run["figure"] == "fits")

    @property
    def then_agrees(self) -> bool | None:
        return None if self.then is None else self.then.get("fits") == (self.run["figure"] == "fits")


def rows(against: Path | None = None, progress: Callable[[str], None] | None = None) -> list[Row]:
    found = []
    for run in RUNS:
        if progress:
            progress(run["id"])
        now, refusal = estimate_here(run["id"])
        then = (None, "", [])
        if against is not None:
            then = estimate_there(against, run)
        found.append(Row(run, now, refusal, then[0], then[1], tuple(then[2])))
    return found


@dataclass(frozen=True)
class Distribution:
    count: int
    median_abs: float | None
    within: int  # how many within WITHIN
    median: float | None  # signed

    @property
    def share_within(self) -> float | None:
        return None if not self.count else self.within / self.count


def distribution(errors: Iterable[float | None]) -> Distribution:
    """The errors of the rows that have one: median |error|, how many within 10%, median error."""
    found = [e for e in errors if e is not None]
    if not found:
        return Distribution(0, None, 0, None)
    return Distribution(len(found), statistics.median(abs(e) for e in found),
                        sum(abs(e) <= WITHIN for e in found), statistics.median(found))


def groups(found: list[Row]) -> list[tuple[str, list[Row]]]:
    """The figure rows by published counter, the issue's target group, and by source."""
    figures = [r for r in found if not r.fact]
    out = [(f"{kind} (vs {COMPARED[kind]})", [r for r in figures if r.run["figure"] == kind]) for kind in COMPARED]
    out = [(label, members) for label, members in out if members]
    out.append(("reserved and device (the issue's targets)", [r for r in figures if r.run["figure"] in TARGETS]))
    out.append(("reserved, device and unstated", [r for r in figures if r.run["figure"] in (*TARGETS, "unstated")]))
    out.append(("every figure row", figures))
    for source in sorted({source_of(r.run) for r in figures}):
        out.append((f"source {source}", [r for r in figures if source_of(r.run) == source]))
    return out


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(found: list[Row], against: Path | None, invocation: str) -> list[str]:
    """The committed table: distributions, the facts, the figure rows."""
    then_label = "65b353f" if against is not None else "-"
    lines = [
        "# Published GPU memory against the estimate",
        "",
        f"Command: `{invocation}` (bench/published_gpu_memory.py; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC). "
        "Rows: tests/data/published_gpu_memory.toml, each with its source and the source's words. Error = "
        "estimate / published - 1, on the estimate's figure that matches the published counter (reserved -> "
        "`per_gpu.reserved`, device -> `per_gpu.device`, active and allocated -> `per_gpu.allocated`, unstated "
        "-> `per_gpu.reserved`: the module docstring says why); 65b353f gave one figure, `per_gpu.peak` "
        "(tensors plus a fixed 0.5 GiB), and its error is on that.",
        "",
        "## Distributions",
        "",
        f"| rows | n | median \\|error\\| now | within 10% now | median error now | median \\|error\\| {then_label} | "
        f"within 10% {then_label} | median error {then_label} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, members in groups(found):
        now = distribution(r.error for r in members)
        then = distribution(r.then_error for r in members)
        lines.append(f"| {label} | {len(members)} | {_abs(now.median_abs)} | {_share(now)} | {percent(now.median)} | "
                     f"{_abs(then.median_abs)} | {_share(then)} | {percent(then.median)} |")
    facts = [r for r in found if r.fact]
    right_now = sum(bool(r.agrees) for r in facts)
    right_then = sum(bool(r.then_agrees) for r in facts)
    lines += [
        "",
        f"## Out-of-memory and fits facts: {right_now} of {len(facts)} agree now, {right_then} of {len(facts)} "
        f"with {then_label}",
        "",
        "Now: `fits` (the allocator replay against the GPU's capacity, and the device figure within its memory); "
        f"{then_label}: its `fits` (its peak within the memory).",
        "",
        f"| run | published | GPU memory GiB | device GiB now | fits now | agrees | peak GiB {then_label} | fits "
        f"{then_label} | agrees {then_label} | why it is off |",
        "|---|---|---:|---:|---|---|---:|---|---|---|",
    ]
    for r in facts:
        lines.append(f"| {r.run['id']} | {r.run['figure']} | {gib(_get(r.now, 'gpu_memory'))} | "
                     f"{gib(_per_gpu(r.now, 'device'))} | {_fits(r.now, r.now_refusal)} | {_yes(r.agrees)} | "
                     f"{gib(_per_gpu(r.then, 'peak'))} | {_fits(r.then, r.then_refusal)} | {_yes(r.then_agrees)} | "
                     f"{cell(_why(r, r.agrees is not True))} |")
    lines += [
        "",
        "## Published figures",
        "",
        f"| run | published | GiB | compared with | estimate GiB | error | allocated GiB | reserved GiB | device GiB | "
        f"peak GiB {then_label} | error {then_label} | why it is off |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in found:
        if r.fact:
            continue
        off = r.error is None or abs(r.error) > WITHIN
        lines.append(f"| {r.run['id']} | {r.run['figure']} | {published_bytes(r.run) / GIB:.2f} | {r.compared} | "
                     f"{gib(r.estimate_bytes)} | {percent(r.error)} | {gib(_per_gpu(r.now, 'allocated'))} | "
                     f"{gib(_per_gpu(r.now, 'reserved'))} | {gib(_per_gpu(r.now, 'device'))} | "
                     f"{gib(_per_gpu(r.then, 'peak'))} | {percent(r.then_error)} | {cell(_why(r, off))} |")
    translated = [r for r in found if r.then_notes]
    if translated:
        lines += ["", f"Options {then_label} does not have, translated for it: "
                  + "; ".join(f"{r.run['id']}: {', '.join(r.then_notes)}" for r in translated) + "."]
    refused = [r for r in found if r.then is None and r.then_refusal]
    if refused:
        lines += ["", f"Refused by {then_label}: " + "; ".join(f"{r.run['id']}: {r.then_refusal}" for r in refused) + "."]
    return lines


def _abs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _share(found: Distribution) -> str:
    return "-" if not found.count else f"{found.within} of {found.count} ({found.share_within:.0%})"


def _get(data: dict | None, key: str):
    return None if data is None else data.get(key)


def _per_gpu(data: dict | None, key: str) -> int | None:
    return None if data is None else data["per_gpu"].get(key)


def _fits(data: dict | None, refusal: str) -> str:
    if data is None:
        return f"not expressible ({refusal})" if refusal else "-"
    return {True: "yes", False: "no", None: "-"}[data.get("fits")]


def _yes(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[value]


def _why(row: Row, off: bool) -> str:
    """The row's reason where it is off (the data's `off_because`), else nothing."""
    if not off:
        return ""
    if row.now is None:
        return row.run.get("off_because", row.now_refusal)
    return row.run.get("off_because", "**not yet explained**")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="an older checkout (a worktree of 65b353f) to show beside")
    parser.add_argument("--no-write", action="store_true", help=f"print instead of writing {RESULT.relative_to(REPO)}")
    args = parser.parse_args()
    found = rows(args.against, progress=lambda run_id: print(run_id, file=sys.stderr))
    invocation = "python bench/published_gpu_memory.py" + (" --against <worktree of 65b353f>" if args.against else "")
    text = "\n".join(markdown(found, args.against, invocation)) + "\n"
    if args.no_write:
        print(text)
    else:
        RESULT.write_text(text, encoding="utf-8")
        print(f"written: {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
