"""How many configurations per second `zeroplan plan` evaluates, in-process, warm and cold.

A configuration is one (ZeRO stage, offload, checkpointing, GPU count, micro-batch, accumulation)
point of the search: the planner decides whether it fits (exactly, as a full estimate would) and
computes its step cost. Each timed run builds a new Planner, so every evaluation of the memory
model it needs is made inside the timing; the shown configurations' estimates and the report are
included, and so are the "nothing fits" suggestions where nothing fits (their configurations are
not counted). The estimator keeps per-model sizes between calls (model facts, activations, the
engine profiles' layouts and per-configuration sums): "warm" runs follow an untimed run of the
same search, "cold" runs clear every estimator cache first (`zeroplan.estimate.clear_caches`), as
the first plan of a process finds them. Both wall-clock and CPU time (time.process_time) are
given: on a shared machine the wall clock also counts waiting for a core. For scale, the same
work done the naive way, one full `estimate()` per configuration, is timed too.

    python bench/plan_speed.py             # 7 runs per scenario, writes bench/results/plan_speed.md
    python bench/plan_speed.py --runs 3 --no-write

Target (issue 5, section 5): at least 100,000 configurations per second.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zeroplan.importers.catalog import resolve_model
from zeroplan.plan.cost import assumptions_for
from zeroplan.estimate import clear_caches, estimate
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.search import Limits, Planner, SearchSpace, parse_gpu_counts, plan
from zeroplan.spec.training import TrainingSpec

TARGET = 100_000

# (label, model, GPU, CLI-equivalent search)
SCENARIOS = [
    ("default search, one GPU count", "llama-2-7b", "h100-80gb",
     {"gpus": "8"}, "zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8"),
    ("default search, FSDP2", "llama-2-7b", "h100-80gb",
     {"gpus": "8", "engine": "fsdp2"}, "zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8 --engine fsdp2"),
    ("GPU range 8-1024", "llama-2-7b", "h100-80gb",
     {"gpus": "8-1024"}, "zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8-1024"),
    ("global batch 1024 over 8-256 GPUs, every divisor", "llama-3-70b", "h100-80gb",
     {"gpus": "8-256", "global_batch": 1024, "micro_batches": "all"},
     "zeroplan plan llama-3-70b --gpu h100-80gb --gpus 8-256 --global-batch 1024 --micro-batches all"),
    ("every micro-batch 1-1024, GPUs 8-64", "llama-2-7b", "h100-80gb",
     {"gpus": "8-64", "micro_batches": "all"},
     "zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8-64 --micro-batches all"),
    ("every micro-batch 1-1024, GPUs 8-64", "llama-3-70b", "a100-80gb",
     {"gpus": "8-64", "micro_batches": "all"},
     "zeroplan plan llama-3-70b --gpu a100-80gb --gpus 8-64 --micro-batches all"),
]


def run_scenario(model_name: str, gpu_name: str, search: dict, runs: int) -> dict:
    model = resolve_model(model_name)
    gpu = get_gpu(gpu_name)
    assumptions = assumptions_for(gpu)
    counts = parse_gpu_counts(search["gpus"])
    space = SearchSpace(gpu_counts=counts, micro_batches=search.get("micro_batches", "pow2"),
                        global_batch=search.get("global_batch"))
    limits = Limits(gpu.memory_bytes)
    engine = search.get("engine", "deepspeed")
    # a base stage the engine accepts (as the CLI's base_training picks); the search replaces it
    base = TrainingSpec(gpus=max(counts), engine=engine, zero_stage=2 if engine == "fsdp2" else 0)
    result = plan(model, base, space, limits, assumptions)  # untimed: warms the estimator's caches
    times: dict[str, list[float]] = {"wall": [], "cpu": [], "cold_cpu": []}
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = plan(model, base, space, limits, assumptions)
        times["cpu"].append(time.process_time() - cpu)
        times["wall"].append(time.perf_counter() - wall)
    for _ in range(runs):
        clear_caches()
        cpu = time.process_time()
        plan(model, base, space, limits, assumptions)
        times["cold_cpu"].append(time.process_time() - cpu)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "evaluated": result.evaluated,
        "fitting": result.fitting,
        "estimate_calls": result.estimate_calls,
        "median_s": median["wall"],
        "rate": result.evaluated / median["wall"],
        "cpu_rate": result.evaluated / median["cpu"],
        "cold_cpu_rate": result.evaluated / median["cold_cpu"],
        "best": f"{result.top[0].choice.label()}, {result.top[0].choice.gpus} GPUs, micro-batch {result.top[0].micro_batch}"
        if result.top else "nothing fits",
        "space": space,
        "base": base,
        "model": model,
        "planner_args": (model, base, assumptions),
    }


def naive_rate(model, base: TrainingSpec, space: SearchSpace, assumptions, sample: int = 2000) -> float:
    """Configurations per second (CPU time) with one full estimate per configuration (a sample of the grid)."""
    planner = Planner(model, base, assumptions)
    points = []
    for choice in planner.choices(space, Limits(1))[0]:
        points.extend((choice, micro, accum) for micro, accum in planner.micro_batches(space, choice.gpus))
    points = points[:: max(1, len(points) // sample)][:sample]
    trainings = [planner.training(choice, micro, accum) for choice, micro, accum in points]
    start = time.process_time()
    for training in trainings:
        estimate(model, training)
    return len(trainings) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    rows = []
    for label, model_name, gpu_name, search, command in SCENARIOS:
        measured = run_scenario(model_name, gpu_name, search, args.runs)
        naive = naive_rate(measured["model"], measured["base"], measured["space"], measured["planner_args"][2])
        rows.append((label, model_name, gpu_name, command, measured, naive))
        print(f"{label} [{model_name}, {gpu_name}]: {measured['evaluated']:,} configs in {measured['median_s'] * 1e3:.1f} ms "
              f"({measured['estimate_calls']:,} evaluations) = {measured['rate']:,.0f} configs/s wall, "
              f"{measured['cpu_rate']:,.0f} CPU, {measured['cold_cpu_rate']:,.0f} CPU cold; "
              f"one estimate per config: {naive:,.0f} configs/s")

    default_rate = rows[0][4]["cpu_rate"]
    verdict = "passes" if default_rate >= TARGET else f"misses ({default_rate:,.0f} configs/s of CPU)"
    lines = [
        "# Planner speed",
        "",
        (f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC with `python bench/plan_speed.py --runs {args.runs}` on "
        f"{platform.machine()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end), "
        f"Python {platform.python_version()}; median of {args.runs} runs, "
        "each with a new planner (warm and cold estimator caches: see below). A configuration is a (stage, offload, checkpointing, GPU count, "
        "micro-batch, accumulation) point whose fit is decided exactly and whose step cost is computed."),
        "",
        f"Target (issue 5): at least {TARGET:,} configurations per second.",
        "",
        ("| scenario | model, GPU | configurations | memory-model evaluations | median wall time | configs/s (wall) "
         "| configs/s (CPU) | configs/s (CPU, cold) | one estimate per config (CPU) | best config |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, model_name, gpu_name, command, m, naive in rows:
        lines.append(f"| {label} | {model_name}, {gpu_name} | {m['evaluated']:,} | {m['estimate_calls']:,} | "
                     f"{m['median_s'] * 1e3:.1f} ms | {m['rate']:,.0f} | {m['cpu_rate']:,.0f} | {m['cold_cpu_rate']:,.0f} | "
                     f"{naive:,.0f} | {m['best']} |")
    lines += ["", "Commands (CLI equivalents of the scenarios):", ""]
    lines += [f"- `{command}`" for *_, command, _m, _n in [(r[0], r[3], r[4], r[5]) for r in rows]]
    lines += [
        "",
        "How: memory never shrinks with the micro-batch and is convex in it (tested against full estimates in",
        "tests/test_plan.py), so for each (stage, offload, checkpointing, GPU count) a bracketing search finds the",
        "last micro-batch that fits, starting from a neighbouring choice's answer: about two evaluations of the",
        "memory model per choice, whatever the number of micro-batches. The verdict is exact (the last that fits",
        "and the first that does not are both evaluated). Evaluations use `zeroplan.estimate.fit`, the same",
        "profile as `estimate()` without building the per-phase result (tested equal); a choice whose",
        "activations equal another's (selective checkpointing under fused attention) shares that choice's",
        "evaluations. The rest is a few float operations",
        "per configuration.",
        "",
        "Reading the numbers: the rate grows with the micro-batches per choice, because the evaluations per",
        "choice stay at about two; the planner adds a validated spec and a cost model per choice, and the",
        f"ranking. The default search (powers of two, 11 micro-batches per choice) {verdict} the target in this",
        "run. A global batch",
        "with few divisors per GPU count leaves 2-4 configurations per choice (one without accumulation, a",
        "few with), most settled by one failing probe: that row is bound by the evaluation rate, at about",
        "2x the rate of one estimate per configuration, and is the closest to the target. The cold column",
        "clears every estimator cache (`zeroplan.estimate.clear_caches`) before each run, as the first plan of a process finds them: what",
        "the profiles keep per model and configuration (layouts, bucket walks, stage-3 gathering) is built",
        "inside the timing; it matters most for 80-block models: llama-3-70b's first plan over six GPU",
        "counts misses the target. The CPU column is the",
        "planner's own cost; the wall clock also counts waiting for a core on this shared machine.",
        "Where nothing fits, plan() also searches for the smallest change that would fit; that time is",
        "included and its configurations are not counted.",
    ]
    text = "\n".join(lines) + "\n"
    if not args.no_write:
        out = REPO / "bench" / "results" / "plan_speed.md"
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
