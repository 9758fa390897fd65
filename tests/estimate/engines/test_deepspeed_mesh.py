"""DeepSpeed on a mesh (issue 14): AutoTP and Ulysses estimated against what measure/engines/deepspeed_mesh.py measured
on gloo (deepspeed 0.19.8, torch 2.13.0, tiny-llama; `zeroplan validate --rows 'mesh-ds-*'`, docs/measure.md
"DeepSpeed AutoTP and Ulysses"), written to and read from a DeepSpeed JSON, refused where not measured."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import MeasureError
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.deepspeed_json import settings_from_deepspeed, write_deepspeed_config
from zeroplan.measure.grid import _grid
from zeroplan.measure.mesh_rules import refuse_unmeasurable
from zeroplan.spec.training import TrainingSpec

SMALL_BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000}


def _training(gpus: int = 2, zero_stage: int = 1, **mesh) -> TrainingSpec:
    return TrainingSpec(engine="deepspeed", zero_stage=zero_stage, gpus=gpus, micro_batch=2, seq_len=128,
                        precision="fp32", recipe="plain", model_init="device", device="cpu", deepspeed=SMALL_BUCKETS,
                        mesh=mesh)


def _worst(training: TrainingSpec):
    return estimate_mesh(resolve_model("tiny-llama"), training).worst.estimate


def _steady_peak(training: TrainingSpec) -> int:
    """Tensor bytes at the steady peak (the comparison leaves the overhead out)."""
    return max(sum(p.categories[:6]) for p in _worst(training).phases if p.step.value == "steady")


def test_autotp_keeps_the_embedding_whole_as_measured():
    # measured on both ranks (tp 2, ZeRO 1): 1,133,056 bytes of fp32 parameters = 283,264 elements: the blocks'
    # linears and lm_head halved, the 512 x 128 embedding and the norms whole (Llama's tp_plan has no embed_tokens)
    params = max(p.categories.params for p in _worst(_training(tp=2)).phases if p.step.value == "steady")
    assert params == 1_133_056


@pytest.mark.parametrize("training, measured", [
    (_training(tp=2), 10_216_608),  # rank 1's forward; rank 0: 9,950,360 at backward
    (_training(zero_stage=2, tp=2), 9_950_360),
    (_training(gpus=4, tp=2), 8_250_776),
    (_training(cp=2), 9_049_624),
], ids=["autotp2-zero1", "autotp2-zero2", "autotp2-dp2", "ulysses2"])
def test_each_mesh_is_within_three_percent_of_its_measured_worst_rank(training, measured):
    assert _steady_peak(training) == pytest.approx(measured, rel=0.03)


def test_autotp_has_no_sequence_or_loss_parallelism():
    # the same mesh with torchtitan's flags switched off: AutoTP ignores them (estimate/engines/deepspeed_mesh.py)
    assert _steady_peak(_training(tp=2)) == _steady_peak(_training(tp=2, sequence_parallel=False, loss_parallel=False))


def test_the_json_writes_autotp_and_ulysses_and_reads_them_back():
    for mesh, key, value in ((dict(tp=2), "tensor_parallel", {"autotp_size": 2}), (dict(cp=2), "sequence_parallel_size", 2)):
        training = _training(gpus=4, **mesh)
        config = write_deepspeed_config(training)
        assert config[key] == value
        settings = settings_from_deepspeed(config, lambda field: "ds.json", gpus=4)
        assert settings["mesh"] == mesh
        assert settings["micro_batch"] == 2 and settings["grad_accum"] == 1


def test_ulysses_batch_counts_world_over_the_sequence_ranks():
    # runtime/config.py: world_size = dist.get_world_size() / mpu.get_sequence_parallel_world_size() (measured:
    # "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 1 * 1.0")
    assert write_deepspeed_config(_training(gpus=2, cp=2))["train_batch_size"] == 2
    assert write_deepspeed_config(_training(gpus=2, tp=2))["train_batch_size"] == 4  # AutoTP: the whole world
    settings = settings_from_deepspeed({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                        "gradient_accumulation_steps": 1, "sequence_parallel_size": 2},
                                       lambda field: "ds.json")
    assert settings["gpus"] == 4


def test_plan_emits_a_deepspeed_mesh_that_reads_back_to_the_same_estimate(tmp_path):
    path = tmp_path / "ds.json"
    result = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--gpu-memory", "40GiB", "--gpus", "8", "--seq-len", "4096",
                                      "--mesh", "--engine", "deepspeed", "--zero", "1", "--emit", "deepspeed", str(path)])
    assert result.exit_code == 0, result.output
    assert "it reads back to the same estimate" in result.output
    assert json.loads(path.read_text())["tensor_parallel"] == {"autotp_size": 2}


def test_plan_mesh_with_deepspeed_refuses_a_torchtitan_emit(tmp_path):
    result = CliRunner().invoke(cli, ["plan", "tiny-llama", "--gpu-memory", "8GiB", "--gpus", "2", "--mesh",
                                      "--engine", "deepspeed", "--emit", "torchtitan", str(tmp_path / "job.toml")])
    assert result.exit_code == 2
    assert ("--emit torchtitan: a mesh plan of engine deepspeed writes a DeepSpeed JSON (--emit deepspeed); or give "
            "--engine fsdp2") in result.output


@pytest.mark.parametrize("changes, message", [
    (dict(mesh={"tp": 2, "cp": 2}, gpus=4), "mesh: DeepSpeed AutoTP and Ulysses together are not measured"),
    (dict(checkpointing="full"), "checkpointing: checkpointing is not measured on a DeepSpeed mesh"),
    (dict(mesh={"cp": 2}, attention="eager"), "attention: Ulysses needs SDPA"),
])
def test_what_the_deepspeed_mesh_runner_does_not_run_is_refused(changes, message):
    training = _training(tp=2).varied(**changes)
    with pytest.raises(MeasureError, match=message):
        refuse_unmeasurable(resolve_model("tiny-llama"), training)


def test_deepspeed_mesh_rows_carry_their_prefix():
    ids = [row.id for row in _grid() if row.engine == "deepspeed" and row.mesh]
    assert len(ids) == 4 and all(row_id.startswith("mesh-ds-") for row_id in ids)
