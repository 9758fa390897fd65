"""`zeroplan plan`: search ZeRO stage x offload x checkpointing x micro-batch (x GPU count) for the
configurations that fit, and rank them by the step-cost model of `zeroplan.cost`.

Speed comes from the estimator's structure, not from skipping it. For one choice of everything but
the micro-batch, each phase's bytes are affine in the micro-batch (activations, logits and their
temporaries scale with the sequences in flight; model states and engine buffers do not), so two
estimates (micro-batch 1 and 2) give every phase as `base + slope * micro_batch`. That is only used
where it is exact: a third full estimate at the largest micro-batch searched must agree byte for
byte on every phase and on the per-node bytes, or the planner falls back to one full estimate per
micro-batch for that choice. `tests/test_plan.py` checks the shortcut against full estimates over a
grid. Gradient accumulation enters the estimate only through whether it is on (an accumulated
gradient is kept), so the fit is made separately for grad_accum 1 and grad_accum > 1 and verified
the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from zeroplan.cost import Assumptions, ModelFlops, StepCost, StepCostModel, model_flops, step_cost_model
from zeroplan.errors import SpecError
from zeroplan.estimate.result import Estimate
from zeroplan.spec.training import Checkpointing, Offload, TrainingSpec

Estimator = Callable[..., Estimate]

DEFAULT_HEADROOM = 0.05
"""Fraction of GPU memory kept free by default: covers what the driver reserves (a 80 GiB H100
shows 79.1 GiB to PyTorch) and allocator fragmentation beyond the estimate's overhead term."""


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may vary. Micro-batches are powers of two up to `max_micro_batch`, or,
    with `global_batch`, the divisors of global_batch / gpus (grad_accum makes up the rest)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload_targets: tuple[Offload, ...] = (Offload.NONE, Offload.CPU)
    checkpointing: tuple[Checkpointing, ...] = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)
    gpu_counts: tuple[int, ...] = (8,)
    max_micro_batch: int = 1024
    global_batch: int | None = None


@dataclass(frozen=True)
class Limits:
    """Memory a configuration must fit in: per GPU (less the headroom), and per node on the host."""

    gpu_memory_bytes: int
    headroom: float = DEFAULT_HEADROOM
    cpu_memory_bytes: int | None = None  # per node; None = not limited
    nvme_bytes: int | None = None  # per node; None = no NVMe (nvme offload is not searched)

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < 1:
            raise SpecError(f"--headroom: must be in [0, 1), got {self.headroom}")

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * (1 - self.headroom))


@dataclass(frozen=True)
class Choice:
    """Everything the planner varies except the micro-batch and accumulation."""

    zero_stage: int
    offload_optimizer: Offload
    offload_params: Offload
    checkpointing: Checkpointing
    gpus: int

    def label(self) -> str:
        text = f"ZeRO-{self.zero_stage}"
        if self.offload_optimizer != Offload.NONE:
            text += f" opt->{self.offload_optimizer.value}"
        if self.offload_params != Offload.NONE:
            text += f" params->{self.offload_params.value}"
        if self.checkpointing != Checkpointing.NONE:
            text += f" ckpt {self.checkpointing.value}"
        return text


@dataclass(frozen=True)
class RankedConfig:
    """One configuration that fits, with its full estimate, its cost and why it ranks there."""

    rank: int
    choice: Choice
    micro_batch: int
    grad_accum: int
    training: TrainingSpec
    estimate: Estimate
    cost: StepCost
    reason: str


@dataclass(frozen=True)
class Plan:
    model_name: str
    limits: Limits
    assumptions: Assumptions
    evaluated: int  # configurations whose fit and cost were computed
    fitting: int
    estimate_calls: int  # full estimates made, probes included
    top: tuple[RankedConfig, ...]
    largest_micro_batch: RankedConfig | None  # the fitting config with the most sequences per micro-batch
    suggestions: tuple[str, ...]  # when nothing fits: the smallest changes that would fit
    notes: tuple[str, ...] = field(default=())


class _MemoryFit:
    """Per-phase bytes of one Choice as a function of the micro-batch: affine where verified,
    otherwise one full estimate per micro-batch (cached)."""

    __slots__ = ("phases", "cpu", "nvme", "exact")

    def __init__(self, phases, cpu, nvme, exact=None):
        self.phases = phases  # ((base, slope), ...) per phase total
        self.cpu = cpu  # (base, slope) per node
        self.nvme = nvme
        self.exact = exact  # callable micro_batch -> Estimate, when not affine


