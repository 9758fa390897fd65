"""Launch a local measurement: spawn one worker per rank, collect their results, leave nothing running.

- gloo: `nproc` CPU worker processes joined through a file store (`init_method=file://`, no
  listening socket) on the loopback interface;
- nccl: one process per visible GPU, joined through env:// on 127.0.0.1 and a free port;
- fake (`simulate=True`): one process simulating `nproc` ranks (FakeTensorMode + fake process
  group), for worlds and models larger than the machine.
Each worker is forked from a server that has imported torch once (`worker_server`: a fresh
Python's start is mostly that import) and runs in its own session; stopping it kills that whole
session, so whatever it started (compilers, DeepSpeed's helpers) ends with it
(`processes.kill_sessions`). A DeepSpeed run first builds the C++ ops it needs that are not
built yet, in one process, saying so, before the workers and their timeout start
(`deepspeed_build`). Any rank that fails ends the run at once with an error naming the rank; a
timeout or Ctrl-C kills every worker (and a build); a rank that runs out of device memory makes
the result "does not fit" with the peak it reached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from zeroplan.errors import MeasureError
from zeroplan.measure import deepspeed_build, host_memory, stacks
from zeroplan.measure.processes import (
    child_env,
    exit_status,
    kill_sessions,
    last_line,
    remove_dead_run_folders,
    run_folder,
    spawn,
)
from zeroplan.measure.worker_server import Worker
from zeroplan.measure.worker_server import start as start_worker
from zeroplan.measure.mesh_rules import refuse_unmeasurable
from zeroplan.measure.fsdp1_rules import refuse_unmeasurable_fsdp1
from zeroplan.measure.quant_rules import refuse_unmeasurable_quant
from zeroplan.measure.result import MeasureResult, RankResult
from zeroplan.spec.model import ModelSpec, TransformerSpec
from zeroplan.spec.training import Device, TrainingSpec

POLL_S = 0.05
DEFAULT_RECIPE = "plain"  # measure runs zeroplan's own loop unless --recipe names a program it runs
# hf-trainer: transformers.Trainer itself (programs/hf_trainer.py); torchtitan, torchtune: their
# flow reproduced in zeroplan's loop (programs/reproduction.py, docs/measure.md says why)
RUNNABLE_RECIPES = ("plain", "hf-trainer", "torchtitan", "torchtune")
MAX_SIMULATED_RANKS = 16_384
"""The largest world --simulate stands for: the largest published training world (Llama 3 405B on
16,384 H100s: "The Llama 3 Herd of Models", 2024, section 3.3). Its time grows with the world, since
FSDP2 cuts every parameter into one shard per rank: tiny-llama took 7 s at 64 ranks, 12 s at 1,024 and
52 s at 8,192, llama-1b (seq 512) 13 s at 64 and 58 s at 1,024, on 2 cores (docs/measure.md, "Simulating
large worlds")."""
MAX_LOCAL_RANKS = 64
"""The most gloo ranks one machine runs: one process per rank, each with torch and its own copy of the
model's state, all connected pairwise (gloo's full mesh); 32 ranks of tiny-llama took 16 s on 2 cores.
A larger world is what --simulate is for."""
MAX_STEPS = 1_000
"""The most training steps a run takes: step 1 is the first step and steps 2 on the steady state, which repeats."""


def choose_backend(requested: str | None, simulate: bool = False) -> str:
    """The process-group backend of a run: fake when simulated, else the one requested, else nccl
    where CUDA GPUs are visible and gloo otherwise."""
    if simulate:
        if requested not in (None, "fake"):
            raise MeasureError(f"backend: --simulate runs the fake backend, not {requested}")
        return "fake"
    if requested is None:
        from zeroplan.measure.context import default_backend

        return default_backend()
    return requested


def measured_device(backend: str) -> Device:
    """The memory a run measures: the GPUs' under nccl, the host's under gloo and fake."""
    return Device.CUDA if backend == "nccl" else Device.CPU


def write_job(path: Path, model: TransformerSpec, training: TrainingSpec, **fields) -> None:
    """The job file a worker reads: both specs as JSON plus `fields` (backend, steps, init_method, ...)."""
    job = {"model": model.model_dump(mode="json"), "training": training.model_dump(mode="json"), **fields}
    path.write_text(json.dumps(job))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, local_rank: int, world_size: int, nproc: int, backend: str) -> dict[str, str]:
    env = child_env(backend)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(nproc))
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "lo"
        # one intra-op thread per worker unless asked otherwise: nproc workers share the cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


