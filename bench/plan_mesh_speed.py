"""How long `zeroplan plan --mesh` takes as a whole process, against another checkout (issue 14: "a plan of
llama-3-70b (and llama-3.1-405b) on 64 to 1024 H100s at seq 8192 and 131072 answers in under a second").

Each scenario runs as a fresh `python -m zeroplan plan ...` process in this checkout and in the one given by
--against (e.g. a worktree of main), alternately, `--runs` times each; a process's time is its CPU time
(user + system, from the process timer `resource.getrusage(RUSAGE_CHILDREN)`), with the wall clock beside it:
on a shared machine the wall clock also counts waiting for a core, so the two checkouts are compared by the
ratio of their medians, taken in pairs under the same load. Every pair's outputs (exit status, standard output
and error, and the emitted TOML) are compared byte for byte: a speed-up must not change a plan. The one part
allowed to differ is the summary line's counts (fit checks made, meshes found to fit), and its clause saying how
many meshes the cost bound left unchecked (zeroplan/plan/mesh.py `_cost_above`): "same plans" then.

    python bench/plan_mesh_speed.py --against /path/to/main-worktree            # writes bench/plan_mesh_speed.md
    python bench/plan_mesh_speed.py --against /path/to/main-worktree --runs 1 --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = ("llama-3-70b", "llama-3.1-405b")
GPU_COUNTS = (64, 512, 1024)
SEQ_LENS = (8192, 131072)


def scenarios() -> list[tuple[str, list[str]]]:
    """(label, plan arguments), `{emit}` standing for the TOML's path."""
    runs = []
    for model in MODELS:
        for gpus in GPU_COUNTS:
            for seq in SEQ_LENS:
                args = [model, "--gpu", "h100-80gb", "--gpus", str(gpus), "--seq-len", str(seq), "--engine", "fsdp2",
                        "--mesh"]
                runs.append((f"{model} {gpus} GPUs seq {seq}", args))
                runs.append((f"{model} {gpus} GPUs seq {seq} --emit torchtitan", args + ["--emit", "torchtitan", "{emit}"]))
    return runs


def run_once(checkout: Path, args: list[str], emit_path: str) -> tuple[float, float, tuple]:
    """One whole process: its CPU seconds, wall seconds, and (exit status, stdout, stderr, emitted file)."""
    if os.path.exists(emit_path):
        os.remove(emit_path)
    command = [sys.executable, "-m", "zeroplan", "plan", *[emit_path if a == "{emit}" else a for a in args]]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    emitted = Path(emit_path).read_bytes() if os.path.exists(emit_path) else None
    return cpu, wall, (done.returncode, done.stdout, done.stderr, emitted)


# the summary line as a418856 wrote it ("N of M meshes evaluated fit in X per GPU") and as it is now
_COUNTS = re.compile(rb"GPUs: (?:[\d,]+ of [\d,]+ meshes evaluated|[\d,]+ mesh and checkpointing choices) fit in (.*?) "
                     rb"per GPU(?: \([\d,]+ fit checks\))?(?:; [\d,]+ more could not rank in the top \d+ at any "
                     rb"micro-batch \(a bound on their cost\)(?:,| and were) not checked)?")


def without_counts(output: tuple) -> tuple:
    """`output` with the summary line's counts (and the cost bound's clause) taken out."""
    status, stdout, stderr, emitted = output
    return status, _COUNTS.sub(rb"GPUs: N of M meshes evaluated fit in \1 per GPU", stdout), stderr, emitted


def measure(base: Path, runs: int, only: str | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        emit_path = os.path.join(scratch, "plan.toml")
        for label, args in scenarios():
            if only and only not in label:
                continue
            times = {"before": [], "after": []}
            identical = same_plans = True
            for _ in range(runs):
                cpu_b, wall_b, out_b = run_once(base, args, emit_path)
                cpu_a, wall_a, out_a = run_once(REPO, args, emit_path)
                times["before"].append((cpu_b, wall_b))
                times["after"].append((cpu_a, wall_a))
                identical = identical and out_a == out_b
                same_plans = same_plans and without_counts(out_a) == without_counts(out_b)
            row = {"label": label, "identical": identical, "same_plans": same_plans, "status": out_a[0],
                   "output": "identical" if identical else "same plans" if same_plans else "DIFFERS"}
            for side, pairs in times.items():
                row[f"{side}_cpu"] = statistics.median(cpu for cpu, _ in pairs)
                row[f"{side}_wall"] = statistics.median(wall for _, wall in pairs)
            row["ratio"] = row["before_cpu"] / row["after_cpu"]
            rows.append(row)
            print(f"{label:58} before {row['before_cpu']:.2f} s  after {row['after_cpu']:.2f} s  "
                  f"x{row['ratio']:.1f}  {row['output']}", flush=True)
    return rows


def git_head(checkout: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def markdown(rows: list[dict], base: Path, runs: int) -> str:
    lines = [
        "# `zeroplan plan --mesh`: whole-process time",
        "",
        f"Written by `bench/plan_mesh_speed.py --against <checkout of {git_head(base)}>` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, this checkout at {git_head(REPO)}; {platform.python_version()}, "
        f"{os.cpu_count()} cores shared with other work (PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}: "
        "zeroplan's modules are compiled at every start). Median of "
        f"{runs} runs each, run in pairs (before, after) under the same load. CPU s is user + system time of the "
        "process (`getrusage(RUSAGE_CHILDREN)`); the wall clock also counts waiting for a core. Every pair's "
        "exit status, output and emitted TOML were compared byte for byte; \"same plans\": identical but for the "
        "summary line's counts and its cost-bound clause.",
        "",
        "| scenario | exit | before CPU s | after CPU s | before/after | before wall s | after wall s | output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['label']} | {row['status']} | {row['before_cpu']:.2f} | {row['after_cpu']:.2f} | "
                     f"{row['ratio']:.1f}x | {row['before_wall']:.2f} | {row['after_wall']:.2f} | "
                     f"{row['output']} |")
    total_before = sum(row["before_cpu"] for row in rows)
    total_after = sum(row["after_cpu"] for row in rows)
    slowest = max(rows, key=lambda row: row["after_cpu"])
    lines += ["", f"All {len(rows)} scenarios: {total_before:.1f} s of CPU before, {total_after:.1f} s after "
              f"({total_before / total_after:.1f}x); the slowest after: {slowest['label']}, {slowest['after_cpu']:.2f} s.",
              ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="the checkout to compare with (before)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/plan_mesh_speed.md")
    parser.add_argument("--only", help="only the scenarios whose label contains this (implies --no-write)")
    options = parser.parse_args()
    rows = measure(options.against.resolve(), options.runs, options.only)
    text = markdown(rows, options.against.resolve(), options.runs)
    if not (options.no_write or options.only):
        (REPO / "bench" / "plan_mesh_speed.md").write_text(text)
    print(text)
    return 0 if all(row["same_plans"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
