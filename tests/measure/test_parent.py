"""The parent of a `zeroplan measure` run (the CLI and the launcher) never imports torch: only the
ranks use it, and importing it cost the parent about a third of a CPU run's wall time. The backend
is chosen from what the GPU driver and the torch build say, read without torch."""

import importlib.util
import json
import subprocess
import sys

import pytest

from zeroplan.measure import context
from tests.paths import REPO


# Runs in a fresh interpreter: this test process may have imported torch already. The run itself
# is replaced by one that returns a made-up result, so that everything else the parent does (the
# backend, the estimate, a DeepSpeed --config check, the table, --output) runs for real.
PARENT = """
import importlib.util, json, sys
from click.testing import CliRunner
from zeroplan.cli import cli
from zeroplan.measure import launcher
from zeroplan.measure.result import MeasureResult, PhaseResult, RankResult

def fake_run(model, training, *, nproc, backend, **_):
    cats = {"params": 100, "grads": 0, "optimizer_states": 0, "activations": 0, "buffers": 0, "temporaries": 0}
    phases = [PhaseResult(step, phase, 100, 100, cats) for step in (1, 2) for phase in ("forward", "backward", "optimizer_step")]
    ranks = [RankResult(rank, phases, [0.1, 0.1]) for rank in range(nproc)]
    return MeasureResult(backend, training.engine.value, training.zero_stage, nproc, "made-up", model.name, ranks, steps=2)

launcher.run_measurement = fake_run
report = {}
result = CliRunner().invoke(cli, ["measure", "--help"])
report["help"] = [result.exit_code, "torch" in sys.modules]
if importlib.util.find_spec("torch") is not None:
    output = sys.argv[1] + "/m.json"
    result = CliRunner().invoke(cli, ["measure", "tiny-llama", "--engine", "torch", "--nproc", "2", "--output", output])
    report["run"] = [result.exit_code, "torch" in sys.modules, result.output]
if importlib.util.find_spec("deepspeed") is not None:
    config = sys.argv[1] + "/ds.json"
    open(config, "w").write('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}')
    result = CliRunner().invoke(cli, ["measure", "tiny-llama", "--engine", "deepspeed", "--zero", "2", "--nproc", "2", "--config", config])
    report["deepspeed"] = [result.exit_code, "torch" in sys.modules, result.output]
print(json.dumps(report))
"""


def _parent(tmp_path) -> dict:
    done = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_measure_help_and_the_parent_of_a_run_do_not_import_torch(tmp_path):
    report = _parent(tmp_path)
    assert report["help"] == [0, False]
    for name in ("run", "deepspeed"):
        if name in report:
            exit_code, imported_torch, output = report[name]
            assert exit_code == 0, output
            assert f"2 ranks ({context.default_backend()}, " in output
            assert not imported_torch
    if "run" in report:
        data = json.loads((tmp_path / "m.json").read_text())
        assert (data["engine"], data["backend"]) == ("torch", context.default_backend())


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),  # unset: every device
        ("", 0),
        ("-1", 0),  # CUDA's way to hide every device
        ("0,2", 2),
        ("1,-1,2", 1),  # the list ends at the first invalid entry
        ("0,7", 1),  # no device 7 on a 4-GPU host
        ("GPU-8a2c0f1e,MIG-3b", 2),  # UUIDs
    ],
)
def test_cuda_visible_devices_narrow_the_driver_s_gpus_as_cuda_reads_them(visible, expected):
    assert context._narrowed(4, visible) == expected


def test_the_backend_is_gloo_without_nvidia_gpus_or_with_a_cpu_build_of_torch(monkeypatch, tmp_path):
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for bus in ("0000:07:00.0", "0000:0a:00.0"):
        (gpus / bus).mkdir()
    monkeypatch.setattr(context, "NVIDIA_GPUS", gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(context, "_torch_local_version", lambda: "cu124")
    assert (context.visible_cuda_devices(), context.default_backend()) == (2, "nccl")
    monkeypatch.setattr(context, "_torch_local_version", lambda: "cpu")
    assert (context.visible_cuda_devices(), context.default_backend()) == (0, "gloo")
    monkeypatch.setattr(context, "_torch_local_version", lambda: "")
    monkeypatch.setattr(context, "NVIDIA_GPUS", tmp_path / "no-driver")
    assert (context.visible_cuda_devices(), context.default_backend()) == (0, "gloo")


def test_the_default_backend_agrees_with_torch_on_this_machine():
    torch = pytest.importorskip("torch")
    torch_says = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    assert context.default_backend() == torch_says
