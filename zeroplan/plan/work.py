"""What one configuration asks of a GPU per micro-batch and per step: FLOPs, matmul shapes and the bytes
each collective moves, before any rate (zeroplan/plan/step_time.py divides them by rates).

Counts, per token of the model (docs/throughput.md derives each):
- matmuls: 2 FLOPs per multiply-add; forward 2 per parameter a token runs, backward 4 for a trained weight
  (its input's gradient and its own) and 2 for a frozen one (Kaplan et al. 2020 section 2.1; Narayanan et
  al. 2021 section 5.1). A token runs every block's attention and dense MLP, the experts it is routed to
  (top-k of E: GShard, Lepikhin et al. 2020) and the output head; the input embedding is a lookup (no FLOPs:
  torchtitan `get_nparams_and_flops` leaves it out).
- attention: QK^T and AV under a causal mask compute half the score matrix, as FlashAttention does
  (Dao et al. 2022 section 3.1, its causal kernels skip the masked blocks): forward 4 x keys x q_width per
  token, keys = s/2 on average (min(window, s) under a sliding window), backward 2.5x the forward
  (FlashAttention's own count: the backward recomputes the scores, Dao 2023 section 4.1). The model FLOPs
  (MFU) count the backward as twice the forward (PaLM, Chowdhery et al. 2022, appendix B).
- recomputation per checkpointing policy: full runs each checkpointed block's forward again (every block,
  or every Nth: torchtitan `_apply_layer_sac`); selective the attention core (Korthikanti et al. 2022
  section 5: under FlashAttention its forward kernel); op (torchtitan `_apply_op_sac`: the outputs of every
  other aten.mm and of attention are saved) half of the block's matmul forward; none nothing.
Meshes (torchtitan parallel_dims.py `build_mesh`: tp innermost, then cp, dp_shard, dp_replicate, pp): a
rank computes 1/tp of each matmul and of the attention heads, b x s / cp tokens of each micro-batch, the
layers of its pipeline stages (the slowest rank sets the pace); expert parallelism moves tokens, not FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimate.dtypes import state_bytes
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.parallel.mesh import rank_kinds
from zeroplan.estimate.pipeline import rank_params
from zeroplan.estimate.activations.moe import idle_expert_params
from zeroplan.spec.mesh import routed_experts
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, Precision, TrainingSpec

ATTENTION_BACKWARD = 2.5
"""FlashAttention's backward FLOPs over its forward's (Dao 2023, FlashAttention-2, section 4.1: the backward
runs five matmuls of the forward's two, recomputing the scores)."""


@dataclass(frozen=True)
class ModelShape:
    """What the step-time model needs of a model (one per model and set of trained parameters)."""

    layers: int  # transformer blocks (1 for a model known by its size only)
    layer_params: float  # matmul parameters a token runs in one block (its routed experts only)
    head_params: int  # the output head's (0 for a model known by its size only)
    trained_share: float  # trained parameters over all (LoRA, frozen groups: 4 FLOPs per frozen one, not 6)
    q_width: int  # query heads x head width (0: attention not counted)
    kv_width: int
    hidden: int
    intermediate: int  # a dense MLP's inner width, or a routed expert's
    gated: bool
    vocab: int
    experts: int  # routed experts per sparse layer (1 for a dense model)
    experts_per_token: int
    window: int | None  # sliding-window keys, and the share of layers that slide
    sliding_share: float


def model_shape(model, training: TrainingSpec) -> ModelShape:
    """`model`'s shape for the step-time model; `training` decides which parameters train (freeze, LoRA)."""
    if not isinstance(model, TransformerSpec):  # a parameter count: every parameter a matmul weight, one block
        trained = model.params if model.trainable_params is None else model.trainable_params
        return ModelShape(1, float(model.params), 0, trained / model.params, 0, 0, 0, 0, False, 0, 1, 1, None, 0.0)
    facts = model_facts(model, training)
    trained_share = facts.trainable_params / facts.total_params if facts.total_params else 1.0
    h, vocab = model.hidden_size, model.vocab_size
    active = facts.total_params
    inner = model.intermediate_size
    if model.moe is not None:  # Qwen3-MoE, DeepSeek-V3, GPT-OSS: experts of their own width
        active -= idle_expert_params(model)
        inner = model.moe.expert_intermediate_size
    elif model.is_moe:  # Mixtral: each token runs experts_per_token of num_experts gated MLPs (3 h x i each)
        active -= model.num_layers * (model.num_experts - model.experts_per_token) * 3 * h * inner
    lookups = vocab * h * (1 if model.tie_word_embeddings else 2) - vocab * h  # the untied input embedding
    positions = model.max_position_embeddings * h if model.position_embedding == "learned" else 0
    layer_params = (active - lookups - positions - vocab * h) / model.num_layers
    sliding = 0.0
    if model.sliding_window is not None:
        globals_ = model.num_layers // model.sliding_window_pattern if model.sliding_window_pattern > 1 else 0
        sliding = (model.num_layers - globals_) / model.num_layers
    heads_width = model.num_heads * model.dim_per_head
    if model.mla is not None:  # DeepSeek's MLA: scores over qk_head_dim, values of v_head_dim
        heads_width = model.num_heads * (model.mla.qk_head_dim + model.mla.v_head_dim) // 2
    return ModelShape(model.num_layers, layer_params, vocab * h, trained_share, heads_width,
                      model.kv_heads * model.dim_per_head, h, inner, model.mlp == "gated", vocab,
                      routed_experts(model), _experts_per_token(model), model.sliding_window, sliding)


def _experts_per_token(model: TransformerSpec) -> int:
    """Experts each token is routed to: the MoE spec's (Qwen3-MoE, DeepSeek-V3, GPT-OSS) or Mixtral's."""
    return model.moe.experts_per_token if model.moe is not None else model.experts_per_token


@dataclass(frozen=True)
class Pace:
    """The pipeline rank that sets a mesh's pace, and what it holds."""

    layers: int  # blocks of the slowest pipeline rank
    head: bool  # it holds the output head
    params: int  # parameters it holds before data-parallel sharding (what its FSDP unit gathers)
    trained_params: int
    gathered_tensors: int  # its tensors DeepSpeed ZeRO-3 gathers one by one (above stage3_param_persistence_threshold)


def pace(model, training: TrainingSpec) -> Pace:
    """The slowest pipeline rank of `training.mesh`: the most matmul work per micro-batch (blocks, and the
    head); its parameters as the estimate counts a rank's (`rank_params`)."""
    mesh = training.mesh
    if not isinstance(model, TransformerSpec):  # a parameter count: gathered a largest layer at a time
        trained = model.params if model.trainable_params is None else model.trainable_params
        layers = -(-model.params // (model.largest_layer_params or model.params))
        return Pace(1, False, model.params, trained, layers)
    facts = model_facts(model, training)
    threshold = training.deepspeed.stage3_param_persistence_threshold
    if mesh.is_trivial:
        return Pace(model.num_layers, True, _gathered(facts), facts.trainable_params, _large_tensors(facts, threshold, 1.0))
    shape = model_shape(model, training)
    kinds = rank_kinds(model, mesh, 1)
    slowest = max(kinds, key=lambda kind: kind.layers * shape.layer_params + kind.head * shape.head_params)
    held = max(rank_params(model, training, kind) for kind in kinds)
    return Pace(slowest.layers, slowest.head, held, int(held * shape.trained_share),
                _large_tensors(facts, threshold, slowest.layers / model.num_layers))


def _large_tensors(facts, threshold: int, block_share: float) -> int:
    """Parameter tensors at or above DeepSpeed's persistence threshold (stage3.py: smaller ones stay whole on every
    rank), the blocks' scaled to the share a rank holds."""
    found = 0.0
    for group in facts.groups:
        large = sum(1 for tensor in group.tensors if tensor.numel >= threshold)
        found += large * group.count * (block_share if group.role == "block" else 1.0)
    return max(1, round(found))


def _gathered(facts) -> int:
    """Elements one all-gather of the whole model moves, as the estimate's facts hold them: a 4-bit base as
    its packed storage in the gathered dtype (estimate/lora.py `packed_layout`)."""
    return sum(group.params * group.count for group in facts.groups)


@dataclass(frozen=True)
class Work:
    """One configuration's work on its slowest rank, per local token (a micro-batch has micro_batch x seq_len
    / cp of them on a rank); only the matmul shapes depend on the micro-batch (`gemms`)."""

    matmul_flops: float  # forward + backward of the rank's matmuls (1/tp of each)
    linear_share: float  # of which the blocks' linears (float8 converts them; the head stays bf16)
    attention_flops: float  # FlashAttention's count, forward + backward
    recompute_matmul_flops: float
    recompute_attention_flops: float
    model_flops: float  # the model FLOPs (MFU) of one token of the global batch, over the whole model
    forward_share: float  # the share of matmul + attention work in forward (the rest is backward)
    element_bytes: int  # a matmul operand's bytes
    shape: ModelShape
    tp: int
    layers: int  # blocks of the slowest rank
    head: bool

    def gemms(self, tokens: int) -> tuple[tuple[int, int, int, float], ...]:
        """The rank's forward matmuls of a micro-batch of `tokens` local tokens, (M, K, N, count): each block's
        projections cut by tp (torchtitan's colwise q/k/v and gate/up, rowwise o/down), routed experts each on
        their share of the tokens (k of E), and the head."""
        shape, tp, layers = self.shape, self.tp, self.layers
        if not shape.q_width:  # a parameter count: square matmuls holding a block's worth of parameters
            side = max(1, int(shape.layer_params**0.5))
            return ((tokens, side, side, shape.layer_params / side**2),)
        h = shape.hidden
        gemms = [(tokens, h, (shape.q_width + 2 * shape.kv_width) // tp, layers),
                 (tokens, shape.q_width // tp, h, layers)]
        up = (2 if shape.gated else 1) * shape.intermediate // tp
        if shape.experts > 1:
            routed = max(1, tokens * shape.experts_per_token // shape.experts)
            gemms += [(routed, h, up, layers * shape.experts), (routed, shape.intermediate // tp, h, layers * shape.experts)]
        else:
            gemms += [(tokens, h, up, layers), (tokens, shape.intermediate // tp, h, layers)]
        if self.head:
            gemms.append((tokens, h, shape.vocab // tp, 1))
        return tuple(gemms)


def _keys(shape: ModelShape, seq: int) -> float:
    """Keys a query attends to on average under the causal mask (and the sliding window)."""
    full = seq / 2
    if shape.window is None or shape.window >= seq:
        return full
    window = shape.window - shape.window**2 / (2 * seq)  # min(i, w) averaged over positions i
    return shape.sliding_share * window + (1 - shape.sliding_share) * full


def recompute_share(training: TrainingSpec, layers: int) -> float:
    """Blocks a full checkpointing policy recomputes, as a share of a rank's: every one, or every Nth."""
    every = training.checkpoint_every
    return 1.0 if not every else (layers // every) / layers if layers else 0.0


def work(model, training: TrainingSpec) -> Work:
    """The work per local token of `training` on its slowest rank (the micro-batch and accumulation unread)."""
    shape = model_shape(model, training)
    slowest = pace(model, training)
    tp = training.mesh.tp
    per_param = 4.0 + 2.0 * shape.trained_share  # forward 2, input gradient 2, weight gradient 2 if trained
    block = slowest.layers * shape.layer_params
    head = shape.head_params if slowest.head else 0
    matmul = per_param * (block + head) / tp
    keys = _keys(shape, training.seq_len)
    attention_forward = slowest.layers * 4 * keys * shape.q_width / tp
    attention = attention_forward * (1 + ATTENTION_BACKWARD)
    recompute_matmul = recompute_attention = 0.0
    mode = training.checkpointing
    if mode == Checkpointing.FULL:
        share = recompute_share(training, slowest.layers)
        recompute_matmul = share * 2 * block / tp
        recompute_attention = share * attention_forward
    elif mode == Checkpointing.SELECTIVE:
        recompute_attention = attention_forward
    elif mode == Checkpointing.OP:
        recompute_matmul = block / tp  # every other matmul's forward: half of 2 FLOPs per parameter
    whole = shape.layers * shape.layer_params + shape.head_params
    model_flops = per_param * whole + 3 * shape.layers * 4 * keys * shape.q_width
    total = matmul + attention
    forward = (2 * (block + head) / tp + attention_forward) / total if total else 1 / 3
    element = state_bytes(training.precision, training.optimizer).activation
    return Work(matmul, block / (block + head) if block + head else 1.0, attention, recompute_matmul,
                recompute_attention, model_flops, forward, element, shape, tp, slowest.layers, slowest.head)


def precision_peak(precision: Precision, rates) -> float:
    """The peak FLOP/s a run of `precision` computes at: fp32 matmuls run on CUDA cores (PyTorch leaves TF32
    off for matmuls: torch.backends.cuda.matmul.allow_tf32 defaults to False since 1.12)."""
    return rates.fp32_flops_per_s if precision == Precision.FP32 else rates.gpu_flops_per_s
