"""`zeroplan validate`: estimate and measure a grid of configurations, and report the error.

The accuracy harness of issue 4. Four jobs, each a small group of pure functions:
- the grid, as data (`GRID`: one `Row` per configuration, a covering design, not a cross product);
- running it: each selected row measured with `zeroplan.measure.launcher.run_measurement`, one row
  at a time, its measurement cached by row id (and a fingerprint of the specs it ran) so that
  re-running a few rows keeps the others;
- comparing: the estimate is recomputed at every report (it is cheap, and the estimator changes
  more often than the engines), then set against the cached measurement: the steady-state peak,
  the first-step peak, and each category at the steady peak;
- reporting: markdown (`docs/accuracy.md`) and JSON (`docs/accuracy.json`).

Definitions (the same in the report's header):
- measured steady peak: the highest phase peak of steps 2 and later, largest over ranks; the
  categories compared are those of that rank at that phase;
- measured first-step peak: the highest phase peak of set-up and step 1, largest over ranks;
- estimated peaks: `Estimate.peak_of(Step.STEADY)` and `Estimate.peak_of(Step.FIRST)` (the first
  step includes set-up), tensor bytes only (the estimate's `overhead`, the CUDA context, is not a
  tensor and no counter below sees it);
- error = estimate / measured - 1 (positive: the estimate is too high).
- a category misses when |estimate - measured| exceeds both 5% of the measured bytes and the
  floor (64 KiB, or 1% of the measured steady peak if larger), so that a category of a few bytes
  on both sides is not a miss.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from zeroplan.errors import MeasureError, SpecError, ZeroplanError
from zeroplan.estimate.result import CATEGORY_NAMES, Estimate, Step

STEADY_TOLERANCE = 0.03  # issue 4 §3: the steady-state peak within 3% on every row
FIRST_TOLERANCE = 0.05  # the first-step peak within 5%
CATEGORY_TOLERANCE = 0.05  # every category within 5%
CATEGORY_FLOOR_BYTES = 64 * 2**10  # 64 KiB ...
CATEGORY_FLOOR_FRACTION = 0.01  # ... or 1% of the measured steady peak, whichever is larger
CATEGORIES = tuple(name for name in CATEGORY_NAMES if name != "overhead")  # what the accounting records
MIB = 2**20

DEFAULT_STEPS = 3  # step 1 creates the optimizer states; steps 2-3 are the steady state
DEFAULT_TIMEOUT_S = 900.0
BACKENDS = ("gloo", "nccl")
MEASURE_MODES = ("all", "missing", "none")

# DeepSpeed "small buckets": buckets far below the default 5e8 elements, so that the buckets are
# exercised rather than one buffer larger than the model; persistence 0 makes stage 3 shard every
# tensor of the tiny models (the default 1e5 keeps them all whole). deepspeed/runtime/zero/config.py.
SMALL_BUCKETS = {
    "reduce_bucket_size": 100_000,
    "allgather_bucket_size": 100_000,
    "stage3_prefetch_bucket_size": 100_000,
    "stage3_param_persistence_threshold": 0,
}


# --------------------------------------------------------------------------------------------
# The grid


@dataclass(frozen=True)
class Row:
    """One configuration of the grid: a catalogue model, an engine set-up and a workload."""

    model: str
    engine: str  # torch, fsdp2, deepspeed
    stage: int
    precision: str = "fp32"
    offload: bool = False  # fsdp2: CPUOffloadPolicy; deepspeed: offload_optimizer cpu
    checkpointing: str = "none"
    attention: str = "fused"  # fused (SDPA) or eager
    micro_batch: int = 2
    seq_len: int = 128
    world: int = 2
    simulate: bool = False  # the fake backend: one process standing for `world` ranks
    small_buckets: bool = False  # deepspeed: SMALL_BUCKETS instead of DeepSpeed's defaults
    quick: bool = False  # part of the CI slice (`--quick`, tests/test_accuracy_slice.py)

    @property
    def id(self) -> str:
        setup = f"{self.engine}-{self.stage}" + ("+offload" if self.offload else "") + ("+smallbkt" if self.small_buckets else "")
        ckpt = "ckpt" if self.checkpointing == "full" else "nockpt" if self.checkpointing == "none" else self.checkpointing
        world = f"fake{self.world}" if self.simulate else f"w{self.world}"
        parts = (self.model, setup, self.precision, ckpt, f"{self.micro_batch}x{self.seq_len}", world)
        return "/".join(parts + (("eager",) if self.attention == "eager" else ()))

    @property
    def needs_cpu_adam(self) -> bool:
        """DeepSpeed optimizer offload runs DeepSpeedCPUAdam, a JIT build (~1 min, 2 GB) the first time."""
        return self.engine == "deepspeed" and self.offload

    def training_fields(self, backend: str = "gloo") -> dict[str, Any]:
        """The TrainingSpec fields of this row (device cuda for an nccl run, else cpu)."""
        fields: dict[str, Any] = {
            "engine": self.engine, "zero_stage": self.stage, "gpus": self.world, "precision": self.precision,
            "micro_batch": self.micro_batch, "seq_len": self.seq_len, "checkpointing": self.checkpointing,
            "attention": self.attention, "device": "cuda" if backend == "nccl" and not self.simulate else "cpu",
        }
        if self.offload:
            fields["offload_optimizer"] = "cpu"
            if self.engine == "fsdp2" and self.stage == 3:
                fields["offload_params"] = "cpu"  # CPUOffloadPolicy moves parameters with the optimizer
        if self.small_buckets:
            fields["deepspeed"] = dict(SMALL_BUCKETS)
        if self.engine == "deepspeed":
            # measure builds the model whole, then deepspeed.initialize partitions it (no zero.Init)
            fields["deepspeed"] = {**fields.get("deepspeed", {}), "zero_init": False}
        return fields


def _grid() -> tuple[Row, ...]:
    """The covering design (docs/accuracy.md, "Grid"): every engine set-up on both tiny models,
    with precision x checkpointing x batch covered pairwise over the main set-ups; llama-100m on
    one row per main set-up; FSDP2 on llama-1b at 8 and 64 simulated ranks."""
    # The L4 orthogonal array over (precision, checkpointing, micro-batch x seq): any two of the
    # three factors take all four level pairs over its four runs.
    l4 = (("fp32", "none", (2, 128)), ("fp32", "full", (4, 256)), ("bf16", "none", (4, 256)), ("bf16", "full", (2, 128)))
    tiny = ("tiny-llama", "tiny-gpt2")
    main = [  # (engine, stage, extra fields): all four L4 runs
        ("torch", 0, {}), ("torch", 1, {}), ("fsdp2", 2, {}), ("fsdp2", 3, {}),
        ("deepspeed", 1, {}), ("deepspeed", 2, {}), ("deepspeed", 3, {}),
    ]
    variants = [  # two L4 runs each (fp32 without, bf16 with checkpointing)
        ("fsdp2", 2, {"offload": True}), ("fsdp2", 3, {"offload": True}),
        ("deepspeed", 1, {"small_buckets": True}), ("deepspeed", 2, {"small_buckets": True}),
        ("deepspeed", 3, {"small_buckets": True}),
        ("deepspeed", 2, {"offload": True, "small_buckets": True}), ("deepspeed", 3, {"offload": True, "small_buckets": True}),
    ]
    # The CI slice: the first (fp32, no checkpointing, 2x128) run of these set-ups.
    quick = {("torch", 0, ()), ("torch", 1, ()), ("fsdp2", 2, ()), ("fsdp2", 3, ()), ("deepspeed", 2, ("small_buckets",))}
    rows: list[Row] = []
    for k, (engine, stage, extra) in enumerate(main + variants):
        runs = l4 if k < len(main) else (l4[0], l4[3])
        for j, (precision, ckpt, (mb, seq)) in enumerate(runs):
            # alternate the models so each sees both levels of every factor across set-ups
            model = tiny[(k + (j in (1, 2))) % 2] if len(runs) == 4 else tiny[(j + k) % 2]
            is_quick = j == 0 and (engine, stage, tuple(sorted(extra))) in quick
            rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, micro_batch=mb, seq_len=seq,
                            quick=is_quick, **extra))
    # about 100M parameters: one row per main set-up, short sequences (each step is ~1e11 FLOP on CPU)
    for engine, stage, precision, ckpt in (
        ("torch", 0, "fp32", "none"), ("torch", 1, "bf16", "none"), ("fsdp2", 2, "bf16", "full"),
        ("fsdp2", 3, "fp32", "none"), ("deepspeed", 2, "bf16", "none"), ("deepspeed", 3, "fp32", "full"),
    ):
        rows.append(Row("llama-100m", engine, stage, precision, checkpointing=ckpt))
    # simulated worlds (fake backend, FSDP2 only): llama-1b at 8 and 64 ranks; one tiny row for CI
    for stage, world, precision, ckpt in (
        (2, 8, "bf16", "none"), (3, 8, "bf16", "none"), (3, 8, "fp32", "full"),
        (2, 64, "bf16", "full"), (3, 64, "bf16", "none"), (3, 64, "fp32", "none"),
    ):
        rows.append(Row("llama-1b", "fsdp2", stage, precision, checkpointing=ckpt, world=world, simulate=True))
    rows.append(Row("tiny-llama", "fsdp2", 3, "fp32", world=8, simulate=True, quick=True))
    # Selective checkpointing (the attention core recomputed) and eager attention, on both tiny
    # models: fused and eager, with and without autocast (the torch engine's bf16), GQA (tiny-llama)
    # and fused q/k/v (tiny-gpt2).
    for model, engine, stage, precision, ckpt, attention, (mb, seq) in (
        ("tiny-llama", "torch", 0, "bf16", "selective", "eager", (2, 128)),
        ("tiny-llama", "torch", 0, "bf16", "selective", "fused", (2, 128)),
        ("tiny-llama", "fsdp2", 2, "bf16", "selective", "fused", (4, 256)),
        ("tiny-llama", "deepspeed", 2, "bf16", "selective", "eager", (2, 128)),
        ("tiny-gpt2", "fsdp2", 3, "fp32", "selective", "eager", (4, 256)),
        ("tiny-gpt2", "torch", 1, "fp32", "none", "eager", (4, 256)),
        # long sequences, where eager attention's backward (s x s gradients) is the block's peak
        ("tiny-llama", "fsdp2", 3, "fp32", "none", "eager", (1, 1024)),
        ("tiny-llama", "fsdp2", 2, "bf16", "selective", "eager", (1, 1024)),
        ("tiny-llama", "fsdp2", 3, "fp32", "full", "eager", (1, 1024)),
        ("tiny-llama", "torch", 1, "bf16", "none", "eager", (1, 1024)),
        ("tiny-gpt2", "torch", 0, "bf16", "selective", "eager", (4, 256)),
    ):
        quick = (model, engine, ckpt, seq) == ("tiny-llama", "fsdp2", "selective", 1024)  # the CI slice's eager row
        rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, attention=attention, micro_batch=mb, seq_len=seq,
                        quick=quick))
    rows.append(Row("tiny-llama", "deepspeed", 3, "fp32", checkpointing="selective", attention="eager", micro_batch=1,
                    seq_len=1024, small_buckets=True))
    return tuple(rows)


GRID: tuple[Row, ...] = _grid()


def select_rows(
    rows: Sequence[Row], patterns: str | None = None, *, quick: bool = False, skip_deepspeed_offload: bool = False
) -> list[Row]:
    """The rows matching any of the comma-separated `patterns` (a glob on the row id, or a plain
    substring when it has no `*?[`), only the CI slice with `quick`, without the rows that need
    DeepSpeed's cpu_adam build with `skip_deepspeed_offload`."""
    wanted = [p.strip() for p in (patterns or "").split(",") if p.strip()]

    def matches(row: Row) -> bool:
        if not wanted:
            return True
        return any(fnmatch.fnmatchcase(row.id, p) if any(c in p for c in "*?[") else p in row.id for p in wanted)

    chosen = [r for r in rows if matches(r) and (r.quick or not quick) and not (skip_deepspeed_offload and r.needs_cpu_adam)]
    if not chosen:
        raise SpecError(f"rows: no row of the grid matches {patterns!r}" + (" in the --quick slice" if quick else ""))
    return chosen


