"""How long `zeroplan estimate llama-2-7b --gpus 8 --zero 3` takes as a whole, cold process.

Each run is a new Python process (interpreter start-up, imports, catalogue read, estimate, table),
timed from spawn to exit, output discarded. The files are in the page cache, and the bytecode is
cached (in a temporary PYTHONPYCACHEPREFIX, written by two untimed warm-up runs) as it is for an
installed package, whose .pyc files pip writes at install time. A last row runs without the
bytecode cache (PYTHONDONTWRITEBYTECODE=1, as in a source checkout on this machine), where every
zeroplan module is compiled on each start. Reports the median and the 90th percentile, next to
bare `python -c pass` and the dependencies' imports for scale, and writes
bench/results/estimate_speed.md.

    python bench/estimate_speed.py            # 20 runs
    python bench/estimate_speed.py --runs 50 --no-write

Target (issue 2, section 7): median at most 0.25 s on the development machine (2 cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ESTIMATE_ARGS = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"]
TARGET_MEDIAN_S = 0.25
PYCACHE = os.path.join(tempfile.gettempdir(), "zeroplan-bench-pycache")  # keeps the checkout clean


def child_env(bytecode: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)  # let zeroplan's own setting apply, as for a user
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_once(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall-clock and CPU (user + system) seconds of one fresh process of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def import_times(command: list[str], env: dict[str, str], runs: int = 5) -> dict[str, float]:
    """Median cumulative import time in ms of each top-level import (`python -X importtime`) and of
    its direct imports (as 'parent > child'), for imports of at least 2 ms. The top-level entries do
    not overlap, so they add up; their children are part of them."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        done = subprocess.run(
            [command[0], "-X", "importtime", *command[1:]], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, check=False,
        )
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
    # A module imported in one run only (e.g. by a child that moved) still gets its median.
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


def percentile(values: list[float], fraction: float) -> float:
    """The `fraction` quantile by the nearest-rank method."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def summary(walls: list[float], cpus: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(walls),
        "p90": percentile(walls, 0.9),
        "min": min(walls),
        "max": max(walls),
        "cpu_median": statistics.median(cpus),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    args = parser.parse_args()

    estimate = [sys.executable, "-m", "zeroplan", *ESTIMATE_ARGS]
    commands = {
        f"zeroplan {' '.join(ESTIMATE_ARGS)}": (estimate, True),
        "python -c pass (interpreter start-up alone)": ([sys.executable, "-c", "pass"], True),
        "python -c 'import pydantic, click, tabulate' (dependencies alone)": (
            [sys.executable, "-c", "import pydantic, click, tabulate"],
            True,
        ),
        f"zeroplan {' '.join(ESTIMATE_ARGS)}, no bytecode cache": (estimate, False),
    }
    load_before = os.getloadavg()[0]
    timings: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in commands}
    # Round-robin, so that a burst of load from other processes hits every command alike.
    for index in range(2 + args.runs):
        for label, (command, bytecode) in commands.items():
            wall, cpu = run_once(command, child_env(bytecode))
            if index >= 2:  # two untimed warm-up rounds write the bytecode cache
                timings[label][0].append(wall)
                timings[label][1].append(cpu)
    load_after = os.getloadavg()[0]
    rows = []
    for label, (walls, cpus) in timings.items():
        stats = summary(walls, cpus)
        rows.append((label, stats))
        print(
            f"{label}: median {stats['median']:.3f} s, p90 {stats['p90']:.3f} s, min {stats['min']:.3f} s,"
            f" max {stats['max']:.3f} s, CPU median {stats['cpu_median']:.3f} s"
        )

    imports = import_times(estimate, child_env(True))
    for name, ms in imports.items():
        print(f"  import {name}: {ms:.1f} ms")
    median = rows[0][1]["median"]
    verdict = "meets" if median <= TARGET_MEDIAN_S else "misses"
    print(f"target median <= {TARGET_MEDIAN_S} s: {verdict}")
    if args.no_write:
        return
    lines = [
        "# `zeroplan estimate` speed (cold process)",
        "",
        f"Command: `python bench/estimate_speed.py --runs {args.runs}`. Each run is a new `python -m zeroplan`",
        "process, timed from spawn to exit, output discarded, after 2 untimed warm-up runs; bytecode is",
        "cached as for an installed package, except in the last row (PYTHONDONTWRITEBYTECODE=1, as a",
        "source checkout on this machine runs).",
        "",
        (
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
            f" 1-minute load average {load_before:.2f} before and {load_after:.2f} after (other work shares the"
            f" {os.cpu_count()} cores), benchmark niceness {os.nice(0)};"
            f" {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. Commands run round-robin, {args.runs} timed runs each."
        ),
        "",
        "| command | wall median (s) | wall p90 (s) | wall min (s) | wall max (s) | CPU median (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, stats in rows:
        lines.append(
            f"| `{label}` | {stats['median']:.3f} | {stats['p90']:.3f} | {stats['min']:.3f} | {stats['max']:.3f}"
            f" | {stats['cpu_median']:.3f} |"
        )
    lines += ["", f"Target: median at most {TARGET_MEDIAN_S} s (issue 2, section 7): **{verdict}** ({median:.3f} s).", ""]
    if max(load_before, load_after) > (os.cpu_count() or 1):  # more runnable work than cores
        lines += [
            "The machine was busy with other work while this ran: wall-clock times include waiting for a",
            "core (compare `python -c pass`). The CPU column (user + system time of the process) is the",
            "command's own cost, and the closest figure here to a wall-clock time on an idle machine.",
            "",
        ]
    lines += [
        "Where the start-up goes: top-level imports of the estimate command and, after `>`, what they",
        (
            "import directly; cumulative, median of 5 `python -X importtime -m zeroplan"
            f" {' '.join(ESTIMATE_ARGS)}` runs (imports of 2 ms or more):"
        ),
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
