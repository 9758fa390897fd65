"""The per-rank mesh estimate against what measure/engines/mesh.py measured on gloo (torch 2.13.0, tiny-llama;
`zeroplan validate --rows 'mesh-*'`, figures in docs/measure.md "Meshes"), and the behaviours seen there."""

from __future__ import annotations


import pytest

from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA


def _training(gpus: int, grad_accum: int = 1, precision: str = "fp32", zero_stage: int = 3, **mesh) -> TrainingSpec:
    return TrainingSpec(engine="fsdp2", zero_stage=zero_stage, gpus=gpus, micro_batch=2, seq_len=128, grad_accum=grad_accum,
                        precision=precision, recipe="torchtitan", loss="standard", device="cpu", mesh=mesh)


def _steady_peaks(training: TrainingSpec) -> dict[int, int]:
    """Tensor bytes at each pipeline rank kind's steady peak (the comparison leaves the overhead out)."""
    ranks = estimate_mesh(resolve_model("tiny-llama"), training).ranks
    return {rank.kind.pp_rank: max(sum(p.categories[:6]) for p in rank.estimate.phases if p.step.value == "steady")
            for rank in ranks}


@pytest.mark.parametrize("training,measured", [
    (_training(2, tp=2, sequence_parallel=False, loss_parallel=False), {0: 8_424_104}),
    # measured with loss_parallel()'s handlers counted (measure/engines/mesh.py counted_loss_parallel)
    (_training(2, tp=2), {0: 7_252_400}),
    (_training(4, precision="bf16", tp=2), {0: 4_389_816}),
    (_training(4, zero_stage=2, tp=2), {0: 6_751_416}),
    (_training(2, 4, pp=2, pp_schedule="gpipe"), {0: 15_610_988, 1: 20_488_848}),
    (_training(2, 4, pp=2, pp_schedule="1f1b"), {0: 10_979_436, 1: 11_271_300}),
    (_training(4, 4, pp=2, pp_schedule="1f1b"), {0: 10_496_636, 1: 10_115_476}),
], ids=["tp2-nosp", "tp2-sp", "tp2-dp2-bf16", "tp2-dp2-zero2", "pp2-gpipe", "pp2-1f1b", "pp2-1f1b-dp2"])
def test_each_rank_kind_is_within_three_percent_of_its_measured_rank(training, measured):
    estimated = _steady_peaks(training)
    assert estimated.keys() == measured.keys()
    for rank, measured_bytes in measured.items():
        assert estimated[rank] == pytest.approx(measured_bytes, rel=0.03)


def test_tensor_parallelism_alone_holds_no_fsdp2_buffers():
    # torchtitan parallel_dims.py fsdp_enabled: no fully_shard where dp_shard is 1 (measured: 72 bytes of buffers)
    (rank,) = estimate_mesh(resolve_model("tiny-llama"), _training(2, tp=2)).ranks
    assert all(phase.categories.buffers == 0 for phase in rank.estimate.phases)


_TINY_LLAMA_4L = str(DATA / "tiny-llama-4l.toml")


@pytest.mark.parametrize("gpus,schedule,measured", [
    (2, "interleaved-1f1b", {0: 23_617_744, 1: 26_706_140}),
    (2, "zero-bubble", {0: 22_268_112, 1: 36_088_028}),
    (4, "interleaved-1f1b", {0: 22_896_864, 1: 25_836_524}),
], ids=["pp2x2-interleaved-1f1b", "pp2x2-zero-bubble", "pp2x2-interleaved-1f1b-dp2"])
def test_looped_schedules_are_within_three_percent_of_each_measured_rank(gpus, schedule, measured):
    # tiny-llama with 4 layers, pp 2 x 2 virtual stages, 4 micro-batches (grid rows mesh-pp2-<schedule>-v2/...);
    # zero bubble's rank 1 holds four chunks of its 2-block stage and their W inputs (estimate/parallel/pipeline_schedule.py)
    training = _training(gpus, 4, pp=2, pp_schedule=schedule, pp_virtual_stages=2)
    ranks = estimate_mesh(resolve_model(_TINY_LLAMA_4L), training).ranks
    estimated = {rank.kind.pp_rank: max(sum(p.categories[:6]) for p in rank.estimate.phases if p.step.value == "steady")
                 for rank in ranks}
    assert estimated.keys() == measured.keys()
    for rank, measured_bytes in measured.items():
        assert estimated[rank] == pytest.approx(measured_bytes, rel=0.03)
