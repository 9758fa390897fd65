"""A plan, a step time and an estimate's suggestions as plain data: the JSON of `zeroplan plan` (the same shape with
or without --mesh: a data-parallel configuration has `mesh` null) and the `step` and `suggestions` keys of
`zeroplan estimate`. Bytes as ints, seconds as floats."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroplan.estimate.serialize import per_gpu_to_dict, per_node_to_dict
from zeroplan.estimate.serialize import mesh_to_dict

if TYPE_CHECKING:
    from zeroplan.plan.rates import Rates
    from zeroplan.plan.search import Plan, RankedConfig
    from zeroplan.plan.step_time import StepTime
    from zeroplan.plan.suggest import Suggestion


def step_to_dict(step: StepTime, rates: Rates) -> dict[str, Any]:
    """`step` of `estimate --gpu` and of every plan row: seconds, tokens per second per GPU, MFU, the terms (seconds
    by name, summing to `seconds`) and the program knobs priced with it."""
    return {"seconds": step.seconds, "tokens_per_s_per_gpu": step.tokens_per_s, "mfu": step.mfu,
            "terms": dict(step.terms), "knobs": {"compile": rates.compile, "float8": rates.float8,
                                                 "async_tp": rates.async_tp, "calibration": rates.calibration}}


def suggestions_to_dict(suggestions: list[Suggestion]) -> list[dict[str, Any]]:
    """`suggestions` of `estimate` when the peak does not fit: each change, in options and words, and its peak."""
    return [{"change": s.change, "what": s.what, "peak": s.peak_bytes} for s in suggestions]


def _mesh_dict(config: RankedConfig) -> dict[str, Any] | None:
    return None if config.choice.mesh.is_trivial else mesh_to_dict(config.training)


def _config_dict(config: RankedConfig, plan: Plan) -> dict:
    worst = config.worst
    return {
        "rank": config.rank,
        "config": config.choice.label(),
        "mesh": _mesh_dict(config),
        "zero_stage": config.choice.zero_stage,
        "offload_optimizer": config.choice.offload_optimizer.value,
        "offload_params": config.choice.offload_params.value,
        "checkpointing": config.choice.checkpointing.value,
        "checkpoint_every": config.choice.checkpoint_every,
        "gpus": config.choice.gpus,
        "micro_batch": config.micro_batch,
        "grad_accum": config.grad_accum,
        "worst_rank": None if config.choice.mesh.is_trivial else config.estimate.worst.kind.label,
        "per_gpu": per_gpu_to_dict(worst),  # the shapes of `zeroplan estimate --format json`
        "per_node": per_node_to_dict(worst.per_node),
        "step": step_to_dict(config.step, plan.rates),
        "tokens_per_step_per_gpu": config.step.tokens,
        "gpu_seconds_per_million_tokens": config.step.gpu_seconds_per_token * 1e6,
        "reason": config.reason,
    }


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data (the same shape with or without --mesh): bytes as ints, seconds as floats."""
    return {
        "model": plan.model_name,
        "gpus": list(plan.gpu_counts),
        "mesh_search": plan.mesh_search,
        "gpu_memory": plan.limits.gpu_memory_bytes,
        "headroom": plan.limits.headroom,
        "budget": plan.limits.budget_bytes,
        # what a configuration's fit is decided on: its peak (the tensors and the memory outside the allocator)
        # within the budget, not its device figure (`zeroplan estimate`'s fits): a replay per fit check would cost
        # the search more than half its speed (bench/results/published_gpu_memory.md, plan and compare)
        "fits_on": "peak",
        "cpu_memory_per_node": plan.limits.cpu_memory_bytes,
        "nvme_per_node": plan.limits.nvme_bytes,
        "evaluated": plan.evaluated,
        "fitting": plan.fitting,
        "cost_bounded": plan.bounded,
        "estimate_calls": plan.estimate_calls,
        "top": [_config_dict(config, plan) for config in plan.top],
        "largest_micro_batch": None if plan.largest_micro_batch is None else _config_dict(plan.largest_micro_batch, plan),
        "suggestions": list(plan.suggestions),
        "assumptions": plan.rates.model_dump(),
        "notes": list(plan.notes),
    }
