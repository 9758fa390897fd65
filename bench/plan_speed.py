"""How many configurations per CPU second `zeroplan plan` decides, as a whole process, against another checkout.

A configuration is one (GPU count, mesh, ZeRO stage, offload, checkpointing, micro-batch, accumulation) point of
the search whose fit is decided exactly (as a full estimate would) and whose step time is computed; each plan
reports how many it searched. Each scenario runs as a fresh `python -m zeroplan plan ... --format json` process in
this checkout and in the one given by --against (e.g. a worktree of 65b353f), alternately, `--runs` pairs; a
process's CPU time (user + system, `resource.getrusage(RUSAGE_CHILDREN)`) includes Python's start and the imports,
as a user pays them. The two checkouts are compared by the ratio of their median configurations per CPU second,
taken in pairs under the same load (the wall clock of a shared machine also counts waiting for a core). The
checkouts need not search the same configurations: the default search changed on purpose (every checkpointing
policy, op and every-2 among them), and the rate is what the issue asks to keep.

    python bench/plan_speed.py --against /path/to/worktree-of-65b353f          # writes bench/results/plan_speed.md
    python bench/plan_speed.py --against /path/to/worktree-of-65b353f --runs 3 --no-write

Target (issue 20, section 6): the default search (the first scenario) at least 1.25x 65b353f's configurations per
CPU second, as a whole process and for the planner alone (`plan()` in one process, warm caches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.25

SCENARIOS = [
    ("default search", ["llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"]),
    ("default search, FSDP2", ["llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--engine", "fsdp2"]),
    ("GPU range 8-1024", ["llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8-1024"]),
    ("global batch 1024 over 8-256 GPUs, every divisor",
     ["llama-3-70b", "--gpu", "h100-80gb", "--gpus", "8-256", "--global-batch", "1024", "--micro-batches", "all"]),
    ("every micro-batch 1-1024, GPUs 8-64", ["llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8-64", "--micro-batches", "all"]),
]


def run_once(checkout: Path, args: list[str]) -> tuple[float, float, int]:
    """One whole process in `checkout`: its CPU seconds, wall seconds and the configurations it searched."""
    command = [sys.executable, "-m", "zeroplan", "plan", *args, "--format", "json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # the checkout as the working directory: `python -m` puts it first on sys.path
    done = subprocess.run(command, cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
                          text=True, timeout=600, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, json.loads(done.stdout)["evaluated"]


# The planner alone, in one process, warm caches: `plan()` of the default search timed 21 times (either checkout's
# API: the rates of zeroplan.plan.rates, or 65b353f's zeroplan.plan.cost assumptions).
IN_PROCESS = """
import statistics, time
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.search import Limits, SearchSpace, plan
from zeroplan.spec.training import TrainingSpec
try:
    from zeroplan.plan.rates import rates_for as rates
except ImportError:
    from zeroplan.plan.cost import assumptions_for as rates
model, gpu = resolve_model("llama-2-7b"), get_gpu("h100-80gb")
args = (model, TrainingSpec(gpus=8), SearchSpace(gpu_counts=(8,)), Limits(gpu.memory_bytes), rates(gpu))
plan(*args)
times = []
for _ in range(21):
    start = time.process_time()
    found = plan(*args)
    times.append(time.process_time() - start)
print(found.evaluated, statistics.median(times))
"""


def in_process(checkout: Path) -> tuple[int, float]:
    done = subprocess.run([sys.executable, "-c", IN_PROCESS], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                          capture_output=True, text=True, timeout=600, check=True)
    evaluated, seconds = done.stdout.split()
    return int(evaluated), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (a worktree of 65b353f)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for label, plan_args in SCENARIOS:
        rates: dict[str, list[float]] = {"this": [], "other": []}
        configs = {}
        for _ in range(args.runs):  # interleaved pairs: both checkouts under the same load
            for name, checkout in (("other", args.against), ("this", REPO)):
                cpu, _, evaluated = run_once(checkout, plan_args)
                rates[name].append(evaluated / cpu)
                configs[name] = evaluated
        median = {name: statistics.median(values) for name, values in rates.items()}
        rows.append((label, plan_args, configs, median))
        print(f"{label}: {configs['other']:,} configs at {median['other']:,.0f}/CPU s before, {configs['this']:,} at "
              f"{median['this']:,.0f}/CPU s now: {median['this'] / median['other']:.2f}x")
    default = rows[0][3]["this"] / rows[0][3]["other"]
    alone = {name: in_process(checkout) for name, checkout in (("other", args.against), ("this", REPO))}
    lines = [
        "# Planner speed against 65b353f",
        "",
        (f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC with `python bench/plan_speed.py --against <worktree of "
         f"65b353f> --runs {args.runs}` on {platform.machine()} ({os.cpu_count()} cores shared, load average "
         f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}: whole `python -m zeroplan plan "
         "... --format json` processes, the two checkouts alternately; the median of each one's configurations per "
         "CPU second (user + system, imports included)."),
        "",
        f"Target (issue 20): the default search at least {TARGET}x 65b353f's configurations per CPU second: "
        f"{default:.2f}x, {'met' if default >= TARGET else 'missed'}.",
        "",
        "| scenario | command | configurations 65b353f | configs/CPU s 65b353f | configurations now | configs/CPU s now | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, plan_args, configs, median in rows:
        lines.append(f"| {label} | `zeroplan plan {' '.join(plan_args)}` | {configs['other']:,} | {median['other']:,.0f} | "
                     f"{configs['this']:,} | {median['this']:,.0f} | {median['this'] / median['other']:.2f}x |")
    rate = {name: evaluated / seconds for name, (evaluated, seconds) in alone.items()}
    per_config = rate["this"] / rate["other"]
    lines += [
        "",
        (f"The planner alone (in one process, warm caches, `plan()` of the default search, median of 21): 65b353f "
         f"{alone['other'][0]:,} configurations in {alone['other'][1] * 1e3:.1f} ms ({rate['other']:,.0f}/s), "
         f"now {alone['this'][0]:,} in {alone['this'][1] * 1e3:.1f} ms ({rate['this']:,.0f}/s): per configuration "
         f"{per_config:.2f}x 65b353f's (target {TARGET}x: {'met' if per_config >= TARGET else 'missed'})."),
        "",
        "Why the counts differ: the default search now has every checkpointing policy the estimator models (none,",
        "selective, op, full, every-2: five where 65b353f had three) and the step time prices each configuration with",
        "the full cost model (collective overlap, roofline, latency). The search decides every configuration exactly",
        "with two fit checks per memory class in the steady state (the last micro-batch that fits and the first that",
        "does not); op and every-2 are memory classes of their own, selective shares none's under fused attention.",
    ]
    if not args.no_write:
        out = REPO / "bench" / "results" / "plan_speed.md"
        out.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