class Progress(Protocol):
    """What a run reports while it runs (`zeroplan measure` draws it on a terminal: cli/progress.py)."""

    def build(self, label: str, seconds: float) -> None:
        """A DeepSpeed op is being built: its label and the seconds so far (every half second)."""

    def ranks(self, phases: dict[int, tuple[int, str]]) -> None:
        """Each rank's (step, phase) as it opens a phase; step 0 is the set-up (model, engine)."""


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _announce(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_measurement(
    model: ModelSpec,
    training: TrainingSpec,
    *,
    nproc: int,
    backend: str | None = None,
    simulate: bool = False,
    steps: int = 2,
    timeout_s: float = 600.0,
    implementation: str = "auto",
    engine_config: dict | None = None,
    announce: Callable[[str], None] = _announce,
    fork_workers: bool | None = None,
    progress: Progress | None = None,
    check_memory: bool = True,
    snapshot: str | None = None,
    notes: Sequence[str] = (),
) -> MeasureResult:
    """Run `steps` training steps of `model` under `training` on `nproc` local ranks and return
    what every rank measured. `backend` None picks nccl where GPUs are visible, else gloo;
    `simulate` runs one fake-backend process standing for `nproc` ranks. `announce` is told of a
    DeepSpeed op build before it starts (default: a line on stderr); the build is not part of
    `timeout_s`. `fork_workers`: fork the workers from the worker server (None: on gloo and fake;
    nccl workers start as fresh processes, see `_start_worker`). `progress` is told of a build's
    seconds and of each rank's phases (the ranks write them to a file the launcher polls). `check_memory`:
    refuse a run whose estimated host bytes exceed what this machine has available (measure/host_memory.py).
    `snapshot`: a path with "{rank}" where each rank writes its stream for PyTorch's memory viewer (run_snapshot.py).
    `notes` (the estimate's, of what it takes as given) are announced once the run is found runnable, before it starts.

    Raises MeasureError when a rank fails (naming it and its exception) or the run times out."""
    backend = check_runnable(model, training, nproc=nproc, backend=backend, simulate=simulate, steps=steps,
                             timeout_s=timeout_s)
    if check_memory:
        check_host_memory(model, training, nproc, backend)
    for note in notes:
        announce(f"note: {note}")
    outcomes = run_ranks(model, training, nproc=nproc, backend=backend, steps=steps, timeout_s=timeout_s,
                         implementation=implementation, engine_config=engine_config, announce=announce,
                         fork_workers=fork_workers, progress=progress, snapshot=snapshot)
    return assemble_result(outcomes, model, training, backend, nproc, steps)


def check_runnable(model: ModelSpec, training: TrainingSpec, *, nproc: int, backend: str | None, simulate: bool,
                   steps: int, timeout_s: float) -> str:
    """Raise MeasureError for a run that cannot be measured, before anything starts; return its backend.
    `nproc` is the ranks of this machine."""
    if not isinstance(model, TransformerSpec):
        raise MeasureError(f"model: {model.name} is known by its parameter count only; measure needs a transformer spec")
    if training.recipe.value not in RUNNABLE_RECIPES:
        raise MeasureError(f"recipe: measure runs {', '.join(RUNNABLE_RECIPES)} so far, not {training.recipe.value}")
    program = training.program
    if program.recipe.value == "torchtitan" and program.loss.value == "chunked" and program.ddp:
        # each chunk's backward runs inside the forward, before DDP's reducer expects any gradient
        raise MeasureError("ddp: torchtitan's chunked loss runs each chunk's backward inside the forward, which "
                           "measure's DDP runner does not reproduce; measure engine fsdp2, one rank without ddp, "
                           "or --loss standard")
    program = training.program
    if (training.engine.value == "fsdp2" and program.recipe.value == "torchtitan" and program.loss.value == "chunked"
            and training.fsdp2_wrapping.units.value == "split"):
        # torchtitan's ChunkedLossWrapper runs lm_head's backward inside the forward; with [norm, lm_head]
        # an FSDP2 unit of its own the gloo workers of torch 2.13 crash (SIGSEGV) in it (docs/measure.md)
        raise MeasureError("fsdp2.units: measure runs torchtitan's chunked loss with the head in the root unit only "
                           "(fsdp2 units root); the estimate of units split is not measured on CPU")
    refuse_unmeasurable(model, training, simulate)  # a mesh run measure/engines/mesh.py cannot run
    refuse_unmeasurable_quant(training, simulate)  # a bitsandbytes base that could not be quantized
    if model.attention_softcap and training.attention.value == "fused":
        # transformers 5.23.0 Gemma2PreTrainedModel._supports_sdpa is False (docs/measure.md)
        raise MeasureError("attention: SDPA cannot soft-cap attention logits (transformers refuses it for "
                           f"{model.model_type}); measure --attention eager")
    if training.engine.value == "paper":  # refused here, before any worker starts
        raise MeasureError("engine: paper is the ZeRO paper's accounting, not a program to run; measure torch, fsdp2 or deepspeed")
    if nproc < 1:
        raise MeasureError(f"nproc: must be at least 1, got {nproc}")
    if simulate and nproc > MAX_SIMULATED_RANKS:
        raise MeasureError(f"nproc: --simulate stands for at most {MAX_SIMULATED_RANKS:,} ranks (the largest published "
                           f"training world), got {nproc:,}; its time grows with the world (llama-1b: 13 s at 64 ranks, "
                           "58 s at 1,024 on 2 cores), so give a large world a longer --timeout")
    if not 1 <= steps <= MAX_STEPS:
        raise MeasureError(f"steps: must be 1 to {MAX_STEPS:,} (the steady state repeats from step 2), got {steps:,}")
    if not 0 < timeout_s < float("inf"):  # nan fails both comparisons: it would switch the timeout off
        raise MeasureError(f"timeout: must be positive, got {timeout_s:g} s")
    backend = choose_backend(backend, simulate)
    if backend not in ("gloo", "nccl", "fake"):
        raise MeasureError(f"backend: {backend!r} is not one of gloo, nccl, fake")
    if backend == "gloo" and nproc > MAX_LOCAL_RANKS:  # nccl: one per visible GPU, checked below
        raise MeasureError(f"nproc: a gloo run starts one process per rank on this machine, {MAX_LOCAL_RANKS} at most; "
                           f"measure a larger world with --simulate (engine fsdp2), got {nproc:,}")
    if backend == "nccl":
        from zeroplan.measure.context import visible_cuda_devices

        if nproc > (visible := visible_cuda_devices()):
            raise MeasureError(f"nproc: {nproc} ranks need {nproc} GPUs, {visible} are visible")
    refuse_unmeasurable_fsdp1(training, on_gpu=backend == "nccl")  # CPU offload, the Trainer's sync_module_states
    if backend == "fake" and training.engine.value != "fsdp2":
        raise MeasureError(f"engine: --simulate runs fsdp2 only (the fake backend needs fake tensors), not {training.engine.value}")
    return backend


def check_host_memory(model: ModelSpec, training: TrainingSpec, nproc: int, backend: str) -> None:
    """Before any worker starts (the kernel's OOM killer tells nobody why): refuse a run of `nproc` local ranks
    whose estimated host bytes exceed what this machine has available (measure/host_memory.py)."""
    host_memory.check_fits(host_memory.run_need(model, training, nproc, backend), host_memory.available())


@dataclass(frozen=True)
class NodeRanks:
    """The ranks this machine runs of a world across nodes (measure/nodes.py): global ranks from
    `first`, the process group's rendezvous in `env`, and `watch`, called at every poll, which raises
    to stop the run (another node failed)."""

    first: int
    world_size: int
    env: dict[str, str]
    watch: Callable[[], None]


def run_ranks(
    model: TransformerSpec, training: TrainingSpec, *, nproc: int, backend: str, steps: int, timeout_s: float,
    implementation: str, engine_config: dict | None, announce: Callable[[str], None] = _announce,
    fork_workers: bool | None = None, progress: Progress | None = None, node: NodeRanks | None = None,
    snapshot: str | None = None,
) -> list[dict]:
    """Start this machine's workers, wait for them, leave nothing running; return their outcomes (the
    workers' `ok` objects; only those that ran out of memory when one did). Without `node`, the
    ranks are 0 .. nproc-1 of a local world joined through a file store (gloo) or 127.0.0.1 (nccl)."""
    processes = 1 if backend == "fake" else nproc
    first, world_size = (node.first, node.world_size) if node is not None else (0, nproc)
    ranks = list(range(first, first + processes))
    remove_dead_run_folders()  # what runs killed outright left in the temporary directory
    workdir = run_folder("measure")
    procs: list[Worker | subprocess.Popen] = []
    ops: tuple[str, ...] = ()  # DeepSpeed's JIT ops this run may build
    # SIGTERM ends the launcher like Ctrl-C: through the `finally` that kills the workers.
    main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _terminate_as_interrupt) if main_thread else None
    try:
        job_path = workdir / "job.json"
        init_method = (workdir / "store").as_uri() if backend == "gloo" and node is None else None
        extra = {"progress": str(workdir / "rank{rank}.phase")} if progress is not None else {}
        if snapshot is not None:
            extra["snapshot"] = snapshot
        write_job(
            job_path, model, training, backend=backend, steps=steps, world_size=world_size,
            init_method=init_method, implementation=implementation, engine_config=engine_config, **extra,
        )
        if training.engine.value == "deepspeed":
            ops = deepspeed_build.ops_for(training, engine_config, cuda=backend == "nccl")
            deepspeed_build.build_ahead(ops, env=child_env(backend), announce=announce,
                                        progress=progress.build if progress is not None else None)
        port = str(_free_port()) if backend == "nccl" and node is None else None
        fork = backend != "nccl" if fork_workers is None else fork_workers
        for rank in ranks:
            env = _worker_env(rank, rank - first, world_size, processes, backend)
            if port:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            if node is not None:
                env.update(node.env)
            argv = ["--job", str(job_path), "--output", str(workdir / f"rank{rank}.json")]
            procs.append(_start_worker(argv, env, workdir / f"rank{rank}.log", fork))
        return _wait(procs, workdir, timeout_s, steps, progress, ranks, node.watch if node is not None else None)
    finally:
        kill_sessions(procs)
        deepspeed_build.remove_stale_locks(ops)  # the lock of a build the workers started
        shutil.rmtree(workdir, ignore_errors=True)
        if main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _start_worker(argv: list[str], env: dict[str, str], log: Path, fork: bool) -> Worker | subprocess.Popen:
    """One worker: forked from the worker server, or a fresh `python -m zeroplan.measure.worker`.

    A GPU run starts fresh processes: CUDA cannot be used in a child forked from a process that
    has initialised the driver, and whether importing torch on a CUDA build (torch.cuda's
    availability check through the CUDA runtime, unless PYTORCH_NVML_BASED_CUDA_CHECK=1) does so
    was never tried here (no GPU); the import is a small price beside a GPU run. Both start the
    same worker program, and a CPU run measures the same bytes either way
    (tests/measure/test_distributed.py)."""
    if fork:
        return start_worker(argv, env=env, log=log)
    with open(log, "wb") as out:
        return spawn([sys.executable, "-m", "zeroplan.measure.worker", *argv], env=env, stdout=out)


