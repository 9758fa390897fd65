"""The one estimate pipeline: every estimate is a mesh, of ones on plain data parallelism, and each of its
rank kinds goes through the same steps, in this order:

1. what the rank holds (`ModelFacts`): the model's layout with adapters (estimate/model/facts.py), cut by the
   mesh's tp, ep and pipeline stage (estimate/parallel/mesh.py `held`);
2. its activations: one micro-batch of its tokens through its blocks (estimate/activations/transformer.py), as the
   adapters (estimate/adapters/lora.py) and the mesh (sequence, context and expert parallelism, the pipeline's
   micro-batches in flight: estimate/parallel/mesh.py `rank_activations`) change them;
3. the engine's profile over those (estimate/engines/), with the data-parallel world the mesh leaves it;
4. what the program adds around the engine: the adapters' storage, the TP embedding's gradient, a looped
   pipeline schedule's walk, the mesh's communication buffers, the CUDA context, host bytes.
Each step names its bytes (estimate/terms.py); the phases are folds of those terms (estimate/ledger.py).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, NamedTuple

from zeroplan.estimate.activations.transformer import (ActivationBytes, ActivationInputs, activation_bytes, activation_inputs,
                                                       attention_kernel, memory_checkpointing)
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, StateBytes, optimizer_state_count, state_bytes
from zeroplan.estimate.engines.common import EngineEstimate, Setup, setup_of, step_temporary_tensors
from zeroplan.estimate.engines.deepspeed_mesh import autotp_training
from zeroplan.estimate.model.facts import ModelFacts, model_facts
from zeroplan.estimate.ledger import fold
from zeroplan.estimate.adapters.lora import kbit_activation_bytes, lora_activations
from zeroplan.estimate.parallel.mesh import (MeshBuffers, held, looped_schedule_phases, mesh_buffers, rank_activations, rank_kinds,
                                    rank_setup, with_buffers)
from zeroplan.estimate.device.estimate import outside_memory
from zeroplan.estimate.result import (Estimate, MeshEstimate, ModelSummary, NodeBytes, ParamParts, PhaseBytes,
                                      PieceSizes, RankEstimate, RankKind)
from zeroplan.estimate.terms import naming
from zeroplan.spec.mesh import PPSchedule, check_mesh
from zeroplan.spec.optimizer_step import training_optimizer_step
from zeroplan.spec.model import ModelSpec, TransformerSpec
from zeroplan.estimate.activations.compiled import compiles_block
from zeroplan.spec.program import Loss, Recipe
from zeroplan.spec.training import Attention, Device, Engine, Precision, TrainingSpec

if TYPE_CHECKING:
    from zeroplan.spec.gpu import GpuSpec
    from zeroplan.spec.mesh import MeshSpec

IMPLEMENTATION = "hf-transformers"  # the modules activations.py describes, with the model's dropout rates
_IMPLEMENTATIONS = {attention: f"{IMPLEMENTATION}/{attention.value}" for attention in Attention}
# engine -> (module under zeroplan.estimate.engines, its profile function). A module is imported
# when its engine is first estimated: a command estimates one engine, and importing the others
# cost a tenth of `zeroplan estimate`'s start-up (bench/results/estimate_speed.md).
_PROFILES = {Engine.DEEPSPEED: ("deepspeed", "estimate_deepspeed"), Engine.FSDP2: ("fsdp2", "estimate_fsdp2"), Engine.FSDP1: ("fsdp1", "estimate_fsdp1"),
             Engine.TORCH: ("torch_ddp", "estimate_torch"), Engine.PAPER: ("paper", "estimate_paper")}
_LOADED: dict[Engine, Any] = {}
_NO_BUFFERS = MeshBuffers(0, 0, 0)


def engine_profile(engine: Engine) -> Any:
    """The profile function of `engine` (estimate/engines/), imported at its first use."""
    profile = _LOADED.get(engine)
    if profile is None:
        module, function = _PROFILES[engine]
        profile = _LOADED[engine] = getattr(import_module(f"zeroplan.estimate.engines.{module}"), function)
    return profile


class EngineRun(NamedTuple):
    """Steps 1-3 for one rank kind: what it holds, its activations, and the engine's profile over them."""

    facts: ModelFacts
    acts: ActivationBytes | None
    engine: Engine  # the engine the rank runs (a mesh rank with nothing to shard steps as plain torch)
    setup: Setup
    result: EngineEstimate


