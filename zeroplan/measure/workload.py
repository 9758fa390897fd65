"""The workload of a measurement: the model of a spec, built for real, and its random batches.

Where transformers is installed, the Hugging Face architecture of the spec, built from a config
with random weights (`AutoModelForCausalLM.from_config`, no download), the dropout rates the run
trains with (the model's config, or `--dropout P` on every dropout layer), and the attention kernel
of the training spec ("sdpa" for fused, "eager" for eager), in train() mode so that dropout runs;
otherwise `zeroplan.measure.reference_model`, which has no dropout layers. Which one ran is
`Workload.implementation`, e.g. "hf-transformers-5.23.0:LlamaForCausalLM/sdpa" or "zeroplan-reference:llama/sdpa".

Checkpointing (the same for both implementations):
- full: each block's forward runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`,
  so a block keeps its input only and is recomputed in backward;
- selective: the attention core only (softmax(qk^T)v, or the fused kernel) is recomputed
  (Korthikanti et al. 2022, section 4.2), as zeroplan.estimate.activations.transformer models it: the
  reference model checkpoints its core; a Hugging Face model's core is the function its attention
  module calls through transformers' AttentionInterface, which runs under checkpoint here
  (`_checkpoint_attention_core`). The core's inputs (q, k, v) stay alive for the recomputation;
  what the core saves (eager's softmax output and repeated k/v, the fused kernel's log-sum-exp)
  does not;
- op: torchtitan's per-op policy on every block (zeroplan.measure.op_checkpoint);
- full with checkpoint_every N: blocks N, 2N, ... only (1-based, torchtitan v0.2.2
  `_apply_layer_sac`), the others keep everything.

The loss is the training program's (`TrainingSpec.program.loss`): the model's own for standard,
else the final hidden states through zeroplan.measure.losses (a chunked loss under the torchtitan
recipe is torchtitan's ChunkedLossWrapper, as the estimator's `_loss_terms` counts it).

Activation offload cpu: the model's forward (embeddings to the output head) runs under torchtune's
offloading hooks (zeroplan.measure.activation_offload), the head under its no-op hooks, and the
loss after them, as torchtune's recipes call `self._model(**batch)` inside the context and the loss
outside; the standard loss is then ForCausalLMLoss written out (the same tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroplan.errors import MeasureError
from zeroplan.measure import losses
from zeroplan.measure.activation_offload import OffloadActivations, offloading_for
from zeroplan.measure.op_checkpoint import op_checkpointed
from zeroplan.spec.model import DropoutRates, TransformerSpec
from zeroplan.spec.program import Loss, Recipe
from zeroplan.spec.training import Precision, TrainingSpec

IMPLEMENTATIONS = ("auto", "hf", "reference")


class CausalLM(nn.Module):
    """The model every engine wraps: `forward(input_ids, labels)` returns the mean causal-LM loss."""

    def __init__(self, lm: nn.Module, blocks: nn.ModuleList, hf: bool, loss: str = "standard", loss_chunks: int = 1):
        super().__init__()
        self.lm = lm
        self.hf = hf
        self.transformer_blocks = list(blocks)  # a plain list: not registered twice as submodules
        self.loss = loss
        self.loss_chunks = loss_chunks
        self.offload: OffloadActivations | None = None  # `offload_activations`
        self.compiled_loss = None  # the standard loss compiled (measure/compiled.py), applied to the head's output

    def offload_activations(self) -> None:
        """Run the forward under torchtune's activation offloading from now on."""
        self.offload = offloading_for(self._head())

    @torch.no_grad()
    def init_materialized(self) -> None:
        """Fill a model built on the meta device once its (sharded) storage exists (`to_empty`):
        parameters drawn from N(0, 0.02) shard by shard (values do not change memory), rotary
        frequency buffers recomputed (Hugging Face: its own `_init_weights` for rotary modules;
        reference: `reset_buffers`). Other buffers keep what `to_empty` left."""
        for param in self.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param  # a DTensor's shard
            local.normal_(0.0, 0.02)
        if not self.hf:
            self.lm.reset_buffers()
            return
        for module in self.lm.modules():
            if "RotaryEmbedding" in type(module).__name__:
                self.lm._init_weights(module)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.offload is not None:
            return self._offloaded_forward(input_ids, labels)
        if self.compiled_loss is not None:
            return self.compiled_loss(self._head()(self._hidden(input_ids)), losses.shifted_labels(labels))
        if self.loss == "fused-linear":
            return losses.fused_linear_cross_entropy(self._hidden(input_ids), self._head(), losses.shifted_labels(labels))
        if self.loss == "chunked-torchtitan":
            return losses.torchtitan_chunked_loss(self._hidden(input_ids), self._head(), losses.shifted_labels(labels),
                                                  self.loss_chunks)
        if self.loss == "chunked":  # the hidden states are freed before the loss, as torchtune's model returns
            logits = losses.chunked_logits(self._hidden(input_ids), self._head(), self.loss_chunks)
            return losses.chunked_cross_entropy(logits, losses.shifted_labels(labels))
        if self.hf:
            return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss
        return self.lm(input_ids, labels)

    def _offloaded_forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.offload:  # torchtune full_finetune_single_device.py: `with self.activations_handling_ctx`
            hidden = self._hidden(input_ids)
            if self.loss == "chunked":
                logits = losses.chunked_logits(hidden, self._head(), self.loss_chunks)
            elif self.loss == "standard":
                logits = self._head()(hidden)
        shifted = losses.shifted_labels(labels)
        if self.loss == "fused-linear":  # the kernel is the head and the loss: outside, as a loss is
            return losses.fused_linear_cross_entropy(hidden, self._head(), shifted)
        del hidden
        if self.loss == "chunked":
            return losses.chunked_cross_entropy(logits, shifted)
        # ForCausalLMLoss (transformers/loss/loss_utils.py): fp32 logits, shifted labels
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                           ignore_index=-100)

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output (batch, seq, hidden), before the output projection."""
        if self.hf:
            return self.lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.lm.hidden(input_ids)

    def _head(self) -> nn.Module:
        return self.lm.get_output_embeddings() if self.hf else self.lm.lm_head


@dataclass
class Workload:
    model: CausalLM
    implementation: str


def hf_config_kwargs(spec: TransformerSpec, dropout: DropoutRates = DropoutRates()) -> tuple[str, dict]:
    """The Hugging Face model_type and config fields of `spec`, trained with `dropout`'s rates."""
    model_type = spec.model_type
    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": dropout.attention,
    }
    rotary = common | {"num_key_value_heads": spec.kv_heads, "head_dim": spec.dim_per_head}
    if model_type == "gpt2":
        return model_type, {
            "vocab_size": spec.vocab_size,
            "n_embd": spec.hidden_size,
            "n_layer": spec.num_layers,
            "n_head": spec.num_heads,
            "n_inner": spec.intermediate_size,
            "n_positions": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "resid_pdrop": dropout.residual,
            "embd_pdrop": dropout.embedding,
            "attn_pdrop": dropout.attention,
        }
    if model_type == "gpt_neox":
        return model_type, common | {"hidden_dropout": dropout.residual, "attention_bias": spec.attention_bias}
    if model_type == "llama":
        return model_type, rotary | {"attention_bias": spec.attention_bias, "mlp_bias": spec.mlp_bias}
    if model_type == "gemma":
        return model_type, rotary | {"attention_bias": spec.attention_bias}
    if model_type in ("mistral", "qwen2"):
        return model_type, rotary | {"sliding_window": None}
    if model_type == "mixtral":
        return model_type, rotary | {
            "sliding_window": None,
            "num_local_experts": spec.num_experts,
            "num_experts_per_tok": spec.experts_per_token,
        }
    if model_type == "phi3":
        return model_type, common | {
            "num_key_value_heads": spec.kv_heads,
            "resid_pdrop": dropout.residual,
            "embd_pdrop": 0.0,  # read by no Phi3Model module
            "sliding_window": None,
            "pad_token_id": 0,  # Phi3Config's 32000 is outside a small test vocabulary (values change no memory)
        }
    if spec.moe is not None or spec.mla is not None or spec.attention_sinks:  # Qwen3-MoE, DeepSeek-V3, GPT-OSS
        from zeroplan.measure.moe_config import moe_config_kwargs

        return model_type, moe_config_kwargs(spec, rotary)
    families = _dense_family_kwargs(spec, rotary)
    if families is not None:
        return model_type, families
    raise MeasureError(
        f"model: hf_model_type {model_type!r} has no Hugging Face mapping here; "
        "use llama, mistral, mixtral, qwen2, gemma, phi3, gpt2, gpt_neox, qwen3, gemma2, gemma3_text or olmo2"
    )