def _wait(procs: list[Worker | subprocess.Popen], workdir: Path, timeout_s: float, steps: int,
          progress: Progress | None = None, ranks: list[int] | None = None,
          watch: Callable[[], None] | None = None) -> list[dict]:
    """Wait for every worker (procs[i] runs rank ranks[i]); the first failure or out-of-memory ends the run."""
    ranks = list(range(len(procs))) if ranks is None else ranks
    deadline = time.monotonic() + timeout_s
    phases: dict[int, tuple[int, str]] = {}
    while True:
        if progress is not None:
            phases = _report_phases(workdir, ranks, phases, progress)
        codes = [exit_status(proc) for proc in procs]
        if any(code not in (None, 0) for code in codes):
            _raise_first_failure(codes, workdir, ranks, [proc.pid for proc in procs])
            return [o for o in (_read(workdir / f"rank{r}.json") for r in ranks) if _out_of_memory(o)]
        if all(code == 0 for code in codes):
            if progress is not None:  # the phases the ranks wrote since the last look
                _report_phases(workdir, ranks, phases, progress)
            outcomes = [_read(workdir / f"rank{rank}.json") for rank in ranks]
            missing = [rank for rank, outcome in zip(ranks, outcomes) if outcome is None]
            if missing:
                raise MeasureError(f"rank {missing[0]} exited without writing its result")
            return outcomes
        if watch is not None:
            watch()
        if time.monotonic() > deadline:
            _raise_timeout(procs, codes, workdir, timeout_s, steps, ranks)
        time.sleep(POLL_S)


