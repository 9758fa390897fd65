"""Context parallelism's ring attention in the estimate (estimate/parallel/context.py) against torch 2.13's ring run on
gloo through measure/cp_cpu.py: the ring's own allocations, and the worst rank of the grid rows `mesh-cp2*`
(`zeroplan validate --rows 'mesh-cp2*'`, figures in docs/measure.md, "Context parallelism on CPU")."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.parallel.context import ring_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec


@pytest.mark.parametrize("cp, act_bytes, forward, backward", [
    (2, 4, 331_776, 689_152),
    (2, 2, 331_776, 476_160),
    (4, 4, 231_424, 425_984),
    (4, 2, 198_656, 278_528),
], ids=["cp2-fp32", "cp2-bf16", "cp4-fp32", "cp4-bf16"])
def test_the_ring_allocates_what_torchs_ring_allocated_on_its_worst_rank(cp, act_bytes, forward, backward):
    # measured: tiny-llama's q, k, v (2 x 128 tokens, 4 heads, 2 KV heads, dim 32) through the ring (all-gather
    # rotater, head-tail halves) on cp gloo ranks; bytes the ring held beyond its inputs at its peak, in forward
    # beyond the output and log-sum-exp it returns; the largest over the ranks
    ring = ring_bytes(resolve_model("tiny-llama"), cp, 1, 2 * 128 // cp, act_bytes)
    assert (ring.forward, ring.backward) == (forward, backward)


def test_the_merged_output_copy_is_one_attention_output():
    # o_proj's input on every rank but the ring's last: the merged output copied from (B, heads, T, dim) order
    ring = ring_bytes(resolve_model("tiny-llama"), 2, 2, 128, 2)
    assert ring.output_copy == 128 * 4 * 32 // 2 * 2


def _training(gpus: int, precision: str = "fp32", checkpointing: str = "none", **mesh) -> TrainingSpec:
    return TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, micro_batch=2, seq_len=128, precision=precision,
                        checkpointing=checkpointing, recipe="torchtitan", loss="standard", device="cpu", mesh=mesh)


@pytest.mark.parametrize("training, measured", [
    (_training(2, cp=2), 8_257_192),
    (_training(2, checkpointing="full", cp=2), 7_246_504),
    (_training(4, "bf16", cp=2), 4_488_112),
    (_training(4, "bf16", "full", cp=2), 4_111_024),
    (_training(4, cp=2, tp=2), 4_272_816),
], ids=["cp2", "cp2-ckpt", "cp2-dp2-bf16", "cp2-dp2-bf16-ckpt", "cp2-tp2"])
def test_the_worst_rank_is_within_three_percent_of_the_measured_one(training, measured):
    estimate = estimate_mesh(resolve_model("tiny-llama"), training).worst.estimate
    steady = max(sum(p.categories[:6]) for p in estimate.phases if p.step.value == "steady")
    assert steady == pytest.approx(measured, rel=0.03)

