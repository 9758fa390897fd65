"""`zeroplan estimate` on a mesh (issue 14): a table per rank kind and the worst rank, JSON with every
rank, and bad meshes as one line with exit status 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate.mesh import estimate_mesh
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
    result = run("estimate", "llama-3-8b", "--gpus", "16", "--tp", "2", "--pp", "4", "--cp", "2", "--grad-accum", "8",
                 "--zero", "3", "--engine", "fsdp2", "--seq-len", "8192", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=16, grad_accum=8, seq_len=8192,
                            mesh=MeshSpec(tp=2, pp=4, cp=2))
    expected = estimate_mesh(resolve_model("llama-3-8b"), training)
    assert [rank["per_gpu"]["peak"] for rank in data["ranks"]] == [r.estimate.peak_bytes for r in expected.ranks]
    assert data["per_gpu"]["peak"] == expected.worst.estimate.peak_bytes == max(r["per_gpu"]["peak"] for r in data["ranks"])
    assert data["mesh"]["dp_shard"] == 1 and data["mesh"]["fsdp_degree"] == 2
    assert [rank["micro_batches_in_flight"] for rank in data["ranks"]] == [4, 3, 2, 1]


def test_an_all_ones_mesh_prints_todays_estimate():
    plain = run("estimate", "llama-3-8b", "--gpus", "8", "--zero", "3", "--format", "json")
    ones = run("estimate", "llama-3-8b", "--gpus", "8", "--zero", "3", "--tp", "1", "--pp", "1", "--format", "json")
    assert plain.exit_code == ones.exit_code == 0 and plain.output == ones.output


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--tp", "3"], "mesh: tp 3 x cp 1 x pp 1 x dp_replicate 1 = 3 does not divide gpus 8"),
    (["--gpus", "64", "--tp", "16"], "mesh.tp: 16 does not divide the model's num_kv_heads 8"),
    (["--gpus", "8", "--cp", "2", "--seq-len", "4098"], "mesh.cp: load-balanced context parallelism cuts seq_len 4098"),
    (["--gpus", "8", "--pp", "8", "--grad-accum", "2"], "mesh.pp: schedule 1f1b needs at least pp 8 micro-batches"),
    (["--gpus", "8", "--ep", "2"], "mesh.ep: the model has no experts"),
    (["--gpus", "8", "--tp", "2", "--engine", "torch", "--zero", "0"], "mesh.tp: engine torch is data-parallel only"),
])
def test_bad_meshes_are_one_line_and_exit_2(args, message):
    result = run("estimate", "llama-3-8b", "--zero", "3", "--engine", "fsdp2", *args)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