# --------------------------------------------------------------------------------------------
# Specs, fingerprints, and the measurement summary kept in the JSON


def row_specs(row: Row, backend: str = "gloo"):
    """(ModelSpec, TrainingSpec) of a row."""
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.spec.training import TrainingSpec

    return resolve_model(row.model), TrainingSpec(**row.training_fields(backend))


def run_backend(row: Row, backend: str) -> str:
    """The backend a row runs on: fake for simulated rows, else the run's (gloo or nccl)."""
    return "fake" if row.simulate else backend


def row_implementation(row: Row) -> str:
    """The model code a row runs. Simulated rows run zeroplan's reference model: under fake
    tensors transformers takes the run for tracing (utils/import_utils.py is_tracing) and builds
    an explicit causal mask that a real run does not, so a Hugging Face model would measure
    activations a real run never holds. The reference model mirrors transformers' Llama
    (zeroplan/measure/reference_model.py); tests/test_measure_distributed.py checks that a
    simulated reference run matches a real 2-rank one."""
    return "reference" if row.simulate else "auto"


def fingerprint(row: Row, backend: str, steps: int) -> str:
    """A hash of everything a row's measurement depends on: if it changes, the cache is stale."""
    model, training = row_specs(row, backend)
    data = {"model": model.model_dump(mode="json"), "training": training.model_dump(mode="json"),
            "nproc": row.world, "backend": run_backend(row, backend), "steps": steps}
    if row_implementation(row) != "auto":
        data["implementation"] = row_implementation(row)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _phase_summary(phase) -> dict[str, Any]:
    return {"step": phase.step, "phase": phase.phase, "peak_bytes": phase.peak_bytes, "categories": dict(phase.categories)}