class SingleRank(NamedTuple):
    """What a plain data-parallel estimate reads of its configuration that no micro-batch or accumulation count
    changes (step 1, the engine's `Setup` but for `accumulating`, step 4's overhead): the planner's `FitModel`
    computes it once per configuration."""

    facts: ModelFacts
    dtypes: StateBytes
    activation: int  # bytes per activation element (estimate/adapters/lora.py `kbit_activation_bytes`)
    activations: ActivationInputs | None  # None for a model known by its parameter count
    setup: Setup
    overhead: int  # what is not a tensor: the CUDA context and NCCL's buffers (estimate/device/estimate.py)


class Profile(NamedTuple):
    """One rank kind's phases (its ledger's folds once `fold`ed), per-node bytes and notes."""

    facts: ModelFacts
    kind: RankKind  # with the micro-batches in flight at a looped schedule's peak
    phases: tuple[PhaseBytes, ...]  # every step's phases, overhead and mesh buffers included
    per_node: NodeBytes
    notes: tuple[str, ...]
    param_parts: ParamParts | None  # with LoRA: the peak's params as base + adapter bytes
    term_tensors: tuple = ()  # the block terms known tensor by tensor (ActivationBytes.term_tensors), for the replay
    passing: tuple[PhaseBytes, ...] = ()  # the engine's moments after a phase's peak (EngineEstimate.passing), for the replay


def single_kind(model: ModelSpec) -> RankKind:
    """The one rank kind of plain data parallelism: every block, the embedding and the head."""
    return RankKind(0, (0,), getattr(model, "num_layers", 0), True, True, 1)


def _program_notes(model: ModelSpec, training: TrainingSpec) -> tuple[str, ...]:
    """What the estimate says of the program: a model known by its count, checkpointing that changes no
    byte (issue 11), the CPU math path of attention dropout."""
    if not isinstance(model, TransformerSpec):
        return ("model given by parameter count: activations are not estimated",)
    notes: tuple[str, ...] = ()
    if memory_checkpointing(training, model) != training.checkpointing:
        notes = ("checkpointing selective keeps what none keeps here: the fused attention kernel saves no attention "
                 "scores for the recomputation to spare; op (torchtitan's per-op policy) or full keep less",)
    elif training.checkpoint_every and training.checkpoint_every > model.num_layers:
        notes = (f"checkpoint_every {training.checkpoint_every} exceeds the {model.num_layers} blocks: no block is "
                 "checkpointed",)
    if "model" in training.compile and not compiles_block(model, training):
        notes += ("torch.compile of the blocks: what a compiled block keeps is modelled for dense Llama-family blocks "
                  "with fused attention, no dropout and checkpointing none or full; these blocks are estimated as eager",)
    if "loss" in training.compile and training.program.loss != Loss.STANDARD:
        notes += (f"torch.compile of the loss is modelled for the standard loss; the {training.program.loss.value} "
                  "loss is estimated as eager",)
    if attention_kernel(model, training) == "math":
        notes += ("attention dropout on cpu: SDPA has no fused kernel with dropout there, so its math path "
                  "runs and keeps the attention matrices (fp32)",)
    return notes


def _adapted(training: TrainingSpec) -> Any:
    """The adapters' change to a rank's activations (estimate/adapters/lora.py), or None without LoRA."""
    if training.lora is None:
        return None
    return lambda acts, local_model, local_training: lora_activations(
        acts, local_model, local_training, kbit_activation_bytes(local_training, state_bytes(
            local_training.precision, local_training.optimizer).activation))


def single_rank(model: ModelSpec, training: TrainingSpec) -> SingleRank:
    """`SingleRank` of `training` on plain data parallelism."""
    dtypes = state_bytes(training.precision, training.optimizer)
    activation = kbit_activation_bytes(training, dtypes.activation)
    inputs = activation_inputs(model, training, activation) if isinstance(model, TransformerSpec) else None
    return SingleRank(model_facts(model, training), dtypes, activation, inputs, setup_of(training), _overhead(training))


