"""The expert-parallel rows of the accuracy grid (issue 14, measure/mesh_moe.py): qwen3moe-tiny
(8 experts, top-2) in torchtitan's loop with its standard loss, on 2 and 4 real gloo ranks: ep alone
(each expert unsharded within its efsdp group of one), ep 2 x efsdp 2, ep 4, and ep with full
checkpointing in bf16. Each row's estimate takes the load imbalance its run measured
(estimate/mesh_ep.py `with_measured_imbalance`)."""

from __future__ import annotations

from zeroplan.measure.grid import Row


def ep_rows() -> list[Row]:
    titan = {"recipe": "torchtitan", "loss": "standard"}
    return [
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 2),), **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 2),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 4),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "bf16", checkpointing="full", mesh=(("ep", 2),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 2, "bf16", mesh=(("ep", 2),), **titan),
    ]
