"""Activation memory: the tensors autograd keeps from the forward pass for the backward pass.

Starting point: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1: a GPT block keeps sbh(34 + 5as/h) bytes in 16-bit with dropout. That count
assumes dropout masks, unfused attention and a GELU MLP. The modelled implementation is Hugging
Face transformers' (modeling_llama.py, modeling_gpt2.py) trained with the dropout rates of the
model's config (or `--dropout P`), as zeroplan's measure mode runs it, so the terms below are what
*those* modules save, tensor by tensor:

- RMSNorm (LlamaRMSNorm.forward): upcasts its input to fp32 (kept by pow and mul), keeps the
  normalised tensor cast back (kept by the weight multiply), and rsqrt's fp32 output per token;
  its output is kept by the projections that read it.
- LayerNorm (aten native_layer_norm): keeps input, mean and rstd (fp32 per token); output kept by
  the next linear.
- Attention, fused (scaled_dot_product_attention, flash/efficient kernels): keeps q, k, v, the
  output and a fp32 log-sum-exp per head and token; no s x s matrix (Dao et al. 2022, section 3.1).
  Grouped-query attention keeps k and v at num_kv_heads width.
- Attention, eager (eager_attention_forward): keeps q, k and v expanded to num_heads (repeat_kv),
  the fp32 softmax output a x s x s, and its cast to the compute dtype when that is 16-bit.
- Gated MLP (LlamaMLP): gate output (SiLU input), SiLU output, up output, their product.
- GPT-2 MLP with gelu_new (NewGELUActivation, written out in Python): c_fc output, tanh output,
  0.5*x, 1+tanh, and the product fed to c_proj: five tensors of intermediate width.
- Mixture of experts (MixtralSparseMoeBlock): router logits (fp32 softmax over experts), and the
  gated-MLP tensors for each token-expert pair (top-k of them), plus the gathered expert inputs.
- Logits and loss (ForCausalLMLoss): lm_head output (vocab x tokens, compute dtype, held by the
  model output), an fp32 upcast during the loss, and log_softmax's fp32 output kept for backward.
- Dropout (torch nn.functional.dropout in training, aten/src/ATen/native/Dropout.cpp): on CUDA
  `native_dropout` keeps a bool mask (1 byte per element); on CPU `_dropout_impl` multiplies by a
  noise tensor of the input's dtype and keeps that. GPT-2 and GPT-NeoX drop the embeddings (one
  mask of h per token) and each block's attention and MLP outputs (two), Phi-3 the two block
  outputs; attention dropout drops the probabilities (a x s per token) under eager attention. Under
  fused attention flash and memory-efficient kernels keep their RNG seed and offset only, but on CPU
  SDPA has no fused kernel with dropout: its math path keeps the s x s matrices in fp32
  (docs/engines/activations.md, "Dropout").
Checkpointing (Korthikanti section 5): `full` keeps each block's input only and recomputes one
block at a time in backward (torch.utils.checkpoint replays the RNG state: the same masks come
back); `selective` recomputes the attention core only, which removes the s x s terms of eager
attention and of the math path, attention dropout's masks included (fused attention already
recomputes them); `op` is torchtitan's per-op policy (`_op_saved_per_token`); `checkpoint_every`
N checkpoints blocks N, 2N, ... fully and lets the others keep everything (`ActivationBytes.checkpointed`).
The loss (spec/program.py `Loss`): standard, chunked (torchtune's CEWithChunkedOutputLoss; under
the torchtitan recipe its ChunkedLossWrapper, which differs) or a fused linear + cross-entropy
kernel (Liger's): `_loss_terms`; docs/engines/activations.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import zeroplan.estimate.activations.families as families
import zeroplan.estimate.activations.moe as moe
from zeroplan.estimate.activations.tensors import llama_block_per_token
from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.caches import memo
from zeroplan.estimate.terms import UNNAMED, Terms, named, naming_on, parts_of, register
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.program import ActivationOffload, Loss, Recipe
from zeroplan.spec.training import Attention, Checkpointing, Device, Engine, Precision, TrainingSpec


_DOC = "docs/engines/activations.md"
# The activation terms: ActivationBytes' fields as the ledger names them (estimate/terms.py).
TERMS = {
    "saved_per_block": "activations saved by blocks",
    "recompute_block": "block recomputed in backward",
    "block_backward_transient": "block backward gradients",
    "block_backward_freed": "saved activations freed by a block's backward",  # subtracted: ledger.py nets it
    "block_forward_transient": "block forward intermediates",
    "block_input_grad_bytes": "block input gradient",
    "embedding": "token ids, labels and shared tables",
    "final_norm": "final norm saved activations",
    "logits": "logits",
    "loss_saved": "loss saved activations (fp32)",
    "loss_transient": "loss fp32 upcast",
    "logits_grad": "loss gradients (fp32)",
    "logits_grad_cast": "logits gradient cast",
    "head_backward_temporary": "output head backward gradients",
    "attention_backward_saved": "attention core backward saved",
    "attention_backward_temporary": "attention core backward gradients",
}
register({
    "activations saved by blocks": f"{_DOC} (blocks; Korthikanti et al. 2022 section 4.1)",
    "block recomputed in backward": f"{_DOC} (checkpointing; torch/utils/checkpoint.py)",
    "block backward gradients": f"{_DOC} (a block's backward)",
    "block forward intermediates": f"{_DOC} (a block's forward)",
    "block input gradient": f"{_DOC} (a block's backward: the residual stream's gradient)",
    "saved activations freed by a block's backward": f"{_DOC} (a block's backward frees its MLP product)",
    "token ids, labels and shared tables": f"{_DOC} (outside the blocks)",
    "final norm saved activations": f"{_DOC} (the final norm)",
    "output head backward gradients": f"{_DOC} (lm_head's backward)",
    "attention core backward saved": f"{_DOC} (eager attention's backward)",
    "attention core backward gradients": f"{_DOC} (eager attention's backward)",
    "activations offloaded to the host": f"{_DOC} (activation offloading; torchtune training/_activation_offloading.py)",
}, pieces="activations")
register({  # tensors of the logits' shape (one loss chunk's under a chunked loss)
    "logits": f"{_DOC} (logits and loss; transformers loss_utils.py ForCausalLMLoss)",
    "loss saved activations (fp32)": f"{_DOC} (logits and loss: log_softmax's output)",
    "loss fp32 upcast": f"{_DOC} (logits and loss: the fp32 upcast)",
    "loss gradients (fp32)": f"{_DOC} (logits and loss: nll_loss and log_softmax backward)",
    "logits gradient cast": f"{_DOC} (logits and loss: the gradient cast for lm_head)",
}, pieces="logits")


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank."""

    saved_per_block: int  # kept by one block until its backward (its input only under full checkpointing)
    recompute_block: int  # one block's activations rebuilt in backward under full checkpointing
    block_backward_transient: int  # gradients allocated by the peak of one block's backward
    block_backward_freed: int  # saved tensors that block's backward has freed by then
    block_forward_transient: int  # live in the last block's forward beyond the saved tensors
    block_input_grad_bytes: int  # the gradient of a block's input (residual width)
    embedding: int  # kept outside the blocks for the whole step (token ids, shifted labels)
    final_norm: int  # kept by the final norm, its output (lm_head's input) included
    logits: int  # lm_head output in the compute dtype, alive until the loss is computed
    loss_saved: int  # log_softmax's fp32 output kept for backward
    loss_transient: int  # fp32 upcast of the logits alive while the loss is computed (16-bit only)
    logits_grad: int  # nll_loss's and log_softmax's fp32 gradients, alive together
    logits_grad_cast: int  # the logits' gradient cast to the compute dtype for lm_head (16-bit only)
    num_blocks: int
    # lm_head's backward: the logits' gradient and the gradient of lm_head's input (the weight's
    # gradient is the engine's to count); `_loss_terms`.
    head_backward_temporary: int = 0
    # The backward of eager attention's core (`_attention_backward_per_token`; zero for fused
    # kernels): the block's saved tensors still alive then, and what backward has allocated
    # (recomputed tensors and gradients in flight).
    attention_backward_saved: int = 0
    attention_backward_temporary: int = 0
    # checkpoint_every N (torchtitan v0.2.2 `_apply_layer_sac`): blocks N, 2N, ... (1-based, in
    # forward order) are those of `checkpointed` (full checkpointing), the others these terms.
    checkpoint_every: int = 0
    checkpointed: "ActivationBytes | None" = None
    # activation_offload cpu (torchtune OffloadActivations): the blocks' saved tensors sit on the
    # host (`host_bytes`) from their forward on; in backward the block in progress has what the
    # hooks have brought back, `saved_per_block` then (`_offloaded`), the others nothing: `_before`.
    offloaded: bool = False
    host_bytes: int = 0  # pinned host copies of one micro-batch, at the end of the forward
    # Does a block's backward peak in its attention core (eager attention's s x s gradients)
    # rather than in its MLP? Derived in __post_init__ (read at every moment of every profile).
    attention_peaks: bool = field(init=False, default=False)
    # The tensors behind `saved_per_block` and `recompute_block`, bytes per micro-batch in save order (tensors.py;
    # under checkpoint_every, one block's of each kind); () where they are not known one by one. Only the
    # allocator replay reads them (`term_tensors`), where they add up to their field.
    saved_tensors: tuple[int, ...] = field(default=(), compare=False, repr=False)
    recompute_tensors: tuple[int, ...] = field(default=(), compare=False, repr=False)
    # Derived once (the engine profiles evaluate a block's moments thousands of times per plan):
    # what backward allocates at each moment, and the intercepts of the two moments, affine in
    # the blocks that still hold their saved tensors (1 or more).
    _mlp_temporary: int = field(init=False, default=0, repr=False, compare=False)
    _block_temporary: int = field(init=False, default=0, repr=False, compare=False)
    _peak_intercept: int = field(init=False, default=0, repr=False, compare=False)
    _mlp_intercept: int = field(init=False, default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = object.__setattr__
        if naming_on():
            # a field changed by a transform (TP, CP, EP, LoRA) is still that quantity: its unnamed part takes its name
            for name in _NAMED_FIELDS:
                value = getattr(self, name)
                if UNNAMED in parts_of(value):
                    derived(self, name, _with_field_name(name, value))
        # A recomputed block's MLP product is counted among what backward allocates, not saved.
        mlp_temporary = self.recompute_block - (self.block_backward_freed if self.recompute_block else 0) + self.block_backward_transient
        mlp_intercept = self.blocks_left_saved(1) - self.saved_per_block + mlp_temporary
        attention_intercept = (self.embedding - self.saved_per_block + self.attention_backward_saved
                               + self.attention_backward_temporary)
        peaks = bool(self.attention_backward_temporary) and attention_intercept > mlp_intercept
        derived(self, "attention_peaks", peaks)
        derived(self, "_mlp_temporary", mlp_temporary)
        derived(self, "_block_temporary", self.attention_backward_temporary if peaks else mlp_temporary)
        derived(self, "_mlp_intercept", mlp_intercept)
        derived(self, "_peak_intercept", attention_intercept if peaks else mlp_intercept)

    def replaced(self, **changes: int) -> "ActivationBytes":
        """`dataclasses.replace(self, **changes)` for the int fields, without replace's walk over the fields and
        the frozen __init__: a mesh plan makes thousands (17 us each, 3 here; bench/plan_mesh_speed.md). The
        fields are copied (no field is cached on the instance), the changes applied, the derived ones redone."""
        unknown = changes.keys() - _INT_FIELDS
        if unknown:
            raise TypeError(f"not an int field of ActivationBytes: {', '.join(sorted(unknown))}")
        changed = object.__new__(ActivationBytes)
        changed.__dict__.update(self.__dict__, **changes)
        changed.__post_init__()
        return changed

    def term_tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(ledger term name, the tensors of one period of its growth) for the block terms whose tensors are
        known and add up to their bytes: what a block saves (N blocks' under checkpoint_every N, the last one
        checkpointed), what a checkpointed block's backward rebuilds. The allocator replay cuts those terms so
        (estimate/device/estimate.py); the others keep their kind's pieces."""
        if self.offloaded:  # the blocks' tensors are on the host; the one in flight is a part of a block
            return ()
        found = []
        saved = self.saved_tensors
        if self.checkpoint_every:
            plain, kept = self.saved_tensors, self.checkpointed.saved_tensors
            saved = plain * (self.checkpoint_every - 1) + kept if plain and kept else ()
        if saved and sum(saved) == self._saved_through(self.checkpoint_every or 1):
            found.append((TERMS["saved_per_block"], saved))
        rebuilt = self if not self.checkpoint_every else self.checkpointed
        if rebuilt.recompute_tensors and sum(rebuilt.recompute_tensors) == rebuilt.recompute_block:
            found.append((TERMS["recompute_block"], rebuilt.recompute_tensors))
        return tuple(found)

    def with_each_kind(self, change) -> "ActivationBytes":
        """`change` (ActivationBytes -> ActivationBytes) applied to these terms and, under
        checkpoint_every, to the checkpointed blocks' terms too."""
        changed = change(self)
        return changed if self.checkpointed is None else replace(changed, checkpointed=self.checkpointed.with_each_kind(change))

    def _kind(self, block: int) -> "ActivationBytes":
        """The terms of block `block` (1-based, forward order): `checkpointed` for N, 2N, ..."""
        if self.checkpoint_every and block and block % self.checkpoint_every == 0:
            return self.checkpointed
        return self

    def _saved_through(self, blocks: int) -> int:
        """What blocks 1..`blocks` keep until their backward."""
        if not self.checkpoint_every:
            return blocks * self.saved_per_block
        every = blocks // self.checkpoint_every
        return (blocks - every) * self.saved_per_block + every * self.checkpointed.saved_per_block

    def _before(self, blocks_left: int) -> int:
        """What the blocks before the one in progress keep on the device in backward."""
        return 0 if self.offloaded else self._saved_through(blocks_left - 1)

    @property
    def blocks_saved(self) -> int:
        if self.offloaded:  # on the host; the hooks' forward stash at the end is the final norm's (`final_norm`)
            return self.embedding
        return self.embedding + self._saved_through(self.num_blocks)

    @property
    def forward_end(self) -> int:
        """Bytes held when the forward pass has returned the loss (the logits are freed then:
        log_softmax keeps its output, not its input)."""
        return self.blocks_saved + self.final_norm + self.loss_saved

    @property
    def forward_peak(self) -> int:
        """While the loss is computed: every saved tensor, the logits, their fp32 upcast and
        log_softmax's output."""
        return self.blocks_saved + self.final_norm + self.logits + self.loss_transient + self.loss_saved

    @property
    def blocks_end_peak(self) -> int:
        """The end of the last block's forward: every block's saved tensors, the MLP's output and
        the residual sum being written (the block's output, which the final norm keeps)."""
        return self.blocks_saved + self._kind(self.num_blocks).block_forward_transient

    @property
    def backward_start_peak(self) -> int:
        """log_softmax's backward: its saved output plus the gradients of nll_loss and of log_softmax."""
        return self.forward_end + self.logits_grad

    @property
    def head_backward_saved(self) -> int:
        """lm_head's backward: log_softmax's output is freed, lm_head's input is still saved."""
        return self.blocks_saved + self.final_norm

    def block_backward_peak(self, blocks_left: int) -> int:
        """Inside the backward of a block when `blocks_left` blocks (itself included) still hold
        their saved tensors: the final norm and the loss are gone by then. The larger of two
        moments, the MLP's backward and the attention core's (`attention_peaks`); both are
        affine in `blocks_left` with the same slope, so the same one wins in every block (of
        one kind, under checkpoint_every).
        Equal to `block_backward_saved(blocks_left) + block_backward_temporary_at(blocks_left)`."""
        if not blocks_left:
            return self.embedding + self._block_temporary
        if not self.checkpoint_every:
            return self._peak_intercept + (1 if self.offloaded else blocks_left) * self.saved_per_block
        kind = self._kind(blocks_left)
        return kind._peak_intercept + kind.saved_per_block + self._before(blocks_left)

    def block_backward_saved(self, blocks_left: int) -> int:
        """The part of `block_backward_peak` allocated in forward (saved tensors)."""
        kind = self._kind(blocks_left)
        if kind.attention_peaks and blocks_left:
            return self.embedding + self._before(blocks_left) + kind.attention_backward_saved
        return self.blocks_left_saved(blocks_left)

    def blocks_left_saved(self, blocks_left: int) -> int:
        """Saved tensors at the MLP's backward in the block in progress, `blocks_left` blocks (it
        included) still holding theirs: the MLP's product, freed by down_proj's backward, is gone
        from the block in progress (unless it was recomputed)."""
        kind = self._kind(blocks_left)
        freed = kind.block_backward_freed if not kind.recompute_block and blocks_left else 0
        if blocks_left and self.offloaded:
            return self.embedding + kind.saved_per_block + self._before(blocks_left) - freed
        return self.embedding + self._saved_through(blocks_left) - freed

    def block_mlp_peak(self, blocks_left: int) -> int:
        """The MLP's moment of a block's backward (`block_backward_peak` when the MLP peaks)."""
        if not blocks_left:
            return self.embedding + self._mlp_temporary
        if not self.checkpoint_every:
            return self._mlp_intercept + (1 if self.offloaded else blocks_left) * self.saved_per_block
        kind = self._kind(blocks_left)
        return kind._mlp_intercept + kind.saved_per_block + self._before(blocks_left)

    @property
    def block_input_grad(self) -> int:
        """The gradient of a block's input, alive when its backward ends (residual width)."""
        return self.block_input_grad_bytes

    @property
    def block_backward_temporary(self) -> int:
        """The part of `block_backward_peak` allocated in backward: the recomputed block and the
        gradients in flight (`zeroplan measure` counts what backward allocates as temporaries)."""
        return self._block_temporary

    def block_backward_temporary_at(self, blocks_left: int) -> int:
        """`block_backward_temporary` of the block in progress when `blocks_left` hold theirs."""
        return self._kind(blocks_left)._block_temporary

    def backward_blocks(self) -> list[int]:
        """The blocks, counted from the last (0) in backward order, where a profile looks for a
        block's peak: the ends and their neighbours, the terms being linear in between; every
        block when checkpoint_every mixes two kinds of blocks."""
        n = self.num_blocks
        if self.checkpoint_every:
            return list(range(n))
        return [j for j in sorted({0, 1, n - 2, n - 1}) if 0 <= j < n]


_INT_FIELDS = frozenset(f.name for f in fields(ActivationBytes) if f.init and f.type in ("int", int))
_NAMED_FIELDS = tuple(sorted(TERMS.keys() | {"host_bytes"}))


def _with_field_name(field_name: str, value: int) -> int:
    """`value` with its unnamed part under the field's own term name (`TERMS`)."""
    parts = parts_of(value)
    unnamed = parts.pop(UNNAMED)
    name = TERMS.get(field_name, "activations offloaded to the host")
    parts[name] = parts.get(name, 0) + unnamed
    return Terms(parts)


@dataclass(frozen=True)
class Widths:
    """Element sizes of the activations: the residual stream's and the matmuls' outputs'.

    Equal except under torch.autocast (the torch engine's fp16/bf16, measure/engines/
    torch_engine.py): parameters and the residual stream stay fp32, and every matmul casts its
    input and weight to 16-bit (aten autocast "lower_precision_fp" list: mm, addmm, linear,
    scaled_dot_product_attention); each cast is a new tensor the matmul saves."""

    resid: int
    comp: int
    autocast: bool


@dataclass(frozen=True)
class Dropout:
    """Which dropout layers run (rate above 0), and where: what a dropout keeps depends on the device."""

    embedding: bool
    attention: bool
    residual: bool
    cuda: bool

    def mask(self, element_bytes: int) -> int:
        """Bytes per element of a dropout's kept mask: native_dropout's bool mask on CUDA, the
        noise tensor of the input's dtype on CPU (aten/src/ATen/native/Dropout.cpp `dropout`:
        the fused kernel only where `is_fused_kernel_acceptable`, else `_dropout_impl`)."""
        return 1 if self.cuda else element_bytes


@dataclass(frozen=True)
class AttentionCore:
    """The attention core's kernel and the element sizes of the s x s tensors it keeps.

    fused: flash / memory-efficient SDPA (q, k, v, output and log-sum-exp; with dropout their RNG
    seed and offset only). eager: eager_attention_forward. math: SDPA's math fallback, which is
    what runs on CPU with dropout (the CPU flash kernel refuses dropout: sdp_utils_cpp.cpp
    `check_for_dropout`); it upcasts 16-bit inputs to fp32 and keeps q, k, v, the softmax output,
    the dropout noise and the dropped probabilities in fp32."""

    kernel: str  # fused, eager or math
    qkv: int  # element size of q, k and v as the s x s matmuls keep them
    softmax: int  # of the softmax output
    probs: int  # of the probabilities the matmul with v reads (cast back or dropped)
    mask: int  # of attention dropout's mask (0: no attention dropout)

    @property
    def probs_saved(self) -> int:
        """Bytes kept per attention probability: the softmax output, and the cast back (when its
        dtype differs) or, with dropout, the mask and the dropped probabilities."""
        if self.mask:
            return self.softmax + self.mask + self.probs
        return self.softmax + (self.probs if self.probs != self.softmax else 0)

    @property
    def backward_moment(self) -> tuple[int, int]:
        """(kept, allocated) per probability at the peak of the core's backward: the softmax's
        backward (its output kept; its incoming gradient and result, in the softmax dtype) or,
        with dropout, the dropout's just before (the mask kept too; gradients in the probs' dtype)."""
        softmax = (self.softmax, 2 * self.softmax)
        if not self.mask:
            return softmax
        dropout = (self.softmax + self.mask, 2 * self.probs)
        return dropout if sum(dropout) > sum(softmax) else softmax


def attention_core(spec: TransformerSpec, attention: Attention, dropout: Dropout, w: "Widths") -> AttentionCore:
    if attention == Attention.FUSED and dropout.attention and not dropout.cuda:
        return AttentionCore("math", FP32_BYTES, FP32_BYTES, FP32_BYTES, FP32_BYTES)
    if attention == Attention.FUSED:
        return AttentionCore("fused", w.comp, 0, 0, 0)
    return AttentionCore("eager", w.comp, _softmax_bytes(spec, w), w.comp, dropout.mask(w.comp) if dropout.attention else 0)


def input_projections(spec: TransformerSpec) -> tuple[int, int]:
    """Matmuls reading the attention norm's and the MLP norm's output: separate q/k/v and gate/up
    projections (Llama family), or fused ones (GPT-2's c_attn and c_fc, NeoX, Phi-3)."""
    fused = spec.position_embedding == "learned" or spec.hf_model_type in ("gpt2", "gpt_neox", "phi3")
    attn_reads = 1 if fused else 3
    mlp_reads = 2 if spec.mlp == "gated" and spec.hf_model_type != "phi3" else 1
    return attn_reads, mlp_reads


def norm_saved_per_token(spec: TransformerSpec, w: Widths, reads: int) -> int:
    """A norm and the input of the matmuls reading it.

    RMSNorm (LlamaRMSNorm.forward): `hidden_states.to(float32)` (kept by pow and mul: the input
    itself when it is fp32), `hidden_states * rsqrt(...)` cast back to the input dtype (kept by
    the weight multiply), rsqrt's fp32 output per token. LayerNorm (aten native_layer_norm): its
    input plus fp32 mean and rstd per token. The output is kept by the matmuls that read it:
    once, or under autocast one 16-bit cast per matmul."""
    h = spec.hidden_size
    out = w.comp * h * (reads if w.autocast else 1)
    if spec.norm == "rmsnorm":
        normed = FP32_BYTES if spec.norm_weight_in_fp32 else w.resid  # Gemma2RMSNorm, Olmo2RMSNorm: weight before the cast
        return FP32_BYTES * h + normed * h + FP32_BYTES + out + moe.gpt_oss_norm_extra_per_token(spec, w.resid)
    return w.resid * h + 2 * FP32_BYTES + out


def attention_saved_per_token(spec: TransformerSpec, core: AttentionCore, checkpointing: Checkpointing, seq_len: int,
                               w: Widths) -> int:
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    act = w.comp
    out = act * q_width  # attention output, read by o_proj
    # The fused kernel's fp32 log-sum-exp per head, counted under selective checkpointing too
    # (conservative; keeps `memory_checkpointing` exact): docs/engines/activations.md.
    lse = FP32_BYTES * spec.num_heads if core.kernel == "fused" else 0
    if spec.mla is not None and core.kernel == "fused" and checkpointing != Checkpointing.SELECTIVE:
        return moe.mla_saved_per_token(spec, w.comp)  # DeepSeek's latent attention
    if spec.mla is not None and core.kernel == "eager" and checkpointing != Checkpointing.SELECTIVE:
        # its eager core: the latent path and q, k, v as above, and the softmax's s x s probabilities
        return moe.mla_eager_saved_per_token(spec, w.comp) + core.probs_saved * spec.num_heads * seq_len
    if checkpointing == Checkpointing.SELECTIVE:
        # The core runs under checkpoint: its inputs stay alive for the recomputation (q, and k
        # and v before repeat_kv), nothing it saves does (measured: docs/engines/activations.md).
        return _core_inputs_per_token(spec, w) + out + lse
    if core.kernel == "fused":
        # q and k after rotary (or GPT-2's c_attn output), v; under autocast the casts SDPA saves.
        return act * (q_width + 2 * kv_width) + out + lse
    # eager (and math): k and v repeated to num_heads, the softmax output per query row (s keys each).
    # Llama's eager_attention_forward takes it in fp32 (softmax(..., dtype=float32)) and keeps its
    # cast back for the matmul with v; GPT-2's takes it in the scores' dtype, so only under
    # autocast (softmax is on autocast's fp32 list) is there an fp32 output and a cast. With
    # dropout the matmul keeps the dropped probabilities instead of the cast, and dropout its mask.
    qkv = core.qkv * 3 * q_width
    probs = core.probs_saved * spec.num_heads * seq_len
    if spec.attention_sinks and core.kernel == "eager" and not core.mask:  # GPT-OSS
        per_score, per_head = moe.sinks_probs_saved(w.comp)
        probs = (per_score * seq_len + per_head) * spec.num_heads
    return qkv + out + probs


def _attention_backward_per_token(spec: TransformerSpec, core: AttentionCore, checkpointing: Checkpointing, seq_len: int,
                                  w: Widths, attn_reads: int) -> tuple[int, int]:
    """(saved, allocated in backward) per token at the peak of eager attention's core backward in
    the block in progress: the softmax's backward (torch/csrc/autograd/FunctionsManual.cpp,
    aten _softmax_backward_data), between the backward of probs @ v and of q @ k^T.

    Alive then: the softmax's incoming gradient (fp32 when the softmax upcasts, after the cast's
    backward) and its result, computed in the softmax's dtype before its cast to the scores'
    dtype: 2 x f x a x s; the gradient of the block's
    output (residual width) and of the repeated v (q width), which waits for the softmax branch
    (autograd runs the most recently created node first). Saved tensors still alive: the first
    norm's, q and k as q @ k^T saved them (one storage of q, k and v for GPT-2's split c_attn),
    and the softmax output; v's copy and the cast probabilities were freed with the backward of
    probs @ v, the MLP's and the second norm's with theirs (measured: docs/engines/activations.md).
    With attention dropout the dropout's backward, just before, can be higher (`AttentionCore.backward_moment`).
    Fused kernels keep no s x s tensor: not modelled for them."""
    h = spec.hidden_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    c = core.qkv
    kept, grads = core.backward_moment
    scores = spec.num_heads * seq_len
    transient = grads * scores + w.resid * h + c * q_width
    norm = norm_saved_per_token(spec, w, attn_reads)
    fused_qkv = attn_reads == 1  # q, k and v are views of one projection's output
    repeated = w.comp * q_width if kv_width < q_width else 0  # repeat_kv's copy of k (Llama-family GQA)
    saved_qk = c * 3 * q_width if fused_qkv else c * 2 * q_width
    if checkpointing == Checkpointing.NONE:
        return norm + saved_qk + kept * scores, transient
    if checkpointing == Checkpointing.SELECTIVE:  # the core's inputs are saved; its tensors come back
        # The math path's recomputed fp32 copies of q, k and v, and its output's fp32 gradient, are
        # alive at the backward of probs @ v as well (measured: docs/engines/activations.md, "Dropout").
        copies = (3 * core.qkv + FP32_BYTES) * q_width if core.kernel == "math" else 0
        return norm + _core_inputs_per_token(spec, w), repeated + kept * scores + transient + copies
    # full: the whole block comes back; its input is still saved (`saved_per_block`, added by the caller)
    shared = w.resid * h if norm_saves_block_input(spec, w) else 0
    return 0, norm - shared + saved_qk + kept * scores + transient


def _eager_mask_bytes(micro_batch: int, seq_len: int, w: Widths) -> int:
    """Eager attention reads an explicit causal mask (masking_utils `eager_mask`: batch x 1 x s x s
    in the embeddings' dtype), built once per forward. Without checkpointing no backward needs it;
    a checkpointed core (selective) or block (full) keeps it among its inputs until that block's
    backward, so the first block's keeps it to the end of backward (docs/engines/activations.md)."""
    return micro_batch * seq_len * seq_len * w.resid


def _core_inputs_per_token(spec: TransformerSpec, w: Widths) -> int:
    """What a checkpointed attention core keeps for its recomputation: q, and k and v before
    repeat_kv. Under autocast the rotary embedding's cos and sin are in the fp32 residual dtype,
    so q and k after it are fp32 (type promotion) until the core casts them
    (docs/engines/activations.md)."""
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    qk = w.resid if (w.autocast and spec.position_embedding == "rotary") else w.comp
    return qk * (q_width + kv_width) + w.comp * kv_width


def _softmax_bytes(spec: TransformerSpec, w: Widths) -> int:
    """Element size of eager attention's softmax output: fp32 where it upcasts (Llama's
    softmax(..., dtype=float32); anything under autocast, softmax being on its fp32 list), else
    the scores' dtype (GPT-2)."""
    return FP32_BYTES if (w.autocast or not _softmax_in_compute_dtype(spec)) else w.comp


def norm_saves_block_input(spec: TransformerSpec, w: Widths) -> bool:
    """Does a block's first norm save the block's input tensor itself (LayerNorm; RMSNorm on an
    fp32 input, whose .float() is a no-op), so that full checkpointing's kept input is that one?"""
    if spec.norm_placement == "post":  # OLMo 2: q_proj keeps the input itself, or its autocast cast
        return not w.autocast
    return spec.norm != "rmsnorm" or w.resid == FP32_BYTES


def _softmax_in_compute_dtype(spec: TransformerSpec) -> bool:
    """GPT-2's eager attention (modeling_gpt2.eager_attention_forward) softmaxes in the scores' dtype."""
    return spec.position_embedding == "learned" or spec.hf_model_type == "gpt2" or spec.attention_sinks


def _family_saved_per_token(spec: TransformerSpec, core: AttentionCore, checkpointing: Checkpointing, seq_len: int, w: Widths,
                            attn_reads: int, mlp_reads: int) -> int:
    """The dense families' block terms (estimate/activations/families.py); zero for a Llama block."""
    h = spec.hidden_size
    inputs = sum(families.post_norm_input_delta_per_token(
        spec, norm_saved_per_token(spec, w, reads), w.comp * h * reads if w.autocast else w.resid * h)
        for reads in (attn_reads, mlp_reads))
    # selective checkpointing recomputes the core, soft-capping included
    eager_core = core.kernel == "eager" and checkpointing != Checkpointing.SELECTIVE
    return (families.qk_norm_saved_per_token(spec, w.comp) + 2 * families.output_norm_saved_per_token(spec, w.comp)
            + inputs + families.softcap_scores_per_token(spec, eager_core, seq_len, w.comp)
            + families.sliding_saved_per_token(spec, core.kernel, seq_len, w.comp)
            + families.phi3_sdpa_saved_per_token(spec, core.kernel, checkpointing == Checkpointing.SELECTIVE, w.comp))


def _family_attention_backward_per_token(spec: TransformerSpec, core: AttentionCore, checkpointing: Checkpointing, seq_len: int,
                                         w: Widths, attn_reads: int) -> tuple[int, int]:
    """(saved, allocated) added at the softmax's backward by the dense families: the q/k norms'
    tensors and tanh's soft-capped scores are still alive (their backwards come after), OLMo 2's
    projections keep the block input instead of a norm's tensors."""
    h = spec.hidden_size
    qk = families.qk_norm_saved_per_token(spec, w.comp)
    softcap = families.softcap_scores_per_token(spec, core.kernel == "eager", seq_len, w.comp)
    if checkpointing == Checkpointing.FULL:  # the block is recomputed: all of it allocated in backward
        return 0, qk + softcap
    inputs = families.post_norm_input_delta_per_token(
        spec, norm_saved_per_token(spec, w, attn_reads), w.comp * h * attn_reads if w.autocast else w.resid * h)
    if checkpointing == Checkpointing.SELECTIVE:  # the core's tanh comes back with it
        return qk + inputs, softcap
    return qk + inputs + softcap, 0


def _mlp_saved_per_token(spec: TransformerSpec, w: Widths) -> int:
    if spec.moe is not None:  # experts narrower than the dense MLP, shared experts (estimate/activations/moe.py)
        return moe.mlp_saved_per_token(spec, w.comp)
    h, inner, act = spec.hidden_size, spec.intermediate_size, w.comp
    if spec.mlp == "gated":
        dense = 4 * act * inner  # gate, SiLU(gate), up, product
    else:
        dense = 5 * act * inner  # gelu_new written out: x, tanh, 0.5x, 1+tanh, product
    if not spec.is_moe:
        return dense
    k = spec.experts_per_token
    router = FP32_BYTES * spec.num_experts * 2  # router logits and their fp32 softmax
    gathered_inputs = k * act * h  # each expert's gathered token rows
    return router + gathered_inputs + k * dense


def _weight_casts(spec: TransformerSpec, w: Widths) -> tuple[int, int]:
    """Under autocast, the 16-bit copies of a block's matmul weights and of the output head's,
    made at first use (autocast's weight cache) and saved by each matmul until its backward.
    Biases are cast too, but addmm's backward does not keep them."""
    if not w.autocast:
        return 0, 0
    block = sum(t.numel for t in param_layout(spec).block if t.name.endswith("weight") and "norm" not in t.name)
    return w.comp * block, w.comp * spec.vocab_size * spec.hidden_size


def _block_forward_transient_per_token(spec: TransformerSpec, checkpointing: Checkpointing, w: Widths) -> int:
    """Live in the last block's forward beyond the saved tensors.

    Without checkpointing: the residual add (x + mlp(x)) writes the block's output while
    down_proj's output lives. Under full checkpointing nothing inside the block is saved, but
    its MLP still holds, while it multiplies, the residual stream, the MLP norm's output and
    three intermediate-width tensors (LlamaMLP: SiLU(gate), up and their product; the gate
    output is dropped once SiLU has read it) or four (GPT-2's gelu_new written out: the c_fc
    output, 0.5x, 1 + tanh(...) and the product)."""
    h = spec.hidden_size
    if spec.moe is not None:
        return moe.mlp_forward_transient_per_token(spec, w.resid, w.comp, checkpointing in (Checkpointing.FULL, Checkpointing.OP))
    if checkpointing not in (Checkpointing.FULL, Checkpointing.OP):
        return (w.resid + w.comp) * h
    k = spec.experts_per_token if spec.is_moe else 1
    live_inner = 3 if spec.mlp == "gated" else 4
    return w.resid * h + w.comp * h + k * live_inner * w.comp * spec.intermediate_size


def _block_backward_transient_per_token(spec: TransformerSpec, w: Widths) -> int:
    """Gradients in flight at the peak of a block's backward, beyond its saved tensors.

    The block's backward starts with the gradient of its output (residual width, kept until the
    residual add sums it). The MLP's last product (silu(gate) * up, or gelu_new's 0.5x * (1 +
    tanh)) is read by down_proj / c_proj, whose backward frees it and returns the product's
    gradient (intermediate width); the product's backward (aten mul) then returns two more
    gradients of intermediate width while that one is alive (torch/csrc/autograd/
    FunctionsManual.cpp mul_tensor_backward, one per factor). Allocated: h + 3 x inner; freed:
    the product (`_block_backward_freed_per_token`). The last block's backward peaks there
    (measured: docs/engines/activations.md).
    """
    if spec.moe is not None:
        return moe.mlp_backward_transient_per_token(spec, w.resid, w.comp)
    k = spec.experts_per_token if spec.is_moe else 1
    return w.resid * spec.hidden_size + 3 * k * w.comp * spec.intermediate_size


def _block_backward_freed_per_token(spec: TransformerSpec, dropout: Dropout, w: Widths) -> int:
    """The MLP's product and, with residual dropout, the MLP output's mask (its backward ran first)."""
    k = spec.experts_per_token if spec.is_moe else 1
    product = moe.mlp_backward_freed_per_token(spec, w.resid, w.comp) if spec.moe is not None else k * w.comp * spec.intermediate_size
    return (product + (dropout.mask(w.comp) * spec.hidden_size if dropout.residual else 0)
            + families.output_norm_saved_per_token(spec, w.comp))  # post_feedforward_layernorm's backward ran first


def _residual_masks_per_token(spec: TransformerSpec, dropout: Dropout, w: Widths) -> int:
    """Residual dropout's masks: on the attention's and the MLP's outputs, before each residual add
    (GPT2Attention.resid_dropout and GPT2MLP.dropout; GPT-NeoX post_attention_dropout and
    post_mlp_dropout; Phi-3 resid_attn_dropout and resid_mlp_dropout), in the projections' dtype."""
    return 2 * dropout.mask(w.comp) * spec.hidden_size if dropout.residual else 0


def memory_checkpointing(training: TrainingSpec, model: object = None) -> Checkpointing:
    """The checkpointing mode whose activations `training`'s equal. Selective recomputation
    (Korthikanti et al. 2022, section 4.2) keeps the attention core's inputs instead of what the
    core saves: under fused attention (Dao et al. 2022, section 3.1) that is q, k and v either way
    (`attention_saved_per_token`, with the kernel's log-sum-exp counted in both), so selective
    keeps exactly what no checkpointing keeps, unless autocast makes the kept inputs wider than
    the casts the kernel saves. The engine profiles see checkpointing only through these
    activations, so the two estimates are equal (the planner shares them; tests/plan/test_search.py
    checks it), while the step cost still differs. Not so where `model`'s attention dropout sends
    fused attention down SDPA's math path (on CPU), whose s x s tensors selective recomputes."""
    math = isinstance(model, TransformerSpec) and dropout_of(model, training).attention and training.device == Device.CPU
    if (training.checkpointing == Checkpointing.SELECTIVE and training.attention == Attention.FUSED
            and not runs_autocast(training) and not math):
        return Checkpointing.NONE
    return training.checkpointing


def runs_autocast(training: TrainingSpec) -> bool:
    """Does the run keep fp32 parameters and compute under torch.autocast (`Widths`)?"""
    return training.engine == Engine.TORCH and training.precision in (Precision.BF16, Precision.FP16)


def dropout_of(spec: TransformerSpec, training: TrainingSpec) -> Dropout:
    key = (training.dropout, training.device)
    last_spec, last_key, last = _LAST_DROPOUT
    if spec is last_spec and key == last_key:  # a plan asks for one model's, several times per configuration
        return last
    rates = spec.dropout_rates(training.dropout)
    found = Dropout(rates.embedding > 0, rates.attention > 0, rates.residual > 0, training.device == Device.CUDA)
    _LAST_DROPOUT[:] = (spec, key, found)  # holds the (frozen) spec: its id is never reused while kept
    return found


_LAST_DROPOUT: list = [None, None, None]  # `dropout_of`'s last (spec, (dropout, device), result)


def attention_kernel(spec: TransformerSpec, training: TrainingSpec) -> str:
    """The attention core that runs: fused, eager, or math (SDPA's fallback, fused attention with
    dropout on CPU)."""
    w = Widths(resid=0, comp=0, autocast=runs_autocast(training))
    return attention_core(spec, training.attention, dropout_of(spec, training), w).kernel


class ActivationInputs(NamedTuple):
    """What `activation_bytes` reads of a training spec besides the micro-batch: the same for every micro-batch of
    one configuration (the planner's probes: estimate/__init__.py `FitModel`)."""

    seq_len: int
    checkpointing: Checkpointing
    checkpoint_every: int | None
    kernel: tuple  # `_activation_bytes`' arguments after the checkpointing mode
    reread: bool  # torch.compile, float8 or activation offload: their changes read the spec again


def activation_inputs(spec: TransformerSpec, training: TrainingSpec, act_bytes: int) -> ActivationInputs:
    program = training.program
    titan = program.loss == Loss.CHUNKED and program.recipe == Recipe.TORCHTITAN
    # torchtitan's lm_head, an FSDP2 unit of its own with gradient sync off but for the last chunk,
    # accumulates its unsharded gradient in the fp32 reduce dtype (torch _fsdp_param.py
    # to_accumulated_grad_if_needed); the profile counts the 16-bit one.
    fp32_head_grad = (titan and training.engine == Engine.FSDP2
                      and training.precision in (Precision.BF16, Precision.FP16))
    kernel = (training.attention, runs_autocast(training), act_bytes, dropout_of(spec, training), program.loss,
              program.loss_chunks, "torchtitan" if titan else "torchtune", fp32_head_grad)
    reread = bool(training.compile) or training.float8 is not None or program.activation_offload == ActivationOffload.CPU
    return ActivationInputs(training.seq_len, training.checkpointing, training.checkpoint_every, kernel, reread)


def activation_bytes(spec: TransformerSpec, training: TrainingSpec, act_bytes: int,
                     inputs: ActivationInputs | None = None) -> ActivationBytes:
    """Activations of one micro-batch of `training.micro_batch` x `training.seq_len` tokens; `inputs`: the caller's
    `activation_inputs(spec, training, act_bytes)`, or of a spec that differs from `training` in the micro-batch or
    the accumulation only."""
    inputs = inputs or activation_inputs(spec, training, act_bytes)
    acts = _checkpointed_bytes((spec, training.micro_batch, inputs.seq_len), inputs.checkpointing, inputs.checkpoint_every,
                               inputs.kernel)
    if not inputs.reread:
        return acts
    if training.compile:  # what inductor's graphs keep instead (estimate/activations/compiled.py)
        from zeroplan.estimate.activations.compiled import compiled_changes

        changes = compiled_changes(acts, spec, training, act_bytes, FP32_BYTES if runs_autocast(training) else act_bytes)
        if changes:
            acts = acts.replaced(**changes)
    if training.float8 is not None:  # torchao Float8Linear's casts (estimate/activations/float8.py)
        from zeroplan.estimate.activations.float8 import float8_changes

        acts = acts.with_each_kind(lambda kind: kind.replaced(**float8_changes(kind, spec, training, act_bytes)))
    if training.program.activation_offload == ActivationOffload.CPU:
        return _offloaded(acts, spec, training, act_bytes)
    return acts


def _checkpointed_bytes(args: tuple, checkpointing: Checkpointing, every: int | None, rest: tuple) -> ActivationBytes:
    spec = args[0]
    if every and checkpointing == Checkpointing.FULL:
        if every > spec.num_layers:  # no block index is a multiple of N: nothing is checkpointed
            return _activation_bytes(*args, Checkpointing.NONE, *rest)
        full = _activation_bytes(*args, Checkpointing.FULL, *rest)
        plain = _activation_bytes(*args, Checkpointing.NONE, *rest)
        return replace(plain, embedding=full.embedding, checkpoint_every=every, checkpointed=full)
    return _activation_bytes(*args, checkpointing, *rest)


def _offloaded(acts: ActivationBytes, spec: TransformerSpec, training: TrainingSpec, act_bytes: int) -> ActivationBytes:
    """torchtune 0.6.1 OffloadActivations around the model's forward (training/_activation_offloading.py;
    docs/engines/activations.md, "Activation offloading"): every saved tensor of 1024 bytes or more
    that is not a parameter goes to pinned host memory, the output head's excepted (NoOpManager),
    so the blocks and the final norm's input and rstd leave the device; the loss is outside the
    hooks and stays. Under full checkpointing what a block saves is its input. Tensors under 1024
    bytes (per-token scalars of fewer than 256 tokens) are counted as offloaded too."""
    autocast = runs_autocast(training)
    w = Widths(resid=FP32_BYTES if autocast else act_bytes, comp=act_bytes, autocast=autocast)
    tokens = training.micro_batch * training.seq_len
    final_norm_input = tokens * (norm_saved_per_token(spec, w, 1) - w.comp * spec.hidden_size)
    int64_bytes = 8  # the token ids the embedding saves (the batch keeps the device copy)
    host = acts._saved_through(acts.num_blocks) + final_norm_input + tokens * int64_bytes
    # The forward stash (its 5 latest packs) still holds the final norm's saved tensors when the
    # loss runs; the first offloaded node of backward drops it, before any block: `final_norm` stays.
    # In backward a node's tensors come back as it runs and go after the next one: at a block's
    # peak, in its MLP, about the MLP's saved tensors (a checkpointed block: its input).
    in_flight = acts.saved_per_block
    if training.checkpointing not in (Checkpointing.FULL, Checkpointing.OP):
        in_flight = min(in_flight, tokens * _mlp_saved_per_token(spec, w))
    return replace(acts, offloaded=True, host_bytes=named("activations offloaded to the host", host), saved_per_block=in_flight)


def _block_matmuls(spec: TransformerSpec) -> list[tuple[int, bool]]:
    """(output width, has a bias) of a block's matmuls in forward order, as transformers' modules
    run them: GPT-2's Conv1D is torch.addmm(bias, x, weight); nn.Linear is aten mm without a bias,
    addmm with one (aten/src/ATen/native/Linear.cpp). Mixture of experts: the router, then each of
    the top-k experts' gated MLP (approximate: transformers batches the experts)."""
    h, inner = spec.hidden_size, spec.intermediate_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    if spec.position_embedding == "learned" or spec.hf_model_type == "gpt2":
        return [(3 * h, True), (h, True), (inner, True), (h, True)]  # c_attn, c_proj, mlp.c_fc, mlp.c_proj
    bias = spec.attention_bias
    fused_qkv = spec.hf_model_type in ("gpt_neox", "phi3")
    attention = [(q_width + 2 * kv_width, bias)] if fused_qkv else [(q_width, bias), (kv_width, bias), (kv_width, bias)]
    attention.append((h, spec.attention_out_bias))
    if spec.mlp == "gated":
        up = [(2 * inner, spec.mlp_bias)] if spec.hf_model_type == "phi3" else [(inner, spec.mlp_bias)] * 2
    else:
        up = [(inner, spec.mlp_bias)]
    mlp = up + [(h, spec.mlp_bias)]
    if spec.is_moe:
        return attention + [(spec.num_experts, False)] + mlp * spec.experts_per_token
    return attention + mlp


def _op_saved_per_token(spec: TransformerSpec, attention: Attention, seq_len: int, w: Widths) -> int:
    """The bytes per token of `_op_saved_tensors_per_token`."""
    return sum(_op_saved_tensors_per_token(spec, attention, seq_len, w))


def _op_saved_tensors_per_token(spec: TransformerSpec, attention: Attention, seq_len: int, w: Widths) -> tuple[int, ...]:
    """What torchtitan's per-op policy saves of a block besides its input (torchtitan 0.3.0
    distributed/activation_checkpoint.py `SelectiveAC`): the outputs of the ops in its save list
    (torch's compute_intensive_ops: mm, addmm, bmm, the SDPA kernels), except every second mm or
    linear, counted in forward order from 0 at each block's forward. Fused attention saves the
    kernel's output and fp32 log-sum-exp; eager attention's two bmm (q k^T, probs v) are saved.
    Everything else is recomputed (docs/engines/activations.md, "Per-op checkpointing")."""
    q_width = spec.num_heads * spec.dim_per_head
    if attention == Attention.FUSED:  # the kernel's output and fp32 logsumexp
        core = [w.comp * q_width, FP32_BYTES * spec.num_heads]
    else:  # q @ k^T's scores, probs @ v's output
        core = [w.comp * spec.num_heads * seq_len, w.comp * q_width]
    counted, saved = 0, []
    for index, (width, bias) in enumerate(_block_matmuls(spec)):
        if index == input_projections(spec)[0]:  # the core runs between the q/k/v projections and the output one
            saved += core
        if bias:  # addmm: saved, not counted
            saved.append(w.comp * width)
            continue
        counted += 1
        if counted % 2:
            saved.append(w.comp * width)
    return tuple(saved)


def _loss_terms(spec: TransformerSpec, micro_batch: int, seq_len: int, loss: Loss, chunks: int, w: Widths,
                act_bytes: int, head_cast: int, chunking: str, fp32_head_grad: bool) -> dict[str, int]:
    """The ActivationBytes terms of the output projection and the loss (docs/engines/activations.md,
    "Losses"), and what the final norm's saved tensors change by (`final_norm`)."""
    tokens = micro_batch * seq_len
    vocab, h = spec.vocab_size, spec.hidden_size
    widened = act_bytes != FP32_BYTES
    if loss == Loss.CHUNKED and chunking == "torchtitan":
        # torchtitan 0.3.0 components/loss.py ChunkedLossWrapper: the model returns the final
        # norm's output; N detached .contiguous() copies of it are made up front and an fp32
        # GradAccumulator of its shape; each chunk runs lm_head, the fp32 cross-entropy and its
        # backward at once, so one chunk's logits, upcast, log_softmax output and two fp32
        # gradients are the most alive; the accumulated gradient is what backward starts from
        # (cast to the hidden states' dtype). Estimated from the source, not measured.
        chunk = micro_batch * -(-seq_len // chunks)
        accumulator = tokens * h * FP32_BYTES
        in_chunk = chunk * vocab * (3 * FP32_BYTES + act_bytes) + chunk * h * act_bytes
        return dict(
            logits=0,
            loss_saved=accumulator,
            loss_transient=tokens * h * act_bytes + in_chunk + (vocab * h * FP32_BYTES if fp32_head_grad else 0),
            logits_grad=0,
            logits_grad_cast=0,
            head_backward_temporary=tokens * h * act_bytes,
            final_norm=-tokens * w.comp * h - head_cast,  # lm_head reads the detached copies
        )
    if loss == Loss.FUSED_LINEAR:
        # Liger ops/fused_linear_cross_entropy.py `fused_linear_cross_entropy_forward`: chunks of
        # next_power_of_2(BT / ceil(V / H)) tokens; per chunk the logits (input dtype) turned in
        # place into their gradient, and that gradient times the weight; grad_input (zeros_like
        # the input) and grad_weight (zeros_like the weight) are filled in forward and are all
        # that backward keeps (ctx.save_for_backward); loss_1d is fp32 per token. No input saved.
        chunk = min(1 << (-(-tokens // -(-vocab // h)) - 1).bit_length(), tokens)
        return dict(
            logits=0,
            loss_saved=(tokens + vocab) * h * w.resid,
            # autocast's cached cast of the head weight lives until the forward ends, unsaved
            loss_transient=chunk * (vocab + h) * act_bytes + FP32_BYTES * tokens + head_cast,
            logits_grad=0,
            logits_grad_cast=0,
            head_backward_temporary=tokens * h * w.resid,
            final_norm=-tokens * w.comp * h - head_cast,  # lm_head's saved input (or its cast) is not kept
        )
    logits = tokens * act_bytes * vocab
    loss_saved = tokens * FP32_BYTES * vocab  # log_softmax's fp32 output, every chunk's
    if loss == Loss.CHUNKED:
        # torchtune modules/transformer.py `chunked_output`: lm_head over each of h.chunk(N, dim=1),
        # every logits chunk alive until the loss returns; CEWithChunkedOutputLoss upcasts and
        # log-softmaxes one chunk at a time. Backward runs each chunk's loss before any lm_head
        # (autograd takes the latest node first), so every chunk's logits gradient is alive at
        # the first lm_head backward; from the second on, its weight gradient waits beside the
        # one accumulated (autograd's input buffer; under autocast both are 16-bit, together the
        # size of the fp32 .grad the profile counts).
        chunk_seq = -(-seq_len // chunks)
        count = -(-seq_len // chunk_seq)
        chunk = micro_batch * chunk_seq
        second_weight_grad = 0 if w.autocast else vocab * h * act_bytes
        first = logits + chunk * h * w.resid
        later = (count - 1) * chunk * act_bytes * vocab + 2 * chunk * h * w.resid + second_weight_grad if count > 1 else 0
        return dict(
            logits=logits,
            loss_saved=loss_saved,
            loss_transient=chunk * FP32_BYTES * vocab if widened else 0,
            logits_grad=2 * chunk * FP32_BYTES * vocab,
            logits_grad_cast=logits if widened else 0,
            head_backward_temporary=max(first, later),
            final_norm=0,
        )
    # Backward of nll_loss (a zero-filled fp32 gradient, aten nll_loss_backward) and of
    # log_softmax (_log_softmax_backward_data): both alive with log_softmax's saved output.
    logits_grad = 2 * tokens * FP32_BYTES * vocab
    logits_grad_cast = logits if widened else 0
    return dict(
        logits=logits,
        loss_saved=loss_saved,
        loss_transient=tokens * FP32_BYTES * vocab if widened else 0,  # the fp32 upcast
        logits_grad=logits_grad,
        logits_grad_cast=logits_grad_cast,
        # the logits' gradient (fp32, or its 16-bit cast, the fp32 one freed once the cast's
        # backward has run) and the gradient of lm_head's input
        head_backward_temporary=(logits_grad_cast or logits_grad // 2) + tokens * w.resid * h,
        final_norm=0,
    )


@memo(maxsize=4096)  # the same for every stage, offload and GPU count: warm plans take 16-22% longer without it
def _activation_bytes(spec: TransformerSpec, micro_batch: int, seq_len: int, checkpointing: Checkpointing,
                      attention: Attention, autocast: bool, act_bytes: int, dropout: Dropout, loss: Loss = Loss.STANDARD,
                      loss_chunks: int = 1, chunking: str = "torchtune", fp32_head_grad: bool = False) -> ActivationBytes:
    w = Widths(resid=FP32_BYTES if autocast else act_bytes, comp=act_bytes, autocast=autocast)
    core = attention_core(spec, attention, dropout, w)
    tokens = micro_batch * seq_len
    h = spec.hidden_size
    attn_reads, mlp_reads = input_projections(spec)
    block_casts, head_cast = _weight_casts(spec, w)
    block_per_token = (
        norm_saved_per_token(spec, w, attn_reads)
        + attention_saved_per_token(spec, core, checkpointing, seq_len, w)
        + norm_saved_per_token(spec, w, mlp_reads)
        + _mlp_saved_per_token(spec, w)
        + _residual_masks_per_token(spec, dropout, w)
        + _family_saved_per_token(spec, core, checkpointing, seq_len, w, attn_reads, mlp_reads)
        + moe.qk_norm_saved_per_token(spec, w.comp)
    )
    full_block = (tokens * block_per_token + block_casts + families.offset_weights_bytes(spec)
                  + moe.router_weight_copy_bytes(spec, w.comp))
    full_block += moe.mixed_blocks_bytes(spec, tokens, w.comp)  # dense and sparse blocks: their mean
    attention_saved = attention_temporary = 0
    if core.kernel != "fused":
        saved_pt, temporary_pt = _attention_backward_per_token(spec, core, checkpointing, seq_len, w, attn_reads)
        family_saved, family_temporary = _family_attention_backward_per_token(spec, core, checkpointing, seq_len, w, attn_reads)
        saved_pt, temporary_pt = saved_pt + family_saved, temporary_pt + family_temporary
        attention_saved, attention_temporary = tokens * saved_pt, tokens * temporary_pt
    recompute = forward_casts = 0
    # the tensors behind these bytes, for the allocator replay (tensors.py; `ActivationBytes.term_tensors`)
    full_tensors = tuple(tokens * size for size in llama_block_per_token(spec, core, w, seq_len, attn_reads, mlp_reads))
    if sum(full_tensors) != full_block:  # a family's extras: not known one by one
        full_tensors = ()
    saved_tensors = full_tensors if checkpointing == Checkpointing.NONE else ()
    recompute_tensors: tuple[int, ...] = ()
    if checkpointing in (Checkpointing.FULL, Checkpointing.OP):
        # torch.utils.checkpoint keeps the block input only (Korthikanti section 5: 2sbh in 16-bit)
        # and rebuilds the block's saved tensors in its backward, except the input when the first
        # norm saves that very tensor (LayerNorm; RMSNorm on an fp32 input, whose .float() is a no-op).
        saved_block = tokens * w.resid * h
        shared = saved_block if norm_saves_block_input(spec, w) else 0
        recompute = full_block - shared
        attention_saved += saved_block
        saved_tensors = (saved_block,)
        # what the recomputation rebuilds: the block's tensors, but for its input where the first norm keeps that one
        recompute_tensors = full_tensors[1:] if shared else full_tensors
        if checkpointing == Checkpointing.OP:
            # The per-op policy also keeps its saved ops' outputs; the recomputation takes them
            # from its cache and drops the entries (torch/utils/checkpoint.py
            # _CachedTorchDispatchMode), so the block in backward holds what full checkpointing's does.
            cached_tensors = tuple(tokens * size for size in _op_saved_tensors_per_token(spec, attention, seq_len, w))
            cached = sum(cached_tensors)
            saved_block += cached
            recompute -= cached
            saved_tensors += cached_tensors
            recompute_tensors = ()  # which of the block's tensors the cache spares is not listed
            # Autocast's weight casts are not saved but stay in its cache until the forward ends.
            forward_casts = spec.num_layers * block_casts
    else:
        saved_block = full_block
    # Kept outside the blocks: the token ids (int64, embedding's backward reads them), the
    # shifted labels nll_loss saves (loss_utils.ForCausalLMLoss pads and shifts them: int64), the
    # rotary embedding's cos and sin and, under checkpointing of eager attention, the causal mask;
    # embedding dropout's mask (GPT2Model.drop, GPT-NeoX emb_dropout), on the parameters' dtype.
    int64_bytes = 8
    embedding = 2 * tokens * int64_bytes
    if dropout.embedding:
        embedding += tokens * dropout.mask(w.resid) * h
    if spec.position_embedding == "rotary":
        # LlamaRotaryEmbedding.forward: cos and sin of 1 x seq x head_dim, cast to the embeddings'
        # dtype, shared by the batch and every block; each block's rotary multiply saves them
        # (checkpointed blocks keep them as inputs) until the first block's backward.
        # Partial rotary (GPT-NeoX, Phi-3) rotates fewer dimensions: counted at full head width.
        embedding += (2 * seq_len * spec.dim_per_head * families.rotary_element_bytes(spec, w.resid)
                      * families.rotary_tables(spec))
    if checkpointing != Checkpointing.NONE and attention == Attention.EAGER:
        embedding += _eager_mask_bytes(micro_batch, seq_len, w)
        if 0 < families.sliding_layers(spec) < spec.num_layers:  # a second, sliding-window mask
            embedding += _eager_mask_bytes(micro_batch, seq_len, w)
    head = _loss_terms(spec, micro_batch, seq_len, loss, loss_chunks, w, act_bytes, head_cast, chunking, fp32_head_grad)
    if loss == Loss.STANDARD:  # the model's own forward soft-caps its logits (Gemma 2)
        head["loss_saved"] += tokens * families.final_softcap_per_token(spec, act_bytes)
    # The final norm keeps what a block's norm keeps, its output read by lm_head alone.
    final_norm = (tokens * norm_saved_per_token(spec, w, 1) + head_cast + head.pop("final_norm")
                  + families.offset_weights_bytes(spec, final=True))
    head["loss_transient"] += forward_casts
    terms = dict(
        saved_per_block=saved_block,
        recompute_block=recompute,
        block_backward_transient=tokens * _block_backward_transient_per_token(spec, w),
        block_backward_freed=tokens * _block_backward_freed_per_token(spec, dropout, w),
        block_forward_transient=tokens * _block_forward_transient_per_token(spec, checkpointing, w) + forward_casts,
        block_input_grad_bytes=tokens * w.resid * h,
        embedding=embedding,
        final_norm=final_norm,
        attention_backward_saved=attention_saved,
        attention_backward_temporary=attention_temporary,
        **head,
    )
    return ActivationBytes(num_blocks=spec.num_layers, **{field: named(TERMS[field], value) for field, value in terms.items()},
                           saved_tensors=saved_tensors, recompute_tensors=recompute_tensors)
