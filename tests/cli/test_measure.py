"""`zeroplan measure`: the command over real 2-rank gloo runs and a simulated 8-rank one.

Each run is 2 steps of tiny-llama (zeroplan's reference implementation: no transformers import
in the workers), 1 x 32 tokens, fp32. What is checked is what a user reads: the table's rows and
per-rank line, the JSON contract (the estimate in it is exactly `zeroplan estimate --format
json`), errors on one line with status 2, an out-of-memory as a result with status 3, an
--output file that a failed run never writes, and no worker left running.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.estimate.model.layout import param_layout
from zeroplan.importers.catalog import resolve_model
from zeroplan.cli import cli
from tests.worker_processes import SPAWNED, alive, recording

TIMEOUT = "120"  # seconds per run; a healthy run takes a few seconds
RUN = ["--precision", "fp32", "--micro-batch", "1", "--seq-len", "32", "--steps", "2", "--timeout", TIMEOUT,
       "--implementation", "reference"]
CATEGORIES = ("params", "grads", "optimizer_states", "activations", "buffers")  # issue 3 §4
# Checks that come after the command's own "install torch" check cannot be reached without it.
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="zeroplan measure needs torch")


@pytest.fixture(autouse=True)
def _no_worker_survives(monkeypatch):
    """Every worker a test starts is gone (not even a zombie) when the command returns."""
    from zeroplan.measure import launcher

    monkeypatch.setattr(launcher, "start_worker", recording(launcher.start_worker))
    before = len(SPAWNED)
    yield
    assert [p.pid for p in SPAWNED[before:] if alive(p.pid)] == []


def measure(*args: str):
    return CliRunner().invoke(cli, ["measure", "tiny-llama", *args])


def _param_bytes() -> int:
    return param_layout(resolve_model("tiny-llama")).total_params * 4  # fp32


def _row(output: str, label: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if re.match(rf"^{label}\s{{2,}}", line)]
    return line[len(label):].split()


# -- real runs --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_torch_stage0_on_2_gloo_ranks_prints_estimate_beside_measurement():
    result = measure("--engine", "torch", "--zero", "0", "--nproc", "2", "--units", "MiB", *RUN)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("tiny-llama: torch ZeRO-0, 2 ranks (gloo, cpu), fp32, adamw, micro-batch 1 x 32 tokens, 2 steps\n")
    assert "measured: zeroplan-reference:llama/sdpa; estimated: hf-transformers/fused" in out
    # DDP: every rank holds the whole model, its gradients, two Adam moments, and buckets as large as the gradients
    params_mib = f"{_param_bytes() / 2**20:.3f}"
    assert _row(out, "params") == [params_mib, params_mib, "+0.0%"] * 2
    assert _row(out, "grads")[1] == params_mib
    assert _row(out, "buffers")[1] == params_mib  # DDP's reducer buckets
    est, meas, error = _row(out, "peak")[:3]
    assert error == f"{float(est.replace(',', '')) / float(meas.replace(',', '')) - 1:+.1%}"
    assert re.search(r"^steady state peak per rank: rank 0 [\d.]+ MiB \(\w+\), rank 1 [\d.]+ MiB \(\w+\); "
                     r"categories above are rank [01]'s$", out, re.MULTILINE)


@pytest.mark.distributed
def test_fsdp2_stage3_table_and_json_file(tmp_path):
    path = tmp_path / "m.json"
    result = measure("--engine", "fsdp2", "--zero", "3", "--nproc", "2", "--units", "MiB", "--output", str(path), *RUN)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("tiny-llama: fsdp2 ZeRO-3, 2 ranks (gloo, cpu)")
    assert set(_row(result.stdout, "peak phase")) <= {"init", "forward", "backward", "optimizer_step"}
    data = json.loads(path.read_text())
    # the contract of issue 3 §4
    assert (data["backend"], data["engine"], data["world_size"], data["zero_stage"]) == ("gloo", "fsdp2", 2, 3)
    assert data["implementation"] == "zeroplan-reference:llama/sdpa"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for rank in data["ranks"]:
        assert {"rank", "peak", "peak_phase", "categories", "phases"} <= set(rank)
        assert set(CATEGORIES) <= set(rank["categories"])
        assert sum(rank["categories"].values()) == rank["peak"]
        # ZeRO-3: each rank keeps half the parameters (the shards of an even split)
        (steady,) = [p for p in rank["phases"] if p["step"] == 2 and p["phase"] == "optimizer_step"]
        assert steady["categories"]["params"] == pytest.approx(_param_bytes() / 2, rel=0.01)
    # the estimate is exactly what `zeroplan estimate --format json` prints for the same configuration
    estimated = CliRunner().invoke(cli, ["estimate", "tiny-llama", "--recipe", "plain", "--engine", "fsdp2", "--zero", "3", "--gpus", "2",
                                         "--device", "cpu", "--precision", "fp32", "--micro-batch", "1",
                                         "--seq-len", "32", "--format", "json"])
    assert data["estimate"] == json.loads(estimated.stdout)
    for step in ("steady", "first"):
        assert set(data["error"][step]) == {*CATEGORIES, "temporaries", "peak"}
        compared = data["comparison"][step]
        top = max(data["ranks"], key=lambda r: max(p["peak_bytes"] for p in r["summary"] if p["step"] == step))
        measured = max(p["peak_bytes"] for p in top["summary"] if p["step"] == step)
        estimated_peak = max(p["total"] - p["overhead"] for p in data["estimate"]["phases"] if p["step"] == step)
        assert compared["measured"]["peak"] == measured
        assert data["error"][step]["peak"] == pytest.approx(estimated_peak / measured - 1)
    assert list(tmp_path.iterdir()) == [path]  # no temp file left beside it


@pytest.mark.distributed
def test_simulated_8_ranks_json():
    result = measure("--engine", "fsdp2", "--zero", "3", "--nproc", "8", "--simulate", "--format", "json", *RUN)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["backend"], data["world_size"], data["device"]) == ("fake", 8, "cpu")
    assert [r["rank"] for r in data["ranks"]] == [0]  # rank 0 stands for all
    assert data["estimate"]["config"]["gpus"] == 8
    (rank,) = data["ranks"]
    (steady,) = [p for p in rank["phases"] if p["step"] == 2 and p["phase"] == "optimizer_step"]
    assert steady["categories"]["params"] == pytest.approx(_param_bytes() / 8, rel=0.05)
    assert any(note.startswith("simulated:") for note in data["notes"])


@pytest.mark.distributed
def test_a_failed_run_prints_one_line_and_writes_no_file(monkeypatch, tmp_path):
    from zeroplan.measure.worker import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "raise@1")
    path = tmp_path / "m.json"
    result = measure("--engine", "torch", "--zero", "0", "--nproc", "2", "--output", str(path), *RUN)
    assert result.exit_code == 2
    assert result.stderr == "Error: rank 1 failed: RuntimeError: injected fault on rank 1\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_out_of_memory_is_a_result_with_status_3(monkeypatch, tmp_path):
    from zeroplan.measure.worker import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "oom@0")
    path = tmp_path / "m.json"
    result = measure("--engine", "torch", "--zero", "0", "--nproc", "2", "--units", "MiB", "--output", str(path), *RUN)
    assert result.exit_code == 3, result.output
    assert re.search(r"^DOES NOT FIT: ran out of device memory: rank 0 at forward "
                     r"\(OutOfMemoryError: injected out-of-memory on rank 0\), peak reached [\d.]+ MiB$", result.stdout, re.MULTILINE)
    data = json.loads(path.read_text())
    assert data["fits"] is False and "steady" not in data["error"]
    assert data["ranks"][0]["peak"] >= 2 * _param_bytes()  # the model and DDP's buckets were built


# -- refused before any worker starts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "torch", "--nproc", "0"], r"Invalid value for '--nproc': 0 is not in the range x>=1"),
        (["--engine", "torch", "--nproc", "2", "--steps", "1"], r"Invalid value for '--steps'"),
        (["--engine", "torch", "--nproc", "2", "--gpus", "4"], r"--gpus 4 must equal --nproc 2"),
        pytest.param(["--engine", "torch", "--nproc", "8", "--simulate"], r"^Error: engine: --simulate runs fsdp2 only .*not torch$",
                     marks=NEEDS_TORCH),
        (["--engine", "fsdp2", "--zero", "3", "--nproc", "8", "--simulate", "--backend", "gloo"],
         r"--simulate runs the fake backend; leave out --backend gloo"),
        pytest.param(["--engine", "torch", "--nproc", "2", "--backend", "gloo", "--device", "cuda"],
                     r"--device cuda does not match a gloo run, which measures cpu memory", marks=NEEDS_TORCH),
        pytest.param(["--engine", "fsdp2", "--zero", "1", "--nproc", "2"], r"engine fsdp2 covers zero_stage 2", marks=NEEDS_TORCH),
    ],
)
def test_bad_options_are_one_line_with_status_2(args, message, tmp_path):
    path = tmp_path / "m.json"
    result = measure(*args, "--output", str(path))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.output
    assert re.search(message, result.stderr.strip())
    assert not path.exists()


def _never(*args, **kwargs):
    pytest.fail("a worker was started")


@NEEDS_TORCH
@pytest.mark.parametrize(
    ("args", "message"),
    [
        # issue 21: ran silently towards its 600 s timeout (about 6 ms per simulated rank of tiny-llama)
        (["--engine", "fsdp2", "--zero", "3", "--nproc", "1000000", "--simulate"],
         r"^Error: nproc: --simulate stands for at most 16,384 ranks \(the largest published training world\), got "
         r"1,000,000; its time grows with the world \(.*\), so give a large world a longer --timeout$"),
        (["--engine", "torch", "--nproc", "1000"],
         r"^Error: nproc: a gloo run starts one process per rank on this machine, 64 at most; measure a larger world "
         r"with --simulate \(engine fsdp2\), got 1,000$"),
        (["--engine", "torch", "--nproc", "2", "--steps", "1000000"],
         r"^Error: steps: must be 1 to 1,000 \(the steady state repeats from step 2\), got 1,000,000$"),
    ],
)
def test_every_count_is_bounded_before_any_worker_starts(args, message, monkeypatch):
    from zeroplan.measure import launcher

    monkeypatch.setattr(launcher, "start_worker", _never)
    monkeypatch.setattr(launcher, "spawn", _never)
    result = measure(*args, *RUN[:6])  # --precision, --micro-batch, --seq-len
    assert result.exit_code == 2, result.output
    assert re.search(message, result.stderr.strip()), result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_deepspeed_json_that_disagrees_fails_before_any_rank_starts(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    import zeroplan.measure.launcher as launcher

    monkeypatch.setattr(launcher, "run_measurement", lambda *a, **k: pytest.fail("a rank was started"))
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW"}}')
    result = measure("--engine", "deepspeed", "--nproc", "2", "--config", str(config), "--grad-accum", "2")
    assert result.exit_code == 2, result.output
    assert result.stderr == "Error: config: gradient_accumulation_steps is 4 but the training spec says grad_accum 2\n"


@NEEDS_TORCH
def test_a_parameter_count_model_cannot_be_measured():
    result = CliRunner().invoke(cli, ["measure", "--params", "7B", "--engine", "torch", "--nproc", "2"])
    assert result.exit_code == 2
    assert result.stderr == "Error: model: 7,000,000,000 params is known by its parameter count only; measure needs a transformer spec\n"


def test_nccl_without_gpus_says_how_many_are_visible():
    pytest.importorskip("torch")
    result = measure("--engine", "torch", "--nproc", "2", "--backend", "nccl")
    assert result.exit_code == 2
    assert result.stderr == "Error: nproc: 2 ranks need 2 GPUs, 0 are visible\n"


@NEEDS_TORCH
def test_deepspeed_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importlib.util.find_spec("deepspeed") -> None
    result = measure("--engine", "deepspeed", "--zero", "2", "--nproc", "2")
    assert result.exit_code == 2
    assert result.stderr == "Error: engine deepspeed needs DeepSpeed; install it with: pip install 'zeroplan[deepspeed]'\n"


def test_implementations_match_the_workload():
    pytest.importorskip("torch")
    from zeroplan.cli.measure_options import IMPLEMENTATIONS
    from zeroplan.measure.workload import IMPLEMENTATIONS as WORKLOAD

    assert IMPLEMENTATIONS == WORKLOAD


@pytest.mark.distributed
def test_output_goes_through_a_symlink_and_dash_is_standard_output(tmp_path):
    """Issue 21: --output replaced a symlink with a file, made new files 0600 and took - for a file name."""
    real = tmp_path / "real.json"
    real.write_text("{}\n")
    real.chmod(0o644)
    link = tmp_path / "m.json"
    link.symlink_to(real)
    result = measure("--engine", "torch", "--zero", "0", "--nproc", "1", "--output", str(link), *RUN)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and json.loads(real.read_text())["world_size"] == 1
    assert real.stat().st_mode & 0o777 == 0o644
    dash = measure("--engine", "torch", "--zero", "0", "--nproc", "1", "--output", "-", *RUN)
    assert dash.exit_code == 0, dash.output
    assert json.loads(dash.stdout)["world_size"] == 1  # standard output holds the JSON alone
    assert "tiny-llama: torch ZeRO-0, 1 rank" in dash.stderr  # the table went to standard error
    assert not (Path.cwd() / "-").exists()
