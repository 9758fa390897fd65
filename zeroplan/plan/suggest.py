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


class _Option(NamedTuple):
    what: str
    change: str
    fields: dict


def _dimensions(training: TrainingSpec) -> list[list[_Option]]:
    """The memory-saving changes of one configuration, each dimension's options weakest first: a smaller
    micro-batch (the same sequences per step: accumulation makes up the rest), checkpointing, a higher ZeRO stage,
    CPU offload."""
    micro = [_Option(f"micro-batch {m} x {training.grad_accum * training.micro_batch // m} accumulation steps "
                     "(the same batch)", f"--micro-batch {m} --grad-accum {training.grad_accum * training.micro_batch // m}",
                     {"micro_batch": m, "grad_accum": training.grad_accum * training.micro_batch // m})
             for m in (training.micro_batch // 2**k for k in range(1, training.micro_batch.bit_length()))
             if m >= 1 and training.micro_batch % m == 0]
    ckpt = [_Option(f"{mode.value} activation checkpointing", f"--checkpointing {mode.value}",
                    {"checkpointing": mode, "checkpoint_every": None})
            for mode in (Checkpointing.SELECTIVE, Checkpointing.OP, Checkpointing.FULL) if mode != training.checkpointing]
    stages = [_Option(f"ZeRO stage {stage}", f"--zero {stage}", {"zero_stage": stage})
              for stage in ENGINE_STAGES[training.engine] if stage > training.zero_stage]
    offload = []
    if training.engine == Engine.DEEPSPEED:
        offload = [_Option("CPU offload of the optimizer states", "--offload-optimizer cpu",
                           {"offload_optimizer": Offload.CPU, "zero_stage": max(training.zero_stage, 1)}),
                   _Option("CPU offload of the optimizer and parameters (ZeRO-Infinity)",
                           "--zero 3 --offload-optimizer cpu --offload-params cpu",
                           {"offload_optimizer": Offload.CPU, "offload_params": Offload.CPU, "zero_stage": 3})]
    elif training.engine == Engine.FSDP2:  # CPUOffloadPolicy moves parameters and optimizer together
        offload = [_Option("CPU offload of the optimizer and parameters (FSDP2 CPUOffloadPolicy)",
                           "--offload-optimizer cpu --offload-params cpu",
                           {"offload_optimizer": Offload.CPU, "offload_params": Offload.CPU})]
    return [dim for dim in (micro, ckpt, stages, offload) if dim]


def suggest_changes(model, training: TrainingSpec, budget_bytes: int, max_gpus: int = MAX_SUGGESTED_GPUS) -> list[Suggestion]:
    """For one configuration over `budget_bytes`: the smallest changes that fit, each checked by an estimate
    (`zeroplan.estimate.fit`, or the worst rank's on a mesh). First the single changes (the weakest option of
    each kind that fits, and the fewest GPUs by doubling); if none fits, the kinds combined: every kind's strongest
    option, then each kind backed off to its weakest option that still fits, and the fewest GPUs with them."""
    def peak(fields: dict) -> int | None:
        from zeroplan.estimate import fit
        from zeroplan.plan.mesh_fit import worst_within

        try:
            changed = training.varied(**fields)
            if changed.mesh.is_trivial:
                found = fit(model, changed).peak_bytes
                return found if found <= budget_bytes else None
            worst = worst_within(model, changed, budget_bytes)
        except SpecError:
            return None
        return None if worst is None else worst.estimate.peak_bytes

    def fewest_gpus(fields: dict) -> tuple[int, int] | None:
        gpus = training.gpus
        while gpus * 2 <= max_gpus:
            gpus *= 2
            found = peak({**fields, "gpus": gpus})
            if found is not None:
                return gpus, found
        return None

    def describe(options: list[_Option], gpus: int | None, bytes_: int) -> Suggestion:
        whats = [option.what for option in options] + ([f"{gpus} GPUs"] if gpus else [])
        flags: dict[str, str] = {}  # an option given twice (ZeRO-Infinity's --zero 3 and a stage's) once
        for option in options:
            words = option.change.split()
            flags.update(zip(words[::2], words[1::2]))
        if gpus:
            flags["--gpus"] = str(gpus)
        return Suggestion(" ".join(f"{flag} {value}" for flag, value in flags.items()), " + ".join(whats), bytes_)

    found: list[Suggestion] = []
    dimensions = _dimensions(training)
    for options in dimensions:
        for option in options:
            bytes_ = peak(option.fields)
            if bytes_ is not None:
                found.append(describe([option], None, bytes_))
                break
    more = fewest_gpus({})
    if more:
        found.append(describe([], *more))
    if found:
        return found
    strongest = [options[-1] for options in dimensions]
    combined = {key: value for option in strongest for key, value in option.fields.items()}
    if peak(combined) is not None:  # back each kind off to its weakest option that still fits with the others
        chosen = list(strongest)
        for index, options in enumerate(dimensions):
            for option in options:
                trial = chosen[:index] + [option] + chosen[index + 1:]
                if peak({key: value for o in trial for key, value in o.fields.items()}) is not None:
                    chosen = trial
                    break
        for index in reversed(range(len(chosen))):  # and drop the kinds it fits without
            trial = chosen[:index] + chosen[index + 1:]
            if peak({key: value for o in trial for key, value in o.fields.items()}) is not None:
                chosen = trial
        fields = {key: value for option in chosen for key, value in option.fields.items()}
        found.append(describe(chosen, None, peak(fields)))
    for options in ([], [dim[-1] for dim in dimensions if "zero_stage" in dim[-1].fields][:1],
                    [dim[-1] for dim in dimensions if {"zero_stage", "checkpointing"} & set(dim[-1].fields)][:2]):
        # more GPUs: as configured, then with the highest stage, then with full checkpointing too
        more = fewest_gpus({key: value for option in options for key, value in option.fields.items()})
        if more:
            found.append(describe(options, *more))
            break
    return found
