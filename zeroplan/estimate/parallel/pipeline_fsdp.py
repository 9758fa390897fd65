"""Which pipeline stages FSDP2 leaves sharded after their forward (issue 14, zero bubble under FSDP2).

Under `ScheduleInterleavedZeroBubble`, an I that finds a stage's parameters sharded keeps nothing for
its W (estimate/parallel/pipeline_schedule.py `inputs_only_backwards`). A stage's parameters are sharded after
its forward when FSDP2 shards at all and every unit holding them reshards after forward
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `post_forward`: `reshard()` then
`FSDPParam.to_sharded` sets the sharded DTensors back on the module). Derivation: docs/engines/mesh.md.
"""

from __future__ import annotations

from zeroplan.spec.program import FSDP2Units
from zeroplan.spec.training import Engine, TrainingSpec


def resharded_stages(training: TrainingSpec, stage_blocks: dict[int, int], last_stage: int) -> frozenset[int]:
    """The stages (of `stage_blocks`: stage -> blocks it holds) whose every FSDP2 unit reshards after
    forward. A stage with some units kept gathered is left out: their param groups hold its graph."""
    if training.engine != Engine.FSDP2 or training.mesh.fsdp_degree(training.gpus) == 1:
        return frozenset()  # torchtitan `fsdp_enabled`: no fully_shard, the parameters are plain tensors
    wrapping = training.fsdp2_wrapping
    blocks_reshard = training.zero_stage == 3
    resharded = set()
    for stage, blocks in stage_blocks.items():
        # torchtitan `apply_fsdp` over a stage's modules: every block, the stage's last one as reshard_last_block
        units = [blocks_reshard] * max(blocks - 1, 0) + [wrapping.reshard_last_block] * (blocks > 0)
        outside = stage == 0 or stage == last_stage
        if outside and wrapping.units == FSDP2Units.SPLIT:
            units += [blocks_reshard] * (stage == 0) + [wrapping.reshard_head] * (stage == last_stage)
        elif outside:
            units.append(wrapping.reshard_root)  # the root's unit holds the embeddings and the head
        if units and all(units):
            resharded.add(stage)
    return frozenset(resharded)
