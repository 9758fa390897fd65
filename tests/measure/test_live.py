"""Inside the user's program (issue 25, item 2): `zeroplan.ZeroplanCallback()` in the real transformers
Trainer and `zeroplan.track(model, optimizer)` in a plain DDP loop, on CPU, held to the estimate of
what they read from the live objects; a model zeroplan cannot describe trains on with one warning;
`strict=True` stops before step 1.

The programs (tests/live_program.py) run as 1 or 2 fresh processes, started in sessions of their own
(zeroplan/measure/processes.py `spawn`), joined through a file store on the loopback interface, stopped
by a deadline and swept afterwards: none outlives its test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from zeroplan.errors import FieldError
from tests.paths import TESTS

pytest.importorskip("torch")
pytest.importorskip("transformers")

from zeroplan.measure.comparison import TARGETS  # noqa: E402
from zeroplan.measure.processes import child_env, exit_status, kill_sessions, spawn  # noqa: E402

from tests.worker_processes import alive  # noqa: E402

PROGRAM = TESTS / "live_program.py"
DEADLINE_S = 300  # a 3-step tiny-llama run takes 10-30 s per process on 2 busy cores


def run_program(tmp_path: Path, mode: str, nproc: int = 1, *args: str) -> tuple[list[dict], list[str]]:
    """Run the program on `nproc` ranks; return each rank's outcome and log."""
    procs = []
    try:
        for rank in range(nproc):
            env = child_env("gloo") | {"OMP_NUM_THREADS": "1"}
            argv = [sys.executable, str(PROGRAM), "--mode", mode, "--output", str(tmp_path / "rank{rank}.json"), *args]
            if nproc > 1:  # as torchrun sets them; one process is a plain `python train.py`
                env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GLOO_SOCKET_IFNAME": "lo"}
                argv += ["--store", str(tmp_path / "store")]
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(spawn(argv, env=env, stdout=log))
        deadline = time.monotonic() + DEADLINE_S
        while any(exit_status(p) is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        statuses = [exit_status(p) for p in procs]
    finally:
        kill_sessions(procs)
    assert [p.pid for p in procs if alive(p.pid)] == []
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(nproc)]
    assert statuses == [0] * nproc, f"statuses {statuses}:\n" + "\n".join(log[-3000:] for log in logs)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)], logs


def assert_within_targets(report: dict, measure_json: dict) -> None:
    for step in ("steady", "first"):
        error = measure_json["error"][step]["peak"]
        assert abs(error) <= TARGETS.peak_tolerance(step), f"{step} peak: {error:+.2%}"
    assert report["step"] == "steady"
    assert report["error"]["peak"] == measure_json["error"]["steady"]["peak"]
    assert sum(report["measured"][c] for c in report["measured"] if c != "peak") == report["measured"]["peak"]


