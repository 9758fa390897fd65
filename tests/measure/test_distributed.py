"""Real distributed steps: 2 gloo ranks on CPU (and the fake backend for 2, 8 and 64 ranks).

The assertions are physics that a wrong engine set-up or a wrong accounting breaks: ZeRO-1
halves the optimizer states of each rank, ZeRO-3 halves the parameters, FSDP2 stage 2 keeps the
gathered parameters after forward, a simulated run matches a real one, and every phase's
categories add up to its peak. Each run is 2 steps of tiny-llama or tiny-gpt2 (a few MB), made
once per module and shared by the tests that read it.
"""

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zeroplan.estimate.model.layout import param_layout  # noqa: E402
from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.errors import MeasureError  # noqa: E402
from zeroplan.measure import launcher, worker_server  # noqa: E402
from zeroplan.measure.worker import FAULT_ENV  # noqa: E402
from zeroplan.measure.processes import remove_dead_run_folders  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402
from tests.worker_processes import SPAWNED, alive, workers_recorded  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120  # per run; a healthy run of these takes a few seconds
MIB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _record_workers():
    with workers_recorded(launcher):
        yield


def _training(engine: str, stage: int, **fields) -> TrainingSpec:
    # recipe plain: zeroplan's own loop, which these tests measure (the default recipe runs the Trainer)
    defaults = dict(precision="fp32", micro_batch=2, seq_len=64, device="cpu", gpus=2, recipe="plain")
    return TrainingSpec(engine=engine, zero_stage=stage, **(defaults | fields))


def _run(model: str, engine: str, stage: int, nproc: int = 2, simulate: bool = False, implementation: str = "reference", **fields):
    # every argument spelled out: lru_cache tells _run(m, e, s) from _run(m, e, s, implementation="reference")
    return _measured(model, engine, stage, nproc, simulate, implementation, tuple(sorted(fields.items())))


@functools.lru_cache(maxsize=None)
def _measured(model: str, engine: str, stage: int, nproc: int, simulate: bool, implementation: str, fields: tuple):
    training = _training(engine, stage, **(dict(fields) | {"gpus": nproc}))
    return launcher.run_measurement(
        resolve_model(model), training, nproc=nproc, simulate=simulate, steps=2, timeout_s=TIMEOUT_S,
        implementation=implementation,
    )


def _category(result, category: str, rank: int = 0, step: int = 2, phase: str = "optimizer_step") -> int:
    """A category live at the end of a phase is in its peak too: read it at the peak of the phase."""
    (found,) = [p for p in result.ranks[rank].phases if p.step == step and p.phase == phase]
    return found.categories[category]


def _param_bytes(model: str) -> int:
    return param_layout(resolve_model(model)).total_params * 4


CONFIGS = [
    ("tiny-llama", "torch", 0, {}),
    ("tiny-llama", "torch", 1, {}),
    ("tiny-llama", "fsdp2", 2, {}),
    ("tiny-llama", "fsdp2", 3, {}),
    ("tiny-llama", "fsdp2", 3, {"offload_optimizer": "cpu", "offload_params": "cpu"}),
    ("tiny-llama", "fsdp2", 3, {"precision": "bf16"}),
    ("tiny-gpt2", "torch", 0, {"grad_accum": 2}),
    ("tiny-llama", "fsdp2", 3, {"implementation": "hf"}),
]


@pytest.mark.parametrize("model,engine,stage,fields", CONFIGS, ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(map(str, v.values())))
def test_every_phase_of_every_rank_adds_up_to_its_peak(model, engine, stage, fields):
    result = _run(model, engine, stage, **fields)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert result.world_size == 2 and result.backend == "gloo" and result.fits
    for rank in result.ranks:
        assert [(p.step, p.phase) for p in rank.phases] == [
            (0, "model"), (0, "engine"),
            (1, "forward"), (1, "backward"), (1, "optimizer_step"),
            (2, "forward"), (2, "backward"), (2, "optimizer_step"),
        ]
        for phase in rank.phases:
            assert sum(phase.categories.values()) == phase.peak_bytes
            assert phase.peak_bytes >= phase.live_bytes
        assert len(rank.step_times_s) == 2
        if engine == "torch":  # DDP wraps a model that is whole on every rank
            assert rank.phases[0].categories["params"] == _param_bytes(model)
        else:  # FSDP2 shards a model built on the meta device: a rank only ever allocates its shards
            assert rank.phases[0].peak_bytes == 0
            assert rank.phases[1].categories["params"] == _param_bytes(model) // 2