def _device_peaks(phases) -> dict[str, int] | None:
    """The CUDA allocator's peaks over `phases` (max_memory_allocated / max_memory_reserved), None on CPU."""
    devices = [p.device for p in phases if p.device]
    if not devices:
        return None
    return {key: max(d.get(key, 0) for d in devices) for key in ("allocated_peak_bytes", "reserved_peak_bytes")}


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
        devices = {"steady": _device_peaks(steady), "first": _device_peaks(first)}
        if devices["steady"]:
            entry["device"] = devices
        ranks.append(entry)
    return {"backend": result.backend, "world_size": result.world_size, "implementation": result.implementation,
            "steps": result.steps, "fits": result.fits, "notes": list(result.notes), "ranks": ranks}


# --------------------------------------------------------------------------------------------
# Comparing an estimate with a measurement


@dataclass(frozen=True)
class CategoryCheck:
    estimated_bytes: int
    measured_bytes: int
    floor_bytes: int

    @property
    def error(self) -> float | None:
        """estimate / measured - 1, None when nothing was measured."""
        return self.estimated_bytes / self.measured_bytes - 1 if self.measured_bytes else None

    @property
    def below_floor(self) -> bool:
        return self.estimated_bytes < self.floor_bytes and self.measured_bytes < self.floor_bytes

    @property
    def ok(self) -> bool:
        allowed = max(CATEGORY_TOLERANCE * self.measured_bytes, self.floor_bytes)
        return abs(self.estimated_bytes - self.measured_bytes) <= allowed