class _World(NamedTuple):
    """What `outside_memory` reads of a training spec: the device, the mesh, the world and the GPU."""

    device: Device
    mesh: MeshSpec
    gpus: int
    node_gpus: int
    gpu: GpuSpec | None


def _overhead(training: TrainingSpec) -> int:
    """What is not a tensor (estimate/device/estimate.py `outside_memory`); none for the paper's engine."""
    if training.engine == Engine.PAPER:
        return 0
    return _outside_memory(_World(training.device, training.mesh, training.gpus, training.node_gpus, training.gpu))


@memo(maxsize=256)  # the same for every micro-batch, ZeRO stage, offload and checkpointing of a world
def _outside_memory(world: _World) -> int:
    return outside_memory(world)


def _single_run(model: ModelSpec, training: TrainingSpec, rank: SingleRank) -> EngineRun:
    """Steps 1-3 on plain data parallelism: the whole model, every rank alike."""
    acts = None
    if isinstance(model, TransformerSpec):
        acts = activation_bytes(model, training, rank.activation, rank.activations)
        if training.lora is not None:
            acts = lora_activations(acts, model, training, rank.activation)  # estimate/adapters/lora.py
    if training.engine == Engine.PAPER:
        result = engine_profile(Engine.PAPER)(rank.facts, rank.setup, rank.dtypes)
    else:
        result = engine_profile(training.engine)(rank.facts, rank.setup, acts)
    return EngineRun(rank.facts, acts, training.engine, rank.setup, result)


@memo(maxsize=64)  # every micro-batch and checkpointing choice of a mesh plan asks for the same rank kinds
def _mesh_run(model: TransformerSpec, training: TrainingSpec, shape: RankKind) -> EngineRun:
    """Steps 1-3 for one rank kind of a mesh (`shape`: the kind as its profile reads it)."""
    dtypes = state_bytes(training.precision, training.optimizer)
    adapted = _adapted(training)
    facts = model_facts(model, training) if adapted else held(model, training, shape)
    activation = kbit_activation_bytes(training, dtypes.activation)
    acts = rank_activations(model, training, shape, activation, adapted)
    engine, setup = rank_setup(training)
    if shape.embedding and "embeddings" not in training.freeze and training.engine == Engine.FSDP2 and engine == Engine.TORCH:
        # without FSDP2 (mesh.py `rank_setup`) the rowwise embedding's Replicate gradient stays whole until zero_grad
        from zeroplan.estimate.parallel.tp_embedding import with_replicated_embedding_grad

        facts = with_replicated_embedding_grad(facts, model, training.mesh)
    return EngineRun(facts, acts, engine, setup, engine_profile(engine)(facts, setup, acts))