def test_zero1_halves_each_ranks_optimizer_states():
    ddp, zero1 = _run("tiny-llama", "torch", 0), _run("tiny-llama", "torch", 1)
    full = _category(ddp, "optimizer_states")
    # AdamW: exp_avg and exp_avg_sq in fp32 (2 x 4 bytes per parameter), a 4-byte step per tensor
    assert full == 2 * _param_bytes("tiny-llama") + 4 * len(param_layout(resolve_model("tiny-llama")).all_tensors)
    shards = [_category(zero1, "optimizer_states", rank) for rank in (0, 1)]
    assert sum(shards) == full  # ZeroRedundancyOptimizer partitions whole tensors, unevenly
    assert all(shard <= 0.6 * full for shard in shards)
    # the parameters and gradients stay whole on every rank
    assert _category(zero1, "params") == _category(ddp, "params") == _param_bytes("tiny-llama")
    assert _category(zero1, "grads") == _param_bytes("tiny-llama")


def test_fsdp2_stage3_halves_each_ranks_parameters_and_gradients():
    ddp, zero3 = _run("tiny-llama", "torch", 0), _run("tiny-llama", "fsdp2", 3)
    full = _param_bytes("tiny-llama")
    for rank in (0, 1):
        # dim-0 shards, padded to a multiple of the world size (here every dim 0 is even)
        assert _category(zero3, "params", rank) == full // 2
        assert _category(zero3, "grads", rank) == full // 2
        assert _category(zero3, "optimizer_states", rank) < 0.55 * _category(ddp, "optimizer_states", rank)
    assert zero3.peak_bytes < ddp.peak_bytes


def test_fsdp2_stage2_keeps_the_gathered_blocks_after_forward():
    zero2, zero3 = _run("tiny-llama", "fsdp2", 2), _run("tiny-llama", "fsdp2", 3)
    layout = param_layout(resolve_model("tiny-llama"))

    def after_forward(result):
        return result.ranks[0].phases[5].live_bytes  # step 2 forward

    # reshard_after_forward=False keeps every block's full parameters from forward to backward
    blocks_bytes = layout.num_blocks * layout.block_params * 4
    assert after_forward(zero2) - after_forward(zero3) >= blocks_bytes


def test_cpu_offload_on_a_cpu_machine_holds_the_same_model_states():
    # Host and device are one memory here: offload moves bytes, it does not remove them.
    plain = _run("tiny-llama", "fsdp2", 3)
    offload = _run("tiny-llama", "fsdp2", 3, offload_optimizer="cpu", offload_params="cpu")
    for category in ("params", "grads", "optimizer_states"):
        assert _category(offload, category) == _category(plain, category)
    assert any("host and device are one memory" in note for note in offload.notes)


def test_bf16_mixed_precision_keeps_fp32_shards_and_smaller_activations():
    fp32 = _run("tiny-llama", "fsdp2", 3)
    bf16 = _run("tiny-llama", "fsdp2", 3, precision="bf16")
    # MixedPrecisionPolicy(param_dtype=bf16): the sharded parameters stay fp32 (the master copy)
    assert _category(bf16, "params") == _category(fp32, "params")
    # activations are computed in bf16; the fp32 logits and loss are kept either way
    assert _category(bf16, "activations", phase="forward") < 0.85 * _category(fp32, "activations", phase="forward")