def _report_phases(workdir: Path, ranks: list[int], shown: dict[int, tuple[int, str]], progress: Progress) -> dict:
    """Read the ranks' phase files; tell `progress` when one has moved on."""
    phases = dict(shown)
    for rank in ranks:
        written = _read(workdir / f"rank{rank}.phase")
        if written is not None:
            phases[rank] = (written["step"], written["phase"])
    if phases != shown:
        progress.ranks(phases)
    return phases


def _raise_timeout(procs: list[Worker | subprocess.Popen], codes: list[int | None], workdir: Path, timeout_s: float,
                   steps: int, ranks: list[int]) -> None:
    """Raise the timeout, naming the call each running rank is stuck in (its stack, measure/stacks.py)."""
    stuck = [index for index, code in enumerate(codes) if code is None]
    running = [ranks[index] for index in stuck]
    dumps = stacks.request([procs[index].pid for index in stuck], [workdir / f"rank{rank}.log" for rank in running])
    where = [f"rank {running[index]} in {frame}" for index, dump in sorted(dumps.items())
             if (frame := stacks.innermost_frame(dump))]
    error = MeasureError(
        f"timed out after {timeout_s:g} s ({steps} steps); stopped ranks {', '.join(map(str, running))}"
        + (f" ({'; '.join(where)})" if where else "")
    )
    error.worker_traceback = "\n".join(f"rank {running[index]}:\n{dump}" for index, dump in sorted(dumps.items()))
    raise error


