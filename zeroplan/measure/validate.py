"""`zeroplan validate`, the running half: measure the accuracy grid's rows and set each against
its estimate.

- the grid itself is data in `zeroplan.measure.grid`;
- each selected row is measured with `zeroplan.measure.launcher.run_measurement`, one row at a
  time, its measurement cached by row id (with a fingerprint of the specs it ran and the commit
  it came from) so that re-running a few rows keeps the others; two runs sharing a cache take
  turns under a lock file;
- the estimate is recomputed at every report (it is cheap, and the estimator changes more often
  than the engines), then set against the cached measurement by `zeroplan.measure.comparison`,
  the comparison `zeroplan measure` uses too;
- `zeroplan.report.accuracy` renders the result (docs/accuracy.md and docs/accuracy.json).

Nothing here imports torch: measuring runs in worker processes (zeroplan.measure).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import statistics
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from zeroplan.errors import MeasureError, SpecError, ZeroplanError
from zeroplan.measure.comparison import CATEGORIES, TARGETS, Comparison, Targets, compare, device_peaks, summary_peaks
from zeroplan.measure.grid import Row, missing_files, row_implementation, row_specs, run_backend
from zeroplan.measure.published import PublishedCheck, check_published
from zeroplan.measure.replay_check import ReplayPair, replay_pair

DEFAULT_STEPS = 3  # step 1 creates the optimizer states; steps 2-3 are the steady state
DEFAULT_TIMEOUT_S = 900.0
BACKENDS = ("gloo", "nccl")
MEASURE_MODES = ("all", "missing", "none")


# --------------------------------------------------------------------------------------------
# Fingerprints, and the measurement summary kept in the JSON


def fingerprint(row: Row, backend: str, steps: int) -> str:
    """A hash of everything a row's measurement depends on: if it changes, the cache is stale.

    The specs enter without their defaults, and the training program as resolved: a knob added to
    the spec with a default that runs what ran before leaves the measurements valid, while any value
    the run reads (a default included) changes the hash through the program."""
    from zeroplan.estimate.serialize import program_to_dict

    model, training = row_specs(row, backend)
    data = {"model": model.model_dump(mode="json", exclude_defaults=True),
            "training": training.model_dump(mode="json", exclude_defaults=True),
            "program": program_to_dict(training.program),
            "nproc": row.world, "backend": run_backend(row, backend), "steps": steps}
    if row_implementation(row) != "auto":
        data["implementation"] = row_implementation(row)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _phase_summary(phase) -> dict[str, Any]:
    from zeroplan.measure.result import adapter_split

    return {"step": phase.step, "phase": phase.phase, "peak_bytes": phase.peak_bytes, "categories": dict(phase.categories),
            **adapter_split(phase)}


def summarize_measurement(result) -> dict[str, Any]:
    """What the report keeps of a `MeasureResult`: per rank, the steady and first-step peaks with
    their categories (and the CUDA counters' peaks on nccl)."""
    ranks = []
    for rank in result.ranks:
        steady = [p for p in rank.phases if p.stage == "steady"]
        first = [p for p in rank.phases if p.stage in ("init", "first")]
        if not steady:
            raise MeasureError(f"rank {rank.rank} has no steady-state step (steps 2 and later): run at least 2 steps")
        entry = {"rank": rank.rank, "steady": _phase_summary(max(steady, key=lambda p: p.peak_bytes)),
                 "first": _phase_summary(max(first, key=lambda p: p.peak_bytes))}
        devices = {"steady": device_peaks(p.device for p in steady), "first": device_peaks(p.device for p in first)}
        if devices["steady"]:
            entry["device"] = devices
        if (device_memory := rank.device_memory()) is not None:  # the whole run's CUDA counters
            entry["device_memory"] = device_memory
        if rank.allocator_replay is not None:  # the rank's stream through the allocator model
            entry["allocator_replay"] = dict(rank.allocator_replay)
        ranks.append(entry)
    return {"backend": result.backend, "world_size": result.world_size, "implementation": result.implementation,
            "steps": result.steps, "fits": result.fits, "notes": list(result.notes), "ranks": ranks}


# --------------------------------------------------------------------------------------------
# The distribution of the errors over rows


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(errors: dict[str, float]) -> dict[str, Any]:
    """Median, 90th percentile and worst of |error| over rows; the worst keeps its sign and row."""
    if not errors:
        return {"rows": 0}
    magnitudes = [abs(e) for e in errors.values()]
    worst_id = max(errors, key=lambda k: abs(errors[k]))
    return {"rows": len(errors), "median": statistics.median(magnitudes), "p90": percentile(magnitudes, 90),
            "worst": errors[worst_id], "worst_row": worst_id}


# --------------------------------------------------------------------------------------------
# Reasons for the misses (written by the estimator team)


def load_reasons(path: Path) -> dict[str, str]:
    """docs/accuracy_reasons.toml: `"row id or glob" = "reason"`; a missing file means no reasons."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as error:
        raise SpecError(f"{path}: {error}") from None
    bad = [key for key, value in data.items() if not isinstance(value, str)]
    if bad:
        raise SpecError(f"{path}: {bad[0]}: a reason must be a string (\"row id\" = \"why it misses\")")
    return data


def reason_for(row_id: str, reasons: dict[str, str]) -> str:
    """The reason for `row_id`: its exact key, else the first glob key that matches it, else ""."""
    if row_id in reasons:
        return reasons[row_id]
    return next((text for key, text in reasons.items() if any(c in key for c in "*?[") and fnmatch.fnmatchcase(row_id, key)), "")


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class RunOptions:
    backend: str = "gloo"  # gloo (CPU processes) or nccl (GPUs); simulated rows always run fake
    steps: int = DEFAULT_STEPS
    timeout_s: float = DEFAULT_TIMEOUT_S
    measure: str = "all"  # all selected rows, only those "missing" from the cache, or "none"


def load_records(path: Path | None) -> dict[str, dict[str, Any]]:
    """The cached measurements of a previous report's JSON, by row id (empty when there is none)."""
    if path is None or not Path(path).exists():
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as error:
        raise SpecError(f"{path}: not a zeroplan validate report ({error})") from None
    return {row["id"]: row["record"] for row in data.get("rows", []) if "record" in row}


def _source_version() -> str | None:
    """The checkout's commit (with "+dirty" when zeroplan/ has local changes), None outside a git checkout:
    which accounting and engine code a cached measurement came from."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "zeroplan"], cwd=root, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def check_files(grid: Sequence[Row], selected: Sequence[Row], records: dict[str, dict[str, Any]]) -> None:
    """Raise SpecError, before any row runs, when a row to measure or a row the report estimates (one
    with a cached record) reads a file that is not here: the spec files of zeroplan's tests, which only
    a checkout has. Before issue 21, `validate --quick` run in an installed copy measured its rows and
    then failed on tests/data/tiny-llama-4l.toml when it wrote the report."""
    wanted = {row.id for row in selected}
    needed = [row for row in grid if row.id in wanted or row.id in records]
    missing = missing_files(needed)
    if not missing:
        return
    path, ids = next(iter(missing.items()))
    more = sum(len(ids) for ids in missing.values()) - 1
    to_measure = any(row_id in wanted for ids in missing.values() for row_id in ids)
    raise SpecError(
        f"{path} is missing: row {ids[0]} reads it" + (f" ({more} more rows read missing files)" if more else "")
        + "; it is a spec file of zeroplan's tests, which only a checkout has: run validate in a zeroplan checkout, or "
        + ("select rows that do not read it with --rows" if to_measure else
           "write the report to another --output-json (its cache has measurements of such rows)")
    )


def measure_row(row: Row, options: RunOptions) -> dict[str, Any]:
    """Measure one row; a failed measurement is a record too (its error is reported, not raised)."""
    from zeroplan.measure.launcher import run_measurement

    model, training = row_specs(row, options.backend)
    record: dict[str, Any] = {"fingerprint": fingerprint(row, options.backend, options.steps),
                              "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                              "source": _source_version()}
    started = time.monotonic()
    try:
        result = run_measurement(model, training, nproc=row.world, backend=run_backend(row, options.backend),
                                 simulate=row.simulate, steps=options.steps, timeout_s=options.timeout_s,
                                 implementation=row_implementation(row))
        record["measurement"] = summarize_measurement(result)
    except ZeroplanError as error:
        record["failure"] = str(error)
        if getattr(error, "worker_traceback", ""):  # a failed rank's traceback, or the stacks of a timeout
            record["failure_detail"] = error.worker_traceback
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def run_rows(
    rows: Sequence[Row],
    records: dict[str, dict[str, Any]],
    options: RunOptions,
    *,
    on_start: Callable[[Row], None] | None = None,
    on_done: Callable[[Row, dict[str, Any] | None, bool], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Measure `rows` one after another (each run uses every core) into a copy of `records`.

    `on_start(row)` is called before a row, `on_done(row, record, measured_now)` after it, with the
    record measured now (`measured_now` True), or the cached one when it was not measured again
    (None when there is none)."""
    records = dict(records)
    for row in rows:
        if on_start:
            on_start(row)
        cached = records.get(row.id)
        fresh = cached is not None and cached.get("fingerprint") == fingerprint(row, options.backend, options.steps)
        measure = options.measure == "all" or (options.measure == "missing" and not (fresh and "measurement" in cached))
        if measure:
            records[row.id] = measure_row(row, options)
        if on_done:
            on_done(row, records.get(row.id), measure)
    return records


# --------------------------------------------------------------------------------------------
# The report


@dataclass
class RowReport:
    row: Row
    record: dict[str, Any] | None
    comparison: Comparison | None
    reason: str
    stale: bool = False  # measured with different specs than the row's current ones
    replay: ReplayPair | None = None  # the estimate's stream and the real one through the allocator model

    @property
    def status(self) -> str:
        if self.record is None:
            return "not measured"
        if "failure" in self.record:
            return "failed"
        return "miss" if self.comparison.misses() else "ok"


@dataclass
class Report:
    rows: list[RowReport]
    backend: str
    command: str
    steps: int
    wall_seconds: float | None = None
    generated: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    targets: Targets = TARGETS  # what each row is held to
    categories: tuple[str, ...] = CATEGORIES  # the categories compared, in report order
    published: list[PublishedCheck] = field(default_factory=list)  # published GPU runs against the estimate

    @property
    def compared(self) -> list[RowReport]:
        return [r for r in self.rows if r.comparison is not None]

    @property
    def within_targets(self) -> list[RowReport]:
        return [r for r in self.compared if not r.comparison.misses()]

    @property
    def measuring_seconds(self) -> float:
        """The wall time the rows' cached measurements took, summed."""
        return sum(r.record.get("seconds", 0) for r in self.rows if r.record)

    def measured_span(self) -> tuple[str, str, list[str]] | None:
        """(earliest, latest, commits) of the cached measurements (rows are re-measured piecemeal); None without any."""
        records = [r.record for r in self.rows if r.record and "measurement" in r.record]
        if not records:
            return None
        times = sorted(r.get("measured_at", "") for r in records)
        return times[0], times[-1], sorted({r.get("source") or "unknown" for r in records})

    @property
    def replay_differences(self) -> dict[str, int] | None:
        """|estimate's reserved - real stream's reserved| over the replayed rows, in bytes: median, 90th percentile,
        and how many rows differ by at most one large segment (the unit a tiny model's relative error hides)."""
        pairs = [r.replay for r in self.replayed]
        if not pairs:
            return None
        differences = [abs(pair.difference_bytes) for pair in pairs]
        return {"median_bytes": round(percentile(differences, 50)), "p90_bytes": round(percentile(differences, 90)),
                "within_one_segment": sum(abs(p.difference_bytes) <= p.large_segment_bytes for p in pairs),
                "rows": len(pairs), "large_segment_bytes": pairs[0].large_segment_bytes}

    @property
    def replayed(self) -> list[RowReport]:
        """The measured rows whose real stream was kept, so that both replays are compared."""
        return [r for r in self.compared if r.replay is not None and r.replay.error is not None]

    def distributions(self) -> dict[str, dict[str, Any]]:
        return {
            "steady_peak": distribution({r.row.id: r.comparison.steady.peak.error for r in self.compared}),
            "first_step_peak": distribution({r.row.id: r.comparison.first.peak.error for r in self.compared}),
            "reserved_replay": distribution({r.row.id: r.replay.error for r in self.replayed}),
        }


def build_report(rows: Sequence[Row], records: dict[str, dict[str, Any]], reasons: dict[str, str], *,
                 backend: str, steps: int, command: str, wall_seconds: float | None = None) -> Report:
    """Estimate every row now and set it against its cached measurement."""
    from zeroplan.estimate import estimate_mesh
    from zeroplan.estimate.serialize import phase_to_dict
    from zeroplan.measure.grid_ep import with_measured_imbalance

    out = []
    for row in rows:
        record = records.get(row.id)
        comparison = replayed = None
        if record is not None and "measurement" in record:
            model, training = row_specs(row, backend)
            training = with_measured_imbalance(training, record["measurement"].get("notes", ()))  # EP rows
            # the worst rank kind's estimate against the rank that peaks highest (a plain row has one kind)
            estimated = estimate_mesh(model, training)
            phases = [phase_to_dict(phase) for phase in estimated.worst.estimate.phases]
            comparison = compare(phases, summary_peaks(record["measurement"]), engine=row.engine)
            replayed = replay_pair(estimated, record["measurement"])
        stale = record is not None and record.get("fingerprint") != fingerprint(row, backend, steps)
        out.append(RowReport(row, record, comparison, reason_for(row.id, reasons), stale,
                             replayed if comparison is not None else None))
    return Report(out, backend, command, steps, wall_seconds, published=check_published())


def update_report(
    grid: Sequence[Row], new_records: dict[str, dict[str, Any]], reasons: dict[str, str], *, backend: str, steps: int,
    command: str, json_path: Path, write: Callable[[Report], None], wall_seconds: float | None = None,
) -> Report:
    """Merge `new_records` into the cache (the JSON report at `json_path`), build the report and
    `write` it, under a lock file, so that two `zeroplan validate` runs sharing the JSON (say one
    re-measuring a few rows while the whole grid runs) keep each other's measurements."""
    with _locked(Path(json_path).with_name(f".{Path(json_path).name}.lock")):
        records = load_records(json_path) | new_records
        if wall_seconds is None and Path(json_path).exists():  # a partial run keeps the last whole run's time
            wall_seconds = json.loads(Path(json_path).read_text()).get("wall_seconds")
        report = build_report(grid, records, reasons, backend=backend, steps=steps, command=command, wall_seconds=wall_seconds)
        write(report)
    return report


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive flock on `lock_path`, removed when released. A waiter that wakes on a file
    already removed (its inode no longer at the path) locks the new one instead."""
    import fcntl

    while True:
        lock = open(lock_path, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(lock_path).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # still holding the lock: nobody else owns this path
        lock.close()


def checkout_docs() -> Path | None:
    """The `docs/` folder of the zeroplan checkout this code runs from, None for an installed copy:
    the reports' default home, never a `docs/` made in whatever directory the command runs in."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    return docs if (docs / "accuracy_reasons.toml").is_file() else None


def default_outputs(backend: str, grid: str = "accuracy") -> tuple[Path, Path] | None:
    """The checkout's docs/accuracy.{md,json} for CPU runs, docs/accuracy_gpu.{md,json} for nccl,
    docs/accuracy_gpu-1.{md,json} (gpu-8) for the GPU grids; None outside a checkout."""
    docs = checkout_docs()
    if docs is None:
        return None
    stem = f"accuracy_{grid}" if grid != "accuracy" else "accuracy_gpu" if backend == "nccl" else "accuracy"
    return docs / f"{stem}.md", docs / f"{stem}.json"


def check_gpus(rows: Sequence[Row], backend: str) -> None:
    """Before any row runs: an nccl run needs as many visible CUDA GPUs as its widest real row; a
    MeasureError that says so in one line otherwise (a machine without CUDA, a CPU build of torch)."""
    if backend != "nccl":
        return
    from zeroplan.measure.context import visible_cuda_devices

    needed = max((row.world for row in rows if not row.simulate), default=0)
    visible = visible_cuda_devices()
    if visible < needed:
        where = "no CUDA GPU is visible here" if visible == 0 else f"only {visible} CUDA GPU(s) are visible here"
        raise MeasureError(f"--backend nccl: the selected rows need {needed} GPU(s) on one node and {where} "
                           "(a CPU build of torch sees none): run it on a GPU machine, or use --backend gloo")
