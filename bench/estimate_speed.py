"""Start-up of the command line, as ratios to importing the libraries it is built on.

Each figure is the median over paired runs of a new process, timed from spawn to exit, output
discarded. Two ways of running zeroplan are timed:

- a plain (not editable) install of this checkout in a fresh virtual environment, built in a
  temporary directory (`pip install` of a copy of the working tree: its dependencies come from
  pip's configured index), run through the console script as a user runs it:
  `VENV/bin/zeroplan estimate llama-2-7b --gpus 8 --zero 3` over
  `VENV/bin/python -c "import click, tabulate; from pydantic import BaseModel"` (issue 20, item 6),
  and `VENV/bin/zeroplan --help` and `VENV/bin/zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8`
  over the same floors, for scale, and the floor with one pydantic model defined (what pydantic
  itself adds to any program that defines one);
- `python -m zeroplan` from this checkout (the interpreter running this script, the checkout on
  PYTHONPATH, bytecode cached in a temporary PYTHONPYCACHEPREFIX written by the warm-up rounds):
  the estimate over the same floor and `zeroplan --help` over `python -c "import click"` (issue 9).

This machine is shared, so seconds say more about the neighbours than about zeroplan: each pair
runs a command and its floor back to back (in alternating order) and gives one ratio, and the
pairs of all ratios are interleaved, so a burst of load hits a command and its floor alike. Each
ratio is also given in CPU time (user + system of the child, `resource.getrusage`), which waiting
for a core does not inflate. Also reports where the installed estimate's start-up goes
(`python -X importtime`), and writes bench/results/estimate_speed.md.

    python bench/estimate_speed.py                      # 21 pairs per ratio, both ways
    python bench/estimate_speed.py --pairs 41 --no-write
    python bench/estimate_speed.py --only installed     # or: --only checkout

Targets: the installed estimate at most 1.3x its floor (issue 20, item 6); from the checkout, the
estimate and --help at most 1.5x theirs (issue 9, item 6).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ESTIMATE_ARGS = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"]
PLAN_ARGS = ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
LIBRARIES = "import click, tabulate; from pydantic import BaseModel"
# the floor and one pydantic model with one constrained field: what pydantic itself adds once a model is defined
# (pydantic.fields and what it imports: pydantic.types, annotated_types, secrets, hashlib), for scale
ONE_MODEL = f"{LIBRARIES}\nfrom pydantic import Field\nclass Spec(BaseModel):\n    size: int = Field(1, ge=1)"
CHECKOUT_TARGET = 1.5  # issue 9, item 6
INSTALLED_TARGET = 1.3  # issue 20, item 6
PYCACHE = os.path.join(tempfile.gettempdir(), "zeroplan-bench-pycache")  # keeps the checkout clean
WARM_UP_ROUNDS = 2
# what a copy of the working tree for `pip install` leaves out: build outputs and environments
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".hypothesis", ".cache")


@dataclass
class Ratio:
    """A command timed against its floor, pair by pair."""

    label: str
    command: list[str]
    floor_label: str
    floor: list[str]
    env: dict[str, str]
    cwd: Path
    target: float | None
    wall: list[tuple[float, float]] = field(default_factory=list)  # (command s, floor s) per pair
    cpu: list[tuple[float, float]] = field(default_factory=list)

    def ratios(self, kind: str) -> list[float]:
        return [command / floor for command, floor in getattr(self, kind)]

    def median(self, kind: str, which: int) -> float:
        return statistics.median(pair[which] for pair in getattr(self, kind))


def checkout_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": PYCACHE}
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)  # let zeroplan's own setting apply, as for a user
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def installed_env() -> dict[str, str]:
    """A user's environment: nothing of this checkout on the path; bytecode as pip compiled it at install."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE", "PYDANTIC_DISABLE_PLUGINS",
                          "PYTHONHOME", "VIRTUAL_ENV")}
    return env


def plain_install(directory: Path) -> Path:
    """A fresh virtual environment in `directory` with a plain install of a copy of the working tree; its bin/."""
    source = directory / "source"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    environment = directory / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    bin_dir = environment / "bin"
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           str(source)], cwd=directory, env=installed_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pip install of the checkout failed: {done.stderr[-2000:]}")
    return bin_dir


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_pairs(ratios: list[Ratio], pairs: int) -> None:
    """Every ratio's pairs, interleaved, after untimed warm-up rounds (which write the checkout's bytecode cache)."""
    for index in range(WARM_UP_ROUNDS + pairs):
        for ratio in ratios:
            if index % 2:  # alternate which goes first, so that neither always follows the other
                floor, command = timed(ratio.floor, ratio.env, ratio.cwd), timed(ratio.command, ratio.env, ratio.cwd)
            else:
                command, floor = timed(ratio.command, ratio.env, ratio.cwd), timed(ratio.floor, ratio.env, ratio.cwd)
            if index >= WARM_UP_ROUNDS:
                ratio.wall.append((command[0], floor[0]))
                ratio.cpu.append((command[1], floor[1]))


