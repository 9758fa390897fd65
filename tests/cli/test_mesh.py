"""`zeroplan estimate` on a mesh (issue 14): a table per rank kind and the worst rank, JSON with every
rank, and bad meshes as one line with exit status 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import TrainingSpec


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_tp_estimate_prints_the_rank_kinds_and_the_worst():
    result = run("estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--zero", "3", "--engine", "fsdp2",
                 "--seq-len", "8192")
    assert result.exit_code == 0, result.output
    assert "Mesh: tp 8 (sequence parallel) x cp 1 x pp 1 x dp_replicate 1 x dp_shard 8" in result.output
    assert "Worst rank: pp rank 0 (embedding, 80 layers, head, loss)" in result.output


def test_pipeline_json_carries_every_rank_and_the_worst_at_the_top():
    result = run("estimate", "llama-3-8b", "--recipe", "torchtitan", "--gpus", "16", "--tp", "2", "--pp", "4", "--cp", "2", "--grad-accum", "8",
                 "--zero", "3", "--engine", "fsdp2", "--seq-len", "8192", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    training = TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=16, grad_accum=8, seq_len=8192,
                            mesh=MeshSpec(tp=2, pp=4, cp=2))
    expected = estimate_mesh(resolve_model("llama-3-8b"), training)
    assert [rank["per_gpu"]["peak"] for rank in data["ranks"]] == [r.estimate.peak_bytes for r in expected.ranks]
    assert data["per_gpu"]["peak"] == expected.worst.estimate.peak_bytes == max(r["per_gpu"]["peak"] for r in data["ranks"])
    assert data["mesh"]["dp_shard"] == 1 and data["mesh"]["fsdp_degree"] == 2
    assert [rank["micro_batches_in_flight"] for rank in data["ranks"]] == [4, 3, 2, 1]


def test_checkpoint_every_block_but_one_under_tp_without_sequence_parallel_is_estimated():
    result = run("estimate", "llama-3-8b", "--gpus", "8", "--tp", "2", "--zero", "3", "--engine", "fsdp2",
                 "--checkpointing", "full", "--checkpoint-every", "2", "--no-sequence-parallel", "--format", "json")
    every = run("estimate", "llama-3-8b", "--gpus", "8", "--tp", "2", "--zero", "3", "--engine", "fsdp2",
                "--checkpointing", "full", "--no-sequence-parallel", "--format", "json")
    assert result.exit_code == every.exit_code == 0
    # half the blocks keep all their tensors instead of their input alone
    assert json.loads(result.output)["per_gpu"]["peak"] > json.loads(every.output)["per_gpu"]["peak"]


def test_checkpoint_every_under_sequence_parallel_cuts_each_kind_of_block_as_it_keeps_its_tensors():
    """torchtitan runs every-N checkpointing with sequence parallelism (its SAC wrapper around blocks whose norms
    are SequenceParallel); measured row mesh-tp2/.../ckpt-every2 (docs/accuracy.md). Half the blocks keep
    everything, cut over tp as blocks without checkpointing are; the other half keep their input shard."""
    args = ("estimate", "llama-3-8b", "--gpus", "8", "--tp", "2", "--zero", "3", "--engine", "fsdp2",
            "--checkpointing", "full", "--format", "json")
    every, sp_off, all_blocks = (run(*args, *extra) for extra in (("--checkpoint-every", "2"),
                                                                   ("--checkpoint-every", "2", "--no-sequence-parallel"),
                                                                   ()))
    assert every.exit_code == sp_off.exit_code == all_blocks.exit_code == 0
    peak = {name: json.loads(result.output)["per_gpu"]["peak"] for name, result in
            (("every", every), ("sp_off", sp_off), ("all", all_blocks))}
    assert peak["all"] < peak["every"] < peak["sp_off"]


def test_an_all_ones_mesh_prints_todays_estimate():
    plain = run("estimate", "llama-3-8b", "--gpus", "8", "--zero", "3", "--format", "json")
    ones = run("estimate", "llama-3-8b", "--gpus", "8", "--zero", "3", "--tp", "1", "--pp", "1", "--format", "json")
    assert plain.exit_code == ones.exit_code == 0 and plain.output == ones.output


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--tp", "3"], "mesh: tp 3 x cp 1 x pp 1 x dp_replicate 1 = 3 does not divide gpus 8"),
    (["--gpus", "64", "--tp", "16"], "mesh.tp: 16 does not divide the model's num_kv_heads 8"),
    (["--gpus", "8", "--cp", "2", "--seq-len", "4098"], "mesh.cp: load-balanced context parallelism cuts seq_len 4098"),
    (["--recipe", "torchtitan", "--gpus", "8", "--pp", "8", "--grad-accum", "2"], "mesh.pp: schedule 1f1b needs at least pp 8 micro-batches"),
    (["--recipe", "torchtitan", "--gpus", "8", "--ep", "2"], "mesh.ep: the model has no experts"),
    (["--gpus", "8", "--tp", "2", "--engine", "torch", "--zero", "0"], "mesh.tp: engine torch is data-parallel only"),
])
def test_bad_meshes_are_one_line_and_exit_2(args, message):
    result = run("estimate", "llama-3-8b", "--zero", "3", "--engine", "fsdp2", *args)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def _toml(tmp_path, parallelism: str, training: str = "local_batch_size = 8\nglobal_batch_size = 64\nseq_len = 8192\n"):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nname = "llama3"\nflavor = "70B"\n[training]\n{training}[parallelism]\n{parallelism}')
    return str(path)


def test_torchtitan_parallelism_table_is_read_into_the_mesh(tmp_path):
    from zeroplan.importers.options import training_spec_from_options

    config = _toml(tmp_path, "tensor_parallel_degree = 8\npipeline_parallel_degree = 4\ncontext_parallel_degree = 2\n"
                   'pipeline_parallel_schedule = "Interleaved1F1B"\ndata_parallel_replicate_degree = 2\n'
                   "data_parallel_shard_degree = 1\npipeline_parallel_microbatch_size = 2\n")
    training = training_spec_from_options({}, config)
    mesh = training.mesh
    assert (mesh.tp, mesh.cp, mesh.pp, mesh.dp_replicate, mesh.pp_schedule.value, mesh.pp_virtual_stages) == \
        (8, 2, 4, 2, "interleaved-1f1b", 2)
    assert training.gpus == 8 * 2 * 4 * 2 * 1
    # global 64 over local 8 x (dp_replicate 2 x dp_shard 1) = 4 steps, each 8 / 2 = 4 pipeline micro-batches of 2
    assert (training.micro_batch, training.grad_accum) == (2, 16)
    assert training.zero_stage == 2  # fsdp_reshard_after_forward "default" is `not pp_enabled`


def test_torchtitan_layers_per_stage_gives_the_virtual_stages(tmp_path):
    from zeroplan.importers.options import training_spec_from_options

    # (80 + 2) / 6 -> 14 stages over pp 7 = 2 per rank
    config = _toml(tmp_path, 'pipeline_parallel_degree = 7\npipeline_parallel_schedule = "InterleavedZeroBubble"\n'
                   "pipeline_parallel_layers_per_stage = 6\n")
    training = training_spec_from_options({"gpus": 56}, config)
    assert (training.mesh.pp_virtual_stages, training.mesh.pp_schedule.value) == (2, "zero-bubble")


def test_compare_on_a_mesh_shows_each_configurations_worst_rank():
    result = run("compare", "llama-3-8b", "--recipe", "torchtitan", "--gpus", "16", "--zero", "2,3", "--engine", "fsdp2", "--tp", "2", "--pp", "2",
                 "--grad-accum", "4", "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    for row, stage in zip(rows, (2, 3)):
        training = TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=stage, gpus=16, grad_accum=4, mesh=MeshSpec(tp=2, pp=2))
        assert row["per_gpu"]["peak"] == estimate_mesh(resolve_model("llama-3-8b"), training).worst.estimate.peak_bytes
