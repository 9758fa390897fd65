"""Per-rank estimates on a device mesh (issue 14): tensor, context, pipeline and expert parallelism
around ZeRO/FSDP. Derivations and sources: docs/engines/mesh.md.

Ranks of one mesh differ only along the pipeline: every pipeline stage is a rank kind (the first
holds the embedding and the most micro-batches in flight, the last the output head and the
logits). Each kind is estimated by the single-rank engine profiles over what that rank holds:
- parameters: its stage's modules, TP-sharded as torchtitan's plans shard them (colwise q/k/v and
  gate/up, rowwise o/down, the embedding on its vocabulary rows, the head colwise), experts split
  over EP; the engine then shards those over the data-parallel ranks only (`MeshSpec.fsdp_degree`);
- activations: one micro-batch of seq_len / cp tokens through heads / tp, intermediate / tp, with
  the norms' own tensors over the sequence split by tp under sequence parallelism, plus the other
  micro-batches its schedule keeps in flight (kept for the whole step, as the embedding's are);
- buffers: the ring's key/value chunks and fp32 accumulators (CP), the pipeline's receive buffers
  (PP), the all-to-all dispatch and combine buffers (EP).
An all-ones mesh is today's estimate, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from zeroplan.estimate.activations.transformer import FP32_BYTES, ActivationBytes, activation_bytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import state_bytes
from zeroplan.estimate.engines.common import Setup, ceil_div, setup_of
from zeroplan.estimate.engines.deepspeed_mesh import autotp_facts, autotp_training
from zeroplan.estimate.model.facts import ModelFacts, ModuleGroup, model_facts
from zeroplan.estimate.model.layout import ParamTensor, param_layout
from zeroplan.estimate.ledger import fold
from zeroplan.estimate.parallel.experts import (backward_transient_delta, first_block_gradient, placed_experts, recompute_end_transient,
                                      saved_per_block_delta)
from zeroplan.estimate.result import (CategoryBytes, Estimate, MeshEstimate, ModelSummary, Phase, PhaseBytes, RankEstimate,
                                      RankKind)
from zeroplan.spec.mesh import MeshSpec, PPSchedule, check_mesh
from zeroplan.spec.model import ModelSpec, TransformerSpec
from zeroplan.spec.program import GradSync, Loss
from zeroplan.spec.training import Checkpointing, Engine, TrainingSpec
from zeroplan.estimate.terms import named, naming, register, relabel

register({
    "zero bubble: output gradients kept from I to W": "torch/distributed/pipelining/_backward.py stage_backward_input "
                                                      "(docs/engines/mesh.md)",
    "pipeline sends pending": "torch/distributed/pipelining/schedules.py _step_microbatches (sends waited at the step's end)",
    "pipeline receive buffers": "torch/distributed/pipelining/stage.py _prepare_forward_infra, _create_grad_recv_info",
    "Ulysses all-to-all buffers": "deepspeed/sequence/layer.py _SeqAllToAll",
}, pieces="activations")
register({
    "async TP symmetric-memory workspace": "torch/distributed/_symmetric_memory/__init__.py get_symm_mem_workspace, "
                                           "_pipelined_produce_and_all2all (docs/engines/programs.md, async TP)",
}, pieces="whole")
register({  # tensors of the rank's logits shard: one, and the backward's three
    "loss parallel: log_softmax's shifted logits (fp32)": "torch/distributed/tensor/parallel/loss.py _log_softmax "
                                                          "(docs/engines/mesh.md, Loss parallelism)",
    "loss parallel: nll_loss and log_softmax backward (fp32)": "torch/distributed/tensor/parallel/loss.py "
                                                               "_nll_loss_and_log_softmax_backward (docs/engines/mesh.md, "
                                                               "Loss parallelism)",
}, pieces="logits")

# Tensor-parallel plans (torchtitan v0.2.2 models/llama3/infra/parallelize.py `apply_tp`; 0.3.0
# models/common/decoder_sharding.py): layer roles (model/layout.py), by how their weight is cut over tp.
_COLWISE = ("qkv_in", "mlp_in", "head", "experts")
_ROWWISE = ("attn_out", "mlp_out", "embedding")


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Blocks per pipeline stage as torchtitan splits them (distributed/pipeline_parallel.py
    `generate_llm_fqn_per_model_part`, input and output weights 1): the embedding and the head
    each count as one layer, the num_layers + 2 are spread evenly, the first stages taking the remainder."""
    if stages == 1:
        return [num_layers]
    effective = num_layers + 2
    per_stage, extra = divmod(effective, stages)
    counts = [per_stage + (1 if index < extra else 0) for index in range(stages)]
    counts[0] -= 1
    counts[-1] -= 1
    return counts