def checkout_ratios() -> list[Ratio]:
    python, env = sys.executable, checkout_env()
    return [
        Ratio(f"python -m zeroplan {' '.join(ESTIMATE_ARGS)}", [python, "-m", "zeroplan", *ESTIMATE_ARGS],
              f"python -c '{LIBRARIES}'", [python, "-c", LIBRARIES], env, REPO, CHECKOUT_TARGET),
        Ratio("python -m zeroplan --help", [python, "-m", "zeroplan", "--help"], "python -c 'import click'",
              [python, "-c", "import click"], env, REPO, CHECKOUT_TARGET),
    ]


def installed_ratios(bin_dir: Path, cwd: Path) -> list[Ratio]:
    python, zeroplan, env = str(bin_dir / "python"), str(bin_dir / "zeroplan"), installed_env()
    floor = (f"VENV/bin/python -c '{LIBRARIES}'", [python, "-c", LIBRARIES])
    return [
        Ratio(f"VENV/bin/zeroplan {' '.join(ESTIMATE_ARGS)}", [zeroplan, *ESTIMATE_ARGS], *floor, env, cwd, INSTALLED_TARGET),
        Ratio("VENV/bin/zeroplan --help", [zeroplan, "--help"], "VENV/bin/python -c 'import click'",
              [python, "-c", "import click"], env, cwd, None),
        Ratio(f"VENV/bin/zeroplan {' '.join(PLAN_ARGS)}", [zeroplan, *PLAN_ARGS], *floor, env, cwd, None),
        Ratio("VENV/bin/python -c '...; class Spec(BaseModel): size: int = Field(1, ge=1)'", [python, "-c", ONE_MODEL],
              *floor, env, cwd, None),
    ]