def test_gradient_accumulation_keeps_the_gradients_between_micro_batches():
    result = _run("tiny-gpt2", "torch", 0, grad_accum=2)
    assert result.implementation == "zeroplan-reference:gpt2/sdpa"
    # DDP under no_sync: the first micro-batch's gradients are live through the second forward
    # (a tied head: the embedding's gradient counts once)
    assert _category(result, "grads", phase="forward") == _param_bytes("tiny-gpt2")
    # without accumulation the step drops them (set_to_none) before the next forward
    assert _category(_run("tiny-llama", "torch", 0), "grads", phase="forward") == 0


def test_hugging_face_model_holds_the_same_model_states_as_the_reference():
    hf, reference = _run("tiny-llama", "fsdp2", 3, implementation="hf"), _run("tiny-llama", "fsdp2", 3)
    assert hf.implementation.startswith("hf-transformers-") and hf.implementation.endswith(":LlamaForCausalLM/sdpa")
    for category in ("params", "grads", "optimizer_states"):
        assert _category(hf, category) == _category(reference, category)
    # the same computation: activations within a tenth (transformers' kernels keep other tensors)
    forward = _category(reference, "activations", phase="forward")
    assert _category(hf, "activations", phase="forward") == pytest.approx(forward, rel=0.1)


@pytest.mark.parametrize("implementation", ["reference", "hf"])
def test_simulated_two_ranks_match_a_real_two_rank_run(implementation):
    # transformers' model too: under fake tensors it computes its attention mask as a real run (fake_hf.py)
    real = _run("tiny-llama", "fsdp2", 3, implementation=implementation)
    fake = _run("tiny-llama", "fsdp2", 3, simulate=True, implementation=implementation)
    assert fake.backend == "fake" and fake.world_size == 2 and len(fake.ranks) == 1
    for step, phase in [(1, "forward"), (2, "forward"), (2, "backward"), (2, "optimizer_step")]:
        (simulated,) = [p for p in fake.ranks[0].phases if (p.step, p.phase) == (step, phase)]
        measured = [p for r in real.ranks for p in r.phases if (p.step, p.phase) == (step, phase)]
        # the same bytes as the real ranks (seen byte for byte), up to when gloo drops a
        # collective's buffer (NOTES: run to run a rank's peak moves by about one gathered group)
        assert min(abs(simulated.peak_bytes - m.peak_bytes) for m in measured) <= MIB
        for category in ("params", "optimizer_states"):
            assert simulated.categories[category] in [m.categories[category] for m in measured]
    assert abs(fake.peak_bytes - real.peak_bytes) <= MIB


