"""When nothing fits: the smallest changes that would, each found by a search, never guessed.

For `plan`: allow more checkpointing policies, CPU offload, every ZeRO stage, more host memory, more GPUs (the
smallest doubling that fits), a GPU with more memory, then the same with checkpointing and offload allowed.
For `estimate` (one configuration): a smaller micro-batch (the same tokens per step: the accumulation makes up the
rest), a checkpointing policy, a higher ZeRO stage, offload, more GPUs; the first of each kind that fits."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from zeroplan.errors import SpecError
from zeroplan.plan.meshes import mesh_label
from zeroplan.plan.policies import DEFAULT_POLICIES
from zeroplan.spec.training import ENGINE_STAGES, Checkpointing, Engine, Offload, TrainingSpec

if TYPE_CHECKING:
    from zeroplan.plan.search import Hit, Limits, Planner, SearchSpace

MAX_SUGGESTED_GPUS = 65536


def _describe(planner: Planner, hit: Hit) -> str:
    accumulation = f" x {hit.grad_accum} accumulation" if hit.grad_accum > 1 else ""
    mesh = "" if hit.choice.mesh.is_trivial else f", {mesh_label(hit.choice.mesh, hit.choice.gpus)}"
    return f"{hit.choice.label()}{mesh}, micro-batch {hit.micro_batch}{accumulation}"


def suggest(planner: Planner, space: SearchSpace, limits: Limits, max_gpus: int = MAX_SUGGESTED_GPUS) -> list[str]:
    """When nothing in `space` fits: the smallest changes that would, each checked by a search."""
    from zeroplan.importers.gpus import all_gpus
    from zeroplan.spec.units import format_bytes

    found = []
    every_policy = tuple(dict.fromkeys((*space.checkpointing, *DEFAULT_POLICIES)))
    if set(space.checkpointing) != set(every_policy):
        hit = planner.best(replace(space, checkpointing=every_policy), limits)
        if hit:
            found.append(f"allow activation checkpointing (--checkpointing {hit.choice.policy.label}): {_describe(planner, hit)}")
    if Offload.CPU not in space.offload_targets:
        hit = planner.best(replace(space, offload_targets=tuple(space.offload_targets) + (Offload.CPU,)), limits)
        if hit:
            found.append(f"allow CPU offload (--offload cpu): {_describe(planner, hit)}")
    stages = ENGINE_STAGES[planner.base.engine]
    if space.zero_stages is not None and set(space.zero_stages) != set(stages):
        hit = planner.best(replace(space, zero_stages=None), limits)
        if hit:
            found.append(f"allow ZeRO-{hit.choice.zero_stage} (--zero {hit.choice.zero_stage}): {_describe(planner, hit)}")
    if limits.cpu_memory_bytes is not None:
        hit = planner.best(space, replace(limits, cpu_memory_bytes=None))
        if hit and hit.choice.mesh.is_trivial:
            needed = planner.fit_at(hit.choice, hit.micro_batch, hit.grad_accum).per_node.cpu_bytes
            found.append(f"more CPU memory per node ({format_bytes(needed, 'GiB')}): {_describe(planner, hit)}")
    relaxed_space = replace(space, checkpointing=every_policy, zero_stages=None,
                            offload_targets=tuple(dict.fromkeys((*space.offload_targets, Offload.CPU))))
    relaxed_limits = replace(limits, cpu_memory_bytes=None)
    # More GPUs or a bigger GPU: first as searched, then (if nothing smaller worked) with everything else allowed.
    attempts = [(space, limits, "")]
    if not found and (relaxed_space, relaxed_limits) != (space, limits):
        attempts.append((relaxed_space, relaxed_limits, " with checkpointing, every ZeRO stage and CPU offload allowed"))
    for try_space, try_limits, extra in attempts:
        gpus = max(space.gpu_counts)
        while gpus * 2 <= max_gpus:
            gpus *= 2
            if space.global_batch is not None and space.global_batch % gpus:
                break
            hit = planner.best(replace(try_space, gpu_counts=(gpus,)), try_limits)
            if hit:
                found.append(f"use {gpus} GPUs (--gpus {gpus}){extra}: {_describe(planner, hit)}")
                break
        for gpu in all_gpus():
            if gpu.memory_bytes <= limits.gpu_memory_bytes:
                continue
            hit = planner.best(try_space, replace(try_limits, gpu_memory_bytes=gpu.memory_bytes))
            if hit:
                found.append(f"a GPU with more memory (--gpu {gpu.name}, {gpu.stated_memory}){extra}: {_describe(planner, hit)}")
                break
        if found:
            break
    if not found:
        found.append(f"nothing tried fits (up to {max_gpus} GPUs, every GPU preset): shorten the sequence or use model "
                     "parallelism (--mesh)")
    return found


class Suggestion(NamedTuple):
    """One change to a configuration that makes it fit: the options to give, in words, and its peak."""

    change: str  # the command-line options, e.g. "--micro-batch 1 --grad-accum 4"
    what: str  # the same in words
    peak_bytes: int


def suggest_changes(model, training: TrainingSpec, budget_bytes: int, max_gpus: int = MAX_SUGGESTED_GPUS) -> list[Suggestion]:
    """For one configuration over `budget_bytes`: the first change of each kind that fits, each checked by an
    estimate (`zeroplan.estimate.fit`, or the worst rank's on a mesh)."""
    found: list[Suggestion] = []

    def peak(changed: TrainingSpec) -> int | None:
        from zeroplan.estimate import fit
        from zeroplan.plan.mesh_fit import worst_within

        try:
            if changed.mesh.is_trivial:
                return fit(model, changed).peak_bytes
            worst = worst_within(model, changed, budget_bytes)
        except SpecError:
            return None
        return None if worst is None else worst.estimate.peak_bytes

    def attempt(what: str, change: str, **fields) -> bool:
        try:
            changed = training.varied(**fields)
        except SpecError:
            return False
        bytes_ = peak(changed)
        if bytes_ is not None and bytes_ <= budget_bytes:
            found.append(Suggestion(change, what, bytes_))
            return True
        return False

    micro = training.micro_batch // 2
    while micro >= 1:  # the same sequences per step: accumulation makes up the rest
        accum = training.grad_accum * training.micro_batch // micro
        if training.micro_batch % micro == 0 and attempt(
                f"a smaller micro-batch ({micro}, {accum} accumulation steps for the same batch)",
                f"--micro-batch {micro} --grad-accum {accum}", micro_batch=micro, grad_accum=accum):
            break
        micro //= 2
    for mode in (Checkpointing.SELECTIVE, Checkpointing.OP, Checkpointing.FULL):
        if mode != training.checkpointing and attempt(f"{mode.value} activation checkpointing",
                                                      f"--checkpointing {mode.value}", checkpointing=mode,
                                                      checkpoint_every=None):
            break
    for stage in ENGINE_STAGES[training.engine]:
        if stage > training.zero_stage and attempt(f"ZeRO stage {stage}", f"--zero {stage}", zero_stage=stage):
            break
    if training.engine != Engine.TORCH and training.offload_optimizer == Offload.NONE:
        stage = max(training.zero_stage, 1)
        both = training.engine == Engine.FSDP2  # CPUOffloadPolicy moves parameters and optimizer together
        if not (both and attempt("CPU offload of the optimizer and parameters (FSDP2 CPUOffloadPolicy)",
                                 "--offload-optimizer cpu --offload-params cpu", offload_optimizer=Offload.CPU,
                                 offload_params=Offload.CPU, zero_stage=max(stage, 2))):
            if not attempt("CPU offload of the optimizer states", f"--offload-optimizer cpu --zero {stage}",
                           offload_optimizer=Offload.CPU, zero_stage=stage) and training.engine == Engine.DEEPSPEED:
                attempt("CPU offload of the optimizer and parameters (ZeRO-Infinity)",
                        "--zero 3 --offload-optimizer cpu --offload-params cpu", zero_stage=3,
                        offload_optimizer=Offload.CPU, offload_params=Offload.CPU)
    gpus = training.gpus
    while gpus * 2 <= max_gpus:
        gpus *= 2
        if attempt(f"{gpus} GPUs", f"--gpus {gpus}", gpus=gpus):
            break
    return found
