"""`zeroplan measure`'s progress (issue 25, item 5): on a terminal, each rank's step and phase and
DeepSpeed's builds on stderr, redrawn in place; otherwise nothing. The terminal is a pseudo-terminal
(the standard library's `pty`); the run is 2 gloo ranks of tiny-llama, as tests/cli/test_measure.py's."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from zeroplan.cli.progress import MeasureProgress, StatusLine, bar
from tests.paths import REPO

RUN = ["measure", "tiny-llama", "--engine", "torch", "--zero", "0", "--nproc", "2", "--precision", "fp32",
       "--micro-batch", "1", "--seq-len", "32", "--steps", "2", "--implementation", "reference", "--format", "json",
       "--timeout", "120"]
BOUND_S = 240


def _run(stderr_on_a_terminal: bool) -> tuple[int, str, bytes]:
    """`python -m zeroplan RUN` with stdout a pipe and stderr a pseudo-terminal or a pipe."""
    master = slave = None
    if stderr_on_a_terminal:
        master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "zeroplan", *RUN], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave if slave is not None else subprocess.PIPE)
    try:
        if slave is None:
            out, err = proc.communicate(timeout=BOUND_S)
            return proc.returncode, out.decode(), err
        os.close(slave)
        err, deadline = b"", time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            try:
                chunk = os.read(master, 65536) if ready else b""
            except OSError:  # the terminal's other side closed: the command exited
                break
            err += chunk
            if not chunk and proc.poll() is not None:
                break
        return proc.wait(timeout=30), proc.stdout.read().decode(), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if master is not None:
            os.close(master)


@pytest.mark.distributed
def test_on_a_terminal_each_rank_s_phases_are_drawn_in_place():
    status, out, err = _run(stderr_on_a_terminal=True)
    assert status == 0, err.decode(errors="replace")
    assert json.loads(out)["world_size"] == 2  # stdout is the same document
    frames = err.decode().split("\r\x1b[K")
    assert frames[1] == "measuring on 2 ranks ..."
    assert "[################....] 5/6 step 2/2: rank 0 optimizer_step, rank 1 optimizer_step" in frames
    assert any("rank 0" in frame and "rank 1" in frame and "step 1/2" in frame for frame in frames)
    assert frames[-1] == ""  # the status line is cleared before the command ends
    assert "\n" not in err.decode()


@pytest.mark.distributed
def test_elsewhere_it_is_quiet():
    status, out, err = _run(stderr_on_a_terminal=False)
    assert status == 0, err.decode(errors="replace")
    assert json.loads(out)["world_size"] == 2
    assert err == b""


def test_the_launcher_reports_each_rank_s_last_phase(monkeypatch):
    """The ranks write their phase to a file the launcher polls; the last one of each is always reported."""
    pytest.importorskip("torch")
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.measure.launcher import run_measurement
    from zeroplan.spec.training import TrainingSpec

    seen: list[dict] = []

    class Recorder:
        def build(self, label, seconds):
            raise AssertionError("no DeepSpeed build in a torch run")

        def ranks(self, phases):
            seen.append(dict(phases))

    training = TrainingSpec(engine="torch", zero_stage=0, gpus=2, precision="fp32", micro_batch=1, seq_len=32,
                            device="cpu", recipe="plain")
    run_measurement(resolve_model("tiny-llama"), training, nproc=2, backend="gloo", steps=2, timeout_s=120,
                    implementation="reference", progress=Recorder())
    assert seen[-1] == {0: (2, "optimizer_step"), 1: (2, "optimizer_step")}
    assert all(seen[i] != seen[i + 1] for i in range(len(seen) - 1))  # told only when a rank moved on


def test_a_deepspeed_build_reports_its_seconds(monkeypatch, tmp_path):
    """The build child's protocol (deepspeed_build's module docstring), spoken by a stand-in that takes 1.2 s."""
    from zeroplan.measure import deepspeed_build

    (tmp_path / "stand_in_build.py").write_text(
        "import sys, time\nname = sys.argv[-1]\nprint('compiling', name, flush=True)\ntime.sleep(1.2)\n"
        "print('ready', name, flush=True)\n")
    monkeypatch.setattr(deepspeed_build, "MODULE", "stand_in_build")
    monkeypatch.setattr(deepspeed_build, "built", lambda name, folder: False)
    announced, ticks = [], []
    deepspeed_build.build_ahead(("deepspeed_shm_comm",), env={**os.environ, "PYTHONPATH": str(tmp_path)},
                                announce=announced.append, progress=lambda label, s: ticks.append((label, s)),
                                timeout_s=60)
    label = deepspeed_build.OPS["deepspeed_shm_comm"].label
    assert announced == [deepspeed_build.announcement("deepspeed_shm_comm")]
    assert len(ticks) >= 2 and {t[0] for t in ticks} == {label}
    assert [t[1] for t in ticks] == sorted(t[1] for t in ticks) and ticks[-1][1] >= 1.0


class _Terminal(StatusLine):
    def __init__(self):
        self.tty, self.shown, self.drawn = True, False, []

    def show(self, text):
        self.drawn.append(text)


def test_the_progress_line_says_where_each_rank_is():
    terminal = _Terminal()
    progress = MeasureProgress(terminal, steps=3)
    progress.build("shared-memory communication op", 12.4)
    progress.ranks({0: (0, "engine"), 1: (0, "model")})
    progress.ranks({0: (2, "backward"), 1: (1, "optimizer_step")})
    progress.ranks({rank: (3, "forward" if rank < 40 else "backward") for rank in range(64)})
    assert terminal.drawn == [
        "building DeepSpeed's shared-memory communication op: 12 s",
        f"{bar(0, 9)} set-up: rank 0 engine, rank 1 model",
        f"{bar(2, 9)} step 2/3: rank 0 backward, rank 1 optimizer_step",
        f"{bar(6, 9)} step 3/3: 40 ranks at forward of step 3, 24 ranks at backward of step 3",
    ]
    assert bar(5, 6) == "[################....] 5/6"
