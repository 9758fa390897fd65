"""One rank of a measurement: `python -m zeroplan.measure.worker --job JOB.json --output OUT.json`.

Started by `zeroplan.measure.launcher` for local runs, or by torchrun on several nodes (it reads
RANK, WORLD_SIZE and LOCAL_RANK from the environment and joins with env://, MASTER_ADDR and
MASTER_PORT; "{rank}" in --output is replaced by the rank). The job file holds the model and
training specs, the backend, the steps and the rendezvous (`zeroplan.measure.launcher.write_job`).

On several nodes `zeroplan measure --nnodes M --node-rank K --rdzv-endpoint HOST:PORT` starts it on
every node (measure/nodes.py). By hand: write the job once with `zeroplan.measure.launcher.write_job(path,
model, training, backend="nccl", steps=K, world_size=N, init_method=None)`, run on every node
  torchrun --nnodes M --nproc-per-node G --rdzv-endpoint HOST:PORT -m zeroplan.measure.worker
      --job job.json --output out/rank{rank}.json
and read the outputs with `launcher.load_outputs` and `launcher.assemble_result`.

The rank builds the model under the accounting, lets the engine wrap it, runs `steps` training
steps and records every phase (result.py); it writes one JSON object to --output, atomically:
  {"ok": true, "result": {...RankResult...}, "implementation": "...", "notes": [...]}
  {"ok": false, "rank": R, "error": "Type: message", "traceback": "..."}
A device out-of-memory error is a result (`fits: false`, with the phases reached), not a failure.

For tests, ZEROPLAN_MEASURE_FAULT="raise@R", "hang@R", "oom@R" or "killed@R" makes rank R raise,
hang, run out of memory, or be killed (SIGKILL, as by the kernel's OOM killer) at its first forward pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback

from zeroplan.measure import stacks
from zeroplan.measure.phases import PhaseRecorder

FAULT_ENV = "ZEROPLAN_MEASURE_FAULT"
EXIT_FAILED = 1
EXIT_OOM = 3


def write_json_atomic(path: str, data: dict) -> None:
    """Write `data` to `path` so that a reader sees the whole file or none: temp file, then rename."""
    from zeroplan.spec.files import write_atomic

    write_atomic(path, json.dumps(data))


def phase_writer(job: dict, rank: int):
    """Where the rank says which phase it is in, for the launcher's progress line: job["progress"] is a
    path with "{rank}" (written whole each time: {"step": S, "phase": P}), or absent (nothing written)."""
    pattern = job.get("progress")
    if not pattern:
        return None
    path = pattern.replace("{rank}", str(rank))

    def write(step: int, phase: str) -> None:
        write_json_atomic(path, {"step": step, "phase": phase})

    return write


def _inject_fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, _, target = spec.partition("@")
    if target and int(target) != rank:
        return
    import torch

    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "hang":
        time.sleep(3600)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank}")
    if kind == "killed":  # as the kernel's OOM killer ends a process: SIGKILL, nothing written
        os.kill(os.getpid(), signal.SIGKILL)


def _implementation(job: dict, training) -> str:
    """The job's model implementation; a mesh run's is the reference model (measure/engines/mesh.py says why)."""
    # expert parallelism runs the transformers MoE model; DeepSpeed's mesh runs the HF model
    from zeroplan.measure.mesh_rules import is_mesh_run

    if is_mesh_run(training) and training.mesh.ep == 1 and training.engine.value != "deepspeed":
        return "reference"
    return job.get("implementation", "auto")


def run_rank(job: dict, rank: int, world_size: int, local_rank: int) -> dict:
    """Run one rank's measurement; return the `ok` JSON object."""
    import torch

    from zeroplan.measure.accounting import TensorAccounting
    from zeroplan.measure.allocations import AllocatorAccounting
    from zeroplan.measure.allocator_replay import replay_summary
    from zeroplan.measure.context import device_for, init_process_group, make_probe
    from zeroplan.measure.engines.common import RunContext, module_buffers
    from zeroplan.measure.engines import build_runner, model_context, model_device
    from zeroplan.measure.programs.reproduction import REPRODUCED, reproduction_name
    from zeroplan.measure.result import RankResult
    from zeroplan.measure.workload import build_workload, make_batch
    from zeroplan.spec.model import TransformerSpec
    from zeroplan.spec.training import TrainingSpec

    spec = TransformerSpec.model_validate(job["model"])
    training = TrainingSpec.model_validate(job["training"])
    backend = job["backend"]
    init_process_group(backend, rank, world_size, job.get("init_method"))
    device = device_for(backend, local_rank)
    ctx = RunContext(rank, world_size, local_rank, device, backend, job.get("engine_config"))
    probe = make_probe(device)
    torch.manual_seed(1234 + rank)
    if training.recipe.value == "hf-trainer":  # the Trainer owns the loop (programs/hf_trainer.py)
        from zeroplan.measure.programs.hf_trainer import run_trainer

        return run_trainer(spec, training, ctx, steps=job["steps"], probe=probe, fault=_inject_fault,
                           on_phase=phase_writer(job, rank))

    held: dict = {}  # what the classifier can see so far: the model, then the runner

    def classify():
        if "peft" in held:  # adapters apart, quantization states as parameters (programs/peft_model.py)
            return held["peft"](engine_classify(), held["model"])
        return engine_classify()

    def engine_classify():
        if "runner" in held:
            return held["runner"].tensors_by_category()
        if "model" in held:
            params = list(held["model"].parameters())
            # under deepspeed.zero.Init a parameter's storage is its partition, `ds_tensor`
            partitions = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
            return {"params": params + partitions, "buffers": module_buffers(held["model"])}
        return {}

    fake_mode = contextlib.nullcontext()
    if backend == "fake":
        from zeroplan.measure.fake_hf import fake_tensor_mode

        fake_mode = fake_tensor_mode()
    step_times: list[float] = []
    fits, oom_message = True, None
    # The accounting is entered inside the fake mode, so it sees the fake tensors it makes. A compiled run is
    # counted from the allocator's records: under a dispatch mode Dynamo runs the eager ops (allocations.py).
    # A GPU rank counts its device's storages only: offloaded shards, gradients and states sit on the host
    # (FSDP1's CPUOffload, FSDP2's CPUOffloadPolicy, DeepSpeed's offload), which the estimate counts per node.
    deferred = bool(training.compile)
    counter = (AllocatorAccounting(device) if deferred
               else TensorAccounting(device_type="cuda" if device.type == "cuda" else None))
    with fake_mode, counter as accounting:
        accounting.set_classifier(classify)
        progress, marks = phase_writer(job, rank), []  # marks: (index of a phase's first event, step, phase)

        def on_phase(step: int, phase: str) -> None:  # where each phase's allocations begin, for --snapshot
            marks.append((len(accounting.events), step, phase))
            if progress is not None:
                progress(step, phase)

        recorder = PhaseRecorder(accounting, probe, on_phase if job.get("snapshot") and not deferred else progress)
        try:
            with recorder.phase(0, "model", default_category="temporaries"):
                with model_context(training, ctx):
                    workload = build_workload(
                        spec, training, model_device(training, ctx), implementation=_implementation(job, training)
                    )
                held["model"], held["model_name"] = workload.model, workload.implementation
                if getattr(training, "lora", None) is not None or getattr(training, "quant", None) is not None:
                    from zeroplan.measure.programs.peft_model import with_peft_categories

                    held["peft"] = with_peft_categories
            with recorder.phase(0, "engine", default_category="temporaries", born_as="buffers"):
                held["runner"] = runner = build_runner(workload.model, training, ctx)
            for step in range(1, job["steps"] + 1):
                started = time.perf_counter()
                for _ in range(training.grad_accum):
                    with recorder.phase(step, "forward", default_category="activations"):
                        _inject_fault(rank)
                        input_ids, labels = make_batch(spec, training, device)
                        loss = runner.forward(input_ids, labels)
                    # Saved activations were born in forward; what backward allocates and the
                    # runner does not name (the logits' gradient, gradients in flight between
                    # layers, activations recomputed by checkpointing) is a temporary.
                    with recorder.phase(step, "backward", default_category="activations", born_as="temporaries"):
                        runner.backward(loss)
                        del loss, input_ids, labels
                with recorder.phase(step, "optimizer_step", default_category="temporaries"):
                    runner.step()
                if device.type == "cuda":  # kernels run asynchronously: the step ends when the GPU is done
                    torch.cuda.synchronize(device)
                step_times.append(time.perf_counter() - started)
        except torch.OutOfMemoryError as error:  # torch.cuda.OutOfMemoryError is one
            recorder.close()
            fits, oom_message = False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        classifications = accounting.classifications
    if deferred:
        recorder.rebuild(accounting.finish())
        replayed = {"replayed": False, "events": 0, "reason": "a compiled run is counted from the allocator's records "
                    "(measure/allocations.py), which keep no stream of the program's allocations to replay"}
    else:
        replayed = replay_summary(accounting.events, truncated=accounting.events_truncated, environ=os.environ)
        if job.get("snapshot"):  # the stream for PyTorch's memory viewer (measure/run_snapshot.py), where it was asked
            write_snapshot_part(job["snapshot"], rank, accounting, marks)
    result = RankResult(rank, list(recorder.phases.values()), step_times, fits, oom_message, classifications, replayed)
    notes = []
    if backend == "fake":
        notes.append(f"simulated: one process under FakeTensorMode stands for rank 0 of {world_size}")
    offload = getattr(held.get("model"), "offload", None)
    if offload is not None:  # measure/activation_offload.py: host copies are kept out of the device counts
        notes.append(f"activation offload: at most {offload.peak_host_bytes:,} bytes of host copies per rank, "
                     "not in the device counts")
    notes.extend(getattr(held.get("runner"), "notes", lambda: [])())  # expert parallelism: its measured imbalance
    implementation = held.get("model_name", "unknown")
    if training.recipe.value in REPRODUCED:  # torchtitan, torchtune: their flow in this loop (programs/reproduction.py)
        implementation = reproduction_name(training, implementation)
    return {"ok": True, "result": result.to_json_dict(), "implementation": implementation, "notes": notes}


