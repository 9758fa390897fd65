"""Start-up of the command line, as ratios to importing the libraries it is built on.

Two ratios, each the median over paired runs of a new Python process, timed from spawn to exit,
output discarded:

- `zeroplan estimate llama-2-7b --gpus 8 --zero 3` over
  `python -c "import click, tabulate; from pydantic import BaseModel"` (the floor: the design
  card's libraries);
- `zeroplan --help` over `python -c "import click"`.

This machine is shared, so seconds say more about the neighbours than about zeroplan: each pair
runs back to back (in alternating order) and gives one ratio, and the pairs of both ratios are
interleaved, so a burst of load hits a command and its floor alike. Bytecode is cached (in a
temporary PYTHONPYCACHEPREFIX, written by untimed warm-up rounds) as it is for an installed
package. `zeroplan` runs as `python -m zeroplan` from this checkout. Also reports where the
estimate's start-up goes (`python -X importtime`), and writes bench/results/estimate_speed.md.

    python bench/estimate_speed.py              # 21 pairs per ratio
    python bench/estimate_speed.py --pairs 41 --no-write

Target (issue 9, item 6): both ratios at most 1.5.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ESTIMATE_ARGS = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"]
TARGET_RATIO = 1.5
PYCACHE = os.path.join(tempfile.gettempdir(), "zeroplan-bench-pycache")  # keeps the checkout clean
WARM_UP_ROUNDS = 2

# (label, zeroplan's arguments, floor label, floor code)
RATIOS = [
    (f"zeroplan {' '.join(ESTIMATE_ARGS)}", ESTIMATE_ARGS,
     "python -c 'import click, tabulate; from pydantic import BaseModel'", "import click, tabulate; from pydantic import BaseModel"),
    ("zeroplan --help", ["--help"], "python -c 'import click'", "import click"),
]


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": PYCACHE}
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)  # let zeroplan's own setting apply, as for a user
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def wall_seconds(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.decode()[-2000:]}")
    return seconds


def paired_ratios(pairs: int) -> list[dict]:
    """For each ratio: the per-pair ratios and both commands' seconds, pairs interleaved."""
    runs = [{"ratios": [], "command_s": [], "floor_s": []} for _ in RATIOS]
    for index in range(WARM_UP_ROUNDS + pairs):
        for (_, args, _, floor_code), run in zip(RATIOS, runs):
            command = [sys.executable, "-m", "zeroplan", *args]
            floor = [sys.executable, "-c", floor_code]
            if index % 2:  # alternate which goes first, so that neither always follows the other
                floor_s, command_s = wall_seconds(floor), wall_seconds(command)
            else:
                command_s, floor_s = wall_seconds(command), wall_seconds(floor)
            if index >= WARM_UP_ROUNDS:  # warm-up rounds write the bytecode cache
                run["ratios"].append(command_s / floor_s)
                run["command_s"].append(command_s)
                run["floor_s"].append(floor_s)
    return runs


def import_times(args: list[str], runs: int = 5) -> dict[str, float]:
    """Median cumulative import time in ms of each top-level import (`python -X importtime`) and of
    its direct imports (as 'parent > child'), for imports of at least 2 ms. The top-level entries do
    not overlap, so they add up; their children are part of them."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "zeroplan", *args], cwd=REPO, env=child_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    runs = paired_ratios(args.pairs)
    load_after = os.getloadavg()[0]
    rows, verdicts = [], []
    for (label, _, floor_label, _), run in zip(RATIOS, runs):
        ratio = statistics.median(run["ratios"])
        low, high = quartiles(run["ratios"])
        verdicts.append(ratio <= TARGET_RATIO)
        rows.append((label, floor_label, ratio, low, high, statistics.median(run["command_s"]), statistics.median(run["floor_s"])))
        print(f"{label} / {floor_label}: median ratio {ratio:.2f} (quartiles {low:.2f}-{high:.2f}),"
              f" {rows[-1][5]:.3f} s / {rows[-1][6]:.3f} s")
    imports = import_times(ESTIMATE_ARGS)
    for name, ms in imports.items():
        print(f"  import {name}: {ms:.1f} ms")
    verdict = "meets" if all(verdicts) else "misses"
    print(f"target: both ratios <= {TARGET_RATIO}: {verdict}")
    if args.no_write:
        return
    lines = [
        "# Start-up of the command line (cold process), as ratios",
        "",
        f"Command: `python bench/estimate_speed.py --pairs {args.pairs}`. Each figure is a new process, timed from",
        "spawn to exit, output discarded; `zeroplan` runs as `python -m zeroplan` from this checkout, bytecode",
        "cached as for an installed package. Each pair runs a command and its floor back to back (alternating",
        f"which goes first); the pairs of both ratios are interleaved, after {WARM_UP_ROUNDS} untimed warm-up rounds.",
        "",
        (
            f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other work), Python"
            f" {platform.python_version()}, 1-minute load average {load_before:.2f} before and {load_after:.2f} after;"
            f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC."
        ),
        "",
        "| command | floor | median ratio | quartiles | command median (s) | floor median (s) |",
        "|---|---|---:|---:|---:|---:|",
        *(f"| `{label}` | `{floor}` | {ratio:.2f} | {low:.2f}-{high:.2f} | {command_s:.3f} | {floor_s:.3f} |"
          for label, floor, ratio, low, high, command_s, floor_s in rows),
        "",
        f"Target (issue 9, item 6): both ratios at most {TARGET_RATIO}: **{verdict}**. Seconds are for scale only:",
        "on this shared machine they move with the neighbours' load; the ratios much less.",
        "",
        "Where the estimate's start-up goes: top-level imports and, after `>`, what they import directly;",
        f"cumulative, median of 5 `python -X importtime -m zeroplan {' '.join(ESTIMATE_ARGS)}` runs (2 ms or more):",
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
