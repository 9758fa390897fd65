"""Host memory before a local run (measure/host_memory.py, issue 21): a run whose estimated host bytes
exceed what this machine has available is refused in one line with the figures before any worker
starts, `--no-memory-check` runs it anyway, and a rank killed outright is said to be killed, perhaps
out of memory, with the kernel's own line where it can be read.

Before: `measure --config <torchtitan 8B TOML>` on a 23 GiB machine started its ranks; the kernel's
OOM killer ended rank 0 after 58 s and the run said "rank 0 exited with status -9: no output"."""

from __future__ import annotations

import importlib.util
import re
import signal

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import MeasureError
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure import host_memory
from zeroplan.measure.host_memory import HostAvailable, HostNeed, check_fits, killed_message, oom_kill_record, run_need
from zeroplan.spec.training import TrainingSpec
from tests import paths

DATA = paths.DATA / "configs"
GIB = 2**30


def _training(**fields) -> TrainingSpec:
    return TrainingSpec(**{"engine": "fsdp2", "zero_stage": 3, "gpus": 2, "precision": "fp32", "seq_len": 64,
                           "device": "cpu", "recipe": "plain", **fields})


def test_a_cpu_run_holds_every_ranks_peak_on_the_host():
    model, training = resolve_model("tiny-llama"), _training()
    peak = estimate_mesh(model, training).worst.estimate.peak_bytes
    assert run_need(model, training, 2, "gloo") == HostNeed(2 * peak, 2, peak)
    assert run_need(model, training, 2, "fake") == HostNeed(0, 2, 0)  # fake tensors hold nothing


def test_a_pipeline_adds_up_its_ranks_each_with_its_own_peak():
    model = resolve_model("tiny-llama")
    training = _training(gpus=4, mesh={"pp": 2}, recipe="torchtitan", loss="standard", grad_accum=2)
    ranks = estimate_mesh(model, training).ranks
    assert len({rank.estimate.peak_bytes for rank in ranks}) == 2  # the two stages differ
    need = run_need(model, training, 4, "gloo")
    assert need.total_bytes == sum(rank.ranks * rank.estimate.peak_bytes for rank in ranks)
    assert need.largest_rank_bytes == max(rank.estimate.peak_bytes for rank in ranks)


def test_a_gpu_run_holds_only_what_it_offloads_on_the_host():
    model = resolve_model("tiny-llama")
    training = _training(engine="deepspeed", zero_stage=2, offload_optimizer="cpu", device="cuda")
    per_node = estimate_mesh(model, training).worst.estimate.per_node.cpu_bytes
    assert per_node > 0
    assert run_need(model, training, 2, "nccl") == HostNeed(per_node, 2, 0)


def test_a_run_that_does_not_fit_is_refused_with_the_figures():
    need = HostNeed(int(146.76 * GIB), 2, int(73.38 * GIB))
    with pytest.raises(MeasureError) as raised:
        check_fits(need, HostAvailable(int(21.5 * GIB), "MemAvailable"))
    assert str(raised.value) == (
        "memory: the estimate puts this run at 146.76 GiB of host memory (2 ranks, up to 73.38 GiB each), and this "
        "machine has 21.50 GiB available (MemAvailable); measure fewer ranks or a smaller batch or model, or pass "
        "--no-memory-check to run it anyway")
    check_fits(need, HostAvailable(200 * GIB, "MemAvailable"))
    check_fits(need, None)  # nothing to compare with: no refusal


def test_what_is_available_is_memavailable_or_what_the_cgroup_leaves(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:        21599028 kB\nMemAvailable:   22222222 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "_cgroup_left", lambda: None)
    assert host_memory.available() == HostAvailable(22222222 * 1024, "MemAvailable")
    monkeypatch.setattr(host_memory, "_cgroup_left", lambda: 4 * GIB)  # a container's limit, below MemAvailable
    assert host_memory.available() == HostAvailable(4 * GIB, "left under this cgroup's memory limit")