def write_snapshot_part(pattern: str, rank: int, accounting, marks) -> None:
    """This rank's snapshot at `pattern` ("{rank}" replaced); nothing where the stream was cut short (event_limit):
    the launcher's assembly says so."""
    if accounting.events_truncated:
        return
    import pickle

    from zeroplan.measure.run_snapshot import rank_snapshot
    from zeroplan.spec.files import write_atomic

    write_atomic(pattern.replace("{rank}", str(rank)), pickle.dumps(rank_snapshot(accounting.events, marks, rank, os.environ)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zeroplan.measure.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job JSON written by zeroplan.measure.launcher.write_job")
    parser.add_argument("--output", required=True, help="where this rank writes its JSON; {rank} is replaced")
    args = parser.parse_args(argv)
    stacks.dump_on_signal()  # a launcher that times out asks where this rank is stuck
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    output = args.output.replace("{rank}", str(rank))
    try:
        with open(args.job) as f:
            job = json.load(f)
        world_size = int(os.environ.get("WORLD_SIZE", job.get("world_size", 1)))
        outcome = run_rank(job, rank, world_size, local_rank)
    except BaseException as error:  # noqa: BLE001 - any failure is reported to the launcher
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        failure = {"ok": False, "rank": rank, "error": message, "traceback": traceback.format_exc(), "time": time.time()}
        write_json_atomic(output, failure)
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # do not wait for peers stuck in a collective
    write_json_atomic(output, outcome | {"time": time.time()})
    sys.stdout.flush()
    if not outcome["result"]["fits"]:
        os._exit(EXIT_OOM)  # peers may wait in a collective this rank will never join
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
