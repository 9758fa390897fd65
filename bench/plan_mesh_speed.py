"""How long `zeroplan plan --mesh` takes as a whole process (issue 24: "a 405B mesh plan on 512 GPUs under 1 s
of CPU"), and, with --against, another checkout beside it.

Each scenario runs as a fresh `python -m zeroplan plan ...` process in this checkout (and in the other one,
alternately, `--runs` times each); a process's time is its CPU time (user + system, from
`resource.getrusage(RUSAGE_CHILDREN)`), with the wall clock beside it: on a shared machine the wall clock also
counts waiting for a core. The plans themselves changed on purpose with the one step-time model (issue 24), so the
two checkouts' outputs are not compared; tests/plan/test_mesh_speed.py checks that the search's shortcuts change
no plan.

    python bench/plan_mesh_speed.py                                   # writes bench/plan_mesh_speed.md
    python bench/plan_mesh_speed.py --against /path/to/worktree-of-65b353f --runs 3
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
                        "--recipe", "torchtitan", "--mesh"]
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


TARGET_S = 1.0
TARGETED = "llama-3.1-405b 512 GPUs seq 8192"


def measure(base: Path | None, runs: int, only: str | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        emit_path = os.path.join(scratch, "plan.toml")
        for label, args in scenarios():
            if only and only not in label:
                continue
            times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
            for _ in range(runs):
                if base is not None:
                    cpu_b, wall_b, _ = run_once(base, args, emit_path)
                    times["before"].append((cpu_b, wall_b))
                cpu_a, wall_a, out_a = run_once(REPO, args, emit_path)
                times["after"].append((cpu_a, wall_a))
            row = {"label": label, "status": out_a[0]}
            for side, pairs in times.items():
                if pairs:
                    row[f"{side}_cpu"] = statistics.median(cpu for cpu, _ in pairs)
                    row[f"{side}_wall"] = statistics.median(wall for _, wall in pairs)
            rows.append(row)
            before = f"before {row['before_cpu']:.2f} s  " if base is not None else ""
            print(f"{label:58} {before}now {row['after_cpu']:.2f} s CPU, {row['after_wall']:.2f} s wall, exit {row['status']}",
                  flush=True)
    return rows


def git_head(checkout: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def markdown(rows: list[dict], base: Path | None, runs: int) -> str:
    against = f" --against <checkout of {git_head(base)}>" if base is not None else ""
    lines = [
        "# `zeroplan plan --mesh`: whole-process time",
        "",
        f"Written by `bench/plan_mesh_speed.py{against} --runs {runs}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, this "
        f"checkout at {git_head(REPO)}; Python {platform.python_version()}, {os.cpu_count()} cores shared with other "
        f"work (load average {os.getloadavg()[0]:.1f} at the end). Median of {runs} runs each. CPU s is user + system "
        "time of the process (`getrusage(RUSAGE_CHILDREN)`), Python's start and imports included; the wall clock also "
        "counts waiting for a core.",
        "",
    ]
    targeted = [row for row in rows if row["label"].startswith(TARGETED)]
    if targeted:
        worst = max(row["after_cpu"] for row in targeted)
        lines += [f"Target (issue 24): a 405B mesh plan on 512 GPUs under {TARGET_S:.0f} s of CPU: {worst:.2f} s at most "
                  f"({'met' if worst < TARGET_S else 'missed'}).", ""]
    head = "| scenario | exit | " + ("before CPU s | " if base is not None else "") + "CPU s | wall s |"
    lines += [head, "|---|---|" + ("---:|" if base is not None else "") + "---:|---:|"]
    for row in rows:
        before = f"{row['before_cpu']:.2f} | " if base is not None else ""
        lines.append(f"| {row['label']} | {row['status']} | {before}{row['after_cpu']:.2f} | {row['after_wall']:.2f} |")
    slowest = max(rows, key=lambda row: row["after_cpu"])
    lines += ["", f"The slowest: {slowest['label']}, {slowest['after_cpu']:.2f} s of CPU.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="another checkout to time beside this one (before)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/plan_mesh_speed.md")
    parser.add_argument("--only", help="only the scenarios whose label contains this (implies --no-write)")
    options = parser.parse_args()
    base = options.against.resolve() if options.against else None
    rows = measure(base, options.runs, options.only)
    text = markdown(rows, base, options.runs)
    if not (options.no_write or options.only):
        (REPO / "bench" / "plan_mesh_speed.md").write_text(text)
    print(text)
    return 0 if all(row["status"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