def _dense_family_kwargs(spec: TransformerSpec, rotary: dict) -> dict | None:
    """Config fields of the dense families of issue 13 (Qwen3, Gemma 2, Gemma 3 text, OLMo 2); None for others."""
    bias = {"attention_bias": spec.attention_bias}
    if spec.model_type == "qwen3":
        return rotary | bias | {"use_sliding_window": False}
    if spec.model_type == "olmo2":
        return rotary | bias
    if spec.model_type not in ("gemma2", "gemma3_text"):
        return None
    pattern = spec.sliding_window_pattern
    layer_types = [("full_attention" if spec.sliding_window is None or (i + 1) % pattern == 0 else "sliding_attention")
                   for i in range(spec.num_layers)]
    return rotary | bias | {
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types,
        "attn_logit_softcapping": spec.attention_softcap,
        "final_logit_softcapping": spec.final_logit_softcap,
        "query_pre_attn_scalar": spec.dim_per_head,
    }


def _find_blocks(lm: nn.Module, num_layers: int) -> nn.ModuleList:
    # model.model.layers (Llama family), transformer.h (GPT-2), gpt_neox.layers: the first
    # ModuleList with one entry per layer.
    for module in lm.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise MeasureError(f"model: cannot find the {num_layers} transformer blocks of {type(lm).__name__}")