def profile_rank(model: ModelSpec, training: TrainingSpec, kind: RankKind, micro_batches: int,
                 bounded: tuple[RankKind, ...] = ()) -> Profile | None:
    """One rank kind's profile (the module docstring's steps); with `bounded`, phases no lower than any of
    theirs (middle ranks of a looped schedule, `middle_ranks_peak_bound`), or None where that does not apply."""
    trivial = training.mesh.is_trivial
    if not trivial and training.engine == Engine.DEEPSPEED:  # AutoTP's plan is not torchtitan's (engines/deepspeed_mesh.py)
        training = autotp_training(training)
    unmixed = not trivial and _mixed_precision_disabled(training)
    if unmixed:
        training = training.model_copy(update={"precision": Precision.FP32})
    mesh = training.mesh
    if trivial:
        single = single_rank(model, training)
        run, overhead = _single_run(model, training, single), single.overhead
    else:
        # the profile reads the kind's ends, layers, stage count and (one stage per rank) micro-batches in flight
        # only: the middle ranks of a looped schedule share it and differ in their walk alone
        shape = kind._replace(pp_rank=0, stages=tuple(range(len(kind.stages))),
                              in_flight=0 if mesh.pp_schedule.looped and mesh.pp > 1 else kind.in_flight)
        run = _mesh_run(model, training, shape)
        overhead = _overhead(training)
    facts, result = run.facts, _with_adapters(model, training, run)
    notes = _program_notes(model, training)
    if training.lora is not None and isinstance(model, TransformerSpec):
        from zeroplan.estimate.adapters.program import lora_notes

        notes += lora_notes(model, training, facts)
    dtypes = state_bytes(training.precision, training.optimizer)
    if mesh.pp > 1 and mesh.pp_schedule.looped:
        looped = looped_schedule_phases(model, training, kind, facts, run.acts, result.phases, dtypes.activation,
                                        micro_batches, bounded)
        if looped is None:
            return None
        result, kind = result._replace(phases=looped[0]), kind._replace(in_flight=looped[1])  # the walk's count at its peak
    # the moments after a phase's peak, raised as their phases are; the adapters and a looped schedule change the
    # phases themselves, so there the replay reads the peaks alone
    passing = result.passing if result is run.result and not (mesh.pp > 1 and mesh.pp_schedule.looped) else ()
    buffers = _NO_BUFFERS if trivial else mesh_buffers(model, training, kind, dtypes.activation, micro_batches)
    phases = with_buffers(result.phases, buffers, overhead)
    passing = with_buffers(passing, buffers, overhead) if passing else ()
    per_node, offload_notes = _host(run, result, training)
    notes += offload_notes + result.notes
    if unmixed:
        notes += ("torchtitan trains in fp32 here: with tp or pp and nothing for FSDP to shard, mixed precision is "
                  "disabled (distributed/utils.py maybe_enable_amp)",)
    if training.paged_optimizer:  # estimate/engines/bnb_optim.py
        from zeroplan.estimate.engines.bnb_optim import paged_notes

        notes += paged_notes(training.engine.value, training.device.value, training.deepspeed.client_optimizer,
                             training.node_gpus, int(per_node.unified_bytes))
    parts = None
    if training.lora is not None and isinstance(model, TransformerSpec):
        from zeroplan.estimate.adapters.program import adapter_param_parts

        parts = adapter_param_parts(phases, facts, training, run.setup)
    return Profile(facts, kind, phases, per_node, notes, parts, run.acts.term_tensors() if run.acts is not None else (),
                   passing)


def single_peak(model: ModelSpec, training: TrainingSpec, rank: SingleRank) -> tuple[int, NodeBytes]:
    """`profile_rank`'s peak and per-node bytes on plain data parallelism (`rank` being `single_rank(model,
    training)`), without what only a shown estimate reads: its notes, its phases with their overhead, the adapters'
    split of the parameters. The overhead is in every phase alike, so it adds to the largest engine phase."""
    run = _single_run(model, training, rank)
    result = _with_adapters(model, training, run)
    return max([sum(p.categories) for p in result.phases]) + rank.overhead, _host(run, result, training)[0]


def _with_adapters(model: ModelSpec, training: TrainingSpec, run: EngineRun) -> EngineEstimate:
    """The engine's profile with the adapters' storage (estimate/adapters/program.py), or as it is without LoRA."""
    if training.lora is None or not isinstance(model, TransformerSpec):
        return run.result
    from zeroplan.estimate.adapters.program import with_adapters

    return with_adapters(run.result, run.facts, model, training, run.setup)


def _host(run: EngineRun, result: EngineEstimate, training: TrainingSpec) -> tuple[NodeBytes, tuple[str, ...]]:
    """Per-node host bytes: the engine's, and the activations offloaded to the host (with a note on a CPU run)."""
    if run.acts is not None and run.acts.offloaded:
        return _with_offloaded_activations(result.per_node, run.acts.host_bytes, training)
    return result.per_node, ()


def _mixed_precision_disabled(training: TrainingSpec) -> bool:
    """torchtitan v0.2.2 distributed/utils.py `maybe_enable_amp`: mixed precision is FSDP's (MixedPrecisionPolicy);
    without FSDP (dp_shard x cp of 1) under TP or PP it is disabled, with a warning, and the run is fp32."""
    mesh = training.mesh
    return (training.recipe == Recipe.TORCHTITAN and training.engine == Engine.FSDP2 and (mesh.tp > 1 or mesh.pp > 1)
            and mesh.fsdp_degree(training.gpus) == 1 and training.precision in (Precision.BF16, Precision.FP16))