def _phase_totals(estimate: Estimate) -> tuple[int, ...]:
    return tuple(phase.total_bytes for phase in estimate.phases)


def _phase_keys(estimate: Estimate) -> tuple:
    return tuple((phase.step, phase.phase) for phase in estimate.phases)


class Planner:
    """Evaluates configurations of one model; caches what it learns across searches (so that the
    'nothing fits' suggestions re-use the main search's estimates)."""

    def __init__(self, model, base: TrainingSpec, assumptions: Assumptions, estimator: Estimator | None = None):
        if estimator is None:
            from zeroplan.estimate import estimate as estimator
        self.model = model
        self.base = base
        self.assumptions = assumptions
        self._estimate = estimator
        self.estimate_calls = 0
        self._specs: dict[Choice, TrainingSpec | str] = {}
        self._fits: dict[tuple[Choice, bool], _MemoryFit] = {}
        self._costs: dict[Choice, StepCostModel] = {}
        self._flops: ModelFlops | None = None
        self._base_dump = base.model_dump()

    # -- building blocks -------------------------------------------------------------------------
    def estimate(self, training: TrainingSpec) -> Estimate:
        self.estimate_calls += 1
        return self._estimate(self.model, training)

    def spec(self, choice: Choice) -> TrainingSpec | str:
        """The validated TrainingSpec of `choice`, or why the combination is invalid."""
        if choice not in self._specs:
            values = dict(self._base_dump)
            values.update(
                zero_stage=choice.zero_stage,
                offload_optimizer=choice.offload_optimizer,
                offload_params=choice.offload_params,
                checkpointing=choice.checkpointing,
                gpus=choice.gpus,
            )
            if self.base.gpus_per_node is not None and choice.gpus < self.base.gpus_per_node:
                values["gpus_per_node"] = choice.gpus
            try:
                self._specs[choice] = TrainingSpec.model_validate(values)
            except ValidationError as error:
                message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
                self._specs[choice] = f"{choice.label()} on {choice.gpus} GPUs skipped: {message}"
        return self._specs[choice]

    def training(self, choice: Choice, micro_batch: int, grad_accum: int) -> TrainingSpec:
        spec = self.spec(choice)
        if isinstance(spec, str):
            raise SpecError(spec)
        # micro_batch and grad_accum are validated (>= 1) by construction here; copying skips re-validation.
        return spec.model_copy(update={"micro_batch": micro_batch, "grad_accum": grad_accum})

    def cost_model(self, choice: Choice) -> StepCostModel:
        if choice not in self._costs:
            if self._flops is None:
                summary = self.estimate(self.training(choice, 1, 1)).model
                self._flops = model_flops(self.model, summary.params, summary.trainable_params)
            self._costs[choice] = step_cost_model(self._flops, self.spec(choice), self.assumptions)
        return self._costs[choice]

    def memory_fit(self, choice: Choice, accumulating: bool, largest_micro_batch: int, largest_accum: int) -> _MemoryFit:
        key = (choice, accumulating)
        fit = self._fits.get(key)
        if fit is not None:
            return fit
        accum = 2 if accumulating else 1
        one = self.estimate(self.training(choice, 1, accum))
        two = self.estimate(self.training(choice, 2, accum))
        fit = _affine(one, two)
        if fit is not None and largest_micro_batch > 2:
            check = self.estimate(self.training(choice, largest_micro_batch, largest_accum))
            if not _agrees(fit, check, largest_micro_batch):
                fit = None
        if fit is None:  # not affine: a full estimate per micro-batch
            cache: dict[int, Estimate] = {}

            def exact(micro_batch: int, grad_accum: int) -> Estimate:
                if (micro_batch, grad_accum) not in cache:
                    cache[(micro_batch, grad_accum)] = self.estimate(self.training(choice, micro_batch, grad_accum))
                return cache[(micro_batch, grad_accum)]

            fit = _MemoryFit((), (0, 0), (0, 0), exact)
        self._fits[key] = fit
        return fit

    # -- search ----------------------------------------------------------------------------------
    def choices(self, space: SearchSpace, limits: Limits) -> tuple[list[Choice], list[str]]:
        targets = [t for t in space.offload_targets if t != Offload.NVME or limits.nvme_bytes is not None]
        valid, notes = [], []
        for gpus in space.gpu_counts:
            for stage in space.zero_stages:
                if stage == 0:
                    offloads = [(Offload.NONE, Offload.NONE)]
                elif stage < 3:
                    offloads = [(target, Offload.NONE) for target in targets]
                else:
                    offloads = [(opt, params) for opt in targets for params in targets]
                for opt, params in offloads:
                    for checkpointing in space.checkpointing:
                        choice = Choice(stage, opt, params, checkpointing, gpus)
                        spec = self.spec(choice)
                        if isinstance(spec, str):
                            if spec not in notes:
                                notes.append(spec)
                        else:
                            valid.append(choice)
        return valid, notes

    def micro_batches(self, space: SearchSpace, gpus: int) -> list[tuple[int, int]]:
        """(micro_batch, grad_accum) pairs searched on `gpus` GPUs; empty if the global batch does not split."""
        if space.global_batch is None:
            pairs, micro = [], 1
            while micro <= space.max_micro_batch:
                pairs.append((micro, self.base.grad_accum))
                micro *= 2
            return pairs
        if space.global_batch % gpus:
            return []
        per_gpu = space.global_batch // gpus
        return [(m, per_gpu // m) for m in range(1, min(per_gpu, space.max_micro_batch) + 1) if per_gpu % m == 0]

    def search(self, space: SearchSpace, limits: Limits) -> tuple[int, list[tuple[float, int, Choice, int, int]], list[str]]:
        """Every configuration of `space`: returns (evaluated, fitting as (seconds per token, peak
        bytes, choice, micro, accum) sorted cheapest first, the lower peak first on a tie, notes)."""
        choices, notes = self.choices(space, limits)
        budget = limits.budget_bytes
        cpu_limit = limits.cpu_memory_bytes
        nvme_limit = limits.nvme_bytes if limits.nvme_bytes is not None else 0
        evaluated = 0
        fitting: list[tuple[float, int, Choice, int, int]] = []
        pairs_by_gpus = {gpus: self.micro_batches(space, gpus) for gpus in space.gpu_counts}
        for gpus, pairs in pairs_by_gpus.items():
            if not pairs:
                notes.append(f"{gpus} GPUs skipped: global batch {space.global_batch} is not divisible by {gpus}")
        for choice in choices:
            pairs = pairs_by_gpus[choice.gpus]
            if not pairs:
                continue
            cost = self.cost_model(choice)
            for accumulating in (False, True):
                group = [(m, a) for m, a in pairs if (a > 1) == accumulating]
                if not group:
                    continue
                largest = group[-1]
                fit = self.memory_fit(choice, accumulating, largest[0], largest[1])
                evaluated += len(group)
                if fit.exact is None:
                    phases, (cpu_base, cpu_slope), (nvme_base, nvme_slope) = fit.phases, fit.cpu, fit.nvme
                    for micro, accum in group:
                        peak = max(base + slope * micro for base, slope in phases)
                        if peak > budget:
                            continue
                        if cpu_limit is not None and cpu_base + cpu_slope * micro > cpu_limit:
                            continue
                        if nvme_base + nvme_slope * micro > nvme_limit:
                            continue
                        fitting.append((cost.seconds_per_token(micro, accum), peak, choice, micro, accum))
                else:
                    for micro, accum in group:
                        estimate = fit.exact(micro, accum)
                        if _fits(estimate, budget, cpu_limit, nvme_limit):
                            fitting.append((cost.seconds_per_token(micro, accum), estimate.peak_bytes, choice, micro, accum))
        fitting.sort(key=lambda item: item[:2])
        return evaluated, fitting, notes


def _affine(one: Estimate, two: Estimate) -> _MemoryFit | None:
    if _phase_keys(one) != _phase_keys(two):
        return None
    ones, twos = _phase_totals(one), _phase_totals(two)
    phases = tuple((2 * a - b, b - a) for a, b in zip(ones, twos))
    cpu = (2 * one.per_node.cpu_bytes - two.per_node.cpu_bytes, two.per_node.cpu_bytes - one.per_node.cpu_bytes)
    nvme = (2 * one.per_node.nvme_bytes - two.per_node.nvme_bytes, two.per_node.nvme_bytes - one.per_node.nvme_bytes)
    return _MemoryFit(phases, cpu, nvme)


def _agrees(fit: _MemoryFit, estimate: Estimate, micro_batch: int) -> bool:
    totals = _phase_totals(estimate)
    return (
        len(totals) == len(fit.phases)
        and all(base + slope * micro_batch == total for (base, slope), total in zip(fit.phases, totals))
        and fit.cpu[0] + fit.cpu[1] * micro_batch == estimate.per_node.cpu_bytes
        and fit.nvme[0] + fit.nvme[1] * micro_batch == estimate.per_node.nvme_bytes
    )


def _fits(estimate: Estimate, budget: int, cpu_limit: int | None, nvme_limit: int) -> bool:
    return (
        estimate.peak_bytes <= budget
        and (cpu_limit is None or estimate.per_node.cpu_bytes <= cpu_limit)
        and estimate.per_node.nvme_bytes <= nvme_limit
    )


# -- explaining the ranking ----------------------------------------------------------------------
def _why(cost: StepCost, choice: Choice, micro_batch: int, training: TrainingSpec) -> dict[str, str]:
    stage = choice.zero_stage
    volume = "3Ψ per micro-batch" if stage == 3 else ("Ψ per micro-batch + Ψ per step" if stage == 2 else "2Ψ per step")
    where = "across nodes" if choice.gpus > training.node_gpus else "inside a node"
    offloaded = [f"{what} over PCIe" for what, target in (("optimizer", choice.offload_optimizer), ("params", choice.offload_params)) if target != Offload.NONE]
    return {
        "compute": f"micro-batch {micro_batch} x {training.seq_len} tokens",
        "recompute": f"{choice.checkpointing.value} checkpointing recomputes in backward",
        "communication": f"ZeRO-{stage} moves {volume} {where}",
        "offload": "offload traffic: " + (", ".join(offloaded) or "none"),
        "optimizer": "CPU optimizer step" if choice.offload_optimizer != Offload.NONE else "optimizer step on the GPU",
    }


def _reason(rank: int, cost: StepCost, best: StepCost, choice: Choice, micro_batch: int, training: TrainingSpec) -> str:
    why = _why(cost, choice, micro_batch, training)
    per_token = {name: value / cost.tokens for name, value in cost.terms().items()}
    if rank == 1:
        overheads = {name: value for name, value in per_token.items() if name != "compute"}
        worst = max(overheads, key=overheads.get)
        share = per_token["compute"] / sum(per_token.values())
        return f"cheapest: {share:.0%} of the step is compute; largest other term: {why[worst]}"
    best_per_token = {name: value / best.tokens for name, value in best.terms().items()}
    extra = {name: per_token[name] - best_per_token[name] for name in per_token}
    worst = max(extra, key=extra.get)
    slower = cost.gpu_seconds_per_token / best.gpu_seconds_per_token - 1
    if slower < 0.0005:
        return f"same cost as #1 within 0.05% ({why['communication']}); ranked lower for a higher peak"
    return f"+{slower:.1%} vs #1, mostly {worst}: {why[worst]}"


def plan(
    model,
    base: TrainingSpec,
    space: SearchSpace,
    limits: Limits,
    assumptions: Assumptions,
    top: int = 5,
    estimator: Estimator | None = None,
    planner: Planner | None = None,
) -> Plan:
    """Search `space` for configurations of `model` that fit `limits`, cheapest first."""
    if space.global_batch is not None and space.global_batch < 1:
        raise SpecError(f"--global-batch: must be at least 1, got {space.global_batch}")
    if space.global_batch is not None and all(space.global_batch % gpus for gpus in space.gpu_counts):
        counts = ", ".join(str(g) for g in space.gpu_counts)
        raise SpecError(f"--global-batch: {space.global_batch} is not divisible by the GPU count ({counts})")
    planner = planner or Planner(model, base, assumptions, estimator)
    evaluated, fitting, notes = planner.search(space, limits)
    ranked = []
    for _, _, choice, micro, accum in fitting[:top]:
        ranked.append(_ranked(planner, len(ranked) + 1, choice, micro, accum, ranked[0].cost if ranked else None))
    largest = None
    if fitting:  # the most sequences per micro-batch; the cheapest of those
        index = min(range(len(fitting)), key=lambda i: (-fitting[i][3], fitting[i][0]))
        _, _, choice, micro, accum = fitting[index]
        largest = _ranked(planner, index + 1, choice, micro, accum, ranked[0].cost)
    suggestions = () if fitting else tuple(suggest(planner, space, limits))
    return Plan(
        model_name=getattr(model, "name", "model"),
        limits=limits,
        assumptions=assumptions,
        evaluated=evaluated,
        fitting=len(fitting),
        estimate_calls=planner.estimate_calls,
        top=tuple(ranked),
        largest_micro_batch=largest,
        suggestions=suggestions,
        notes=tuple(notes),
    )


def _ranked(planner: Planner, rank: int, choice: Choice, micro: int, accum: int, best: StepCost | None) -> RankedConfig:
    training = planner.training(choice, micro, accum)
    cost = planner.cost_model(choice).step_cost(micro, accum)
    reason = _reason(rank, cost, best or cost, choice, micro, training)
    return RankedConfig(rank, choice, micro, accum, training, planner.estimate(training), cost, reason)


def _best(planner: Planner, space: SearchSpace, limits: Limits):
    _, fitting, _ = planner.search(space, limits)
    return fitting[0] if fitting else None


def suggest(planner: Planner, space: SearchSpace, limits: Limits, max_gpus: int = 65536) -> list[str]:
    """When nothing in `space` fits: the smallest changes that would, each checked by a search."""
    from dataclasses import replace

    from zeroplan.gpus import all_gpus
    from zeroplan.units import format_bytes

    found = []

    def describe(hit) -> str:
        _, _, choice, micro, accum = hit
        return f"{choice.label()}, micro-batch {micro}" + (f" x {accum} accumulation" if accum > 1 else "")

    all_checkpointing = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)
    if set(space.checkpointing) != set(all_checkpointing):
        hit = _best(planner, replace(space, checkpointing=all_checkpointing), limits)
        if hit:
            found.append(f"allow activation checkpointing (--checkpointing {hit[2].checkpointing.value}): {describe(hit)}")
    if Offload.CPU not in space.offload_targets:
        hit = _best(planner, replace(space, offload_targets=tuple(space.offload_targets) + (Offload.CPU,)), limits)
        if hit:
            found.append(f"allow CPU offload (--offload cpu): {describe(hit)}")
    if limits.cpu_memory_bytes is not None:
        hit = _best(planner, space, replace(limits, cpu_memory_bytes=None))
        if hit:
            training = planner.training(hit[2], hit[3], hit[4])
            needed = planner.estimate(training).per_node.cpu_bytes
            found.append(f"more CPU memory per node ({format_bytes(needed, 'GiB')}): {describe(hit)}")
    gpus = max(space.gpu_counts)
    while gpus * 2 <= max_gpus:
        gpus *= 2
        if space.global_batch is not None and space.global_batch % gpus:
            break
        hit = _best(planner, replace(space, gpu_counts=(gpus,)), limits)
        if hit:
            found.append(f"use {gpus} GPUs (--gpus {gpus}): {describe(hit)}")
            break
    for gpu in all_gpus():
        if gpu.memory_bytes <= limits.gpu_memory_bytes:
            continue
        hit = _best(planner, space, replace(limits, gpu_memory_bytes=gpu.memory_bytes))
        if hit:
            found.append(f"a GPU with more memory (--gpu {gpu.name}, {gpu.stated_memory}): {describe(hit)}")
            break
    if not found:
        found.append("nothing tried fits: the model needs more GPUs than searched, or a smaller sequence length")
    return found


def parse_gpu_counts(text: str) -> tuple[int, ...]:
    """'8' -> (8,); '8,16,64' -> as listed; '8-64' -> powers of two times 8 up to 64: (8, 16, 32, 64)."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            counts, gpus = [], low
            while gpus <= high:
                counts.append(gpus)
                gpus *= 2
            return tuple(counts)
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"--gpus: cannot read {text!r}; write 8, 8,16,64 or a range 8-64 (doubling)") from None
    if any(count < 1 for count in counts):
        raise SpecError(f"--gpus: counts must be at least 1, got {text!r}")
    return counts