@dataclass(frozen=True)
class Comparison:
    """One row's estimate against its measurement."""

    estimated_steady_bytes: int
    measured_steady_bytes: int
    estimated_first_bytes: int
    measured_first_bytes: int
    estimated_steady_phase: str
    measured_steady_phase: str
    max_rank: int
    categories: dict[str, CategoryCheck]
    device: dict[str, float] | None = None  # nccl: errors against max_memory_allocated / reserved

    @property
    def steady_error(self) -> float:
        return self.estimated_steady_bytes / self.measured_steady_bytes - 1

    @property
    def first_error(self) -> float:
        return self.estimated_first_bytes / self.measured_first_bytes - 1

    @property
    def misses(self) -> list[str]:
        """What misses the targets, e.g. ["peak +4.1%", "grads -12.0%"]; empty when within them."""
        out = []
        if abs(self.steady_error) > STEADY_TOLERANCE:
            out.append(f"peak {self.steady_error:+.1%}")
        if abs(self.first_error) > FIRST_TOLERANCE:
            out.append(f"first step {self.first_error:+.1%}")
        for name, check in self.categories.items():
            if not check.ok:
                out.append(f"{name} {_category_text(check)}")
        return out


def compare(estimate: Estimate, measured: dict[str, Any]) -> Comparison:
    """Set an estimate against a measurement summary (`summarize_measurement`)."""
    ranks = measured["ranks"]
    top = max(ranks, key=lambda r: r["steady"]["peak_bytes"])
    steady = estimate.peak_of(Step.STEADY)
    first = estimate.peak_of(Step.FIRST)
    measured_steady = top["steady"]["peak_bytes"]
    floor = max(CATEGORY_FLOOR_BYTES, int(CATEGORY_FLOOR_FRACTION * measured_steady))
    est_categories = steady.categories.as_dict()
    checks = {
        name: CategoryCheck(est_categories[name], int(top["steady"]["categories"].get(name, 0)), floor)
        for name in CATEGORIES
    }
    steady_tensor_bytes = steady.total_bytes - steady.categories.overhead
    device = None
    if all("device" in r for r in ranks):
        allocated = max(r["device"]["steady"]["allocated_peak_bytes"] for r in ranks)
        reserved = max(r["device"]["steady"]["reserved_peak_bytes"] for r in ranks)
        device = {"allocated_peak_bytes": allocated, "reserved_peak_bytes": reserved,
                  "allocated_error": steady_tensor_bytes / allocated - 1 if allocated else math.nan,
                  "reserved_error": steady_tensor_bytes / reserved - 1 if reserved else math.nan}
    return Comparison(
        estimated_steady_bytes=steady_tensor_bytes,
        measured_steady_bytes=measured_steady,
        estimated_first_bytes=first.total_bytes - first.categories.overhead,
        measured_first_bytes=max(r["first"]["peak_bytes"] for r in ranks),
        estimated_steady_phase=steady.phase.value,
        measured_steady_phase=top["steady"]["phase"],
        max_rank=top["rank"],
        categories=checks,
        device=device,
    )


