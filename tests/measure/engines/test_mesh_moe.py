"""Measure expert parallelism (issue 14, zeroplan/measure/engines/mesh_moe.py): 2 gloo ranks on loopback, ep 2,
qwen3moe-tiny; each rank holds half the experts, and the estimate taken with the imbalance the run reports
is within 3% of the worst rank's steady peak."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from zeroplan.estimate import estimate_mesh  # noqa: E402
from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.measure import launcher  # noqa: E402
from zeroplan.measure.grid_ep import measured_imbalance, with_measured_imbalance  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402
from tests.worker_processes import workers_recorded  # noqa: E402

pytestmark = pytest.mark.distributed


def test_ep2_splits_the_experts_and_matches_its_estimate():
    model = resolve_model("qwen3moe-tiny")
    training = TrainingSpec(engine="fsdp2", zero_stage=2, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                            gpus=2, recipe="torchtitan", loss="standard", mesh={"ep": 2})
    with workers_recorded(launcher):
        result = launcher.run_measurement(model, training, nproc=2, steps=2, timeout_s=240)
    factor = measured_imbalance(result.notes)
    assert factor is not None and 1.0 <= factor <= 2.0
    # ep 2 halves the experts (Shard(0)), FSDP2 over dp_shard 2 halves the rest: half the model on each rank
    total = estimate_mesh(model, training).worst.estimate.model.params
    for rank in result.ranks:
        (step,) = [p for p in rank.phases if (p.step, p.phase) == (2, "optimizer_step")]
        assert step.categories["params"] == total // 2 * 4
    measured = max(p.peak_bytes for rank in result.ranks for p in rank.phases if p.stage == "steady")
    estimate = estimate_mesh(model, with_measured_imbalance(training, result.notes)).worst.estimate
    estimated = max(sum(p.categories) for p in estimate.phases if p.step.value == "steady")
    assert estimated == pytest.approx(measured, rel=0.03)
