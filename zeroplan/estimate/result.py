"""What an estimate returns: frozen, plain data, bytes as ints.

The categories are the ones `zeroplan measure` records, so each estimated term can be checked
against a measured one:
- params: parameter storage on the device (sharded, persistent, and the fp32 master where the
  engine keeps it as a parameter), not gathered copies;
- grads: gradient storage (per-parameter .grad, flat gradient partitions, accumulation buffers);
- optimizer_states: optimizer state tensors (Adam moments, momentum) and the fp32 master copy that
  mixed-precision optimizers keep;
- activations: tensors saved for backward in the forward pass, the logits and the loss;
- buffers: communication and gathering buffers of the engine (DDP buckets, DeepSpeed reduce and
  all-gather buckets, ZeRO-3/FSDP2 gathered parameters, reduce-scatter outputs);
- temporaries: what a phase allocates and frees again: optimizer-step intermediates, and in
  backward the gradients of activations (the logits' gradient first) and the block recomputed
  under checkpointing. `zeroplan measure` counts backward allocations no engine names the same way;
- overhead: what is not a tensor (CUDA context, allocator fragmentation); zero for a CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import NamedTuple


class Phase(str, Enum):
    """Phases of a training step, in order. The peak is the maximum over (step, phase)."""

    INIT = "init"  # model built, engine and optimizer created
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"


class Step(str, Enum):
    FIRST = "first"  # optimizer states do not exist yet before the first step() creates them
    STEADY = "steady"  # step 2 and later


class CategoryBytes(NamedTuple):
    """Bytes by category; `total_bytes` is their sum. A named tuple (immutable, as a frozen
    dataclass would be) because the planner builds hundreds of thousands of them."""

    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    activations: int = 0
    buffers: int = 0
    temporaries: int = 0
    overhead: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(CATEGORY_NAMES, self))

    def with_overhead(self, overhead: int) -> "CategoryBytes":
        return self._replace(overhead=self.overhead + overhead)

    def __add__(self, other: "CategoryBytes") -> "CategoryBytes":  # type: ignore[override]
        """Category by category (not tuple concatenation)."""
        return CategoryBytes(*(a + b for a, b in zip(self, other)))


CATEGORY_NAMES = CategoryBytes._fields
"""The one list of memory categories, in report order; every other part reads it from here."""

TENSOR_CATEGORIES = tuple(name for name in CATEGORY_NAMES if name != "overhead")
"""The categories of tensor bytes: what `zeroplan measure` records (overhead is not a tensor)."""


class PhaseBytes(NamedTuple):
    """Bytes live on one GPU at the peak of one phase of one step."""

    step: Step
    phase: Phase
    categories: CategoryBytes

    @property
    def total_bytes(self) -> int:
        return sum(self.categories)


class NodeBytes(NamedTuple):
    """Host-side memory per node under offload (pinned buffers included) and NVMe use."""

    cpu_bytes: int = 0
    pinned_bytes: int = 0  # part of cpu_bytes that is page-locked
    nvme_bytes: int = 0
    # CUDA unified memory of the node's GPUs (bitsandbytes' paged optimizer states, engines/bnb_optim.py): outside
    # PyTorch's allocator, on its GPU while that has room, paged to this node's host memory under pressure
    unified_bytes: int = 0


class ParamParts(NamedTuple):
    """The `params` category at the peak split in two (LoRA, issue 12): the frozen base's storage
    (quantized as bitsandbytes stores it) and what trains (adapters, DoRA magnitudes, modules_to_save
    copies); they sum to the peak's params. `zeroplan measure` records the same split."""

    base_bytes: int
    adapter_bytes: int


class ModelSummary(NamedTuple):
    name: str
    params: int
    trainable_params: int
    implementation: str  # which model implementation the activation terms describe


