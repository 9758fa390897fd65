"""`zeroplan plan`: search ZeRO stage x offload x checkpointing x micro-batch (x GPU count) for the
configurations that fit, and rank them by the step-cost model of `zeroplan.plan.cost`.

Speed comes from the estimator's structure, not from approximating it. For one choice of
everything but the micro-batch, the memory never shrinks as the micro-batch grows (activations,
logits and their temporaries scale with the sequences in flight; model states and engine buffers
do not depend on them), and gradient accumulation changes it only by whether it is on (one
accumulated gradient is kept: `grad_accum > 1` in the engine profiles). So the configurations of a
choice that fit are a prefix of its sorted micro-batches, and the answer is known exactly once the
last that fits and the first that does not have each had a full estimate. Where to look first comes
from neighbouring choices and from the convexity of the peak in the micro-batch
(`Planner._gpu_prefix`): about two full estimates per choice, whatever the number of micro-batches.
`tests/test_plan.py` checks monotonicity and convexity over a grid of models, engines and stages,
and every verdict of the search against a full estimate.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from zeroplan.errors import FieldError, SpecError
from zeroplan.estimate import Fit
from zeroplan.estimate.activations.transformer import memory_checkpointing
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.result import Estimate
from zeroplan.plan.cost import (Assumptions, ModelFlops, StepCost, StepCostModel, gathered_params, model_flops,
                                step_cost_model)
from zeroplan.plan.limits import MAX_GPUS
from zeroplan.spec.training import ENGINE_STAGES, Checkpointing, Engine, Offload, TrainingSpec, config_label

Estimator = Callable[..., Estimate]

DEFAULT_HEADROOM = 0.05
"""Fraction of GPU memory kept free by default: covers what the driver reserves (a 80 GiB H100
shows 79.1 GiB to PyTorch) and allocator fragmentation beyond the estimate's overhead term."""


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may vary. Micro-batches are powers of two up to `max_micro_batch`
    (`micro_batches="pow2"`) or every whole number up to it ("all"); with `global_batch`, only
    those that divide global_batch / gpus (grad_accum makes up the rest)."""

    zero_stages: tuple[int, ...] | None = None  # None: every stage the engine runs (ENGINE_STAGES)
    offload_targets: tuple[Offload, ...] = (Offload.NONE, Offload.CPU)
    checkpointing: tuple[Checkpointing, ...] = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)
    gpu_counts: tuple[int, ...] = (8,)
    max_micro_batch: int = 1024
    micro_batches: Literal["pow2", "all"] = "pow2"
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
            raise FieldError("headroom", f"must be in [0, 1), got {self.headroom}")

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * (1 - self.headroom))


class Choice(NamedTuple):
    """Everything the planner varies except the micro-batch and accumulation (a named tuple: the
    planner keys its caches by it, and a tuple hashes without Python code)."""

    zero_stage: int
    offload_optimizer: Offload
    offload_params: Offload
    checkpointing: Checkpointing
    gpus: int

    def label(self) -> str:
        return config_label(self.zero_stage, self.offload_optimizer, self.offload_params, self.checkpointing)


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
    estimate_calls: int  # estimates and fits made (`zeroplan.estimate.estimate` and `fit`), probes included
    top: tuple[RankedConfig, ...]
    largest_micro_batch: RankedConfig | None  # the fitting config with the most sequences per micro-batch
    suggestions: tuple[str, ...]  # when nothing fits: the smallest changes that would fit
    notes: tuple[str, ...] = field(default=())


class Hit(NamedTuple):
    """A configuration that fits, as the search keeps it; sorts cheapest first, then simplest."""

    seconds_per_token: float
    order: int  # position of the choice in the enumeration: lower stage, less offload, less recompute first
    minus_micro_batch: int  # larger micro-batch first among equals
    choice: Choice
    grad_accum: int

    @property
    def micro_batch(self) -> int:
        return -self.minus_micro_batch


class Planner:
    """Evaluates configurations of one model; caches what it learns across searches (so that the
    'nothing fits' suggestions re-use the main search's estimates)."""

    def __init__(self, model, base: TrainingSpec, assumptions: Assumptions, estimator: Estimator | None = None):
        """`estimator` stands in for `zeroplan.estimate.estimate`, and then decides fits too;
        by default fits are decided by `zeroplan.estimate.fit` (the same peak, faster)."""
        if estimator is None:
            from zeroplan.estimate import estimate as estimator
            from zeroplan.estimate import fit as fitter
        else:
            fitter = estimator
        self.model = model
        self.base = base
        self.assumptions = assumptions
        self._estimate = estimator
        self._fit = fitter
        self.estimate_calls = 0  # estimates and fits
        self._validated: dict[Choice, TrainingSpec | str] = {}  # validated without checkpointing, by choice
        # by (memory twin, micro-batch, accumulation): a fit, replaced by the full estimate once one is made
        self._evaluations: dict[tuple[Choice, int, int], Fit | Estimate] = {}
        self._costs: dict[Choice, StepCostModel] = {}
        # the checkpointing mode whose activations each mode's equal (the base's attention, engine, precision)
        self._memory_modes = {mode: memory_checkpointing(base.model_copy(update={"checkpointing": mode}), model)
                              for mode in Checkpointing}
        self._flops: ModelFlops | None = None

    # -- building blocks -------------------------------------------------------------------------
    def estimate(self, training: TrainingSpec) -> Estimate:
        self.estimate_calls += 1
        return self._estimate(self.model, training)

    def _checked(self, choice: Choice) -> TrainingSpec | str:
        """`choice` validated without its checkpointing mode (an enum field no validator reads, so
        one validation serves every mode), or why the combination is invalid."""
        found = self._validated.get(choice)
        if found is None:
            key = choice._replace(checkpointing=Checkpointing.NONE)
            found = self._validated.get(key)
            if found is None:
                found = self._validated[key] = self._validate(key)
            self._validated[choice] = found
        return found

    def _validate(self, choice: Choice) -> TrainingSpec | str:
        try:
            return self.base.varied(zero_stage=choice.zero_stage, offload_optimizer=choice.offload_optimizer,
                                    offload_params=choice.offload_params, checkpointing=choice.checkpointing, gpus=choice.gpus)
        except SpecError as error:
            label = config_label(choice.zero_stage, choice.offload_optimizer, choice.offload_params)
            return f"{label} on {choice.gpus} GPUs skipped: {error}"

    def training(self, choice: Choice, micro_batch: int, grad_accum: int) -> TrainingSpec:
        checked = self._checked(choice)
        if isinstance(checked, str):
            raise SpecError(checked)
        # The checkpointing mode no validator reads, micro_batch and grad_accum validated (>= 1)
        # by construction here: copying skips re-validation.
        return checked.model_copy(update={"checkpointing": choice.checkpointing, "micro_batch": micro_batch,
                                          "grad_accum": grad_accum})

    def model_flops(self) -> ModelFlops:
        if self._flops is None:  # parameter counts: the same for every configuration of the base
            facts = model_facts(self.model, self.base)
            self._flops = model_flops(self.model, facts.total_params, facts.trainable_params)
        return self._flops

    def cost_model(self, choice: Choice) -> StepCostModel:
        if choice not in self._costs:
            # (the cost model reads neither the micro-batch nor the accumulation)
            spec = self.training(choice, self.base.micro_batch, self.base.grad_accum)
            flops = self.model_flops()
            if spec.quant is not None:  # a 4-bit base is gathered as the packed storage the estimate shards
                flops = replace(flops, gathered_params=gathered_params(model_facts(self.model, spec)))
            self._costs[choice] = step_cost_model(flops, spec, self.assumptions)
        return self._costs[choice]

    def memory_twin(self, choice: Choice) -> Choice:
        """The choice whose estimates `choice` shares: itself, or with the checkpointing mode whose
        activations its own equal (`memory_checkpointing`: selective under fused attention keeps
        what no checkpointing keeps). Only the step cost tells the two apart."""
        checkpointing = self._memory_modes[choice.checkpointing]
        return choice if checkpointing == choice.checkpointing else choice._replace(checkpointing=checkpointing)

    def estimate_at(self, choice: Choice, micro_batch: int, grad_accum: int) -> Estimate:
        """The full estimate of one configuration, cached and shared with its memory twin (built
        from its fit where there is one)."""
        key = (self.memory_twin(choice), micro_batch, grad_accum)
        found = self._evaluations.get(key)
        if isinstance(found, Fit):
            found = self._evaluations[key] = found.estimate()
        elif found is None:
            found = self._evaluations[key] = self.estimate(self.training(key[0], micro_batch, grad_accum))
        return found

    def fit_at(self, choice: Choice, micro_batch: int, grad_accum: int) -> Fit | Estimate:
        """The peak and host bytes of one configuration (`zeroplan.estimate.fit`), cached (the
        suggestions re-search with other limits) and shared with its memory twin."""
        key = (self.memory_twin(choice), micro_batch, grad_accum)
        found = self._evaluations.get(key)
        if found is None:
            self.estimate_calls += 1
            found = self._evaluations[key] = self._fit(self.model, self.training(key[0], micro_batch, grad_accum))
        return found

    def fitting_prefix(self, choice: Choice, pairs: Sequence[tuple[int, int]], limits: Limits, hint: int | None = None) -> int:
        """How many of `pairs` (micro-batch ascending, all accumulating or none) fit on the GPU
        and, per node, in host memory and on NVMe. Host bytes never shrink with the micro-batch
        either, so the configurations that fit the host are a prefix too. `hint`, a guess of the
        answer (the previous choice's), only changes how many estimates it takes."""
        count = self._gpu_prefix(choice, pairs, limits, hint)
        cpu_limit = limits.cpu_memory_bytes
        nvme_limit = limits.nvme_bytes or 0

        def host_fits(index: int) -> bool:
            node = self.fit_at(choice, *pairs[index]).per_node
            return (cpu_limit is None or node.cpu_bytes <= cpu_limit) and node.nvme_bytes <= nvme_limit

        if count == 0 or host_fits(count - 1):
            return count
        low, high = -1, count - 1  # host fits pairs[:low + 1], not pairs[high:]
        while high - low > 1:
            middle = (low + high) // 2
            if host_fits(middle):
                low = middle
            else:
                high = middle
        return low + 1

    def _gpu_prefix(self, choice: Choice, pairs: Sequence[tuple[int, int]], limits: Limits, hint: int | None = None) -> int:
        """How many of `pairs` have a peak within the GPU budget.

        Correctness needs one property: the peak never shrinks as the micro-batch grows, so the
        pairs that fit are a prefix, and the answer is k once pairs[k - 1] is seen to fit and
        pairs[k] is seen not to (or k is 0 or the end). Speed comes from good first probes: the
        hint (neighbouring choices often share their answer, settling it in two estimates), then
        the convexity of g(m) = peak(m) - budget in the micro-batch m, since every phase of an
        engine profile is the largest of a few points whose bytes are affine in m (activations
        and logits are tokens x constants, plus what the batch shares). For a convex g the line
        through the last two fitting probes meets zero at or after the last fitting m, and the
        chord between a fitting and a failing probe meets zero at or before it. Both properties
        are checked against full estimates in tests/test_plan.py; if convexity failed, only the
        number of probes would grow."""
        budget = limits.budget_bytes
        if len(pairs) == 1:  # e.g. a global batch without accumulation: one micro-batch, one probe
            return int(self.fit_at(choice, *pairs[0]).peak_bytes <= budget)
        micros = [micro for micro, _ in pairs]
        excess: dict[int, int] = {}

        def fits(index: int) -> bool:
            excess[index] = self.fit_at(choice, *pairs[index]).peak_bytes - budget
            return excess[index] <= 0

        low, high = -1, len(pairs)  # pairs[:low + 1] fit and pairs[high:] do not; low and high seen (or bounds)
        previous = None  # the fitting probe before `low`
        first = hint - 1 if hint is not None and 0 < hint <= len(pairs) else 0
        while high - low > 1:
            if first is not None:
                guess, first = first, None
            elif low < 0:
                guess = 0
            elif high < len(pairs):  # chord between the bracket's ends: its zero is a fitting m if g is convex
                zero = micros[low] - excess[low] * (micros[high] - micros[low]) / (excess[high] - excess[low])
                guess = bisect_right(micros, zero) - 1
            elif previous is not None:  # secant through the last two fitting probes: nothing fits past its zero
                slope = (excess[low] - excess[previous]) / (micros[low] - micros[previous])
                guess = len(pairs) - 1 if slope <= 0 else bisect_right(micros, micros[low] - excess[low] / slope) - 1
            else:
                guess = low + 1
            guess = min(max(guess, low + 1), high - 1)
            if fits(guess):
                previous, low = (low if low >= 0 else None), guess
            else:
                high = guess
        return low + 1

    # -- search ----------------------------------------------------------------------------------
    def choices(self, space: SearchSpace, limits: Limits) -> tuple[list[Choice], list[str]]:
        targets = [t for t in space.offload_targets if t != Offload.NVME or limits.nvme_bytes is not None]
        valid, notes = [], []
        for gpus in space.gpu_counts:
            for stage in space.zero_stages or ENGINE_STAGES[self.base.engine]:
                if stage == 0 or self.base.engine == Engine.TORCH:  # DDP and ZeroRedundancyOptimizer do not offload
                    offloads = [(Offload.NONE, Offload.NONE)]
                elif stage < 3:
                    offloads = [(target, Offload.NONE) for target in targets]
                elif self.base.engine == Engine.FSDP2:  # CPUOffloadPolicy moves parameters and optimizer together
                    offloads = [(target, target) for target in targets]
                else:
                    offloads = [(opt, params) for opt in targets for params in targets]
                for opt, params in offloads:
                    for checkpointing in space.checkpointing:
                        choice = Choice(stage, opt, params, checkpointing, gpus)
                        spec = self._checked(choice)
                        if isinstance(spec, str):
                            if spec not in notes:
                                notes.append(spec)
                        else:
                            valid.append(choice)
        return valid, notes

    def micro_batches(self, space: SearchSpace, gpus: int) -> list[tuple[int, int]]:
        """(micro_batch, grad_accum) pairs searched on `gpus` GPUs, micro-batch ascending; empty if
        the global batch does not split over `gpus`."""
        if space.micro_batches == "all":
            micros = range(1, space.max_micro_batch + 1)
        else:
            micros = [2**power for power in range(space.max_micro_batch.bit_length()) if 2**power <= space.max_micro_batch]
        if space.global_batch is None:
            return [(micro, self.base.grad_accum) for micro in micros]
        if space.global_batch % gpus:
            return []
        per_gpu = space.global_batch // gpus
        return [(micro, per_gpu // micro) for micro in micros if per_gpu % micro == 0]

    def search(self, space: SearchSpace, limits: Limits) -> tuple[int, list[Hit], list[str]]:
        """Every configuration of `space`: (how many were evaluated, the ones that fit sorted
        cheapest first, notes on what was skipped)."""
        choices, notes = self.choices(space, limits)
        evaluated = 0
        fitting: list[Hit] = []
        # per GPU count: the micro-batches without accumulation and with it (searched apart)
        groups_by_gpus: dict[int, list[tuple[bool, list[tuple[int, int]], list[int]]]] = {}
        for gpus in space.gpu_counts:
            pairs = self.micro_batches(space, gpus)
            if not pairs:
                notes.append(f"{gpus} GPUs skipped: global batch {space.global_batch} is not divisible by {gpus}")
            groups = [(on, [pair for pair in pairs if (pair[1] > 1) == on]) for on in (False, True)]
            groups_by_gpus[gpus] = [(on, group, [micro for micro, _ in group]) for on, group in groups if group]
        # Answers so far (the largest fitting micro-batch, 0 for none) as hints for the next choice:
        # the same choice on another GPU count, else the last one with the same checkpointing (which
        # moves the answer most) on this GPU count, else the last one on this GPU count.
        hints: dict[tuple, int] = {}
        for order, choice in enumerate(choices):
            seconds_per_token = None  # the cost model, built only for a choice where something fits
            for accumulating, group, micros in groups_by_gpus[choice.gpus]:
                evaluated += len(group)
                same = (choice.zero_stage, choice.offload_optimizer, choice.offload_params, choice.checkpointing, accumulating)
                near, last = (choice.gpus, accumulating, choice.checkpointing), (choice.gpus, accumulating)
                hint = None
                if len(group) > 1:
                    twin = self.memory_twin(choice)
                    hint = hints.get((twin, accumulating)) if twin != choice else None  # its answer, from shared estimates
                    if hint is None:
                        hint = hints.get(same, hints.get(near, hints.get(last)))
                    if hint is not None:
                        hint = bisect_right(micros, hint)
                count = self.fitting_prefix(choice, group, limits, hint)
                hints[same] = hints[near] = hints[last] = hints[(choice, accumulating)] = group[count - 1][0] if count else 0
                if count and seconds_per_token is None:
                    seconds_per_token = self.cost_model(choice).seconds_per_token
                for micro, accum in group[:count]:
                    fitting.append(Hit(seconds_per_token(micro, accum), order, -micro, choice, accum))
        fitting.sort()
        return evaluated, fitting, notes


# -- explaining the ranking ----------------------------------------------------------------------
def _frozen_volume(stage: int, engine: Engine) -> str:
    """What `step_cost_model` moves with frozen parameters: gradients and updated parameters are the
    trained Ψt; stage 3 and FSDP2 gather all Ψ for compute."""
    if stage == 3:
        return "2Ψ + Ψt per micro-batch"
    if stage == 2:
        return "Ψ + Ψt per micro-batch" if engine == Engine.FSDP2 else "Ψt per micro-batch + Ψt per step"
    return "3Ψt per step" if stage == 1 and engine == Engine.TORCH else "2Ψt per step"


def _why(cost: StepCost, choice: Choice, micro_batch: int, training: TrainingSpec, flops: ModelFlops) -> dict[str, str]:
    stage = choice.zero_stage
    volume = "3Ψ per micro-batch" if stage == 3 else ("Ψ per micro-batch + Ψ per step" if stage == 2 else "2Ψ per step")
    if flops.trainable_params < flops.params:  # gradients and updated parameters are the trained Ψt only
        volume = _frozen_volume(stage, training.engine)
        volume += f" (Ψt = {flops.trainable_params:,} trained)"
    where = "across nodes" if choice.gpus > training.node_gpus else "inside a node"
    offloaded = [f"{what} over PCIe" for what, target in (("optimizer", choice.offload_optimizer), ("params", choice.offload_params)) if target != Offload.NONE]
    return {
        "compute": f"micro-batch {micro_batch} x {training.seq_len} tokens",
        "recompute": f"{choice.checkpointing.value} checkpointing recomputes in backward",
        "communication": f"ZeRO-{stage} moves {volume} {where}",
        "offload": "offload traffic: " + (", ".join(offloaded) or "none"),
        "optimizer": "CPU optimizer step" if choice.offload_optimizer != Offload.NONE else "optimizer step on the GPU",
    }


def _reason(rank: int, cost: StepCost, best: StepCost, choice: Choice, micro_batch: int, training: TrainingSpec,
            flops: ModelFlops) -> str:
    why = _why(cost, choice, micro_batch, training, flops)
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
        return f"same cost as #1 within 0.05% ({why['communication']}); the simpler config ranks first"
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
        raise FieldError("global_batch", f"must be at least 1, got {space.global_batch}")
    if space.global_batch is not None and all(space.global_batch % gpus for gpus in space.gpu_counts):
        counts = ", ".join(str(g) for g in space.gpu_counts)
        raise FieldError("global_batch", f"{space.global_batch} is not divisible by the GPU count ({counts})")
    return _plan(planner or Planner(model, base, assumptions, estimator), model, space, limits, assumptions, top)


def _plan(planner: Planner, model, space: SearchSpace, limits: Limits, assumptions: Assumptions, top: int) -> Plan:
    evaluated, fitting, notes = planner.search(space, limits)
    # A configuration whose memory twin is another choice (selective checkpointing under fused
    # attention) fits exactly where its twin does and costs at least as much (it only adds
    # recomputation): it is counted, not ranked.
    candidates = [hit for hit in fitting if planner.memory_twin(hit.choice) == hit.choice]
    if len(candidates) < len(fitting):
        notes.append(f"{len(fitting) - len(candidates)} configurations with selective checkpointing are not ranked: under "
                     "fused attention it keeps what no checkpointing keeps (the kernel stores no attention scores) "
                     "and only adds recomputation")
    ranked = []
    for hit in candidates[:top]:
        ranked.append(_ranked(planner, len(ranked) + 1, hit, ranked[0].cost if ranked else None))
    largest = None
    if candidates:  # the most sequences per micro-batch; the cheapest of those
        index = min(range(len(candidates)), key=lambda i: (candidates[i].minus_micro_batch, i))
        largest = _ranked(planner, index + 1, candidates[index], ranked[0].cost)
    for config in ranked[:1]:  # e.g. "model given by parameter count: activations are not estimated"
        notes.extend(note for note in config.estimate.notes if note not in notes)
    estimate_calls = planner.estimate_calls  # the search and the shown configs; not the suggestions
    suggestions = () if fitting else tuple(suggest(planner, space, limits))
    return Plan(
        model_name=getattr(model, "name", "model"),
        limits=limits,
        assumptions=assumptions,
        evaluated=evaluated,
        fitting=len(fitting),
        estimate_calls=estimate_calls,
        top=tuple(ranked),
        largest_micro_batch=largest,
        suggestions=suggestions,
        notes=tuple(notes),
    )


def _ranked(planner: Planner, rank: int, hit: Hit, best: StepCost | None) -> RankedConfig:
    choice, micro, accum = hit.choice, hit.micro_batch, hit.grad_accum
    training = planner.training(choice, micro, accum)
    cost = planner.cost_model(choice).step_cost(micro, accum)
    reason = _reason(rank, cost, best or cost, choice, micro, training, planner.model_flops())
    return RankedConfig(rank, choice, micro, accum, training, planner.estimate_at(choice, micro, accum), cost, reason)


def _best(planner: Planner, space: SearchSpace, limits: Limits) -> Hit | None:
    _, fitting, _ = planner.search(space, limits)
    return fitting[0] if fitting else None


def suggest(planner: Planner, space: SearchSpace, limits: Limits, max_gpus: int = 65536) -> list[str]:
    """When nothing in `space` fits: the smallest changes that would, each checked by a search."""
    from dataclasses import replace

    from zeroplan.importers.gpus import all_gpus
    from zeroplan.spec.units import format_bytes

    found = []

    def describe(hit: Hit) -> str:
        accumulation = f" x {hit.grad_accum} accumulation" if hit.grad_accum > 1 else ""
        return f"{hit.choice.label()}, micro-batch {hit.micro_batch}{accumulation}"

    all_checkpointing = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)
    if set(space.checkpointing) != set(all_checkpointing):
        hit = _best(planner, replace(space, checkpointing=all_checkpointing), limits)
        if hit:
            found.append(f"allow activation checkpointing (--checkpointing {hit.choice.checkpointing.value}): {describe(hit)}")
    if Offload.CPU not in space.offload_targets:
        hit = _best(planner, replace(space, offload_targets=tuple(space.offload_targets) + (Offload.CPU,)), limits)
        if hit:
            found.append(f"allow CPU offload (--offload cpu): {describe(hit)}")
    if limits.cpu_memory_bytes is not None:
        hit = _best(planner, space, replace(limits, cpu_memory_bytes=None))
        if hit:
            needed = planner.fit_at(hit.choice, hit.micro_batch, hit.grad_accum).per_node.cpu_bytes
            found.append(f"more CPU memory per node ({format_bytes(needed, 'GiB')}): {describe(hit)}")
    relaxed_space = replace(space, checkpointing=all_checkpointing,
                            offload_targets=tuple(dict.fromkeys((*space.offload_targets, Offload.CPU))))
    relaxed_limits = replace(limits, cpu_memory_bytes=None)
    # More GPUs or a bigger GPU: first as searched, then (if nothing smaller worked) together with
    # checkpointing and unlimited CPU offload.
    attempts = [(space, limits, "")]
    if not found and (relaxed_space, relaxed_limits) != (space, limits):
        attempts.append((relaxed_space, relaxed_limits, " with checkpointing and CPU offload allowed"))
    for try_space, try_limits, extra in attempts:
        gpus = max(space.gpu_counts)
        while gpus * 2 <= max_gpus:
            gpus *= 2
            if space.global_batch is not None and space.global_batch % gpus:
                break
            hit = _best(planner, replace(try_space, gpu_counts=(gpus,)), try_limits)
            if hit:
                found.append(f"use {gpus} GPUs (--gpus {gpus}){extra}: {describe(hit)}")
                break
        for gpu in all_gpus():
            if gpu.memory_bytes <= limits.gpu_memory_bytes:
                continue
            hit = _best(planner, try_space, replace(try_limits, gpu_memory_bytes=gpu.memory_bytes))
            if hit:
                found.append(f"a GPU with more memory (--gpu {gpu.name}, {gpu.stated_memory}){extra}: {describe(hit)}")
                break
        if found:
            break
    if not found:
        found.append(f"nothing tried fits (up to {max_gpus} GPUs, every GPU preset): shorten the sequence or use model parallelism")
    return found


def parse_gpu_counts(text: str) -> tuple[int, ...]:
    """'8' -> (8,); '8,16,64' -> as listed; '8-64' -> powers of two times 8 up to 64: (8, 16, 32, 64)."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            if high > MAX_GPUS:
                raise FieldError("gpu_counts", f"at most {MAX_GPUS:,} GPUs, got {text!r}")
            counts, gpus = [], low
            while gpus <= high:
                counts.append(gpus)
                gpus *= 2
            return tuple(counts)
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise FieldError("gpu_counts", f"cannot read {text!r}; write 8, 8,16,64 or a range 8-64 (doubling)") from None
    if any(count < 1 for count in counts):
        raise FieldError("gpu_counts", f"counts must be at least 1, got {text!r}")
    if len(set(counts)) < len(counts):
        raise FieldError("gpu_counts", f"a count is listed more than once in {text!r}")
    if max(counts) > MAX_GPUS:
        raise FieldError("gpu_counts", f"at most {MAX_GPUS:,} GPUs, got {text!r}")
    return counts