def _out_of_memory(outcome: dict | None) -> bool:
    return outcome is not None and outcome.get("ok") and not outcome["result"]["fits"]


def _raise_first_failure(codes: list[int | None], workdir: Path, ranks: list[int], pids: list[int]) -> None:
    """Raise for the rank that failed first, unless a rank ran out of memory (a result).

    When one rank dies its peers fail too ("connection closed" in their next collective): the
    root cause is a rank killed by a signal (the kernel's OOM killer: it writes nothing, and its
    peers then write "Connection reset by peer"), else the failure written first, or the
    out-of-memory that stopped a rank."""
    # every rank's file: a rank writes its failure before it exits (atomically, so a file is whole)
    outcomes = {rank: _read(workdir / f"rank{rank}.json") for rank in ranks}
    if any(_out_of_memory(o) for o in outcomes.values()):
        return
    killed = [(rank, code, pid) for rank, code, pid in zip(ranks, codes, pids)
              if code is not None and code < 0 and outcomes[rank] is None]
    if killed:
        rank, code, pid = killed[0]
        raise MeasureError(host_memory.killed_message(rank, code, pid, last_line(workdir / f"rank{rank}.log")))
    written = [(o.get("time", 0.0), rank, o) for rank, o in outcomes.items() if o is not None and not o.get("ok")]
    if written:
        _, rank, outcome = min(written)
        error = MeasureError(f"rank {rank} failed: {outcome['error']}")
        error.worker_traceback = outcome.get("traceback", "")  # kept by validate (failure_detail)
        error.failed_at = outcome.get("time")  # across nodes, the first failure is the cause (measure/nodes.py)
        raise error
    index = min(index for index, code in enumerate(codes) if code not in (None, 0))
    detail = last_line(workdir / f"rank{ranks[index]}.log") or "no output"
    raise MeasureError(f"rank {ranks[index]} exited with status {codes[index]}: {detail}")


def load_outputs(paths: list[Path]) -> list[dict]:
    """The worker outputs of a torchrun launch (one file per rank): raises MeasureError for a
    missing file or a rank that failed, like a local run."""
    outcomes = []
    for path in paths:
        outcome = _read(Path(path))
        if outcome is None:
            raise MeasureError(f"output: {path} is missing or not a worker result")
        if not outcome.get("ok"):
            raise MeasureError(f"rank {outcome.get('rank')} failed: {outcome.get('error')}")
        outcomes.append(outcome)
    return outcomes


def assemble_result(
    outcomes: list[dict], model: TransformerSpec, training: TrainingSpec, backend: str, nproc: int, steps: int
) -> MeasureResult:
    """One MeasureResult from the workers' `ok` outputs."""
    ranks = sorted((RankResult.from_json_dict(o["result"]) for o in outcomes), key=lambda r: r.rank)
    notes = list(outcomes[0].get("notes", []))
    for rank in ranks:
        if not rank.fits:
            notes.append(f"rank {rank.rank} ran out of device memory ({rank.oom_message}); the other ranks were stopped")
    offload = "cpu" in (training.offload_optimizer.value, training.offload_params.value)
    if offload and backend != "nccl":
        notes.append("CPU offload on a CPU run: host and device are one memory, offloaded bytes are in the same totals")
    return MeasureResult(
        backend=backend,
        engine=training.engine.value,
        zero_stage=training.zero_stage,
        world_size=nproc,
        implementation=outcomes[0].get("implementation", "unknown"),
        model=model.name,
        ranks=ranks,
        steps=steps,
        device="cuda" if backend == "nccl" else "cpu",
        notes=notes,
    )