def _model_dtype(training: TrainingSpec) -> torch.dtype:
    # Mixed precision keeps fp32 parameters (the engines cast); pure-bf16 builds them in bf16.
    dtype = torch.bfloat16 if training.precision == Precision.PURE_BF16 else torch.float32
    if getattr(training, "quant", None) is not None:  # a LoRA base in its own precision (programs/peft_model.py)
        from zeroplan.measure.programs.peft_model import base_dtype

        return base_dtype(training.quant, dtype)
    return dtype


def _build_hf(spec: TransformerSpec, training: TrainingSpec) -> tuple[nn.Module, str]:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = hf_config_kwargs(spec, spec.dropout_rates(training.dropout))
    attn = "eager" if training.attention.value == "eager" else "sdpa"
    config = AutoConfig.for_model(model_type, **kwargs)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=_model_dtype(training))
    lm.config.use_cache = False
    return lm, f"hf-transformers-{transformers.__version__}:{type(lm).__name__}/{attn}"


def _build_reference(spec: TransformerSpec, training: TrainingSpec) -> tuple[nn.Module, str]:
    from zeroplan.measure.reference_model import ReferenceCausalLM, family

    if any(spec.dropout_rates(training.dropout)):
        raise MeasureError("dropout: zeroplan's reference model has no dropout layers; measure with transformers "
                           "(implementation hf) or with --dropout 0")
    if spec.model_type in ("qwen3", "gemma2", "gemma3_text", "olmo2"):
        raise MeasureError(f"model: zeroplan's reference model builds Llama and GPT-2 blocks, not {spec.model_type}'s; "
                           "measure with transformers (implementation hf, not --simulate)")
    eager = training.attention.value == "eager"
    # Built in its dtype (not converted after: .to() cannot swap fake tensors under --simulate).
    default = torch.get_default_dtype()
    torch.set_default_dtype(_model_dtype(training))
    try:
        lm = ReferenceCausalLM(spec, eager=eager, recompute_attention_core=training.checkpointing.value == "selective")
    finally:
        torch.set_default_dtype(default)
    return lm, f"zeroplan-reference:{family(spec)}/{'eager' if eager else 'sdpa'}"