def test_the_kernels_oom_line_is_found_for_the_killed_pid():
    log = [  # /dev/kmsg records, as mm/oom_kill.c writes them
        "6,2031,58212345,-;python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0",
        "3,2045,58212399,-;Out of memory: Killed process 4242 (python3) total-vm:31456784kB, anon-rss:22817208kB, "
        "file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:45012kB oom_score_adj:0",
    ]
    assert oom_kill_record(4242, log) == ("Out of memory: Killed process 4242 (python3) total-vm:31456784kB, "
                                          "anon-rss:22817208kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:45012kB "
                                          "oom_score_adj:0")
    assert oom_kill_record(4243, log) is None


def test_a_killed_rank_is_said_to_be_killed(monkeypatch):
    monkeypatch.setattr(host_memory, "_read_kmsg", lambda: ["3,1,1,-;Out of memory: Killed process 77 (python3) anon-rss:9kB"])
    assert killed_message(0, -signal.SIGKILL, 77, "") == (
        "rank 0 was killed (signal 9): out of memory? the kernel says: Out of memory: Killed process 77 (python3) anon-rss:9kB")
    assert killed_message(1, -signal.SIGKILL, 78, "step 1") == (
        "rank 1 was killed (signal 9): out of memory? the kernel's log (dmesg) says whether its OOM killer ended it; "
        "its last output: step 1")
    assert killed_message(1, -signal.SIGSEGV, 78, "") == "rank 1 was killed by SIGSEGV: no output"


# -- the command ----------------------------------------------------------------------------------

NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="zeroplan measure needs torch")


def _never(*args, **kwargs):
    pytest.fail("a worker was started")


@NEEDS_TORCH
def test_the_torchtitan_8b_config_is_refused_before_any_worker_starts(monkeypatch):
    from zeroplan.measure import launcher

    monkeypatch.setattr(launcher, "start_worker", _never)
    monkeypatch.setattr(launcher, "spawn", _never)
    monkeypatch.setattr(host_memory, "available", lambda: HostAvailable(int(21.5 * GIB), "MemAvailable"))
    result = CliRunner().invoke(cli, ["measure", "--config", str(DATA / "torchtitan_v0.2.2_llama3_8b.toml"), "--nproc", "2"])
    assert result.exit_code == 2, result.output
    found = re.fullmatch(r"Error: memory: the estimate puts this run at ([\d.]+) GiB of host memory \(2 ranks, up to "
                         r"([\d.]+) GiB each\), and this machine has 21\.50 GiB available \(MemAvailable\); measure fewer "
                         r"ranks or a smaller batch or model, or pass --no-memory-check to run it anyway\n", result.stderr)
    assert found, result.stderr
    total, each = map(float, found.groups())
    assert each > 60 and abs(total - 2 * each) < 0.02  # two ranks of an 8B model's states and 8192-token activations


@NEEDS_TORCH
def test_no_memory_check_runs_it_anyway(monkeypatch):
    from zeroplan.measure import launcher

    asked = {}

    def refused(*args, check_memory, **kwargs):  # the run itself is not what this test is about
        asked["check_memory"] = check_memory
        raise MeasureError("not run")

    monkeypatch.setattr(launcher, "run_measurement", refused)
    args = ["measure", "tiny-llama", "--engine", "torch", "--nproc", "2", "--seq-len", "32"]
    CliRunner().invoke(cli, args)
    assert asked == {"check_memory": True}
    CliRunner().invoke(cli, [*args, "--no-memory-check"])
    assert asked == {"check_memory": False}
    assert "--no-memory-check" in CliRunner().invoke(cli, ["measure", "--help"]).output


def test_a_refused_run_writes_no_output(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(host_memory, "available", lambda: HostAvailable(GIB, "MemAvailable"))
    output = tmp_path / "m.json"
    result = CliRunner().invoke(cli, ["measure", "--config", str(DATA / "torchtitan_v0.2.2_llama3_8b.toml"), "--nproc", "2",
                                      "--output", str(output)])
    assert result.exit_code == 2
    assert not output.exists()