@pytest.mark.distributed
def test_the_trainer_with_the_callback_reports_its_peaks_within_3_percent(tmp_path):
    (outcome,), (log,) = run_program(tmp_path, "trainer", 1, "--gpu", "h100-80gb")
    report, measure_json = outcome["report"], outcome["measure_json"]
    print(json.dumps(report, indent=1))
    assert_within_targets(report, measure_json)
    assert set(report["estimate"]) == set(report["measured"]) == {
        "params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "peak"}
    # what it read from the live objects is what the Trainer ran
    config = measure_json["estimate"]["config"]
    assert (config["engine"], config["zero_stage"], config["gpus"], config["micro_batch"], config["seq_len"],
            config["precision"], config["recipe"], config["device"]) == ("torch", 0, 1, 2, 128, "fp32", "hf-trainer", "cpu")
    assert measure_json["estimate"]["program"]["optimizer_impl"] == "fused"  # the Trainer's adamw_torch_fused
    assert len(measure_json["ranks"]) == 1
    assert outcome["warnings"] == []
    assert "zeroplan: a CPU run: estimated peak" in log and "on h100-80gb (80.00 GiB) it would need" in log
    assert "steady est." in log  # the table of `zeroplan measure`, printed at the end of step 3


@pytest.mark.distributed
def test_the_trainer_on_two_ddp_ranks_reports_every_rank(tmp_path):
    outcomes, logs = run_program(tmp_path, "trainer", 2)
    assert outcomes[0]["report"] == outcomes[1]["report"]  # every rank holds the gathered report
    measure_json = outcomes[0]["measure_json"]
    print(json.dumps(outcomes[0]["report"], indent=1))
    assert [r["rank"] for r in measure_json["ranks"]] == [0, 1] and measure_json["world_size"] == 2
    config = measure_json["estimate"]["config"]
    assert (config["engine"], config["gpus"], measure_json["estimate"]["program"]["ddp"]) == ("torch", 2, True)
    assert_within_targets(outcomes[0]["report"], measure_json)
    # DDP's buckets, allocated when train() wraps the model, are counted as the engine's buffers
    assert outcomes[0]["report"]["measured"]["buffers"] >= measure_json["estimate"]["per_gpu"]["params"]
    assert "steady est." in logs[0] and "steady est." not in logs[1]  # printed on rank 0 only


@pytest.mark.distributed
def test_track_in_a_plain_ddp_loop(tmp_path):
    outcomes, _ = run_program(tmp_path, "loop", 2)
    measure_json = outcomes[0]["measure_json"]
    print(json.dumps(outcomes[0]["report"], indent=1))
    config, program = measure_json["estimate"]["config"], measure_json["estimate"]["program"]
    assert (config["recipe"], program["ddp"], program["optimizer_impl"]) == ("plain", True, "for-loop")
    assert_within_targets(outcomes[0]["report"], measure_json)


@pytest.mark.distributed
def test_track_in_an_accelerate_loop_with_accumulation(tmp_path):
    pytest.importorskip("accelerate")
    (outcome,), _ = run_program(tmp_path, "accelerate", 1, "--grad-accum", "2")
    measure_json = outcome["measure_json"]
    print(json.dumps(outcome["report"], indent=1))
    config, program = measure_json["estimate"]["config"], measure_json["estimate"]["program"]
    assert (config["grad_accum"], config["gpus"], program["optimizer_impl"]) == (2, 1, "foreach")
    assert outcome["warnings"] == []
    assert_within_targets(outcome["report"], measure_json)


@pytest.mark.distributed
def test_a_model_zeroplan_cannot_describe_trains_on_with_one_warning(tmp_path):
    (outcome,), _ = run_program(tmp_path, "opaque", 1)
    assert outcome["steps_trained"] == 4
    assert len(outcome["warnings"]) == 1
    assert outcome["warnings"][0].startswith("zeroplan cannot estimate this run: the model: Sequential has no Hugging "
                                             "Face config (model.config); training goes on, measured only")
    report = outcome["report"]
    assert report["estimate"] is None and report["error"] is None and report["measured"]["peak"] > 0


def test_strict_stops_before_step_1_when_the_estimate_exceeds_the_gpu():
    """On CPU with gpu= named: an estimate over that GPU's memory stops the first forward, before it runs;
    the tracker leaves everything as it found it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroplan
    from zeroplan.errors import DoesNotFitError

    # a vocabulary of 128k: the fp32 logits of 8 x 4096 tokens alone are 17 GB
    model = LlamaForCausalLM(LlamaConfig(vocab_size=131072, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096))
    optimizer = torch.optim.AdamW(model.parameters())
    backward = torch.autograd.backward
    tracker = zeroplan.track(model, optimizer, gpu="l4-24gb", strict=True, stream=open(os.devnull, "w"))
    ids = torch.zeros(8, 4096, dtype=torch.long)
    with pytest.raises(DoesNotFitError, match=r"on l4-24gb \(.* GiB\) it would need .* GiB per GPU: DOES NOT FIT; stopped "
                                               r"before step 1 \(strict=True\)$"):
        model(input_ids=ids, labels=ids)
    assert tracker.report is None and torch.autograd.backward is backward
    assert not model._forward_pre_hooks


def test_an_optimizer_over_some_parameters_is_noted():
    """The estimate gives optimizer states to every parameter that trains; an optimizer that steps
    fewer is said in the report's notes, from its parameter groups."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroplan

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    optimizer = torch.optim.AdamW(model.lm_head.parameters())
    with zeroplan.track(model, optimizer, steps=2, stream=open(os.devnull, "w")) as tracker:
        ids = torch.zeros(1, 8, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
    head, total = model.lm_head.weight.numel(), sum(p.numel() for p in model.parameters())
    assert f"the optimizer's parameter groups step {head:,} parameters, {total:,} require gradients" in tracker.notes[0]


@pytest.mark.parametrize(("options", "message"), [
    ({"steps": 1}, r"^steps: at least 2"),
    ({"gpu": "h100"}, r"^gpu: unknown GPU 'h100'; did you mean"),
    ({"precision": "fp8"}, r"^precision: the mixed precision the program runs"),
    ({"units": "KiB"}, r"^units: 'KiB' is not one of"),
])
def test_bad_options_are_one_field_error(options, message):
    import torch

    import zeroplan

    with pytest.raises(FieldError, match=message):
        zeroplan.track(torch.nn.Linear(2, 2), **options)
    if "precision" not in options:  # the callback checks its options when made, not at the Trainer's first event
        with pytest.raises(FieldError, match=message):
            zeroplan.ZeroplanCallback(**options)


def test_on_a_gpu_only_gpu_tensors_count():
    """The tracker's accounting on CUDA counts the device's storages only (the user's host data is not
    device memory); fake CUDA tensors stand for them on a CPU-only machine (NOTES: fake runs)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zeroplan.measure.accounting import TensorAccounting

    with FakeTensorMode(), TensorAccounting(device_type="cuda") as on_gpu:
        kept = [torch.empty(1000, device="cuda"), torch.empty(10)]
        assert on_gpu.current_bytes == 4000
    with FakeTensorMode(), TensorAccounting() as everywhere:
        kept = [torch.empty(1000, device="cuda"), torch.empty(10)]
        assert everywhere.current_bytes == 4040
    del kept