def _freeze(lm: nn.Module, blocks: nn.ModuleList, groups: tuple[str, ...]) -> None:
    """Stop the gradients of `groups` (TrainingSpec.freeze): "embeddings" is every embedding
    matrix outside the blocks (tokens, learned positions; a tied head with them), "blocks" the
    transformer blocks, "final" everything else (final norm, untied head)."""
    if not groups:
        return
    in_blocks = {id(p) for p in blocks.parameters()}
    embeddings = {
        id(p) for m in lm.modules() if isinstance(m, nn.Embedding) for p in m.parameters() if id(p) not in in_blocks
    }
    for param in lm.parameters():
        group = "blocks" if id(param) in in_blocks else "embeddings" if id(param) in embeddings else "final"
        if group in groups:
            param.requires_grad_(False)


def _checkpointed(module: nn.Module) -> None:
    """Run `module`'s forward under non-reentrant activation checkpointing (torch.utils.checkpoint)."""
    forward = module.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward


SELECTIVE_ATTENTION = "zeroplan_selective"
"""The AttentionInterface name of `_checkpointed_core` (a name no transformers kernel uses)."""


def _checkpoint_attention_core(attention: nn.Module) -> None:
    """Run the attention core of a Hugging Face attention module under non-reentrant checkpointing.

    Each attention module of the supported families looks its core up by name at every forward
    (`ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
    eager_attention_forward)`). The module gets its own copy of the config naming
    `_checkpointed_core`, which runs the original core under `checkpoint`; the model's config,
    which also picks the attention mask's format, is left as it is."""
    import copy

    from transformers import AttentionInterface

    AttentionInterface.register(SELECTIVE_ATTENTION, _checkpointed_core)
    attention.zeroplan_core_attention = attention.config._attn_implementation
    # a deep copy: the setter also renames the implementation of any sub-config it shares
    config = copy.deepcopy(attention.config)
    config._attn_implementation = SELECTIVE_ATTENTION
    attention.config = config


def _checkpointed_core(module: nn.Module, *args, **kwargs):
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.zeroplan_core_attention
    # "eager" is each model's own function, in its modeling module (it is not registered)
    core = sys.modules[type(module).__module__].eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    return checkpoint(core, module, *args, use_reentrant=False, **kwargs)