def import_times(command: list[str], env: dict[str, str], cwd: Path, runs: int = 5) -> dict[str, float]:
    """Median cumulative import time in ms of each top-level import (`python -X importtime`) and of
    its direct imports (as 'parent > child'), for imports of at least 2 ms. The top-level entries do
    not overlap, so they add up; their children are part of them."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              check=False)
        children: list[tuple[str, int]] = []  # importtime prints the imports of a module before it
        for line in done.stderr.splitlines():
            if not line.startswith("import time:"):
                continue
            _, cumulative_us, name = line.split("|")
            if not cumulative_us.strip().isdigit():
                continue
            depth = (len(name) - len(name.lstrip()) - 1) // 2
            if depth == 1:
                children.append((name.strip(), int(cumulative_us)))
            elif depth == 0:
                samples.setdefault(name.strip(), []).append(int(cumulative_us) / 1000)
                for child, child_us in children:
                    samples.setdefault(f"{name.strip()} > {child}", []).append(child_us / 1000)
                children = []
    medians = {name: statistics.median(values) for name, values in samples.items()}
    order = sorted((name for name in medians if " > " not in name), key=lambda name: -medians[name])
    ranked = {}
    for parent in order:
        if medians[parent] < 2:
            continue
        ranked[parent] = medians[parent]
        for name in sorted(medians, key=lambda name: -medians[name]):
            if name.startswith(f"{parent} > ") and medians[name] >= 2:
                ranked[name] = medians[name]
    return ranked


def quartiles(values: list[float]) -> tuple[float, float]:
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def verdict(ratio: Ratio) -> str:
    if ratio.target is None:
        return "-"
    return "meets" if statistics.median(ratio.ratios("wall")) <= ratio.target else "misses"


def table(ratios: list[Ratio]) -> list[str]:
    lines = ["| command | floor | median ratio | quartiles | CPU-time ratio | command median (s) | floor median (s) | target |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for ratio in ratios:
        wall = ratio.ratios("wall")
        low, high = quartiles(wall)
        target = "" if ratio.target is None else f"<= {ratio.target}: **{verdict(ratio)}**"
        lines.append(f"| `{ratio.label}` | `{ratio.floor_label}` | {statistics.median(wall):.2f} | {low:.2f}-{high:.2f} |"
                     f" {statistics.median(ratio.ratios('cpu')):.2f} | {ratio.median('wall', 0):.3f} |"
                     f" {ratio.median('wall', 1):.3f} | {target} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--only", choices=["installed", "checkout"], help="time one way of running zeroplan only")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="zeroplan-bench-") as scratch:
        scratch = Path(scratch)
        installed: list[Ratio] = []
        if args.only != "checkout":
            start = time.perf_counter()
            bin_dir = plain_install(scratch)
            print(f"plain install in a fresh virtual environment: {time.perf_counter() - start:.1f} s")
            installed = installed_ratios(bin_dir, scratch)
        checkout = checkout_ratios() if args.only != "installed" else []
        load_before = os.getloadavg()[0]
        run_pairs(installed + checkout, args.pairs)
        load_after = os.getloadavg()[0]
        if installed:
            where = "the installed console script"
            command = [str(bin_dir / "python"), "-X", "importtime", str(bin_dir / "zeroplan"), *ESTIMATE_ARGS]
            imports = import_times(command, installed_env(), scratch)
        else:
            where = "`python -m zeroplan` from the checkout"
            command = [sys.executable, "-X", "importtime", "-m", "zeroplan", *ESTIMATE_ARGS]
            imports = import_times(command, checkout_env(), REPO)

    for ratio in installed + checkout:
        wall = ratio.ratios("wall")
        low, high = quartiles(wall)
        print(f"{ratio.label} / {ratio.floor_label}: median ratio {statistics.median(wall):.2f} (quartiles"
              f" {low:.2f}-{high:.2f}), CPU time {statistics.median(ratio.ratios('cpu')):.2f}; {ratio.median('wall', 0):.3f} s /"
              f" {ratio.median('wall', 1):.3f} s; target: {verdict(ratio)}")
    for name, ms in imports.items():
        print(f"  import {name}: {ms:.1f} ms")
    if args.no_write:
        return
    only = f" --only {args.only}" if args.only else ""
    lines = [
        "# Start-up of the command line (cold process), as ratios",
        "",
        f"Command: `python bench/estimate_speed.py --pairs {args.pairs}{only}`. Each figure is a new process, timed from",
        "spawn to exit, output discarded. Each pair runs a command and its floor back to back (alternating which goes",
        f"first); the pairs of every ratio are interleaved, after {WARM_UP_ROUNDS} untimed warm-up rounds. The CPU-time",
        "ratio is the median of the same pairs' user + system seconds, which waiting for a core does not inflate.",
        "",
        (
            f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other work), Python"
            f" {platform.python_version()}, 1-minute load average {load_before:.2f} before and {load_after:.2f} after;"
            f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC."
        ),
        "",
    ]
    if installed:
        lines += [
            "## A plain install, through the console script (issue 20, item 6)",
            "",
            "A fresh virtual environment in a temporary directory, `pip install` of a copy of this working tree (not",
            "editable; pip compiles the bytecode), then `VENV/bin/zeroplan` against `VENV/bin/python` importing the",
            f"libraries. Target: the estimate at most {INSTALLED_TARGET}x its floor; `--help`, `plan` and the floor with one",
            "pydantic model defined (`Field` imports pydantic.types, annotated_types, secrets and hashlib) are for scale.",
            "",
            *table(installed),
            "",
        ]
    if checkout:
        lines += [
            "## `python -m zeroplan` from the checkout (issue 9, item 6)",
            "",
            "The checkout on PYTHONPATH, bytecode cached (in a temporary PYTHONPYCACHEPREFIX, written by the warm-up",
            f"rounds) as it is for an installed package. Target: both at most {CHECKOUT_TARGET}x their floor.",
            "",
            *table(checkout),
            "",
        ]
    lines += [
        "Seconds are for scale only: on this shared machine they move with the neighbours' load; the ratios much less.",
        "",
        f"Where the estimate's start-up goes, through {where}: top-level imports and, after `>`, what they",
        f"import directly; cumulative, median of 5 `python -X importtime` runs of `zeroplan {' '.join(ESTIMATE_ARGS)}`",
        "(2 ms or more):",
        "",
        "| import | ms |",
        "|---|---:|",
        *(f"| `{name}` | {ms:.1f} |" for name, ms in imports.items()),
        "",
    ]
    out = REPO / "bench" / "results" / "estimate_speed.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