def in_flight(schedule: PPSchedule, pp: int, pp_rank: int, virtual: int, micro_batches: int) -> int:
    """Micro-batches (stage chunks) whose activations a pipeline rank keeps at its peak
    (torch/distributed/pipelining/schedules.py): GPipe all of them; Schedule1F1B warms up with
    min(n, pp - rank) forwards before its first backward; the interleaved schedules `_get_warmup_ops`
    (v - 1) * per_round + k * (pp - 1 - rank), capped at n * v, then one forward more before each
    backward (k = 2 for Interleaved1F1B, 1 for InterleavedZeroBubble)."""
    if pp == 1:
        return 1
    if schedule == PPSchedule.GPIPE:
        return micro_batches
    if schedule == PPSchedule.ONE_F_ONE_B:
        return min(micro_batches, pp - pp_rank)
    per_round = micro_batches // max(1, micro_batches // pp)
    factor = 2 if schedule == PPSchedule.INTERLEAVED_1F1B else 1
    warmup = min((virtual - 1) * per_round + factor * (pp - 1 - pp_rank), micro_batches * virtual)
    return min(warmup + 1, micro_batches * virtual)


def rank_kinds(model: TransformerSpec, mesh: MeshSpec, micro_batches: int) -> list[RankKind]:
    return list(_rank_kinds(model.num_layers, mesh, micro_batches))


@memo(maxsize=1024)
def _rank_kinds(num_layers: int, mesh: MeshSpec, micro_batches: int) -> tuple[RankKind, ...]:
    counts = stage_layers(num_layers, mesh.stages)
    kinds = []
    for pp_rank in range(mesh.pp):
        # looped schedules give rank r the stages r, r + pp, r + 2 pp, ... (schedules.py `stage_index`)
        stages = tuple(pp_rank + loop * mesh.pp for loop in range(mesh.pp_virtual_stages))
        chunks = in_flight(mesh.pp_schedule, mesh.pp, pp_rank, mesh.pp_virtual_stages, micro_batches)
        kinds.append(RankKind(pp_rank, stages, sum(counts[s] for s in stages), 0 in stages,
                              mesh.stages - 1 in stages, chunks))
    return tuple(kinds)