def _with_offloaded_activations(per_node: NodeBytes, host_bytes: int, training: TrainingSpec) -> tuple[NodeBytes, tuple[str, ...]]:
    """Add the activations offloaded to the host (pinned: torchtune OffloadActivations(use_pin_memory=True))
    to the engine's per-node host bytes."""
    node = host_bytes * training.node_gpus
    cpu_run = training.device == Device.CPU
    per_node = per_node._replace(cpu_bytes=per_node.cpu_bytes + node,
                                 pinned_bytes=per_node.pinned_bytes + (0 if cpu_run else node))
    notes: tuple[str, ...] = ()
    if cpu_run:
        notes = (f"CPU run: the {host_bytes:,} bytes of activations offloaded per rank are host copies, counted apart "
                 "from the device as on GPUs (zeroplan measure counts them apart too)",)
    return per_node, notes


MAX_PARAM_PIECES = 256  # the replay's cost grows with its events (a few us each): a 70B model's 723 tensors merge in threes


@memo(maxsize=256)  # one per rank's facts (by identity)
def param_pieces(facts: ModelFacts) -> tuple[int, ...]:
    """Every parameter tensor's element count in model.parameters() order, neighbours merged into at most
    MAX_PARAM_PIECES runs: how per-parameter states, gradients and copies are allocated (one tensor each: torch/optim
    `_init_group`, autograd's .grad, FSDP2's per-parameter shards)."""
    numels = [t.numel for g in facts.groups for _ in range(g.count) for t in g.tensors]
    run = -(-len(numels) // MAX_PARAM_PIECES)
    return tuple(sum(numels[i:i + run]) for i in range(0, len(numels), run))


def loss_piece_bytes(model: TransformerSpec, training: TrainingSpec, tokens: int) -> int:
    """One fp32 logits tensor of the rank's loss: its tokens (a chunk's under torchtune's chunked loss: modules/
    transformer.py `chunked_output`) over the vocabulary, sharded over tp under loss parallelism
    (torch/distributed/tensor/parallel/loss.py). The device figures split the loss's terms into tensors of this size."""
    if training.program.loss == Loss.CHUNKED:
        tokens = training.micro_batch * -(-(training.seq_len // training.mesh.cp) // training.program.loss_chunks)
    tp = training.mesh.tp
    vocab = -(-model.vocab_size // tp) if tp > 1 and training.mesh.loss_parallel else model.vocab_size
    return tokens * vocab * FP32_BYTES


def estimate_of(model: ModelSpec, training: TrainingSpec, profile: Profile) -> Estimate:
    """The rank's `Estimate`: its phases folded from their terms (and its ledger, in naming mode)."""
    whole = model_facts(model, training)
    summary = ModelSummary(whole.name, whole.total_params, whole.trainable_params,
                           _IMPLEMENTATIONS[training.attention] if isinstance(model, TransformerSpec)
                           else "parameter count only")
    folded = fold(profile.phases, profile.per_node, profile.passing)
    parts = profile.param_parts
    if parts is not None:
        parts = ParamParts(int(parts.base_bytes), int(parts.adapter_bytes))
    residual = logits = 0
    if isinstance(model, TransformerSpec):
        tokens = training.micro_batch * (training.seq_len // training.mesh.cp)
        residual = tokens * model.hidden_size * state_bytes(training.precision, training.optimizer).activation
        logits = loss_piece_bytes(model, training, tokens)
    pieces = PieceSizes(profile.facts.largest_tensor_numel * FP32_BYTES, residual, logits, param_pieces(profile.facts),
                        optimizer_state_count(training.optimizer), profile.term_tensors,
                        step_temporary_tensors(training_optimizer_step(training).impl))
    return Estimate(summary, training.engine.value, folded.phases, folded.per_node, profile.notes, parts, folded.ledger,
                    pieces)


def rank_estimate(model: ModelSpec, training: TrainingSpec, kind: RankKind) -> RankEstimate:
    """One rank kind of a mesh `check_mesh` passed (the planner estimates only the kinds that can be the worst)."""
    return _rank_estimate(model, training, kind, training.grad_accum if training.mesh.pp > 1 else 1)


def _rank_estimate(model: ModelSpec, training: TrainingSpec, kind: RankKind, micro_batches: int) -> RankEstimate:
    profile = profile_rank(model, training, kind, micro_batches)
    return RankEstimate(profile.kind, training.gpus // training.mesh.pp, int(profile.facts.total_params),
                        estimate_of(model, training, profile))


def _micro_batches(training: TrainingSpec) -> int:
    return training.grad_accum if training.mesh.pp > 1 else 1


def _kinds(model: ModelSpec, training: TrainingSpec) -> list[RankKind]:
    if training.mesh.is_trivial:
        return [single_kind(model)]
    check_mesh(model, training)
    return rank_kinds(model, training.mesh, _micro_batches(training))


def estimate_mesh(model: ModelSpec, training: TrainingSpec) -> MeshEstimate:
    """Each distinct rank kind of `training.mesh` (one on plain data parallelism), estimated with its ledger."""
    with naming():
        return estimate_mesh_unnamed(model, training)


def estimate_mesh_unnamed(model: ModelSpec, training: TrainingSpec) -> MeshEstimate:
    """`estimate_mesh` in the current naming mode: without ledgers in the planner's fast mode, the same bytes."""
    micro_batches = _micro_batches(training)
    return MeshEstimate(training.mesh, tuple(_rank_estimate(model, training, kind, micro_batches)
                                             for kind in _kinds(model, training)))


def estimate_mesh_within(model: ModelSpec, training: TrainingSpec, budget_bytes: int) -> MeshEstimate | None:
    """`estimate_mesh(model, training)` (without ledgers) if its worst rank fits `budget_bytes`, else None. The worst
    rank's peak is the largest, so the first rank over the budget decides: the ends of the pipeline (the most
    micro-batches in flight, the logits) are estimated first and the rest only when those fit."""
    kinds = _kinds(model, training)
    micro_batches = _micro_batches(training)
    ends_first = [0, len(kinds) - 1] + list(range(1, len(kinds) - 1))
    ranks: dict[int, RankEstimate] = {}
    for index in ends_first:
        if index not in ranks:
            ranks[index] = _rank_estimate(model, training, kinds[index], micro_batches)
            if ranks[index].estimate.peak_bytes > budget_bytes:
                return None
    return MeshEstimate(training.mesh, tuple(ranks[index] for index in range(len(kinds))))


def worst_rank_estimate(model: ModelSpec, training: TrainingSpec) -> Estimate:
    """The estimate of the rank with the highest peak: what decides whether a mesh fits (`zeroplan compare`)."""
    return estimate_mesh(model, training).worst.estimate


def middle_ranks_peak_bound(model: TransformerSpec, training: TrainingSpec, kinds: tuple[RankKind, ...]) -> int | None:
    """A peak no rank of `kinds` is above, from one walk of the schedule for them all (mesh.py `envelope_walk`):
    `kinds` are middle ranks (neither embedding nor head) of one ScheduleInterleaved1F1B mesh with the same layers
    and stages, so that they share one engine profile and differ in their walks alone (`profile_rank`). None where
    that does not hold, or a chunk's bytes are negative (the envelope's argument needs them not to be)."""
    mesh = training.mesh
    if (mesh.pp < 2 or mesh.pp_schedule != PPSchedule.INTERLEAVED_1F1B or not kinds
            or any(kind.embedding or kind.head or (kind.layers, len(kind.stages)) != (kinds[0].layers, len(kinds[0].stages))
                   for kind in kinds)):
        return None
    found = profile_rank(model, training, kinds[0], training.grad_accum, bounded=kinds)
    return None if found is None else max(phase.total_bytes for phase in found.phases)


def rank_params(model: TransformerSpec, training: TrainingSpec, kind: RankKind) -> int:
    """`RankEstimate.params` of a rank of `kind`, without its profile (the planner's cost bound)."""
    if training.engine == Engine.DEEPSPEED:
        training = autotp_training(training)
    return held(model, training, kind).total_params
