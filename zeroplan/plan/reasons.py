"""Why a configuration ranks where it does: its step's largest terms beside compute, in words, and against #1
the term it pays most more of per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.spec.training import Engine, Offload

if TYPE_CHECKING:
    from zeroplan.plan.search import RankedConfig


def _data_parallel(config: RankedConfig) -> str:
    """What the ZeRO stage moves, over how many GPUs, inside a node or across nodes (ZeRO paper section 7)."""
    training, choice = config.training, config.choice
    stage, mesh, gpus = choice.zero_stage, choice.mesh, choice.gpus
    frozen = training.lora is not None or bool(training.freeze)
    volume = {3: "gathers every parameter twice and reduce-scatters the gradients per micro-batch",
              2: ("gathers the parameters per forward and reduce-scatters the gradients" if training.engine == Engine.FSDP2
                  else "reduce-scatters the gradients per micro-batch and gathers the updated shards per step"),
              1: "reduces the gradients and gathers the updated shards per step",
              0: "all-reduces the gradients per step"}[stage]
    if frozen:
        volume += " (the trained parameters' only)"
    shards = mesh.fsdp_degree(gpus) if not mesh.is_trivial else gpus
    span = mesh.tp * mesh.cp * mesh.dp_shard(gpus) if not mesh.is_trivial else gpus
    where = "inside a node" if span <= training.node_gpus else "across nodes"
    return f"ZeRO-{stage} {volume} over {shards} GPUs {where} (the part no compute hides)"


def _why(config: RankedConfig, term: str) -> str:
    training, choice, mesh = config.training, config.choice, config.choice.mesh
    if term == "compute":
        tokens = config.micro_batch * training.seq_len // mesh.cp
        return f"micro-batch {config.micro_batch} x {training.seq_len} tokens ({tokens} per GPU), {config.step.mfu:.0%} MFU"
    if term == "recompute":
        policy = f"full checkpointing of one block in {choice.checkpoint_every}" if choice.checkpoint_every else \
            f"{choice.checkpointing.value} checkpointing"
        return f"{policy} recomputes in backward"
    if term == "data parallel":
        return _data_parallel(config)
    if term == "hsdp all-reduce":
        return f"HSDP all-reduces each gradient shard across {mesh.dp_replicate} replicas"
    if term == "tp":
        return f"tp {mesh.tp}: four collectives per block and pass"
    if term == "cp":
        return f"cp {mesh.cp}: the ring passes keys and values around {mesh.cp} ranks"
    if term == "ep":
        return f"ep {mesh.ep}: each MoE layer's all-to-all dispatch and combine"
    if term == "pp bubble":
        return (f"pp {mesh.pp} {mesh.pp_schedule.value}: a bubble of (p - 1)/(v m) with {config.grad_accum} "
                "micro-batches")
    if term == "pp send":
        return f"pp {mesh.pp}: activations and gradients sent between stages"
    if term == "offload":
        moved = [f"{what} over PCIe" for what, target in (("optimizer", choice.offload_optimizer),
                                                          ("params", choice.offload_params)) if target != Offload.NONE]
        return "offload traffic: " + (", ".join(moved) or "none")
    return "CPU optimizer step" if choice.offload_optimizer != Offload.NONE else "optimizer step on the GPU"


def reason(config: RankedConfig, best: RankedConfig) -> str:
    """Rank 1: the compute share and the largest other term; below: how much more GPU time per token than #1
    and the term most of it is in."""
    step = config.step
    if config is best or config.rank == 1:
        others = {name: value for name, value in step.terms.items() if name != "compute"}
        worst = max(others, key=others.get)
        share = step.terms["compute"] / step.seconds
        return f"cheapest: {share:.0%} of the step is compute; largest other term: {_why(config, worst)}"
    per_token = {name: value / step.tokens for name, value in step.terms.items()}
    best_per_token = {name: value / best.step.tokens for name, value in best.step.terms.items()}
    extra = {name: per_token[name] - best_per_token[name] for name in per_token}
    worst = max(extra, key=extra.get)
    slower = step.gpu_seconds_per_token / best.step.gpu_seconds_per_token - 1
    if slower < 0.0005:
        return f"same cost as #1 within 0.05% ({_data_parallel(config)}); the simpler config ranks first"
    return f"+{slower:.1%} vs #1, mostly {worst}: {_why(config, worst)}"