def _category_text(check: CategoryCheck) -> str:
    if check.below_floor:
        return "·"
    if check.error is None:
        return f"+{check.estimated_bytes / MIB:.2f} MiB (none measured)"
    return f"{check.error:+.1%}"


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
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def run_rows(
    rows: Sequence[Row],
    records: dict[str, dict[str, Any]],
    options: RunOptions,
    *,
    on_start: Callable[[Row], None] | None = None,
    on_done: Callable[[Row, dict[str, Any] | None], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Measure `rows` one after another (each run uses every core) into a copy of `records`.

    `on_start(row)` is called before a row, `on_done(row, record)` after it, with the record
    measured now, or the cached one when it was not measured again (None when there is none)."""
    records = dict(records)
    for row in rows:
        if on_start:
            on_start(row)
        cached = records.get(row.id)
        fresh = cached is not None and cached.get("fingerprint") == fingerprint(row, options.backend, options.steps)
        if options.measure == "all" or (options.measure == "missing" and not (fresh and "measurement" in cached)):
            records[row.id] = measure_row(row, options)
        if on_done:
            on_done(row, records.get(row.id))
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

    @property
    def status(self) -> str:
        if self.record is None:
            return "not measured"
        if "failure" in self.record:
            return "failed"
        return "miss" if self.comparison.misses else "ok"


@dataclass
class Report:
    rows: list[RowReport]
    backend: str
    command: str
    steps: int
    wall_seconds: float | None = None
    generated: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))

    @property
    def compared(self) -> list[RowReport]:
        return [r for r in self.rows if r.comparison is not None]

    def distributions(self) -> dict[str, dict[str, Any]]:
        return {
            "steady_peak": distribution({r.row.id: r.comparison.steady_error for r in self.compared}),
            "first_step_peak": distribution({r.row.id: r.comparison.first_error for r in self.compared}),
        }


def build_report(rows: Sequence[Row], records: dict[str, dict[str, Any]], reasons: dict[str, str], *,
                 backend: str, steps: int, command: str, wall_seconds: float | None = None) -> Report:
    """Estimate every row now and set it against its cached measurement."""
    from zeroplan.estimate import estimate

    out = []
    for row in rows:
        record = records.get(row.id)
        comparison = None
        if record is not None and "measurement" in record:
            model, training = row_specs(row, backend)
            comparison = compare(estimate(model, training), record["measurement"])
        stale = record is not None and record.get("fingerprint") != fingerprint(row, backend, steps)
        out.append(RowReport(row, record, comparison, reason_for(row.id, reasons), stale))
    return Report(out, backend, command, steps, wall_seconds)


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f}"


def _pct(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{x:+.1%}"


def _mark(text: str, missed: bool) -> str:
    return f"**{text}**" if missed and text else text


def _world(row: Row, backend: str) -> str:
    return f"{row.world} fake" if row.simulate else f"{row.world} {backend}"


TABLE_HEADERS = ["row", "model", "engine", "stage", "precision", "offload", "ckpt", "mb x seq", "ranks",
                 "est. peak MiB", "meas. peak MiB", "error", "first-step error", "peak phase est/meas", *CATEGORIES]


def table_rows(report: Report) -> list[list[str]]:
    """One list of cells per row (TABLE_HEADERS), misses in bold."""
    body = []
    for r in report.rows:
        row = r.row
        offload = "cpu" if row.offload else ("small bkt" if row.small_buckets else "")
        if row.offload and row.small_buckets:
            offload = "cpu, small bkt"
        cells = [str(i) for i in (r.row.id, row.model, row.engine, row.stage, row.precision, offload,
                                  row.checkpointing, f"{row.micro_batch}x{row.seq_len}", _world(row, report.backend))]
        c = r.comparison
        if c is None:
            status = r.status if r.record is None else f"failed: {r.record['failure']}"
            body.append(cells + ["", "", status, "", ""] + [""] * len(CATEGORIES))
            continue
        cells += [_mib(c.estimated_steady_bytes), _mib(c.measured_steady_bytes),
                  _mark(_pct(c.steady_error), abs(c.steady_error) > STEADY_TOLERANCE),
                  _mark(_pct(c.first_error), abs(c.first_error) > FIRST_TOLERANCE),
                  f"{c.estimated_steady_phase}/{c.measured_steady_phase}".replace("optimizer_step", "step")]
        cells += [_mark(_category_text(c.categories[name]), not c.categories[name].ok) for name in CATEGORIES]
        body.append(cells)
    return body


def render_markdown(report: Report) -> str:
    from tabulate import tabulate

    compared = report.compared
    within = [r for r in compared if not r.comparison.misses]
    dist = report.distributions()
    measured_s = sum(r.record.get("seconds", 0) for r in report.rows if r.record)
    gpu = report.backend == "nccl"
    lines = [
        "# Accuracy: estimate against measurement",
        "",
        "Generated by `zeroplan validate` (issue 4) on " + report.generated + ".",
        "",
    ]
    if gpu:
        lines += ["**These are GPU measurements** (nccl, one process per GPU); simulated rows still run the fake backend.", ""]
    else:
        lines += [
            ("**These are CPU measurements, not GPU ones**: real 2-process runs on the `gloo` backend "
            "(exact live-tensor bytes counted by `zeroplan measure`'s accounting) and simulated runs on "
            "the `fake` backend (one process standing for 8 or 64 ranks under FakeTensorMode). A GPU adds "
            "what no tensor holds (CUDA context, allocator rounding and caching); run "
            "`zeroplan validate --backend nccl` on a GPU machine to extend the table (see below)."),
            "",
        ]
    lines += [
        f"Regenerate: `{report.command}` "
        f"({len(report.rows)} rows; measuring them took {measured_s / 60:.1f} min of wall time in all, "
        f"rows one after another on a 2-core machine"
        + (f"; the last whole run took {report.wall_seconds / 60:.1f} min" if report.wall_seconds is not None else "") + "). "
        "`--rows PATTERN` re-measures only the matching rows and keeps the others' cached measurements; "
        "`--measure none` re-estimates every row against the cached measurements (seconds).",
        "",
        "Measured " + _measured_span(report) + ".",
        "",
        "## Summary",
        "",
        f"Targets (issue 4 §3): steady-state peak within {STEADY_TOLERANCE:.0%}, every category within "
        f"{CATEGORY_TOLERANCE:.0%}, first-step peak within {FIRST_TOLERANCE:.0%}. "
        f"{len(within)} of {len(compared)} measured rows are within every target"
        + (f"; {len(report.rows) - len(compared)} rows have no measurement (failed or not run)" if len(compared) < len(report.rows) else "")
        + ".",
        "",
    ]
    dist_rows = []
    for name, d in dist.items():
        if d["rows"]:
            dist_rows.append([name.replace("_", " "), d["rows"], f"{d['median']:.2%}", f"{d['p90']:.2%}",
                              f"{d['worst']:+.2%} ({d['worst_row']})"])
    if dist_rows:
        lines += [tabulate(dist_rows, headers=["error (absolute) of", "rows", "median", "90th percentile", "worst"], tablefmt="github"), ""]
    lines += [
        "## Definitions",
        "",
        ("- **measured peak**: the highest phase peak of steps 2 and later (the steady state, once the "
        "optimizer states exist), the largest over ranks; **first-step error** compares the highest "
        "peak of set-up and step 1 (largest over ranks) with the estimate's first step."),
        "- **error** = estimate / measured - 1 (positive: the estimate is too high).",
        ("- **categories** (params ... temporaries): the estimate's categories at its steady peak against "
        "the measured categories at the measured steady peak of the rank with the highest peak. A "
        f"category misses when |estimate - measured| exceeds both {CATEGORY_TOLERANCE:.0%} of the measured "
        f"bytes and a floor of {CATEGORY_FLOOR_BYTES // 1024} KiB or {CATEGORY_FLOOR_FRACTION:.0%} of the "
        "measured peak, whichever is larger; `·` means both sides are below that floor. Misses are in bold."),
        ("- offloaded bytes: on a CPU run host and device are one memory, so an offload row's measured "
        "total includes the offloaded states; every row is estimated with `device=cpu`, which tells the "
        "estimator to count them in the same total."),
        "",
        "## Rows",
        "",
        tabulate(table_rows(report), headers=TABLE_HEADERS, tablefmt="github", disable_numparse=True),
        "",
    ]
    if gpu:
        lines += ["## GPU allocator counters", ""]
        gpu_rows = [[r.row.id, _mib(r.comparison.estimated_steady_bytes), _mib(r.comparison.device["allocated_peak_bytes"]),
                     _pct(r.comparison.device["allocated_error"]), _mib(r.comparison.device["reserved_peak_bytes"]),
                     _pct(r.comparison.device["reserved_error"])]
                    for r in compared if r.comparison.device]
        lines += [tabulate(gpu_rows, headers=["row", "est. tensor MiB", "max_memory_allocated MiB", "error",
                                              "max_memory_reserved MiB", "error"], tablefmt="github", disable_numparse=True), ""]
    misses = [r for r in report.rows if r.status in ("miss", "failed")]
    lines += ["## Rows that miss the targets", ""]
    if misses:
        miss_rows = [[r.row.id, "; ".join(r.comparison.misses) if r.comparison else "failed: " + r.record["failure"],
                      r.reason or "(not yet explained)"] for r in misses]
        lines += [tabulate(miss_rows, headers=["row", "misses", "reason"], tablefmt="github", disable_numparse=True), ""]
    else:
        lines += ["None.", ""]
    lines += ["Reasons come from `docs/accuracy_reasons.toml` (`\"row id or glob\" = \"reason\"`).", ""]
    stale = [r.row.id for r in report.rows if r.stale]
    if stale:
        lines += [f"Stale (measured with other specs than the row's current ones; re-run them): {', '.join(stale)}.", ""]
    lines += [GRID_TEXT, GPU_TEXT]
    return "\n".join(lines)


def _measured_span(report: Report) -> str:
    """When and from which commits the cached measurements come (rows are re-measured piecemeal)."""
    records = [r.record for r in report.rows if r.record and "measurement" in r.record]
    if not records:
        return "nothing yet"
    times = sorted(r.get("measured_at", "") for r in records)
    sources = sorted({r.get("source") or "unknown" for r in records})
    return f"between {times[0]} and {times[-1]}, from commit{'s' if len(sources) > 1 else ''} {', '.join(sources)}"


GRID_TEXT = """## Grid

A covering design, not the cross product. Each engine set-up runs on 2 gloo ranks with the
tiny models (tiny-llama: Llama-like, grouped-query attention, untied embeddings; tiny-gpt2:
GPT-2-like, tied embeddings):
- main set-ups (torch 0 and 1, fsdp2 2 and 3, deepspeed 1, 2 and 3 with DeepSpeed's default
  buckets): four rows each, an L4 orthogonal array over precision (fp32, bf16 mixed),
  checkpointing (none, full) and micro-batch x sequence (2x128, 4x256), so every pair of levels
  of those factors occurs, with the models alternating;
- variants (fsdp2 2 and 3 with CPU offload; deepspeed 1, 2 and 3 with small buckets
  (`reduce_bucket_size` = `allgather_bucket_size` = `stage3_prefetch_bucket_size` = 1e5,
  `stage3_param_persistence_threshold` 0); deepspeed 2 and 3 with optimizer offload to CPU and
  small buckets): two rows each (fp32 without checkpointing at 2x128, bf16 with it at 2x128);
- llama-100m (~100M parameters): one row per main set-up at 2x128;
- llama-1b (~1.1B parameters) with FSDP2 stages 2 and 3 on 8 and 64 simulated ranks (fake backend);
- attention and selective checkpointing: twelve rows with selective checkpointing (the attention
  core recomputed) or eager attention (`/eager` in the id; every other row runs fused SDPA):
  fused and eager, with and without autocast (the torch engine's bf16), on both models, six of
  them at 1x1024 or 4x256 tokens, where eager attention's backward is a block's peak;
- the CI slice (`--quick`, tests/test_accuracy_slice.py): the first row of torch 0, torch 1, fsdp2 2,
  fsdp2 3 and deepspeed 2 with small buckets, tiny-llama fsdp2 3 on 8 simulated ranks, and
  tiny-llama fsdp2 2 with selective checkpointing of eager attention at 1x1024.

Rows marked `+offload` with deepspeed need DeepSpeed's `cpu_adam` JIT build (about a minute and
2 GB of RAM the first time); `--skip-deepspeed-offload` leaves them out.
"""

GPU_TEXT = """## On GPUs

`zeroplan validate --backend nccl` runs the same grid with one process per GPU (2 GPUs for the
2-rank rows; simulated rows still run the fake backend) and `device=cuda` in the training spec.
It writes `docs/accuracy_gpu.md` and `docs/accuracy_gpu.json` unless told otherwise, and adds a
table comparing the estimate's tensor bytes (its peak without the CUDA-context overhead) with the
allocator's `max_memory_allocated` and `max_memory_reserved` (the CUDA probe's
`allocated_peak_bytes` and `reserved_peak_bytes`, largest over steady-state phases and ranks).
The main table still compares against the exact tensor accounting, which also runs on GPUs.
"""


def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON: settings, distributions, and per row its config, record (the cache) and comparison."""
    rows = []
    for r in report.rows:
        entry: dict[str, Any] = {"id": r.row.id, "status": r.status, "reason": r.reason,
                                 "config": {"model": r.row.model, "world": r.row.world, "simulate": r.row.simulate,
                                            "quick": r.row.quick, "training": r.row.training_fields(report.backend)}}
        c = r.comparison
        if c is not None:
            entry["comparison"] = {
                "estimated_steady_bytes": c.estimated_steady_bytes, "measured_steady_bytes": c.measured_steady_bytes,
                "steady_error": c.steady_error,
                "estimated_first_bytes": c.estimated_first_bytes, "measured_first_bytes": c.measured_first_bytes,
                "first_error": c.first_error,
                "estimated_steady_phase": c.estimated_steady_phase, "measured_steady_phase": c.measured_steady_phase,
                "max_rank": c.max_rank,
                "categories": {name: {"estimated_bytes": k.estimated_bytes, "measured_bytes": k.measured_bytes,
                                      "error": k.error, "ok": k.ok} for name, k in c.categories.items()},
                "misses": c.misses,
                "device": c.device,
            }
        if r.stale:
            entry["stale"] = True
        if r.record is not None:
            entry["record"] = r.record
        rows.append(entry)
    return {
        "generated": report.generated, "backend": report.backend, "command": report.command, "steps": report.steps,
        "wall_seconds": report.wall_seconds,
        "tolerances": {"steady": STEADY_TOLERANCE, "first_step": FIRST_TOLERANCE, "category": CATEGORY_TOLERANCE,
                       "category_floor_bytes": CATEGORY_FLOOR_BYTES, "category_floor_fraction": CATEGORY_FLOOR_FRACTION},
        "distributions": report.distributions(),
        "rows": rows,
    }


def write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(report: Report, markdown_path: Path | None, json_path: Path | None) -> None:
    if json_path is not None:
        write_atomic(json_path, json.dumps(report_json(report), indent=1) + "\n")
    if markdown_path is not None:
        write_atomic(markdown_path, render_markdown(report))


def update_report(
    grid: Sequence[Row], new_records: dict[str, dict[str, Any]], reasons: dict[str, str], *, backend: str, steps: int,
    command: str, markdown_path: Path, json_path: Path, wall_seconds: float | None = None,
) -> Report:
    """Merge `new_records` into the cache on disk and rewrite both reports, under a lock file, so
    that two `zeroplan validate` runs sharing the JSON (say one re-measuring a few rows while the
    whole grid runs) keep each other's measurements."""
    import fcntl

    lock_path = Path(json_path).with_name(f".{Path(json_path).name}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = load_records(json_path) | new_records
        if wall_seconds is None and Path(json_path).exists():  # a partial run keeps the last whole run's time
            wall_seconds = json.loads(Path(json_path).read_text()).get("wall_seconds")
        report = build_report(grid, records, reasons, backend=backend, steps=steps, command=command, wall_seconds=wall_seconds)
        write_report(report, markdown_path, json_path)
    return report


def default_outputs(backend: str) -> tuple[Path, Path]:
    """docs/accuracy.{md,json} for CPU runs, docs/accuracy_gpu.{md,json} for nccl."""
    stem = "accuracy_gpu" if backend == "nccl" else "accuracy"
    return Path("docs") / f"{stem}.md", Path("docs") / f"{stem}.json"


def row_line(r: RowReport) -> str:
    """One line of progress output for a finished row."""
    if r.comparison is None:
        return f"{r.row.id}: {r.status}" + (f" ({r.record['failure']})" if r.record and "failure" in r.record else "")
    c = r.comparison
    misses = "; ".join(c.misses) or "within targets"
    return (f"{r.row.id}: est {_mib(c.estimated_steady_bytes)} MiB, measured {_mib(c.measured_steady_bytes)} MiB, "
            f"error {c.steady_error:+.2%}, first step {c.first_error:+.2%} -- {misses}")