class PieceSizes(NamedTuple):
    """The size of one tensor of each kind of term (estimate/terms.py PIECES) on a rank: its largest parameter
    tensor in fp32 (the widest form a parameter-sized tensor takes: master, states, fp32 gradients), one
    micro-batch's residual stream in the compute dtype (the tensor most saved activations are), and its logits in
    fp32 (what the loss's tensors are); its parameter tensors' sizes, which per-parameter terms follow; and the
    tensors of the block terms known one by one."""

    tensors: int
    activations: int
    logits: int = 0  # one micro-batch's fp32 logits on the rank (a loss chunk's, under a chunked loss); 0: none
    # the rank's parameter tensors' element counts in model.parameters() order (runs of neighbours merged to at most
    # MAX_PARAM_PIECES, estimate/pipeline.py): a parameter-sized term is split in their proportions; empty: into `tensors`-sized pieces
    param_numels: tuple[int, ...] = ()
    # the optimizer's state tensors per tensor it steps (torch/optim/adam.py `_init_group`: exp_avg and exp_avg_sq;
    # SGD's momentum_buffer): a flat partition's states (PIECES "states") are this many tensors of equal size
    states: int = 1
    # (term name, the tensors of one period) for the terms whose tensors are known one by one (a block's saved
    # tensors: estimate/activations/tensors.py): such a term grows by those tensors, over and over, instead of its kind's
    term_tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # the tensors the size of the stepped tensor that the optimizer's step kernel holds at once (engines/common.py
    # `step_temporary_tensors`): a flat partition's step temporaries (PIECES "step") are this many of equal size
    step_tensors: int = 1


@dataclass(frozen=True)
class Estimate:
    """The memory of one configuration: per-phase, peak, and per-node."""

    model: ModelSummary
    engine: str
    phases: tuple[PhaseBytes, ...]
    per_node: NodeBytes
    notes: tuple[str, ...] = field(default=())
    param_parts: ParamParts | None = None  # with LoRA only: the peak's params as base + adapter bytes
    # every phase's terms (estimate/ledger.py Moment, aligned with `phases`); None from the planner's fast fit
    ledger: tuple | None = field(default=None, compare=False)
    piece_sizes: PieceSizes | None = field(default=None, compare=False)  # its tensors' sizes, for the allocator

    @cached_property
    def peak(self) -> PhaseBytes:
        """The (step, phase) with the most bytes live; the first one wins a tie. (Cached: the
        planner reads it several times per estimate; the phases are immutable.)"""
        return max(self.phases, key=lambda p: p.total_bytes)

    @cached_property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    def peak_of(self, step: Step) -> PhaseBytes:
        return max((p for p in self.phases if p.step == step), key=lambda p: p.total_bytes)


class RankKind(NamedTuple):
    """Ranks that hold the same things: one pipeline rank's stages and what flows through them."""

    pp_rank: int  # 0 .. pp - 1
    stages: tuple[int, ...]  # the pipeline stages this rank runs (several under looped schedules)
    layers: int  # transformer blocks it holds
    embedding: bool  # holds the token embedding (stage 0)
    head: bool  # holds the final norm and the output head, and computes the loss (the last stage)
    in_flight: int  # micro-batches whose activations its schedule keeps at once (stage-sized chunks)

    @property
    def label(self) -> str:
        parts = ["embedding"] * self.embedding + [f"{self.layers} layers"] + ["head, loss"] * self.head
        return f"pp rank {self.pp_rank} ({', '.join(parts)})"


class RankEstimate(NamedTuple):
    kind: RankKind
    ranks: int  # GPUs of this kind in the world
    params: int  # parameters the rank holds before data-parallel sharding (its stage, cut by tp and ep)
    estimate: Estimate


@dataclass(frozen=True)
class MeshEstimate:
    """Every distinct rank kind's estimate; `worst` is the one with the highest peak."""

    mesh: "MeshSpec"  # spec/mesh.py
    ranks: tuple[RankEstimate, ...]

    @cached_property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda rank: rank.estimate.peak_bytes)