def _sharded(tensor: ParamTensor, mesh: MeshSpec, conv1d: bool) -> ParamTensor:
    """One tensor as a rank holds it under TP (and EP for the experts); `conv1d`: the family stores its linears as
    GPT-2's Conv1D, (in, out), not nn.Linear's (out, in)."""
    role = tensor.role
    if role == "experts" and mesh.ep > 1:
        # experts split on dim 0 over ep (torchtitan ExpertParallel); not cut by tp then (0.3.0: efsdp borrows tp)
        return tensor._replace(numel=tensor.numel // mesh.ep, rows=tensor.rows // mesh.ep)
    if mesh.tp == 1:
        return tensor
    colwise, rowwise = role in _COLWISE, role in _ROWWISE
    if not (colwise or rowwise):
        return tensor  # norms and the router are replicated
    if role == "experts":  # (E, out, in): cut on dim 1
        return tensor._replace(numel=tensor.numel // mesh.tp)
    if tensor.name.endswith(".bias"):  # a colwise bias is cut with its outputs; a rowwise one is replicated
        return tensor if rowwise else tensor._replace(numel=ceil_div(tensor.rows, mesh.tp), rows=ceil_div(tensor.rows, mesh.tp))
    # nn.Linear stores (out, in), GPT-2's Conv1D (in, out): colwise cuts the outputs, rowwise the inputs;
    # the embedding's rowwise plan cuts its vocabulary rows (dim 0)
    if (colwise and not conv1d) or (rowwise and (conv1d or role == "embedding")):
        rows = ceil_div(tensor.rows, mesh.tp)  # dim 0, as DTensor's Shard(0): ceil(rows / tp) rows
        return tensor._replace(numel=rows * (tensor.numel // tensor.rows), rows=rows)
    return tensor._replace(numel=tensor.numel // mesh.tp)


def rank_facts(model: TransformerSpec, training: TrainingSpec, kind: RankKind) -> ModelFacts:
    """The parameters one rank of `kind` holds, before the data-parallel sharding."""
    return _rank_facts(model, training.mesh, training.gpus, training.freeze, kind.embedding, kind.layers, kind.head)


# one object per rank kind (hashed by identity downstream): the plan asks again for every micro-batch and checkpointing
@memo(maxsize=1024)
def _rank_facts(model: TransformerSpec, mesh: MeshSpec, gpus: int, freeze: tuple[str, ...], embedding: bool,
                layers: int, head: bool) -> ModelFacts:
    layout = param_layout(model)

    def group(role: str, tensors: tuple[ParamTensor, ...], count: int, frozen: bool) -> ModuleGroup:
        local = placed_experts(tuple(_sharded(t, mesh, model.hf_model_type == "gpt2") for t in tensors), model, mesh, gpus)
        return ModuleGroup(role, local, count, frozen, sum(t.numel for t in local))

    groups = []
    if embedding:
        groups.append(group("embedding", layout.embedding, 1, "embeddings" in freeze))
    if layers:
        groups.append(group("block", layout.block, layers, "blocks" in freeze))
    if head:
        groups.append(group("final", layout.final, 1, "final" in freeze))
    total = sum(g.params * g.count for g in groups)
    trainable = sum(g.params * g.count for g in groups if not g.frozen)
    largest_group = max(g.params for g in groups)
    largest_tensor = max(t.numel for g in groups for t in g.tensors)
    return ModelFacts(model.name, total, trainable, tuple(groups), largest_group, largest_tensor,
                      first_block_gradient(model, mesh) if head and layers else None)


def _local_view(model: TransformerSpec, mesh: MeshSpec, kind: RankKind) -> TransformerSpec:
    """The model as one rank's activations see it: heads and the MLP width cut by tp, the vocabulary too
    under loss parallelism, its stage's blocks only."""
    return _local_model(model, mesh.tp, model.is_moe and mesh.ep > 1, mesh.loss_parallel, max(kind.layers, 1))


# one object per local view: activation_bytes' caches then find it by a cheap hash
@memo(maxsize=1024)
def _local_model(model: TransformerSpec, tp: int, moe_by_ep: bool, loss_parallel: bool, layers: int) -> TransformerSpec:
    return model.model_copy(update=dict(
        num_heads=model.num_heads // tp, num_kv_heads=model.kv_heads // tp, head_dim=model.dim_per_head,
        intermediate_size=model.intermediate_size if moe_by_ep else model.intermediate_size // tp,
        vocab_size=ceil_div(model.vocab_size, tp) if loss_parallel else model.vocab_size,
        num_layers=layers))


def _sequence_parallel_saving(model: TransformerSpec, training: TrainingSpec, tokens: int, act_bytes: int,
                              checkpointed: bool) -> int:
    """What sequence parallelism takes off one block's saved tensors: the two norms' own tensors (their
    input, fp32 upcast and rstd; not the output, which the colwise linears keep all-gathered) and the
    residual stream a checkpointed block keeps, cut over tp (Korthikanti et al. 2022 section 4.2.2).
    `checkpointed`: the block keeps its input alone (full or op checkpointing), or every tensor."""
    tp, h = training.mesh.tp, model.hidden_size
    if checkpointed:
        per_token = act_bytes * h  # the block input a checkpoint keeps
    elif model.norm == "rmsnorm":
        per_token = 2 * (FP32_BYTES * h + act_bytes * h + FP32_BYTES)  # LlamaRMSNorm: fp32 input, normalised, rstd
    else:
        per_token = 2 * (act_bytes * h + 2 * FP32_BYTES)  # LayerNorm: input, mean, rstd
    if model.dropout_rates(training.dropout).residual and not checkpointed:
        # the attention and MLP outputs' dropout runs after the reduce-scatter: its two masks are cut too
        per_token += 2 * h * (1 if training.device.value == "cuda" else act_bytes)
    return tokens * per_token * (tp - 1) // tp


def _sequence_parallel_changes(model: TransformerSpec, training: TrainingSpec, acts: ActivationBytes, tokens: int,
                               act_bytes: int, checkpointed: bool) -> dict[str, int]:
    """What sequence parallelism changes in one kind of block (`checkpointed`: it keeps its input alone)."""
    saved = acts.saved_per_block - _sequence_parallel_saving(model, training, tokens, act_bytes, checkpointed)
    changes = dict(saved_per_block=saved, block_input_grad_bytes=acts.block_input_grad_bytes // training.mesh.tp)
    if checkpointed:
        from zeroplan.estimate.parallel.tp_checkpoint import checkpointed_under_sequence_parallel

        # the norms' own tensors, as a block without checkpointing keeps them, for the recomputation's
        norms_cut = _sequence_parallel_saving(model, training, tokens, act_bytes, checkpointed=False)
        changes.update(checkpointed_under_sequence_parallel(model, training, acts, tokens, act_bytes, norms_cut))
    return changes


def rank_activations(model: TransformerSpec, training: TrainingSpec, kind: RankKind, act_bytes: int,
                     adapted: Callable[[ActivationBytes, TransformerSpec, TrainingSpec], ActivationBytes] | None = None
                     ) -> ActivationBytes:
    """One micro-batch of the rank's tokens through its blocks, heads and MLP cut by tp; `adapted` (LoRA's,
    estimate/adapters/lora.py) changes them as the adapters do, before the mesh's own changes."""
    mesh = training.mesh
    local_seq = training.seq_len // mesh.cp
    local = _local_training(training, local_seq)
    view = _local_view(model, mesh, kind)
    acts = activation_bytes(view, local, act_bytes)
    if adapted is not None:
        acts = adapted(acts, view, local)
    tokens = training.micro_batch * local_seq
    changes: dict[str, int] = {}
    # under checkpoint_every N the blocks N, 2N, ... are acts.checkpointed's and the others keep everything
    checkpointed = training.checkpointing in (Checkpointing.FULL, Checkpointing.OP) and not acts.checkpoint_every
    if mesh.tp > 1 and mesh.sequence_parallel:
        changes.update(_sequence_parallel_changes(model, training, acts, tokens, act_bytes, checkpointed))
    if mesh.tp > 1 and mesh.sequence_parallel and kind.head:
        # the final norm is SequenceParallel too (torchtitan apply_tp "norm"): its input, normalised output
        # and rstd are cut over tp; its output, all-gathered for the head, is not
        h = model.hidden_size
        per_token = FP32_BYTES * h + act_bytes * h + FP32_BYTES if model.norm == "rmsnorm" else act_bytes * h + 2 * FP32_BYTES
        changes.update(final_norm=acts.final_norm - tokens * per_token * (mesh.tp - 1) // mesh.tp)
    if mesh.tp > 1 and mesh.loss_parallel and kind.head and "loss" not in training.compile:
        # (a compiled loss traces the handlers' ops into its own fused graph: estimate/activations/compiled.py)
        changes.update(_loss_parallel_changes(acts, training))
    if mesh.ep > 1 and kind.layers:  # the busiest EP rank's received pairs (estimate/parallel/experts.py)
        kept = "recompute_block" if training.checkpointing in (Checkpointing.FULL, Checkpointing.OP) else "saved_per_block"
        changes.update({kept: changes.get(kept, getattr(acts, kept)) + saved_per_block_delta(model, mesh, tokens, act_bytes)},
                       block_backward_transient=acts.block_backward_transient
                       + backward_transient_delta(model, mesh, tokens, act_bytes))
        if training.checkpointing == Checkpointing.FULL:  # the recomputation's own end can peak higher (estimate/parallel/experts.py)
            changes.update(block_backward_transient=max(changes["block_backward_transient"], recompute_end_transient(
                model, mesh, tokens, act_bytes, changes.get("block_input_grad_bytes", acts.block_input_grad_bytes))))
    if not kind.head:  # the loss and logits live on the last stage; a stage's backward starts from a received gradient
        changes.update(logits=0, loss_saved=0, loss_transient=0, logits_grad=0, logits_grad_cast=0,
                       head_backward_temporary=0, final_norm=0)
    if not kind.layers:
        changes.update(saved_per_block=0, recompute_block=0, block_backward_transient=0, block_backward_freed=0,
                       block_forward_transient=0)
    acts = acts.replaced(**changes) if changes else acts
    if mesh.tp > 1 and mesh.sequence_parallel and acts.checkpointed is not None:
        every = acts.checkpointed
        acts = replace(acts, checkpointed=every.replaced(**_sequence_parallel_changes(model, training, every, tokens,
                                                                                       act_bytes, checkpointed=True)))
    if mesh.cp > 1 and kind.layers and training.engine != Engine.DEEPSPEED:
        from zeroplan.estimate.parallel.context import core_saved_bytes, with_ring_attention

        norm_cut = (_sequence_parallel_saving(model, training, tokens, act_bytes, checkpointed) // 2
                    if mesh.tp > 1 and mesh.sequence_parallel else 0)
        core_saved = core_saved_bytes(_local_view(model, mesh, kind), local, tokens, act_bytes, norm_cut)
        acts = with_ring_attention(acts, model, training, tokens, act_bytes, core_saved)
    # The profile runs one micro-batch through all the rank's blocks: as many stage chunks as it has stages.
    # The other chunks in flight keep their stage's saved tensors for the whole of this one's step.
    chunks = len(kind.stages)
    if mesh.pp_schedule.looped and mesh.pp > 1:
        return acts  # one micro-batch through the rank's stages; `_looped_schedule_peak` walks the schedule
    extra = max(kind.in_flight - chunks, 0)
    if extra:
        one = acts.embedding + kind.layers * acts.saved_per_block // chunks
        if kind.head and chunks == 1:  # the last stage computes each micro-batch's loss right after its forward (`_maybe_compute_loss`)
            one += acts.final_norm + acts.logits + acts.loss_saved
        acts = acts.replaced(embedding=acts.embedding + extra * one)
    if kind.head and mesh.pp > 1:
        # the last stage keeps every micro-batch's output, the logits, until the step ends (stage.py
        # `output_chunks`, merged by `_merge_outputs`): those not in flight stay, and the current one's
        # stays through its own backward beside its logits gradients (seen at the 1F1B last stage's peak)
        micro_batches = training.grad_accum
        acts = acts.replaced(embedding=acts.embedding + (micro_batches - max(kind.in_flight // chunks, 1) + 1) * acts.logits)
    return acts


def _loss_parallel_changes(acts: ActivationBytes, training: TrainingSpec) -> dict[str, int]:
    """What loss_parallel()'s handlers (torch/distributed/tensor/parallel/loss.py) change in the loss of the
    rank's vocabulary shard (docs/engines/mesh.md, "Loss parallelism"). A standard loss: `_log_softmax` keeps
    `x - x_max` beside its exp and then beside the result, one fp32 shard more than aten's kernel while it
    runs; nll_loss's backward handler does log_softmax's too (`_nll_loss_and_log_softmax_backward`:
    zeros_like(x), exp(x) and their sum, then the sum and its product with the gradient: three fp32 shards
    where aten's two kernels keep two) and log_softmax's handler returns that product as it is."""
    if training.program.loss != Loss.STANDARD:
        # the chunked losses' gradients are one chunk's at a time: one fp32 gradient in place of two
        return dict(logits_grad=acts.logits_grad // 2)
    shard = acts.logits_grad // 2  # one fp32 tensor of the rank's logits: aten's backward keeps two
    return dict(loss_transient=acts.loss_transient + relabel("loss parallel: log_softmax's shifted logits (fp32)", shard),
                logits_grad=relabel("loss parallel: nll_loss and log_softmax backward (fp32)", 3 * shard))


# every rank kind of one mesh estimate asks for the same one; copied, not validated again: no validator reads
# seq_len, and an all-ones mesh passes check_world
@memo(maxsize=64)
def _local_training(training: TrainingSpec, local_seq: int) -> TrainingSpec:
    return training.model_copy(update={"seq_len": local_seq, "mesh": MeshSpec()})


def _weight_op_output_width(model: TransformerSpec, mesh: MeshSpec) -> int:
    """Per token, the outputs of one block's parameter-holding ops (q, k, v, o, the MLP's linears, the
    two norms) on one rank: their gradients are what stage_backward_input keeps for the W step."""
    tp, h = mesh.tp, model.hidden_size
    q_width = model.num_heads * model.dim_per_head // tp
    kv_width = model.kv_heads * model.dim_per_head // tp
    mlp_inputs = 2 if model.mlp == "gated" else 1
    return q_width + 2 * kv_width + h + mlp_inputs * model.intermediate_size // tp + h + 2 * h


def looped_schedule_phases(model: TransformerSpec, training: TrainingSpec, kind: RankKind, facts: ModelFacts,
                            acts: ActivationBytes, phases: tuple[PhaseBytes, ...], act_bytes: int,
                            micro_batches: int, bounded: tuple[RankKind, ...] = ()) -> tuple[tuple[PhaseBytes, ...], int] | None:
    """The profile's forward and backward phases raised (or lowered) to the peak found by walking the
    rank's actions of ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (estimate/parallel/pipeline_schedule.py):
    each stage chunk's own saved tensors until its backward (its W under zero bubble), the pending sends and
    the last stage's logits until the step ends, each stage's gradients once its first backward ran; and the
    stage chunks alive at that peak (the rank's micro-batches in flight). With `bounded` (ranks of `kind`'s
    profile), the walk is `_envelope_walk`'s and every phase is no lower than any of theirs (None if it does not apply)."""
    from zeroplan.estimate.parallel.pipeline_fsdp import resharded_stages
    from zeroplan.estimate.parallel.pipeline_schedule import inputs_only_backwards, looped_peak, looped_rank_actions

    mesh = training.mesh
    steady = [p for p in phases if p.step.value == "steady" and p.phase in (Phase.FORWARD, Phase.BACKWARD)]
    profiled = max(steady, key=lambda p: p.categories.grads + p.categories.activations + p.categories.temporaries)
    chunk = _ChunkMaker(model, training, kind, facts, acts, profiled.categories.grads, act_bytes)
    if bounded:
        walked = _envelope_walk(mesh, bounded, chunk, acts, micro_batches)
        if walked is None:
            return None
    else:
        zero_bubble = mesh.pp_schedule == PPSchedule.ZERO_BUBBLE
        actions = looped_rank_actions(mesh.pp, mesh.pp_virtual_stages, micro_batches, kind.pp_rank, zero_bubble)
        inputs_only = inputs_only_backwards(actions, resharded_stages(training, {s: chunk.counts[s] for s in kind.stages},
                                                                      mesh.stages - 1)) if zero_bubble else frozenset()
        walked = looped_peak(actions, {stage: chunk(stage) for stage in kind.stages}, acts.block_forward_transient,
                             acts.block_backward_transient - acts.block_backward_freed, inputs_only)
    # the walk's gradients and pending sends replace the profile's at its peak; the rest is activations
    activations = walked.total - walked.grads - walked.sends - profiled.categories.temporaries
    shift = activations - profiled.categories.activations

    def raised(categories: CategoryBytes) -> CategoryBytes:
        return categories._replace(grads=walked.grads, buffers=categories.buffers + walked.sends,
                                   activations=max(categories.activations + shift, 0))

    return tuple(PhaseBytes(p.step, p.phase, raised(p.categories)) if p.phase in (Phase.FORWARD, Phase.BACKWARD) else p
                 for p in phases), walked.chunks


class _ChunkMaker:
    """What one micro-batch of one pipeline stage keeps (`ChunkBytes`), for the stages of one rank profile."""

    def __init__(self, model: TransformerSpec, training: TrainingSpec, kind: RankKind, facts: ModelFacts,
                 acts: ActivationBytes, profiled_grads: int, act_bytes: int):
        mesh = training.mesh
        self.model, self.mesh, self.acts, self.act_bytes = model, mesh, acts, act_bytes
        self.counts = stage_layers(model.num_layers, mesh.stages)
        self.tokens = training.micro_batch * training.seq_len // mesh.cp
        self.boundary = self.tokens * model.hidden_size * act_bytes // (mesh.tp if mesh.sequence_parallel else 1)
        self.groups = {g.role: g.params * g.count for g in facts.groups}
        self.block_params = self.groups.get("block", 0) // max(kind.layers, 1)
        self.profiled_grads, self.total_params = profiled_grads, max(facts.total_params, 1)

    def __call__(self, stage: int) -> ChunkBytes:
        from zeroplan.estimate.parallel.pipeline_schedule import ChunkBytes

        model, mesh, acts, counts, last = self.model, self.mesh, self.acts, self.counts, self.mesh.stages - 1
        zero_bubble = mesh.pp_schedule == PPSchedule.ZERO_BUBBLE
        params = counts[stage] * self.block_params + (self.groups.get("embedding", 0) if stage == 0 else 0) \
            + (self.groups.get("final", 0) if stage == last else 0)
        head_width = model.hidden_size + (ceil_div(model.vocab_size, mesh.tp) if mesh.loss_parallel else model.vocab_size)
        return ChunkBytes(
            saved=counts[stage] * acts.saved_per_block + (acts.embedding if stage == 0 else 0)
            + (acts.final_norm + acts.loss_saved if stage == last else 0),
            # stage 0 skips its I and runs a full backward at W (stage.py `backward_one_chunk`): it keeps nothing from I to W
            weight_grad_inputs=named("zero bubble: output gradients kept from I to W", zero_bubble * (stage != 0)
                                     * self.tokens * self.act_bytes
                                     * (counts[stage] * _weight_op_output_width(model, mesh) + (head_width if stage == last else 0))),
            sent=named("pipeline sends pending", self.boundary if stage != last else 0),
            sent_grad=named("pipeline sends pending", self.boundary if stage != 0 else 0),
            kept_output=acts.logits if stage == last else 0,
            grads=self.profiled_grads * params // self.total_params)


def _envelope_walk(mesh: MeshSpec, kinds: tuple[RankKind, ...], chunk: _ChunkMaker, acts: ActivationBytes,
                   micro_batches: int) -> LoopedPeak | None:
    """A walk result no lower than any of `kinds`' own (middle ranks of one ScheduleInterleaved1F1B sharing a
    profile), from one walk: the actions of the rank with the most warm-up forwards, each local stage's chunk the
    largest of theirs, the backward moments' transient no lower than the forward's; its gradients are every
    stage's and its sends every one of the step. The argument is in docs/engines/mesh.md ("One walk for the
    middle ranks"); `middle_ranks_peak_bound` says where it applies. None if a chunk's bytes are negative."""
    from zeroplan.estimate.parallel.pipeline_schedule import ChunkBytes, LoopedPeak, looped_peak, looped_rank_actions

    first = min(kinds, key=lambda kind: kind.pp_rank)
    local = [ChunkBytes(*map(max, zip(*(chunk(kind.stages[index]) for kind in kinds))))
             for index in range(len(first.stages))]
    if min(min(c) for c in local) < 0:
        return None
    forward = acts.block_forward_transient
    backward = max(acts.block_backward_transient - acts.block_backward_freed, forward)
    actions = looped_rank_actions(mesh.pp, mesh.pp_virtual_stages, micro_batches, first.pp_rank, False)
    walked = looped_peak(actions, dict(zip(first.stages, local)), forward, backward)
    # by the step's end every forward has sent its output, every backward its input's gradient
    every = sum(c.grads for c in local) + micro_batches * sum(c.sent + c.sent_grad for c in local)
    return LoopedPeak(walked.total, every, 0, walked.chunks)


class MeshBuffers(NamedTuple):
    """Communication buffers a rank holds beyond the data-parallel engine's, by phase."""

    forward: int
    backward: int
    steady: int  # allocated once and kept (the pipeline's receive buffers)
    outside: int = 0  # kept outside the caching allocator (async TP's symmetric memory): the overhead category


def mesh_buffers(model: TransformerSpec, training: TrainingSpec, kind: RankKind, act_bytes: int,
                 micro_batches: int) -> MeshBuffers:
    mesh = training.mesh
    tokens = training.micro_batch * training.seq_len // mesh.cp
    q_width = model.num_heads * model.dim_per_head // mesh.tp
    kv_width = model.kv_heads * model.dim_per_head // mesh.tp
    forward = backward = steady = outside = 0
    # ring attention's tensors (FSDP2) are moments of a block's attention core: rank_activations, estimate/parallel/context.py
    if mesh.cp > 1 and kind.layers and training.engine.value == "deepspeed":
        # Ulysses (deepspeed/sequence/layer.py _SeqAllToAll): q, k, v and the output re-laid out by all-to-all
        forward += named("Ulysses all-to-all buffers", tokens * (2 * q_width + 2 * kv_width) * act_bytes)
        backward += named("Ulysses all-to-all buffers", tokens * (2 * q_width + 2 * kv_width) * act_bytes)
    if mesh.pp > 1:
        # torch/distributed/pipelining/stage.py `_prepare_forward_infra` / `_create_grad_recv_info`: a receive
        # buffer per micro-batch for the stage input (all but stage 0) and for its gradient (all but the last)
        boundary = tokens * model.hidden_size * act_bytes // (mesh.tp if mesh.sequence_parallel else 1)
        stage_count = len(kind.stages)
        receives = stage_count - (1 if kind.embedding else 0)
        grad_receives = stage_count - (1 if kind.head else 0)
        steady += named("pipeline receive buffers", micro_batches * boundary * (receives + grad_receives))
    if mesh.async_tp and kind.layers:
        # torch/distributed/_symmetric_memory/__init__.py `get_symm_mem_workspace`: one workspace per TP group,
        # grown to the largest request and kept; `_pipelined_all_gather_and_consume` asks for the local shard of
        # the all-gathered input, `_pipelined_produce_and_all2all` (matmul + reduce-scatter) for two output chunks:
        # 2 x tokens / tp x h. Allocated by symmetric memory, outside the caching allocator (docs/engines/programs.md)
        shard = tokens * model.hidden_size * act_bytes // mesh.tp
        outside += named("async TP symmetric-memory workspace", 2 * shard)
    # EP's dispatch and combine outputs are activations, none in flight at the peaks (estimate/parallel/experts.py)
    return MeshBuffers(forward, backward, steady, outside)


def with_buffers(phases: tuple[PhaseBytes, ...], buffers: MeshBuffers, overhead: int) -> tuple[PhaseBytes, ...]:
    """`phases` with the mesh's buffers, and `overhead` (with what the mesh keeps outside the allocator) in every phase."""
    overhead += buffers.outside
    extra = {Phase.FORWARD: buffers.forward + buffers.steady, Phase.BACKWARD: buffers.backward + buffers.steady,
             Phase.OPTIMIZER_STEP: buffers.steady}
    raised = []
    for p in phases:
        added = extra.get(p.phase, 0)
        if overhead or added:
            # CategoryBytes._replace(buffers=..., overhead=...), built directly (thousands per plan)
            params, grads, states, activations, held, temporaries, overheads = p.categories
            p = PhaseBytes(p.step, p.phase, CategoryBytes(params, grads, states, activations, held + added, temporaries,
                                                          overheads + overhead))
        raised.append(p)
    return tuple(raised)


# every rank kind of one mesh estimate asks for the same one
@memo(maxsize=64)
def rank_setup(training: TrainingSpec) -> tuple[Engine, Setup]:
    """The engine a rank of `training`'s mesh runs and its set-up (every rank kind's: read from `training` alone)."""
    mesh = training.mesh
    setup = setup_of(training)._replace(gpus=mesh.fsdp_degree(training.gpus),
                                        expert_gpus=mesh.expert_fsdp_degree(training.gpus) if mesh.ep > 1 else 0)
    engine = training.engine
    if engine == Engine.FSDP2 and setup.gpus == 1:  # (a mesh rank's: plain data parallelism runs the engine asked for)
        # torchtitan applies fully_shard only when dp_shard > 1 or cp > 1 (distributed/parallel_dims.py
        # `fsdp_enabled`): a rank with nothing to shard steps its TP/PP-local parameters as one plain module
        engine, setup = Engine.TORCH, setup._replace(zero_stage=0, program=setup.program._replace(ddp=False))
    if mesh.pp > 1 and engine == Engine.FSDP2:
        # a pipeline stage's FSDP2 backward skips the reduce-scatter until the step's last micro-batch
        # (pipelining/stage.py `backward_maybe_with_nosync`: set_requires_gradient_sync(False), then
        # `perform_reduce_grad`): the unsharded gradients accumulate, as grad_sync last
        setup = setup._replace(accumulating=True, program=setup.program._replace(grad_sync=GradSync.LAST))
    if mesh.pp > 1 and mesh.pp_schedule == PPSchedule.GPIPE:
        # GPipe runs every micro-batch's forward before the first backward (schedules.py ScheduleGPipe
        # `_step_microbatches`): no accumulated gradient sits beside the activations in flight; 1F1B's does
        setup = setup._replace(accumulating=False)
    return engine, setup


def held(model: TransformerSpec, training: TrainingSpec, kind: RankKind) -> ModelFacts:
    """What a rank of `kind` holds (`training` as the pipeline runs it: DeepSpeed's AutoTP keeps the embedding whole)."""
    facts = rank_facts(model, training, kind)
    return autotp_facts(model, facts) if training.engine == Engine.DEEPSPEED else facts