@pytest.mark.parametrize("world_size", [8, 64])
def test_simulated_large_worlds_shard_the_model_states(world_size):
    result = _run("tiny-llama", "fsdp2", 3, nproc=world_size, simulate=True)
    assert result.world_size == world_size
    layout = param_layout(resolve_model("tiny-llama"))
    params = _category(result, "params")
    # each tensor's dim 0 is padded up to a multiple of the world size before it is split
    padded = sum(-(-t.rows // world_size) * (t.numel // t.rows) for t in layout.all_tensors)
    assert params == padded * 4
    assert params < 1.2 * _param_bytes("tiny-llama") / world_size or world_size == 64
    for phase in result.ranks[0].phases:
        assert sum(phase.categories.values()) == phase.peak_bytes


# -- faults -----------------------------------------------------------------------------------


def _fault_run(monkeypatch, fault: str, timeout_s: float = TIMEOUT_S):
    monkeypatch.setenv(FAULT_ENV, fault)
    before = len(SPAWNED)
    try:
        return launcher.run_measurement(
            resolve_model("tiny-llama"), _training("torch", 0), nproc=2, steps=2, timeout_s=timeout_s,
            implementation="reference",
        )
    finally:
        spawned = SPAWNED[before:]
        assert len(spawned) == 2
        assert [p.pid for p in spawned if alive(p.pid)] == []


@pytest.fixture(scope="module")
def raised_run(tmp_path_factory):
    """One run whose rank 1 raises, its workers' temporary folder in a folder of its own: the
    error it ended with and what was left in that folder (two tests read them)."""
    folder = tmp_path_factory.mktemp("failed-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(folder))
        with pytest.raises(MeasureError, match=r"^rank 1 failed: ") as raised:
            _fault_run(patch, "raise@1")
    return raised.value, os.listdir(folder)


def test_a_rank_that_raises_ends_the_run_naming_the_rank_and_its_exception(raised_run):
    error, _ = raised_run
    assert re.fullmatch(r"rank 1 failed: RuntimeError: injected fault on rank 1", str(error))


def test_a_timeout_kills_every_worker(monkeypatch):
    # each running rank's innermost frame follows (rank 0 may be importing torch or in its fault, 3 s in)
    with pytest.raises(MeasureError, match=r"^timed out after 3 s \(2 steps\); stopped ranks 0, 1 \(rank 0 in \S+ \(.*\)$"):
        _fault_run(monkeypatch, "hang@0", timeout_s=3)


def test_out_of_memory_is_a_result_that_does_not_fit(monkeypatch):
    result = _fault_run(monkeypatch, "oom@1")
    assert not result.fits
    assert [r.rank for r in result.ranks] == [1]
    rank = result.ranks[0]
    assert rank.oom_message == "OutOfMemoryError: injected out-of-memory on rank 1"
    # the peak reached: the model and the engine were built, the forward pass began
    assert rank.peak_bytes >= 2 * _param_bytes("tiny-llama")  # parameters + DDP buckets
    assert rank.phases[-1].phase == "forward"
    assert any("rank 1 ran out of device memory" in note for note in result.notes)


def test_a_rank_killed_outright_is_said_to_be_killed_perhaps_out_of_memory(monkeypatch):
    """Issue 21: the kernel's OOM killer ended rank 0 and the run said "rank 0 exited with status -9: no output"."""
    with pytest.raises(MeasureError, match=r"^rank 0 was killed \(signal 9\): out of memory\? the kernel"):
        _fault_run(monkeypatch, "killed@0")


def test_ctrl_c_leaves_no_worker_running(monkeypatch):
    class InterruptedClock:  # Ctrl-C arrives while the launcher polls its workers
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(_seconds):
            raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "time", InterruptedClock)
    with pytest.raises(KeyboardInterrupt):
        _fault_run(monkeypatch, "")


def test_a_failed_run_leaves_no_files_behind(raised_run):
    error, left = raised_run
    assert str(error).startswith("rank 1 failed")
    assert left == []


def test_a_worker_sees_only_the_environment_the_launcher_gives_it(monkeypatch):
    # the server imports torch once with the environment of its start; a worker forked from it must
    # run with the launcher's environment of now, as a fresh process would (measure/worker_server.py)
    worker_server.shutdown()
    monkeypatch.setenv(FAULT_ENV, "raise@0")
    worker_server.running_server()  # started with rank 0's fault in its environment
    monkeypatch.delenv(FAULT_ENV)
    try:
        result = _fault_run(monkeypatch, "")
    finally:
        worker_server.shutdown()  # the next run starts a server with this test's environment undone
    assert [rank.rank for rank in result.ranks] == [0, 1] and result.fits


def test_a_forked_worker_measures_what_a_fresh_process_measures():
    # the worker server changes how a worker starts, not what it runs (measure/worker_server.py);
    # GPU runs start fresh processes (launcher._start_worker), so the two must agree byte for byte
    # on the training steps. DDP's steps repeat byte for byte from run to run (12 runs, 6 of each);
    # its construction (step 0) does not, however the workers start: 1 forked and 2 fresh runs of
    # the 12 held more there (what gloo frees on its own thread, freed later)
    forked = _run("tiny-llama", "torch", 0)
    fresh = launcher.run_measurement(resolve_model("tiny-llama"), _training("torch", 0), nproc=2, steps=2,
                                     timeout_s=TIMEOUT_S, implementation="reference", fork_workers=False)
    for one, other in zip(forked.ranks, fresh.ranks, strict=True):
        assert [(p.step, p.phase, p.peak_bytes, p.categories) for p in one.phases if p.step] == \
            [(p.step, p.phase, p.peak_bytes, p.categories) for p in other.phases if p.step]


def test_one_server_serves_every_run_until_an_import_could_read_another_environment(monkeypatch):
    server = worker_server.running_server()
    assert worker_server.running_server() is server
    # variables that change from run to run and no import reads keep it
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    monkeypatch.setenv(FAULT_ENV, "raise@1")
    assert worker_server.running_server() is server
    # any other variable could be read by an import the server made (transformers reads HF_HUB_OFFLINE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    replaced = worker_server.running_server()
    assert replaced is not server and server.proc.poll() is not None  # the old one has ended
    monkeypatch.undo()
    worker_server.shutdown()  # the next run starts one with the environment undone


def test_a_server_that_does_not_start_in_time_is_an_error_not_a_hang(monkeypatch):
    worker_server.shutdown()
    monkeypatch.setattr(worker_server, "START_S", 0.05)  # it imports torch first: seconds
    with pytest.raises(MeasureError, match=r"^the worker server did not say 'ready' within 0.05 s$"):
        worker_server.running_server()
    assert worker_server._server is None  # the next run starts one again


def test_a_killed_server_ends_its_workers_and_the_next_run_starts_another(monkeypatch):
    server = worker_server.running_server()
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    result = _fault_run(monkeypatch, "")  # a new server, a normal run
    assert result.fits and worker_server.running_server() is not server


def test_bad_requests_are_refused_before_any_worker_starts():
    spec, training = resolve_model("tiny-llama"), _training("torch", 0)
    with pytest.raises(MeasureError, match="steps: must be 1 to 1,000 .*, got 0"):
        launcher.run_measurement(spec, training, nproc=2, steps=0)
    with pytest.raises(MeasureError, match="engine: --simulate runs fsdp2 only"):
        launcher.run_measurement(spec, training, nproc=8, simulate=True)
    with pytest.raises(MeasureError, match="backend: 'mpi' is not one of gloo, nccl, fake"):
        launcher.run_measurement(spec, training, nproc=2, backend="mpi")


_LAUNCH_AND_HANG = """
import os, sys
os.environ[{fault_env!r}] = "hang@0"
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure import launcher
from zeroplan.spec.training import TrainingSpec
training = TrainingSpec(engine="torch", zero_stage=0, gpus=2, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                        recipe="plain")
launcher.run_measurement(resolve_model("tiny-llama"), training, nproc=2, steps=1, timeout_s=120, implementation="reference",
                         fork_workers={fork})
"""


def _is_worker(process, launcher_pid: int) -> bool:
    """A worker leads a session of its own; so does the worker server, the launcher's child that forks them."""
    try:
        server = process.ppid() == launcher_pid and "zeroplan.measure.worker_server" in " ".join(process.cmdline())
        return os.getsid(process.pid) == process.pid and not server
    except (ProcessLookupError, OSError):
        return False


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_launcher_leaves_no_worker_running(signum, fork):
    psutil = pytest.importorskip("psutil")
    root = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(root))
    script = _LAUNCH_AND_HANG.format(fault_env=FAULT_ENV, fork=fork)
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        workers, descendants = [], []
        for _ in range(1200):  # the launcher starts two workers (forked by its worker server) within seconds
            descendants = psutil.Process(parent.pid).children(recursive=True)
            workers = [p for p in descendants if _is_worker(p, parent.pid)]
            if len(workers) == 2:
                break
            time.sleep(0.05)
        assert len(workers) == 2
        os.kill(parent.pid, signum)
        parent.wait(timeout=30)
        for _ in range(300):  # SIGKILL reaches the workers through PR_SET_PDEATHSIG (from the launcher or their server)
            if not any(alive(p.pid) for p in descendants):
                break
            time.sleep(0.05)
        # neither a worker nor the server outlives the launcher
        assert [p.pid for p in descendants if alive(p.pid)] == []
    finally:
        parent.kill()
        parent.wait()
    # its run folder: removed by the launcher on SIGTERM; after SIGKILL, by the next run (issue 21)
    left = list(Path(tempfile.gettempdir()).glob(f"zeroplan-measure-{parent.pid}.*"))
    assert len(left) == (1 if signum == signal.SIGKILL else 0)
    remove_dead_run_folders()
    assert not any(folder.exists() for folder in left)
