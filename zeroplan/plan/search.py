"""`zeroplan plan` (with or without `--mesh`): one search over GPU count x mesh x ZeRO stage x offload x
checkpointing policy x micro-batch for the configurations that fit, ranked by the step-time model of
`zeroplan.plan.step_time` (a data-parallel plan is the search over the mesh of ones).

Exactness comes from the estimator; speed from its structure, not from approximating it:
- Micro-batches are searched in groups whose memory grows with the micro-batch: within a group the
  configurations that fit are a prefix, found with a few fit checks. A group shares whether gradients
  accumulate (one accumulated gradient is kept: `grad_accum > 1`) and, under a pipeline, how many
  micro-batches each rank keeps in flight; so a fixed global batch, whose accumulation falls as the
  micro-batch grows, is searched exactly (memory need not grow from one group to the next). Where to probe
  first comes from neighbouring choices and, for a data-parallel choice, the convexity of the peak in the
  micro-batch (`Planner.gpu_prefix`); tests/plan/test_search.py checks every verdict against a full estimate.
- A choice whose memory equals another's (selective checkpointing under fused attention without a ring)
  shares its fit checks (`Planner.memory_twin`).
- `plan --mesh` searches many meshes: each choice's cost is known before its memory (the step time needs no
  estimate), so choices are checked cheapest first, and once `top` choices fit, a choice whose cheapest
  micro-batch costs more than the top-th is not checked (`Plan.bounded` counts them): the plan shown is the
  one the full search gives (tests/plan/test_mesh_speed.py).
- A candidate the training spec refuses (a mesh whose degrees do not fit the GPUs, an offload the engine does
  not run) is skipped with a note, never an error.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from zeroplan.errors import FieldError, SpecError
from zeroplan.estimate import Fit, FitModel
from zeroplan.estimate import estimate_mesh_unnamed
from zeroplan.estimate.activations.transformer import memory_checkpointing
from zeroplan.estimate.parallel.mesh import rank_kinds
from zeroplan.estimate.result import MeshEstimate
from zeroplan.estimate.result import Estimate
from zeroplan.plan.limits import MAX_GPUS
from zeroplan.plan.mesh_fit import worst_within
from zeroplan.plan.meshes import mesh_label, meshes, world_runs
from zeroplan.plan.policies import DEFAULT_POLICIES, Policy
from zeroplan.plan.rates import Rates
from zeroplan.plan.step_time import SharedWork, StepModel, StepTime
from zeroplan.plan.work import Pace, pace, work
from zeroplan.spec.mesh import MeshSpec, check_mesh
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import ENGINE_STAGES, Checkpointing, Engine, Offload, TrainingSpec, config_label

Estimator = Callable[..., Estimate]

DEFAULT_HEADROOM = 0.05
"""Fraction of GPU memory kept free by default: covers what the driver reserves (a 80 GiB H100
shows 79.1 GiB to PyTorch) and allocator fragmentation beyond the estimate's overhead term."""


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may vary. Micro-batches are powers of two up to `max_micro_batch`
    (`micro_batches="pow2"`) or every whole number up to it ("all"); with `global_batch`, only those
    that divide global_batch / (data-parallel ranks) (grad_accum makes up the rest). `mesh`: "none"
    (data parallelism only, or the base's own mesh), "search" (every mesh of `meshes`, `given` fixed)."""

    zero_stages: tuple[int, ...] | None = None  # None: every stage the engine runs (ENGINE_STAGES)
    offload_targets: tuple[Offload, ...] = (Offload.NONE, Offload.CPU)
    checkpointing: tuple[Policy, ...] = DEFAULT_POLICIES
    gpu_counts: tuple[int, ...] = (8,)
    max_micro_batch: int = 1024
    micro_batches: Literal["pow2", "all"] = "pow2"
    global_batch: int | None = None
    mesh: Literal["none", "search"] = "none"
    given: tuple[tuple[str, Any], ...] = ()  # mesh dimensions the search keeps fixed (MeshSpec field, value)


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
    mesh: MeshSpec = MeshSpec()
    checkpoint_every: int | None = None

    def label(self) -> str:
        label = config_label(self.zero_stage, self.offload_optimizer, self.offload_params, self.checkpointing)
        return label + (f" every {self.checkpoint_every}" if self.checkpoint_every else "")

    @property
    def policy(self) -> Policy:
        return Policy(self.checkpointing, self.checkpoint_every)


@dataclass(frozen=True)
class RankedConfig:
    """One configuration that fits, with its full (per-rank) estimate, its step time and why it ranks there. The
    estimate is the planner's, without the ledger nothing in a plan reads (`zeroplan.estimate.estimate_mesh` of
    `training` names its terms)."""

    rank: int
    choice: Choice
    micro_batch: int
    grad_accum: int
    training: TrainingSpec
    estimate: MeshEstimate
    step: StepTime
    reason: str

    @property
    def worst(self) -> Estimate:
        """The estimate of the rank with the highest peak (the whole estimate without a mesh)."""
        return self.estimate.worst.estimate


@dataclass(frozen=True)
class Plan:
    model_name: str
    limits: Limits
    rates: Rates
    evaluated: int  # configurations whose fit was decided
    fitting: int  # of which fit
    estimate_calls: int  # estimates and fit checks made, probes included
    top: tuple[RankedConfig, ...]
    largest_micro_batch: RankedConfig | None  # the fitting config with the most sequences per micro-batch
    suggestions: tuple[str, ...]  # when nothing fits: the smallest changes that would
    notes: tuple[str, ...] = field(default=())
    bounded: int = 0  # choices not checked: at no micro-batch could they rank in the top (`Plan` docstring)
    gpu_counts: tuple[int, ...] = ()
    mesh_search: bool = False


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
    'nothing fits' suggestions re-use the main search's fit checks)."""

    def __init__(self, model, base: TrainingSpec, rates: Rates, estimator: Estimator | None = None):
        """`estimator` stands in for `zeroplan.estimate.estimate` and then decides the fits of data-parallel
        choices; by default fits are decided by `zeroplan.estimate.FitModel` (`fit`'s peak, what the micro-batch
        does not change computed once per choice) and, on a mesh, by the worst rank's estimate (`mesh_fit.worst_within`)."""
        self.model = model
        self.base = base
        self.rates = rates
        self._estimator = estimator
        self.estimate_calls = 0
        self._validated: dict[Choice, TrainingSpec | str] = {}
        # data parallel, by (memory twin, micro-batch, accumulation): a fit
        self._fits: dict[tuple[Choice, int, int], Fit | Estimate] = {}
        self._fit_models: dict[Choice, FitModel] = {}  # data parallel, by memory twin
        # meshes, by (memory twin, micro-batch, accumulation, budget): the worst rank's peak, or None over it
        self._mesh_fits: dict[tuple[Choice, int, int, int], int | None] = {}
        self._steps: dict[Choice, StepModel] = {}
        self._work: dict[tuple, SharedWork] = {}  # (gpus, mesh, policy): the step model's work and rooflines
        self._paces: dict[tuple, Pace] = {}  # (gpus, mesh): the slowest rank
        # the checkpointing mode whose activations each mode's equal (the base's attention, engine, precision)
        self._memory_modes = {mode: memory_checkpointing(base.model_copy(update={"checkpointing": mode}), model)
                              for mode in Checkpointing}

    # -- building blocks -------------------------------------------------------------------------
    def _checked(self, choice: Choice) -> TrainingSpec | str:
        """`choice` validated without its checkpointing policy (an enum no validator reads, and checkpoint_every,
        valid with full checkpointing by construction), or why the combination is invalid."""
        found = self._validated.get(choice)
        if found is None:
            key = choice._replace(checkpointing=Checkpointing.NONE, checkpoint_every=None)
            found = self._validated.get(key)
            if found is None:
                found = self._validated[key] = self._validate(key)
            self._validated[choice] = found
        return found

    def _validate(self, choice: Choice) -> TrainingSpec | str:
        try:
            return self.base.varied(zero_stage=choice.zero_stage, offload_optimizer=choice.offload_optimizer,
                                    offload_params=choice.offload_params, checkpointing=Checkpointing.NONE,
                                    checkpoint_every=None, gpus=choice.gpus, mesh=choice.mesh)
        except SpecError as error:
            return str(error)

    def describe(self, choice: Choice, policy: bool = True) -> str:
        """A choice in a note: its label, mesh and GPU count."""
        label = choice.label() if policy else config_label(choice.zero_stage, choice.offload_optimizer, choice.offload_params)
        mesh = "" if choice.mesh.is_trivial else f" with {mesh_label(choice.mesh, choice.gpus)}"
        return f"{label}{mesh} on {choice.gpus} GPUs"

    def training(self, choice: Choice, micro_batch: int, grad_accum: int) -> TrainingSpec:
        checked = self._checked(choice)
        if isinstance(checked, str):
            raise SpecError(f"{self.describe(choice, policy=False)} skipped: {checked}")
        # the policy no validator reads (checkpoint_every with full, by construction), micro_batch and grad_accum
        # validated (>= 1) by construction here: copying skips re-validation
        return checked.model_copy(update={"checkpointing": choice.checkpointing, "checkpoint_every": choice.checkpoint_every,
                                          "micro_batch": micro_batch, "grad_accum": grad_accum})

    def step_model(self, choice: Choice) -> StepModel:
        """The choice's step-time model (it reads neither the micro-batch nor the accumulation)."""
        found = self._steps.get(choice)
        if found is None:
            training = self.training(choice, self.base.micro_batch, self.base.grad_accum)
            key = (choice.gpus, choice.mesh, choice.policy)  # what the work depends on
            shared = self._work.get(key)
            if shared is None:
                slowest = self._paces.get(key[:2])  # the slowest rank: the mesh's, whatever the policy
                if slowest is None:
                    slowest = self._paces[key[:2]] = pace(self.model, training)
                shared = self._work[key] = SharedWork(work(self.model, training), slowest, {})
            found = self._steps[choice] = StepModel(self.model, training, self.rates, shared)
        return found

    def memory_twin(self, choice: Choice) -> Choice:
        """The choice whose fit checks `choice` shares: itself, or with the checkpointing mode whose
        activations its own equal (`memory_checkpointing`: selective under fused attention keeps what no
        checkpointing keeps), where no context-parallel ring tells them apart (estimate/mesh_cp.py). Only
        the step time tells the two apart."""
        if not self.shares_fits(choice):
            return choice
        return choice._replace(checkpointing=self._memory_modes[choice.checkpointing])

    def shares_fits(self, choice: Choice) -> bool:
        """Whether `choice`'s memory twin is another choice (`memory_twin`)."""
        return self._memory_modes[choice.checkpointing] != choice.checkpointing and choice.mesh.cp == 1

    def fit_at(self, choice: Choice, micro_batch: int, grad_accum: int) -> Fit | Estimate:
        """The peak and host bytes of a data-parallel configuration (`zeroplan.estimate.fit`, by the twin's
        `FitModel`), cached (the suggestions re-search with other limits) and shared with its memory twin."""
        key = (self.memory_twin(choice), micro_batch, grad_accum)
        found = self._fits.get(key)
        if found is None:
            self.estimate_calls += 1
            if self._estimator is not None:
                found = self._estimator(self.model, self.training(key[0], micro_batch, grad_accum))
            else:
                model = self._fit_models.get(key[0])
                if model is None:
                    model = self._fit_models[key[0]] = FitModel(self.model, self.training(key[0], micro_batch, grad_accum))
                found = model.at(micro_batch, grad_accum)
            self._fits[key] = found
        return found

    def mesh_peak(self, choice: Choice, micro_batch: int, grad_accum: int, budget_bytes: int) -> int | None:
        """The worst rank's peak of a mesh configuration if every rank fits `budget_bytes`, else None (a rank
        the model's rules refuse is None too: its choice is noted, `search`)."""
        key = (self.memory_twin(choice), micro_batch, grad_accum, budget_bytes)
        if key not in self._mesh_fits:
            self.estimate_calls += 1
            try:
                worst = worst_within(self.model, self.training(key[0], micro_batch, grad_accum), budget_bytes)
            except SpecError:
                worst = None
            self._mesh_fits[key] = None if worst is None else worst.estimate.peak_bytes
        return self._mesh_fits[key]

    def fitting_prefix(self, choice: Choice, pairs: Sequence[tuple[int, int]], limits: Limits,
                       hint: int | None = None) -> int:
        """How many of `pairs` (micro-batch ascending, one memory group) fit on the GPU and, per node, in
        host memory and on NVMe. Host bytes never shrink with the micro-batch either, so the configurations
        that fit the host are a prefix too. `hint`, a guess of the answer (the previous choice's), only
        changes how many fit checks it takes."""
        if not choice.mesh.is_trivial:
            budget = limits.budget_bytes
            return _bisect_prefix(len(pairs), lambda i: self.mesh_peak(choice, *pairs[i], budget) is not None, hint)
        count = self.gpu_prefix(choice, pairs, limits, hint)
        cpu_limit = limits.cpu_memory_bytes
        nvme_limit = limits.nvme_bytes or 0

        def host_fits(index: int) -> bool:
            node = self.fit_at(choice, *pairs[index]).per_node
            return (cpu_limit is None or node.cpu_bytes <= cpu_limit) and node.nvme_bytes <= nvme_limit

        if count == 0 or host_fits(count - 1):
            return count
        return _bisect_prefix(count, host_fits, None)

    def gpu_prefix(self, choice: Choice, pairs: Sequence[tuple[int, int]], limits: Limits, hint: int | None = None) -> int:
        """How many of `pairs` have a peak within the GPU budget.

        Correctness needs one property: the peak never shrinks as the micro-batch grows within a group, so
        the pairs that fit are a prefix, and the answer is k once pairs[k - 1] is seen to fit and pairs[k]
        is seen not to (or k is 0 or the end). Speed comes from good first probes: the hint (neighbouring
        choices often share their answer, settling it in two fit checks), then the convexity of
        g(m) = peak(m) - budget in the micro-batch m, since every phase of an engine profile is the largest
        of a few points whose bytes are affine in m. For a convex g the line through the last two fitting
        probes meets zero at or after the last fitting m, and the chord between a fitting and a failing
        probe meets zero at or before it. Both properties are checked against full estimates in
        tests/plan/test_search.py; if convexity failed, only the number of probes would grow."""
        budget = limits.budget_bytes
        if len(pairs) == 1:
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
                guess = bisect.bisect_right(micros, zero) - 1
            elif previous is not None:  # secant through the last two fitting probes: nothing fits past its zero
                slope = (excess[low] - excess[previous]) / (micros[low] - micros[previous])
                guess = len(pairs) - 1 if slope <= 0 else bisect.bisect_right(micros, micros[low] - excess[low] / slope) - 1
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
        """Every valid choice of `space`, and a note for each combination skipped (one per reason)."""
        targets = [t for t in space.offload_targets if t != Offload.NVME or limits.nvme_bytes is not None]
        valid: list[Choice] = []
        reasons: dict[str, list[str]] = {}  # why candidates were refused: the choices described
        engine = self.base.engine
        for gpus in space.gpu_counts:
            for mesh in self.meshes(space, gpus):
                for stage in space.zero_stages or ENGINE_STAGES[engine]:
                    if not mesh.is_trivial and not world_runs(mesh, gpus, self.base, stage):
                        continue  # every policy and micro-batch of it would fail the same rule: none to note
                    if stage == 0 or engine == Engine.TORCH:  # DDP and ZeroRedundancyOptimizer do not offload
                        offloads = [(Offload.NONE, Offload.NONE)]
                    elif not mesh.is_trivial:  # meshes are searched without offload
                        offloads = [(Offload.NONE, Offload.NONE)]
                    elif stage < 3:
                        offloads = [(target, Offload.NONE) for target in targets]
                    elif engine == Engine.FSDP2:  # CPUOffloadPolicy moves parameters and optimizer together
                        offloads = [(target, target) for target in targets]
                    else:
                        offloads = [(opt, params) for opt in targets for params in targets]
                    for opt, params in offloads:
                        for policy in space.checkpointing:
                            choice = Choice(stage, opt, params, policy.mode, gpus, mesh, policy.every)
                            refused = self.refused(choice)
                            if refused is None:
                                valid.append(choice)
                            else:
                                reasons.setdefault(refused[1], []).append(refused[0])
        if not valid and reasons:  # nothing to search: every candidate refused, and the first reason is the answer
            reason, described = next(iter(reasons.items()))
            raise SpecError(f"{described[0]} skipped: {reason}")
        # one note per reason, however many candidates it refused
        notes = [f"{described[0]} skipped: {reason}" if len(described) == 1 else
                 f"{len(described)} choices skipped (e.g. {described[0]}): {reason}" for reason, described in reasons.items()]
        return valid, notes

    def refused(self, choice: Choice) -> tuple[str, str] | None:
        """Why the training spec or, on a mesh, the model's rules refuse `choice`: (the choice described, the
        reason); None where they accept it."""
        spec = self._checked(choice)
        if isinstance(spec, str):
            return self.describe(choice, policy=False), spec
        if choice.mesh.is_trivial:
            return None
        accum = max(self.base.grad_accum, 2 * choice.mesh.pp) if choice.mesh.pp > 1 else self.base.grad_accum
        try:
            check_mesh(self.model, self.training(choice, self.base.micro_batch, accum))
        except SpecError as error:
            return self.describe(choice), str(error)
        return None

    def meshes(self, space: SearchSpace, gpus: int) -> list[MeshSpec]:
        """The meshes of `gpus` GPUs the space searches: the base's own (all ones without --mesh), or every
        mesh `meshes` enumerates with the given dimensions fixed."""
        if space.mesh == "none":
            return [self.base.mesh]
        if not isinstance(self.model, TransformerSpec):
            raise SpecError("mesh: a model given by parameter count cannot be cut by tp/cp/pp; give its config")
        return meshes(self.model, self.base, gpus, dict(space.given))

    def micro_batches(self, space: SearchSpace, gpus: int, mesh: MeshSpec = MeshSpec()) -> list[tuple[int, int]]:
        """(micro_batch, grad_accum) pairs searched on `gpus` GPUs cut by `mesh`, micro-batch ascending; empty if
        the global batch does not split over the data-parallel ranks. Without a global batch a pipeline runs at
        least 2 x pp micro-batches per step (torchtitan needs at least pp for 1F1B)."""
        if space.micro_batches == "all":
            micros = range(1, space.max_micro_batch + 1)
        else:
            micros = [2**power for power in range(space.max_micro_batch.bit_length()) if 2**power <= space.max_micro_batch]
        if space.global_batch is None:
            accum = max(self.base.grad_accum, 2 * mesh.pp) if mesh.pp > 1 else self.base.grad_accum
            return [(micro, accum) for micro in micros]
        data_parallel = gpus // mesh.model_ranks
        if space.global_batch % data_parallel:
            return []
        per_rank = space.global_batch // data_parallel
        return [(micro, per_rank // micro) for micro in micros if per_rank % micro == 0]

    def groups(self, mesh: MeshSpec, pairs: list[tuple[int, int]]) -> list[tuple[Any, list[tuple[int, int]]]]:
        """`pairs` split into the groups within which memory grows with the micro-batch on `mesh`: whether gradients
        accumulate, and under a pipeline how many micro-batches each rank keeps in flight."""
        grouped: dict[Any, list[tuple[int, int]]] = {}
        for pair in pairs:
            key: Any = pair[1] > 1
            if mesh.pp > 1:
                key = (key, tuple(kind.in_flight for kind in rank_kinds(self.model, mesh, pair[1])))
            grouped.setdefault(key, []).append(pair)
        return list(grouped.items())

    def search(self, space: SearchSpace, limits: Limits, top: int | None = None,
               price_twins: bool = True) -> tuple[int, list[Hit], list[str], int]:
        """The configurations of `space` that fit, cheapest first: (configurations decided, hits, notes on what
        was skipped, choices not checked). With `top`, choices are checked cheapest first and those whose
        cheapest micro-batch costs more than the top-th checked choice's are not checked (`Plan.bounded`). Without
        `price_twins`, the hits of a choice that shares its twin's fit checks are counted, not priced (their
        `seconds_per_token` is infinite, so they sort last): for a caller that never shows them (`plan`)."""
        choices, notes = self.choices(space, limits)
        pairs_by: dict[tuple[int, MeshSpec], list[tuple[int, int]]] = {}
        for choice in choices:
            key = (choice.gpus, choice.mesh)
            if key not in pairs_by:
                pairs_by[key] = self.micro_batches(space, *key)
                if not pairs_by[key]:
                    where = f"{choice.gpus} GPUs" + ("" if choice.mesh.is_trivial else f" with {mesh_label(choice.mesh, choice.gpus)}")
                    notes.append(f"{where} skipped: global batch {space.global_batch} does not split over its "
                                 f"{choice.gpus // choice.mesh.model_ranks} data-parallel ranks")
        pairs = [pairs_by[(choice.gpus, choice.mesh)] for choice in choices]
        groups_by = {key: self.groups(key[1], found) for key, found in pairs_by.items()}  # the same for every choice
        order = list(range(len(choices)))
        if top is not None:
            bounds = {index: min(map(self.step_model(choices[index]).seconds_per_token, *zip(*pairs[index])))
                      for index in order if pairs[index]}
            order = sorted(bounds, key=lambda index: (bounds[index], index))
        evaluated, bounded = 0, 0
        fitting: list[Hit] = []
        best: list[float] = []  # the cheapest fitting configuration of each choice checked, ascending
        hints: dict[tuple, int] = {}
        for position, index in enumerate(order):
            choice = choices[index]
            if top is not None and len(best) >= top and bounds[index] > best[top - 1]:
                bounded = len(order) - position
                break
            cheapest = None
            for accumulating, group in groups_by[(choice.gpus, choice.mesh)]:
                evaluated += len(group)
                micros = [micro for micro, _ in group]
                hint = self._hint(hints, choice, accumulating, micros)
                count = self.fitting_prefix(choice, group, limits, hint)
                self._remember(hints, choice, accumulating, group[count - 1][0] if count else 0)
                if count and not price_twins and self.shares_fits(choice):
                    fitting.extend(Hit(math.inf, index, -micro, choice, accum) for micro, accum in group[:count])
                elif count:
                    step = self.step_model(choice)
                    for micro, accum in group[:count]:
                        hit = Hit(step.seconds_per_token(micro, accum), index, -micro, choice, accum)
                        fitting.append(hit)
                        cheapest = hit.seconds_per_token if cheapest is None else min(cheapest, hit.seconds_per_token)
            if cheapest is not None and not self.shares_fits(choice):  # a twin is counted, never shown
                bisect.insort(best, cheapest)
        fitting.sort()
        return evaluated, fitting, notes, bounded

    def _hint(self, hints: dict, choice: Choice, accumulating, micros: list[int]) -> int | None:
        """A guess of how many of `micros` fit: the memory twin's answer, else the same choice on another GPU
        count, else the last choice with the same policy (which moves the answer most), else the last one."""
        if len(micros) < 2:
            return None
        twin = self.memory_twin(choice)
        found = hints.get((twin, accumulating)) if twin != choice else None
        if found is None:
            same = (choice.zero_stage, choice.offload_optimizer, choice.offload_params, choice.policy, choice.mesh, accumulating)
            found = hints.get(same, hints.get((choice.gpus, accumulating, choice.policy), hints.get((choice.gpus, accumulating))))
        return None if found is None else bisect.bisect_right(micros, found)

    @staticmethod
    def _remember(hints: dict, choice: Choice, accumulating, largest: int) -> None:
        same = (choice.zero_stage, choice.offload_optimizer, choice.offload_params, choice.policy, choice.mesh, accumulating)
        for key in (same, (choice.gpus, accumulating, choice.policy), (choice.gpus, accumulating), (choice, accumulating)):
            hints[key] = largest

    def best(self, space: SearchSpace, limits: Limits) -> Hit | None:
        """The cheapest configuration of `space` that fits `limits`, or None."""
        _, fitting, _, _ = self.search(space, limits, top=1 if space.mesh == "search" else None)
        return fitting[0] if fitting else None


def _bisect_prefix(length: int, fits: Callable[[int], bool], hint: int | None) -> int:
    """How many of `length` items fit, the ones that fit being a prefix: bisection, after probing the hint (a
    guess of the answer: its last fitting item and the first after it)."""
    low, high = -1, length  # items [0, low] fit, items [high, length) do not
    if hint is not None and 0 < hint <= length:
        if fits(hint - 1):
            low = hint - 1
            if hint < length:
                low, high = (hint, high) if fits(hint) else (low, hint)
        else:
            high = hint - 1
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low + 1


def plan(model, base: TrainingSpec, space: SearchSpace, limits: Limits, rates: Rates, top: int = 5,
         estimator: Estimator | None = None, planner: Planner | None = None, cost_bound: bool = True) -> Plan:
    """Search `space` for configurations of `model` that fit `limits`, cheapest first: each choice shown once,
    at its cheapest micro-batch. A mesh search checks choices cheapest first and leaves out those that cannot
    rank in the top (`cost_bound`; without it every choice is checked: the same plan, tests/plan/test_mesh_speed.py)."""
    from zeroplan.plan.reasons import reason
    from zeroplan.plan.suggest import suggest

    if space.global_batch is not None and space.global_batch < 1:
        raise FieldError("global_batch", f"must be at least 1, got {space.global_batch}")
    if space.global_batch is not None and all(space.global_batch % gpus for gpus in space.gpu_counts):
        counts = ", ".join(str(g) for g in space.gpu_counts)
        raise FieldError("global_batch", f"{space.global_batch} is not divisible by the GPU count ({counts})")
    planner = planner or Planner(model, base, rates, estimator)
    searching = space.mesh == "search"
    evaluated, fitting, notes, bounded = planner.search(space, limits, top=top if searching and cost_bound else None,
                                                        price_twins=False)
    # A configuration whose memory twin is another choice (selective checkpointing under fused attention)
    # fits exactly where its twin does and costs at least as much (it only adds recomputation): counted, not ranked.
    candidates = [hit for hit in fitting if not planner.shares_fits(hit.choice)]
    if len(candidates) < len(fitting):
        notes.append(f"{len(fitting) - len(candidates)} configurations with selective checkpointing are not ranked: under "
                     "fused attention it keeps what no checkpointing keeps (the kernel stores no attention scores) "
                     "and only adds recomputation")
    shown, seen = [], set()
    for hit in candidates:
        if hit.choice not in seen:
            seen.add(hit.choice)
            shown.append(hit)
    ranked: list[RankedConfig] = []
    for hit in shown[:top]:
        ranked.append(_ranked(planner, len(ranked) + 1, hit, ranked[0] if ranked else None, reason))
    largest = None
    if candidates and not searching:  # the most sequences per micro-batch; the cheapest of those
        index = min(range(len(candidates)), key=lambda i: (candidates[i].minus_micro_batch, i))
        position = next(i for i, hit in enumerate(shown) if hit.choice == candidates[index].choice)
        largest = _ranked(planner, position + 1, candidates[index], ranked[0], reason)
    for config in ranked[:1]:  # e.g. "model given by parameter count: activations are not estimated"
        notes.extend(note for note in config.worst.notes if note not in notes)
    estimate_calls = planner.estimate_calls  # the search and the shown configs; not the suggestions
    suggestions = () if fitting else tuple(suggest(planner, space, limits))
    return Plan(getattr(model, "name", "model"), limits, rates, evaluated, len(fitting), estimate_calls, tuple(ranked),
                largest, suggestions, tuple(notes), bounded, space.gpu_counts, searching)


def _ranked(planner: Planner, rank: int, hit: Hit, best: RankedConfig | None, reason) -> RankedConfig:
    choice, micro, accum = hit.choice, hit.micro_batch, hit.grad_accum
    training = planner.training(choice, micro, accum)
    planner.estimate_calls += 1
    estimate = estimate_mesh_unnamed(planner.model, training)  # the planner's fast mode: the same bytes, no names
    step = planner.step_model(choice).at(micro, accum)
    config = RankedConfig(rank, choice, micro, accum, training, estimate, step, "")
    return RankedConfig(rank, choice, micro, accum, training, estimate, step, reason(config, best or config))


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