def _attention_module(block: nn.Module) -> nn.Module:
    for name in ("self_attn", "attn", "attention"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    raise MeasureError(f"training.checkpointing: cannot find the attention module of {type(block).__name__}")


def _peft(lm: nn.Module, training: TrainingSpec, use_hf: bool) -> str | None:
    """Quantize `lm` and add PEFT adapters where the spec asks (programs/peft_model.py); the
    implementation name's suffix, or None for a model without them."""
    from zeroplan.measure.programs.peft_model import apply_peft, implementation_suffix, uses_peft

    if not uses_peft(training):
        return None
    if not use_hf:
        raise MeasureError("training.lora: PEFT adapts Hugging Face models; measure with implementation hf (transformers)")
    apply_peft(lm, training)
    return implementation_suffix(training)


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_hf_model(spec: TransformerSpec, training: TrainingSpec) -> tuple[nn.Module, str]:
    """The Hugging Face model of `spec` as a program is given it (the Hugging Face Trainer): random
    weights, in training mode, frozen groups frozen, on the current default device; no
    checkpointing (the program enables its own). Returns the model and its implementation name."""
    if not isinstance(spec, TransformerSpec):
        raise MeasureError(f"model: {spec.name} is known by its parameter count only; measure needs a transformer spec")
    if not hf_available():
        raise MeasureError("implementation: the Hugging Face Trainer needs transformers; pip install 'zeroplan[hf]'")
    lm, name = _build_hf(spec, training)
    lm.train()
    _freeze(lm, _find_blocks(lm, spec.num_layers), training.freeze)
    if getattr(training, "lora", None) is not None or getattr(training, "quant", None) is not None:
        from zeroplan.measure.programs.peft_model import apply_peft, implementation_suffix

        # the Trainer enables checkpointing and PEFT's input-gradient hook itself (programs/hf_trainer.py)
        apply_peft(lm, training, program_checkpoints=True)
        name += implementation_suffix(training)
    return lm, name


def build_workload(
    spec: TransformerSpec, training: TrainingSpec, device: torch.device, *, implementation: str = "auto"
) -> Workload:
    """Build the model of `spec` on `device` (or under an active FakeTensorMode), ready to wrap."""
    if not isinstance(spec, TransformerSpec):
        raise MeasureError(f"model: {spec.name} is known by its parameter count only; measure needs a transformer spec")
    if implementation not in IMPLEMENTATIONS:
        raise MeasureError(f"implementation: {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    use_hf = implementation == "hf" or (implementation == "auto" and hf_available())
    if implementation == "hf" and not hf_available():
        raise MeasureError("implementation: hf needs transformers; pip install 'zeroplan[hf]'")
    with torch.device(device):
        lm, name = _build_hf(spec, training) if use_hf else _build_reference(spec, training)
    lm.train()
    blocks = _find_blocks(lm, spec.num_layers)
    _freeze(lm, blocks, training.freeze)
    with torch.device(device):  # adapters are made where the base is (meta, under model_init meta)
        name += _peft(lm, training, use_hf) or ""
    if training.float8 is not None:  # torchao Float8Linear in the blocks, before checkpointing and compile
        from zeroplan.measure.float8 import convert_linears

        convert_linears(lm, training.float8, lm.get_output_embeddings() if use_hf else lm.lm_head)
        name += f"+float8-{training.float8.recipe}"
    if training.checkpointing.value == "full":
        every = training.checkpoint_every or 1
        for index, block in enumerate(blocks, start=1):
            if index % every == 0:
                _checkpointed(block)
    elif training.checkpointing.value == "op":
        for block in blocks:
            op_checkpointed(block)
    elif training.checkpointing.value == "selective" and use_hf:
        for block in blocks:
            _checkpoint_attention_core(_attention_module(block))
    program = training.program
    loss = program.loss.value
    if program.loss == Loss.CHUNKED and program.recipe == Recipe.TORCHTITAN:
        loss = "chunked-torchtitan"  # its ChunkedLossWrapper, not torchtune's chunked output (losses.py)
    if "model" in training.compile:  # after checkpointing, before the engine shards (measure/compiled.py)
        from zeroplan.measure.compiled import compile_blocks

        compile_blocks(blocks)
    model = CausalLM(lm, blocks, hf=use_hf, loss=loss, loss_chunks=program.loss_chunks)
    if "loss" in training.compile:
        if program.loss != Loss.STANDARD:
            raise MeasureError(f"training.compile: a compiled loss is measured with loss standard, not {program.loss.value}")
        from zeroplan.measure.compiled import compiled_loss

        model.compiled_loss = compiled_loss()
    if program.activation_offload.value == "cpu":
        model.offload_activations()
    return Workload(model, name)


def make_batch(spec: TransformerSpec, training: TrainingSpec, device: torch.device):
    """Random tokens (micro_batch x seq_len) and their labels (the same ids: the loss shifts them)."""
    input_ids = torch.randint(0, spec.vocab_size, (training.micro_batch, training.seq_len), device=device)
    return input_ids, input_ids
