"""LoRA and QLoRA in the estimate (issue 12): which tensors PEFT adds and trains, how bitsandbytes
stores the frozen base, and what the adapted layers keep for backward. Derivations, with the engine
and library files they come from, are in docs/engines/lora.md.

- Adapters (peft 0.21.2 peft/tuners/lora/layer.py `LoraLayer.update_layer`): `lora_A` (r, in) and
  `lora_B` (out, r) per adapted linear (GPT-2's Conv1D too), B's bias under `lora_bias`, DoRA's
  `lora_magnitude_vector` (out); an adapted embedding has `lora_embedding_A` (r, vocab) and
  `lora_embedding_B` (h, r). `modules_to_save` wraps a module in `ModulesToSaveWrapper`
  (peft/utils/other.py): the original stays, frozen, and a trained copy is added (a tied head's copy
  is a new tensor: the head is untied).
- "all-linear" (peft/tuners/tuners_utils.py `_maybe_include_all_linear_layers`): every nn.Linear and
  Conv1D but the output embedding; Mixtral's router and experts are plain parameters, not layers.
- Quantized bases (bitsandbytes 0.50.2 nn/modules.py `Params4bit`, `Int8Params`; functional.py
  `quantize_4bit`): transformers' `replace_with_bnb_linear` swaps the blocks' linear layers; the
  embeddings, norms, biases and the output head stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from zeroplan.errors import FieldError, SpecError
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.estimate.engines.rules import param_element_bytes
from zeroplan.estimate.model.layout import ParamTensor, param_layout, role_of
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.estimate.terms import named, register
from zeroplan.spec.model import TransformerSpec

register({
    "torchao to_nf4 conversion": "torchao nf4_tensor.py NF4Tensor.from_tensor, convert_to_norm_float_weight (set-up)",
    "model before torchao's NF4 conversion": "torchtune modules/peft/lora.py LoRALinear(quantize_base=True): the model "
                                            "built in its dtype, then to_nf4 weight by weight",
    "no 16-bit copy of a 16-bit head (autocast)": "aten/src/ATen/autocast_mode.cpp cached_cast (a weight of the "
                                                 "target dtype is not copied; estimate/adapters/lora.py without_head_cast)",
    "4-bit MLP outputs cast back to the model's dtype": "bitsandbytes nn/modules.py Linear4bit.forward "
                                                       "(`.to(inp_dtype)`; docs/engines/lora.md Activations)",
    "frozen base as stored (bitsandbytes)": "bitsandbytes nn/modules.py Params4bit, Int8Params (docs/engines/lora.md, "
                                            "The base's storage)",
    "frozen base at the engine's element size": "estimate/adapters/lora.py base_params_delta (taken off the engine's parameters)",
    "LoRA adapters' saved inputs, ranks and masks": "peft tuners/lora/layer.py Linear.forward (lora_A's input, its "
                                                    "copy, A's output, dropout's mask; docs/engines/lora.md Activations)",
    "inputs frozen linears no longer keep (LoRA)": "torch/csrc/autograd (a frozen weight needs no input for its "
                                                   "gradient; docs/engines/lora.md Activations)",
    "quantization state kept on the GPU (offloaded base)": "bitsandbytes nn/modules.py Linear4bit.quant_state (no parameter: "
                                                            "FSDP1's CPUOffload leaves it; docs/engines/fsdp1.md, QLoRA)",
    "offloaded base as stored (bitsandbytes)": "torch/distributed/fsdp/_flat_param.py init_flat_param_attributes (pinned "
                                               "_local_shard of the packed storage: docs/engines/fsdp1.md, QLoRA)",
    "offloaded base at the engine's element size": "estimate/adapters/lora.py base_host_delta (taken off the engine's host bytes)",
})
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "uint8": 1}
DOUBLE_QUANT_BLOCK = 256  # functional.py quantize_4bit: quantize_blockwise(_absmax - offset, blocksize=256)
FOUR_BIT_CODE_VALUES = 16  # functional.py get_4bit_type: the nf4 / fp4 code
DYNAMIC_MAP_VALUES = 256  # functional.py create_dynamic_map: the nested state's 8-bit code

# transformers module names where they differ from the Llama family's (modeling_gpt2.py, modeling_gpt_neox.py)
_PEFT_NAMES = {
    "gpt2": {"attn.c_attn": "attn.c_attn", "attn.c_proj": "attn.c_proj", "mlp.c_fc": "mlp.c_fc", "mlp.c_proj": "mlp.c_proj",
             "embed_tokens": "wte", "embed_positions": "wpe", "lm_head": "lm_head"},
    "gpt_neox": {"attn.qkv_proj": "attention.query_key_value", "attn.o_proj": "attention.dense",
                 "mlp.fc_in": "mlp.dense_h_to_4h", "mlp.fc_out": "mlp.dense_4h_to_h",
                 "embed_tokens": "embed_in"},  # transformers 5 names the head lm_head (was embed_out)
}
# Mixtral (modeling_mixtral.py MixtralSparseMoeBlock): the router `mlp.gate` and `mlp.experts`'s 3-D
# gate_up_proj / down_proj; peft 0.21.2 adapts them as parameters (tuners/lora/layer.py ParamWrapper)
_MOE_NAMES = {"moe.gate": "mlp.gate", "moe.experts.gate_up_proj": "mlp.experts", "moe.experts.down_proj": "mlp.experts"}
# Qwen3-MoE and DeepSeek-V3 (transformers conversion_mapping.py: both convert as "qwen2_moe"): peft
# 0.21.2 utils/transformers_weight_conversion.py `_convert_peft_config_moe` maps their transformers-4
# target names to the fused parameters (`_MOE_TARGET_MODULE_MAPPING`) and drops them from the module
# targets, so a dense or shared-expert MLP's gate_proj/up_proj/down_proj (nn.Linear) is never adapted;
# "all-linear" adds these four names (`_resolve_string_target_modules`). GPT-OSS is not converted: its
# router (GptOssTopKRouter) and experts are not nn.Linear, so it adapts attention only.
_CONVERTED_FAMILIES = ("qwen3_moe", "deepseek_v3")
_V4_TO_PARAMETER = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}  # `_MOE_FUSED_TARGETS["qwen2_moe"]`
_PARAMETER_NAMES = {"moe.gate": "mlp.gate.weight", "moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
                    "moe.experts.down_proj": "mlp.experts.down_proj"}


class Linear(NamedTuple):
    """One linear layer as PEFT sees it."""

    module: str  # the layout's name (attn.q_proj), which names its tensors
    peft_name: str  # the name PEFT matches targets against (self_attn.q_proj)
    in_features: int
    out_features: int
    bias: bool
    role: str  # "block" or "final"
    kind: str = "linear"  # "linear" (nn.Linear or Conv1D: what bitsandbytes quantizes), "router", "experts"
    experts: int = 1  # experts sharing one adapter pair (ParamWrapper: A is (r x E, in), B is (out, r x E))
    rank_factor: int = 1  # peft doubles the rank of a fused gate_up_proj (its rank_pattern)
    layer_role: str = ""  # the layout's role of its weight (model/layout.py ROLES)


def peft_name(spec: TransformerSpec, module: str) -> str:
    names = _PEFT_NAMES.get(spec.hf_model_type or "", {})
    if module in names:
        return names[module]
    return "self_attn." + module[len("attn."):] if module.startswith("attn.") else module


def _linears(spec: TransformerSpec) -> tuple[Linear, ...]:
    """The blocks' linear layers (of every block kind: DeepSeek's dense first layers too) and the
    output head (untied or tied, it is an nn.Linear)."""
    layout = param_layout(spec)
    conv1d = spec.hf_model_type == "gpt2"  # Conv1D keeps (in, out): dim 0 is the input
    found: dict[str, Linear] = {}
    for tensors, _ in layout.runs:
        names = {t.name for t in tensors}
        for t in tensors:
            module = t.name.rsplit(".", 1)[0]
            if t.name.startswith("moe."):
                for linear in _moe_linear(spec, t):
                    found.setdefault(linear.module, linear)
                continue
            if not t.name.endswith(".weight") or "norm" in module:
                continue
            inner = t.numel // t.rows
            in_features, out_features = (t.rows, inner) if conv1d else (inner, t.rows)
            found.setdefault(module, Linear(module, peft_name(spec, module), in_features, out_features,
                                            f"{module}.bias" in names, "block"))
    head = Linear("lm_head", peft_name(spec, "lm_head"), spec.hidden_size, spec.vocab_size, False, "final")
    return tuple(linear._replace(layer_role=role_of(f"{linear.module}.weight")) for linear in (*found.values(), head))


def _moe_linear(spec: TransformerSpec, t: ParamTensor) -> list[Linear]:
    if spec.moe is not None:
        return _moe_family_linear(spec, t)
    h, inner, experts = spec.hidden_size, spec.intermediate_size, spec.num_experts
    if t.name == "moe.gate.weight":
        return [Linear("moe.gate", _MOE_NAMES["moe.gate"], h, experts, False, "block", "router")]
    if t.name == "moe.experts.gate_up_proj":
        return [Linear(t.name, _MOE_NAMES[t.name], h, 2 * inner, False, "block", "experts", experts, 2)]
    if t.name == "moe.experts.down_proj":
        return [Linear(t.name, _MOE_NAMES[t.name], inner, h, False, "block", "experts", experts, 1)]
    return []


def _moe_family_linear(spec: TransformerSpec, t: ParamTensor) -> list[Linear]:
    """Qwen3-MoE, DeepSeek-V3, GPT-OSS (estimate/model/moe_layout.py): the shared experts' nn.Linear layers;
    the router and the fused experts as peft's ParamWrapper sees them (A (r x E, in), B (out, r x E),
    tuners/lora/layer.py ParamWrapper.update_layer), in the converted families only."""
    h, moe = spec.hidden_size, spec.moe
    module = t.name.rsplit(".", 1)[0]
    if module.startswith("moe.shared_experts.") and t.name.endswith(".weight"):  # DeepseekV3MLP: nn.Linear
        return [Linear(module, "mlp." + module[len("moe."):], t.numel // t.rows, t.rows, False, "block")]
    if not _converted(spec):
        return []  # GptOssTopKRouter, GptOssExperts: peft "is not supported" as modules, not converted
    inner, experts = moe.expert_intermediate_size, moe.num_experts
    if t.name == "moe.gate.weight":
        return [Linear("moe.gate", _PARAMETER_NAMES["moe.gate"], h, experts, False, "block", "router")]
    if t.name == "moe.experts.gate_up_proj":  # rank_pattern r x 2: gate_proj and up_proj fused
        return [Linear(t.name, _PARAMETER_NAMES[t.name], h, 2 * inner, False, "block", "experts", experts, 2)]
    if t.name == "moe.experts.down_proj":
        return [Linear(t.name, _PARAMETER_NAMES[t.name], inner, h, False, "block", "experts", experts, 1)]
    return []


def _converted(spec: TransformerSpec) -> bool:
    return spec.moe is not None and spec.hf_model_type in _CONVERTED_FAMILIES


def _converted_targets(spec: TransformerSpec, lora: LoraSpec, linears) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(module targets, parameter targets) as peft's `_convert_peft_config_moe` leaves them for a
    converted family; a FieldError for half of a fused pair, as peft's ValueError."""
    targets = set(lora.targets)
    if lora.all_linear:  # `_resolve_string_target_modules`: leaf names of every nn.Linear but the head, plus the v4 names
        targets = {linear.peft_name.rsplit(".", 1)[-1] for linear in linears
                   if linear.role == "block" and linear.kind == "linear"} | set(_V4_TO_PARAMETER)
    modules, parameters, fused = [], set(), set()
    for target in sorted(targets):
        old = next((old for old in _V4_TO_PARAMETER if _matches(target, old)), None)
        if old is None:
            modules.append(target)
        else:
            parameters.add(_V4_TO_PARAMETER[old])
            fused.add(old)
    for name, parts in _FUSED.items():
        present = [p for p in parts if p in fused]
        if 0 < len(present) < len(parts):
            missing = ", ".join(p for p in parts if p not in fused)
            raise FieldError("lora.targets", f"{', '.join(present)} cannot be adapted without {missing}: peft fuses "
                             f"them into the experts' {name}")
    return tuple(modules), tuple(sorted(parameters))


def _embeddings(spec: TransformerSpec) -> tuple[tuple[str, str, int], ...]:
    """(layout name, PEFT name, rows) of each embedding."""
    return tuple((t.name.rsplit(".", 1)[0], peft_name(spec, t.name.rsplit(".", 1)[0]), t.rows)
                 for t in param_layout(spec).embedding)


def _matches(name: str, target: str) -> bool:
    # peft tuners_utils.py `check_target_module_exists`: the key itself or a dotted suffix of it
    return name == target or name.endswith("." + target)


def module_names(spec: TransformerSpec) -> list[str]:
    """The names a user can target in `spec` (the last part of each; dotted suffixes work too)."""
    if _converted(spec):  # the router and experts by their transformers-4 names, which peft converts
        names = [linear.peft_name.rsplit(".", 1)[-1] for linear in _linears(spec) if linear.kind == "linear"]
        names = [name for name in names if name not in _V4_TO_PARAMETER] + list(_V4_TO_PARAMETER)
    else:
        names = [linear.peft_name.rsplit(".", 1)[-1] for linear in _linears(spec)]
    names += [peft for _, peft, _ in _embeddings(spec)]
    return list(dict.fromkeys(names))


class LoraLayout(NamedTuple):
    """What LoRA adds and trains, as tensors of each module group."""

    embedding: tuple[ParamTensor, ...]  # the embeddings, frozen, plus their adapters and copies
    block: tuple[ParamTensor, ...]  # one adapted block: frozen base tensors and adapters
    plain_block: tuple[ParamTensor, ...]  # a block left out by layers_to_transform (all frozen but trained biases)
    adapted_blocks: int
    final: tuple[ParamTensor, ...]
    adapted: tuple[Linear, ...]  # the adapted linear layers of one block (and the head, when targeted)
    # every block as runs of (tensors, count) in forward order: per block kind (param_layout's runs), the
    # adapted blocks, then those layers_to_transform leaves plain; `block`/`plain_block` are the largest kind's
    runs: tuple[tuple[tuple[ParamTensor, ...], int], ...] = ()


def _frozen(tensors, trainable_bias: bool = False) -> list[ParamTensor]:
    return [t._replace(frozen=not (trainable_bias and t.name.endswith(".bias"))) for t in tensors]


def _adapter(linear: Linear, lora: LoraSpec) -> list[ParamTensor]:
    r, prefix = lora.rank * linear.rank_factor * linear.experts, linear.module
    role = linear.layer_role  # an adapter is part of the layer it adapts
    tensors = [ParamTensor(f"{prefix}.lora_A.weight", r * linear.in_features, r, role=role),
               ParamTensor(f"{prefix}.lora_B.weight", linear.out_features * r, linear.out_features, role=role)]
    if lora.lora_bias:
        tensors.append(ParamTensor(f"{prefix}.lora_B.bias", linear.out_features, linear.out_features, role=role))
    if lora.dora:
        tensors.append(ParamTensor(f"{prefix}.lora_magnitude_vector.weight", linear.out_features, linear.out_features,
                                   role=role))
    return tensors



@memo(maxsize=256)
def lora_layout(spec: TransformerSpec, lora: LoraSpec) -> LoraLayout:
    """The tensors of `spec` with `lora` applied; a SpecError names a target or rank that does not fit."""
    linears = _linears(spec)
    embeddings = _embeddings(spec)
    known = module_names(spec)
    excluded = [linear for linear in linears if any(_matches(linear.peft_name, e) for e in lora.exclude_modules)]
    if _converted(spec):
        modules, parameters = _converted_targets(spec, lora, linears)
        adapted = [linear for linear in linears if any(
            _matches(linear.peft_name, t) for t in (modules if linear.kind == "linear" else parameters))]
        adapted_embeddings = [e for e in embeddings if any(_matches(e[1], t) for t in modules)]
        for target in modules if not lora.all_linear else ():
            if not any(_matches(linear.peft_name, target) for linear in adapted) and not any(
                    _matches(peft, target) for _, peft, _ in embeddings):
                raise FieldError("lora.targets", f"{target!r} names no module of {spec.name}; its modules: {', '.join(known)}")
    elif lora.all_linear:
        adapted = [linear for linear in linears if linear.role == "block"]
        adapted_embeddings: list[tuple[str, str, int]] = []
    else:
        for target in lora.targets:
            if not any(_matches(linear.peft_name, target) for linear in linears) and not any(
                    _matches(peft, target) for _, peft, _ in embeddings):
                raise FieldError("lora.targets", f"{target!r} names no module of {spec.name}; its modules: {', '.join(known)}")
        adapted = [linear for linear in linears if any(_matches(linear.peft_name, t) for t in lora.targets)]
        adapted_embeddings = [e for e in embeddings if any(_matches(e[1], t) for t in lora.targets)]
    adapted = [linear for linear in adapted if linear not in excluded]
    if lora.dora and any(linear.kind in ("experts", "router") for linear in adapted):
        # tuners/lora/layer.py ParamWrapper: "lora.ParamWrapper does not work with use_dora=True"
        raise SpecError("lora.dora: peft has no DoRA for parameter targets (the MoE router and experts)")
    for linear in adapted:
        if lora.rank > min(linear.in_features, linear.out_features):
            raise FieldError("lora.rank", f"{lora.rank} exceeds the dimensions of {linear.peft_name} "
                             f"({linear.in_features} -> {linear.out_features})")
    for target in lora.modules_to_save:
        if not any(_matches(peft, target) for _, peft, _ in embeddings) and not _matches(peft_name(spec, "lm_head"), target):
            saveable = [peft for _, peft, _ in embeddings] + [peft_name(spec, "lm_head")]
            raise FieldError("lora.modules_to_save", f"{target!r} is not a module zeroplan can copy in {spec.name}; "
                             f"it can: {', '.join(saveable)}")
    layout = param_layout(spec)
    every_bias = lora.bias == "all"
    adapted_modules = {linear.module for linear in adapted}

    def block_tensors(block: tuple[ParamTensor, ...], adapt: bool) -> tuple[ParamTensor, ...]:
        tensors = []
        for t in block:
            module = t.name.rsplit(".", 1)[0]
            lora_only = lora.bias == "lora_only" and adapt and module in adapted_modules
            tensors += _frozen([t], every_bias or lora_only)
        if adapt:
            present = {t.name.rsplit(".", 1)[0] for t in block} | {t.name for t in block}
            for linear in adapted:
                if linear.role == "block" and linear.module in present:  # a dense block has no router or experts
                    tensors += _adapter(linear, lora)
        return tuple(tensors)

    embedding = _frozen(layout.embedding)
    h = spec.hidden_size
    for module, peft, rows in embeddings:
        if any(_matches(peft, e) for _, e, _ in adapted_embeddings):
            embedding += [ParamTensor(f"{module}.lora_embedding_A", lora.rank * rows, lora.rank, role=role_of(module)),
                          ParamTensor(f"{module}.lora_embedding_B", h * lora.rank, h, role=role_of(module))]
        if any(_matches(peft, target) for target in lora.modules_to_save):
            embedding.append(ParamTensor(f"{module}.modules_to_save.weight", rows * h, rows, role=role_of(module)))
    final = _frozen(layout.final, every_bias)
    head = [linear for linear in adapted if linear.role == "final"]
    for linear in head:
        final += _adapter(linear, lora)
    if any(_matches(peft_name(spec, "lm_head"), target) for target in lora.modules_to_save):
        final.append(ParamTensor("lm_head.modules_to_save.weight", spec.vocab_size * h, spec.vocab_size, role="head"))
    count = spec.num_layers
    if lora.layers_to_transform is not None:
        bad = [i for i in lora.layers_to_transform if not 0 <= i < count]
        if bad:
            raise SpecError(f"lora.layers_to_transform: block {bad[0]} does not exist ({spec.name} has blocks 0-{count - 1})")
        count = len(set(lora.layers_to_transform))
    runs, start = [], 0
    for tensors, blocks in layout.runs:  # each block kind's own adapters (DeepSeek's dense first layers)
        indices = range(start, start + blocks)
        start += blocks
        adapted_here = blocks if lora.layers_to_transform is None else len(set(lora.layers_to_transform) & set(indices))
        if adapted_here or len(layout.runs) == 1:
            runs.append((block_tensors(tensors, True), adapted_here))
        if adapted_here < blocks:
            runs.append((block_tensors(tensors, False), blocks - adapted_here))
    return LoraLayout(tuple(embedding), block_tensors(layout.block, True), block_tensors(layout.block, False), count,
                      tuple(final), tuple(adapted), tuple(runs))


def adapter_params(spec: TransformerSpec, lora: LoraSpec) -> int:
    """Trainable elements with `lora` applied: what peft's `get_nb_trainable_parameters` returns first."""
    layout = lora_layout(spec, lora)

    def trainable(tensors) -> int:
        return sum(t.numel for t in tensors if not t.frozen)

    return (trainable(layout.embedding) + sum(count * trainable(tensors) for tensors, count in layout.runs)
            + trainable(layout.final))


# --- the quantized base ------------------------------------------------------------------------

def quantized_weight_bytes(numel: int, out_features: int, quant: QuantSpec) -> int:
    """Bytes bitsandbytes keeps for one linear weight of `numel` elements.

    4-bit (functional.py `quantize_4bit`): two values per byte, viewed as `quant_storage` (padded to
    whole elements of it), one fp32 absmax per `blocksize` block; with double quantization the absmax
    is uint8, with one fp32 absmax per 256 of them and an fp32 offset; each state has its own code
    tables (`quant_state_bytes`). 8-bit (`Int8Params`): int8 weight and one fp32 scale (SCB) per output row."""
    if quant.base_precision.is_4bit:
        return packed_elements(numel, quant) * DTYPE_BYTES[quant.quant_storage] + quant_state_bytes(numel, quant)
    if quant.base_precision.is_packed_int:
        return packed_int_weight_bytes(numel // out_features, out_features, quant)
    if quant.base_precision.value == "torchao-nf4":
        return nf4_inner_bytes(numel, quant) + nf4_whole_bytes(quant)
    if quant.base_precision.value == "int8":
        return numel + FP32_BYTES * out_features
    return numel * DTYPE_BYTES[quant.base_precision.value]


NF4_BLOCK = 64  # torchao nf4_tensor.py to_nf4(block_size=64, scaler_block_size=256), as torchtune calls it
NF4_SCALER_BLOCK = 256


def nf4_inner_bytes(numel: int, quant: QuantSpec) -> int:
    """torchao NF4Tensor's tensors that FSDP2 shards and all-gathers (nf4_tensor.py `_INNER_TENSOR_NAMES_FOR_SHARDING`,
    `fsdp_pre_all_gather`): `quantized_data` uint8, two values per byte; `quantized_scalers` int8, one per block of 64;
    `quantization_factor`, one per 256 scalers, in the weight's dtype (the compute dtype)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + DTYPE_BYTES[quant.compute_dtype] * (blocks // NF4_SCALER_BLOCK)


def nf4_whole_bytes(quant: QuantSpec) -> int:
    """NF4Tensor's `scaler_mean` (a scalar) and `nf4` (the 16-value code), whole on every rank (FSDP2 metadata)."""
    return DTYPE_BYTES[quant.compute_dtype] * (1 + 16)


def nf4_dequantize_bytes(numel: int, quant: QuantSpec) -> int:
    """The peak of torchao's `NF4Tensor.get_original_weight` (`weight.to(dtype)` in `linear_nf4`, forward and backward):
    `first_elements` and `second_elements` as int64 (numel / 2 each), their dequantized and scaled halves in the
    weight's dtype (four of numel / 2), and `torch.stack` of the scaled halves (numel): alive together at the stack."""
    element = DTYPE_BYTES[quant.compute_dtype]
    return 2 * 8 * (numel // 2) + 4 * element * (numel // 2) + element * numel


NF4_CHUNK = 1024**2  # nf4_tensor.py CHUNK_SIZE: the elements quantize_tensor_nearest compares at once


def nf4_conversion_bytes(numel: int, quant: QuantSpec) -> int:
    """The peak of torchao's `to_nf4` on one weight (nf4_tensor.py `convert_to_norm_float_weight`): the scaled blocks
    (the weight's dtype) and the uint8 indices, then per chunk of at most 2^20 elements `(value - nf4).abs()`, two
    tensors of 16 values per element alive together."""
    element = DTYPE_BYTES[quant.compute_dtype]
    return element * numel + numel + 2 * 16 * element * min(numel, NF4_CHUNK)


def packed_int_weight_bytes(in_features: int, out_features: int, quant: QuantSpec) -> int:
    """A GPTQ or AWQ linear's buffers, `bits` per weight packed in int32 and per group of `group_size` input
    features one fp16 scale and one packed zero per output feature: GPTQ (gptqmodel QuantLinear) `qweight`
    (in x bits / 32, out) int32, `qzeros` (ceil(in / g), out x bits / 32) int32, `scales` (ceil(in / g), out)
    fp16, `g_idx` (in,) int32; AWQ (WQLinear_GEMM) the same without g_idx, qweight (in, out x bits / 32)."""
    group = in_features if quant.group_size == -1 else quant.group_size
    groups = -(-in_features // group)
    weight = -(-in_features * out_features * quant.bits // 32) * FP32_BYTES
    zeros = -(-groups * out_features * quant.bits // 32) * FP32_BYTES
    scales = groups * out_features * DTYPE_BYTES["fp16"]
    g_idx = FP32_BYTES * in_features if quant.base_precision.value == "gptq" else 0
    return weight + zeros + scales + g_idx


def packed_elements(numel: int, quant: QuantSpec) -> int:
    """Elements of `quant_storage` holding a 4-bit weight of `numel` values, two per byte
    (functional.py `quantize_4bit`: a (packed, 1) tensor viewed as quant_storage)."""
    return -(-numel // (2 * DTYPE_BYTES[quant.quant_storage]))


def quant_state_bytes(numel: int, quant: QuantSpec) -> int:
    """The 4-bit weight's QuantState: one fp32 absmax per block and its own 16-value fp32 code
    (functional.py `quantize_4bit`: `get_4bit_type` builds a new tensor per call); with double
    quantization uint8 absmax, one fp32 absmax per 256 of them, an fp32 offset and the nested state's
    own 256-value fp32 dynamic map (`quantize_blockwise`: `code.to(A.device, copy=True)`)."""
    blocks = -(-numel // quant.blocksize)
    code = FP32_BYTES * FOUR_BIT_CODE_VALUES
    if quant.double_quant:
        return blocks + FP32_BYTES * -(-blocks // DOUBLE_QUANT_BLOCK) + FP32_BYTES + code + FP32_BYTES * DYNAMIC_MAP_VALUES
    return FP32_BYTES * blocks + code


def unquantized_element_bytes(quant: QuantSpec) -> int:
    """Element size of the frozen tensors bitsandbytes leaves alone (embeddings, norms, biases, head)."""
    if not quant.base_precision.is_quantized:
        return DTYPE_BYTES[quant.base_precision.value]
    # prepare_model_for_kbit_training (peft/utils/other.py) casts every non-int8 parameter to fp32
    return FP32_BYTES if quant.upcast_non_quantized else DTYPE_BYTES[quant.compute_dtype]


class BaseTensor(NamedTuple):
    numel: int
    count: int  # copies (blocks)
    stored_bytes: int  # as bitsandbytes (or the base dtype) stores one copy
    packed: bool = False  # a 4-bit weight: packed storage plus a QuantState


@memo(maxsize=256)
def base_tensors(spec: TransformerSpec, quant: QuantSpec) -> tuple[BaseTensor, ...]:
    """Every frozen base tensor with its stored bytes; the blocks' linear weights are the quantized ones."""
    layout = param_layout(spec)
    linears = {linear.module: linear for linear in _linears(spec) if linear.role == "block" and linear.kind == "linear"}
    element = unquantized_element_bytes(quant)
    tensors = [BaseTensor(t.numel, 1, t.numel * element) for t in layout.embedding + layout.final]
    for block, count in layout.runs:  # each block kind (DeepSeek's dense layers quantize their wider MLP)
        for t in block:
            module, kind = t.name.rsplit(".", 1)
            if module in linears and kind == "weight":
                if quant.base_precision.value == "torchao-nf4" and t.numel % (NF4_BLOCK * NF4_SCALER_BLOCK):
                    # nf4_tensor.py from_tensor / double_quantize_scalers: "must be divisible by" the block sizes
                    raise FieldError("quant.base_precision", f"torchao-nf4: {spec.name}'s {module} has {t.numel:,} "
                                     "elements; torchao's to_nf4 needs a multiple of 16,384 (blocks of 64, 256 of them)")
                stored = quantized_weight_bytes(t.numel, linears[module].out_features, quant)
            else:
                stored = t.numel * element  # the fused 3-D experts are parameters, which bitsandbytes leaves alone
            packed = (quant.base_precision.is_4bit or quant.base_precision.value == "torchao-nf4") and module in linears \
                and kind == "weight"
            tensors.append(BaseTensor(t.numel, count, stored, packed))
    return tuple(tensors)


def dequantized_weight_bytes(spec: TransformerSpec, quant: QuantSpec) -> int:
    """The largest weight a quantized layer materialises in the compute dtype in its forward and again
    in its backward (bitsandbytes autograd/_functions.py MatMul4Bit: `dequantize_4bit(B, quant_state)`;
    MatMul8bitLt's backward: `CB * SCB / 127`)."""
    if not quant.base_precision.is_quantized:
        return 0
    largest = max((linear.in_features * linear.out_features for linear in _linears(spec)
                   if linear.role == "block" and linear.kind == "linear"),
                  default=0)
    if quant.base_precision.value == "torchao-nf4":  # its dequantization's own peak (`nf4_dequantize_bytes`)
        return nf4_dequantize_bytes(largest, quant)
    return largest * DTYPE_BYTES[quant.compute_dtype]


# --- what the adapted layers keep for backward ---------------------------------------------------

class AdapterActivations(NamedTuple):
    """Per token of one block: bytes LoRA adds to (or, negative, removes from) what activations.py
    counts for a block trained whole, and the largest forward temporary of one adapted layer."""

    saved_per_token: int
    forward_temporary: int  # DoRA's identity, LoRA weight, its scaled copy and the combined weight for the weight norm
    embedding: int = 0  # bytes (negative: removed) kept for the whole step: token ids, the first block's first norm
    final_norm: int = 0  # bytes the final norm and the head's input change by


def adapter_activations(spec: TransformerSpec, lora: LoraSpec, autocast: bool, comp: int, adapter_element: int,
                        cuda: bool, attn_reads: int, mlp_reads: int, base_needs_grads: bool = False,
                        input_recast: bool = False) -> AdapterActivations:
    """docs/engines/lora.md "Activations": a frozen base linear saves no input (no weight gradient);
    each adapted linear's A saves its input, its own copy when PEFT's cast to the adapter dtype, autocast's
    cast or the adapter's dropout makes one; B saves A's output (r); dropout keeps its mask (a bool on
    CUDA, a tensor of the input's dtype on CPU); DoRA saves the base and LoRA results (2 x out).
    `base_needs_grads`: the base's weights are views of a FlatParameter that requires grad (FSDP1 with
    use_orig_params, docs/engines/fsdp1.md "LoRA"), so the base keeps what a trained block keeps and only the
    adapters' own tensors are added. `input_recast`: A's input is a copy of its own in the compute dtype (FSDP1's
    adapter units under the Trainer: `adapter_input_recast`)."""
    layout = lora_layout(spec, lora)
    block = [linear for linear in layout.adapted if linear.role == "block"]
    h, inner = spec.hidden_size, spec.intermediate_size
    own_copy = autocast or lora.dropout > 0 or adapter_element != comp or input_recast
    copy_element = comp if autocast else adapter_element
    dropped = kept = 0  # what the frozen base no longer keeps; what the adapters keep
    # what the base linears kept of their inputs (activations.py `norm_saved_per_token`, `_mlp_saved_per_token`)
    readers = {} if base_needs_grads else {"attn": attn_reads, "mlp": mlp_reads}
    for side, reads in readers.items():
        inputs = [linear for linear in block if linear.module.startswith(f"{side}.") and linear.in_features == h
                  and not linear.module.endswith(("o_proj", "c_proj", "down_proj", "fc_out"))]
        dropped -= comp * h * (reads if autocast else 1)
        if inputs and not own_copy:
            kept += comp * h  # A saves the norm's output itself, once for all that read it
    down = [linear for linear in block if linear.module.endswith(("mlp.down_proj", "mlp.c_proj", "mlp.fc_out"))]
    if not spec.is_moe and spec.moe is None and not base_needs_grads:  # a dense MLP (a sparse one's experts keep their product: lora_experts.py)
        dropped -= comp * inner  # the MLP's product, kept by down_proj for its weight gradient only
        if down and not own_copy:
            kept += comp * inner
    if spec.norm == "rmsnorm" and not base_needs_grads:
        # LlamaRMSNorm `self.weight * hidden_states.to(input_dtype)`: mul saves the normalized tensor
        # for the weight's gradient only (autograd FunctionsManual mul_tensor_backward); frozen, it is not kept
        dropped -= 2 * _normalized_bytes(spec, autocast, comp)
    temporary = 0
    # ParamWrapper (routers, expert stacks) merges W + s*BA instead of running A and B on the tokens: no
    # per-token adapter tensors there (peft tuners/lora/layer.py `ParamWrapper.forward`; lora_experts.py)
    for linear in (linear for linear in block if linear.kind == "linear"):
        if own_copy:
            kept += copy_element * linear.in_features
        kept += copy_element * lora.rank  # A's output, kept by B
        if lora.dropout > 0:
            kept += (1 if cuda else copy_element) * linear.in_features
        if lora.dora:
            kept += 2 * copy_element * linear.out_features
            # dora.py: the identity (kept by lora_A's graph), A's output on it (kept by lora_B), the LoRA
            # weight, and in `get_weight_norm` its scaled copy and the sum, alive at the add's return
            temporary = max(temporary, adapter_element * (linear.in_features ** 2 + linear.in_features * lora.rank
                                                          + 3 * linear.in_features * linear.out_features))
    delta = (named("LoRA adapters' saved inputs, ranks and masks", kept)
             + named("inputs frozen linears no longer keep (LoRA)", dropped))
    return AdapterActivations(delta, temporary)


def kbit_output_element(quant: QuantSpec | None, autocast: bool, comp: int) -> int:
    """The dtype a quantized base layer returns: bitsandbytes' Linear4bit computes in its compute dtype (autocast's
    under autocast) and returns `.to(inp_dtype)`, its input's dtype (nn/modules.py `Linear4bit.forward`), which is
    the dtype the model is built in (`model_element_bytes`); other layers return autocast's dtype (`comp`)."""
    if not autocast or quant is None or not quant.base_precision.is_4bit:
        return comp
    return model_element_bytes(quant, autocast, comp)


def kbit_mlp_widening(spec: TransformerSpec, quant: QuantSpec | None, autocast: bool, comp: int) -> int:
    """Per token of one block, what the MLP's saved elementwise tensors take beyond activations.py's count
    (autocast's dtype) when its 4-bit linears return the model's wider dtype (`kbit_output_element`): a gated
    MLP's gate output (SiLU's input), SiLU's output and the up output (mul's inputs); gelu_new's four
    (docs/engines/lora.md "Activations"). The product is down_proj's input, kept by a frozen base for
    nothing (lora.py `adapter_activations`); zero for a sparse MLP (its experts are not bitsandbytes layers)."""
    out = kbit_output_element(quant, autocast, comp)
    if out == comp or spec.is_moe or spec.moe is not None:
        return 0
    return (out - comp) * (3 if spec.mlp == "gated" else 4) * spec.intermediate_size


def _layer_norm_narrowing(spec: TransformerSpec, quant: QuantSpec | None, autocast: bool, comp: int) -> int:
    """Per token, the bytes one LayerNorm saves less than activations.py counts under autocast (fp32
    residual) when the model itself is 16-bit (measure/programs/peft_model.py `base_dtype`: a 16-bit base,
    or a k-bit base's compute dtype): CPU autocast runs `native_layer_norm` in its input's dtype, so it
    saves a 16-bit input, mean and rstd (checked: NativeLayerNormBackward0 `_saved_result1/2` are bf16).
    RMSNorm upcasts to fp32 itself; `prepare_model_for_kbit_training` makes the norms fp32."""
    if spec.norm == "rmsnorm" or not autocast or quant is None or quant.upcast_non_quantized:
        return 0
    model_dtype = quant.compute_dtype if quant.base_precision.is_quantized else quant.base_precision.value
    if DTYPE_BYTES[model_dtype] == FP32_BYTES:
        return 0
    return (FP32_BYTES - comp) * (spec.hidden_size + 2)


def _normalized_bytes(spec: TransformerSpec, autocast: bool, comp: int) -> int:
    """Per token, the RMSNorm's normalized tensor its weight multiply keeps (activations.py
    `norm_saved_per_token`: fp32 for the families that multiply before the cast)."""
    resid = FP32_BYTES if autocast else comp
    return (FP32_BYTES if spec.norm_weight_in_fp32 else resid) * spec.hidden_size


def outside_blocks(spec: TransformerSpec, lora: LoraSpec, autocast: bool, comp: int, adapter_element: int, cuda: bool,
                   input_grads: bool, head_input_kept: bool, narrowed: int = 0) -> tuple[int, int]:
    """Per token, what a frozen base stops autograd from keeping outside the adapted blocks' own
    tensors (docs/engines/lora.md "Activations"): (whole-step bytes, final-norm bytes), negative.

    - The embedding's token ids: a frozen `nn.Embedding` builds no backward node (no EmbeddingBackward
      saving `indices`) unless its weight or an adapter of it trains.
    - The first block's first norm and the dropout masks of the adapters reading it: nothing upstream of
      the first adapter needs a gradient unless the embeddings train or PEFT's input-gradient hook
      (`enable_input_require_grads`, set with checkpointing) marks the embeddings' output.
    - The final RMSNorm's normalized tensor (weight frozen) and, with a frozen head, its input: the
      matmul saves `self` for the weight's gradient only."""
    layout = lora_layout(spec, lora)
    h = spec.hidden_size
    resid = FP32_BYTES if autocast else comp
    embedding = 0 if _trains(layout.embedding) else -8  # int64 ids
    if not _first_input_needs_grad(layout, lora, input_grads):
        if spec.norm == "rmsnorm":  # the fp32 input (the input itself when fp32) and rsqrt's output
            embedding -= FP32_BYTES * h + FP32_BYTES
        else:  # native_layer_norm's input, mean and rstd (`narrowed` less in a 16-bit model)
            embedding -= resid * h + 2 * FP32_BYTES - narrowed
        if lora.dropout > 0:  # dropout of an input that needs no gradient keeps no mask (Dropout.cpp `dropout`)
            readers = [linear for linear in layout.adapted if linear.role == "block" and linear.module.startswith("attn.")
                       and linear.in_features == h and not linear.module.endswith(("o_proj", "c_proj"))]
            embedding -= len(readers) * (1 if cuda else (comp if autocast else adapter_element)) * h
    final_norm = -_normalized_bytes(spec, autocast, comp) if spec.norm == "rmsnorm" else -narrowed
    if not _trains(layout.final) and head_input_kept:
        final_norm -= comp * h
    return embedding, final_norm


def _trains(tensors) -> bool:
    """Whether any of `tensors` (a LoraLayout group) trains."""
    return any(not t.frozen for t in tensors)


def _first_input_needs_grad(layout: LoraLayout, lora: LoraSpec, input_grads: bool) -> bool:
    """Whether the first block's input tensors are kept as a trained model keeps them, i.e. not spared by
    the frozen base (`outside_blocks`, `with_zero3_kept_inputs`): the embeddings train, PEFT's
    input-gradient hook marks the embeddings' output (`input_grads`), the first block is not among the
    adapted ones, or every bias trains."""
    first_block = lora.layers_to_transform is None or 0 in lora.layers_to_transform
    return _trains(layout.embedding) or input_grads or not first_block or lora.bias == "all"


def with_zero3_kept_inputs(extra: AdapterActivations, spec: TransformerSpec, training, comp: int, adapter_element: int,
                           autocast: bool, head_input_kept: bool) -> AdapterActivations:
    """`extra` with the inputs the frozen linears keep under ZeRO-3 (estimate/adapters/zero3.py), under
    `outside_blocks`' conditions for the first block's input and the head's."""
    from zeroplan.estimate.adapters.zero3 import kept_inputs

    lora = training.lora
    layout = lora_layout(spec, lora)
    first_input_needs_grad = _first_input_needs_grad(layout, lora, training.checkpointing.value != "none")
    head_input_removed = head_input_kept and not _trains(layout.final)
    kept = kept_inputs(spec, lora, training.quant, training, comp, adapter_element, autocast, first_input_needs_grad,
                       head_input_removed, [linear for linear in _linears(spec) if linear.role == "block"],
                       [linear for linear in layout.adapted if linear.role == "block"])
    return extra._replace(saved_per_token=extra.saved_per_token + kept.block, embedding=extra.embedding + kept.first_block,
                          final_norm=extra.final_norm + kept.head)


def with_adapter_activations(acts, tokens: int, extra: AdapterActivations, weight_casts_removed: int):
    """`acts` (activations.py ActivationBytes) with LoRA's per-block delta: in the saved tensors, or
    under full/op checkpointing in the recomputed block (the block keeps its input only); and the
    terms outside the blocks (`outside_blocks`)."""
    delta = tokens * extra.saved_per_token - weight_casts_removed

    def adjusted(a):
        if a.recompute_block:
            return replace(a, recompute_block=max(0, a.recompute_block + delta))
        return replace(a, saved_per_block=max(0, a.saved_per_block + delta))

    if acts is None:
        return None
    changed = acts.with_each_kind(adjusted)
    # not clipped: the embedding term also gives back the first block's own tensors, counted with the blocks
    return replace(changed, embedding=changed.embedding + tokens * extra.embedding,
                   final_norm=max(0, changed.final_norm + tokens * extra.final_norm))


# --- the estimate's hooks (estimate/__init__.py) --------------------------------------------------

def adapter_element_bytes(engine: str, precision: str, comp: int, recipe: str = "hf-trainer") -> int:
    """The adapters' dtype: PEFT keeps them fp32 (get_peft_model autocast_adapter_dtype=True) and the
    torch engine leaves them so; DeepSpeed casts the whole module to its 16-bit dtype
    (engine.py `_configure_distributed_model`); FSDP2 gathers them in its param_dtype; torchtune's
    LoRALinear is built in the model's dtype."""
    if recipe == "torchtune":
        return comp
    if engine == "torch" or precision == "fp32":
        return FP32_BYTES
    return comp


def model_element_bytes(quant: QuantSpec | None, autocast: bool, comp: int) -> int:
    """The dtype the measured program builds the model in (measure/programs/peft_model.py `base_dtype`):
    a 16/32-bit base's own, a k-bit base's compute dtype (fp32 after prepare_model_for_kbit_training's
    upcast), else the engine's (fp32 parameters under the torch engine's autocast)."""
    if quant is None:
        return FP32_BYTES if autocast else comp
    if quant.base_precision.is_quantized:
        return FP32_BYTES if quant.upcast_non_quantized else DTYPE_BYTES[quant.compute_dtype]
    return DTYPE_BYTES[quant.base_precision.value]


def kbit_activation_bytes(training, comp: int) -> int:
    """The activations' element size: the engine's (`comp`), except for a k-bit base under the torch engine
    without autocast, whose model is built in the compute dtype (measure/programs/peft_model.py
    `base_dtype`, as `from_pretrained(dtype=...)` loads it) and runs in it: bitsandbytes returns its
    layers' outputs in their input's dtype (autograd/_functions.py `MatMul4Bit`, `MatMul8bitFp`)."""
    from zeroplan.estimate.activations.transformer import runs_autocast

    quant = training.quant
    if (quant is None or not quant.base_precision.is_quantized or quant.upcast_non_quantized
            or training.engine.value != "torch" or runs_autocast(training)):
        return comp
    return DTYPE_BYTES[quant.compute_dtype]


def lora_activations(acts, spec: TransformerSpec, training, comp: int):
    """`acts` with what the adapted blocks keep instead of what whole blocks keep (docs/engines/lora.md)."""
    from zeroplan.estimate.activations.transformer import runs_autocast, input_projections, attention_kernel
    from zeroplan.estimate.adapters.experts import merged_weight_bytes
    from zeroplan.estimate.adapters.int8 import int8_inputs, with_int8_inputs
    from zeroplan.estimate.adapters.recompute import recompute_dtypes, recompute_moment_bytes, with_recompute_moment
    from zeroplan.estimate.adapters.trainer import adapters_stay_fp32
    from zeroplan.estimate.adapters.zero3 import block_linears_keep_inputs
    from zeroplan.spec.program import Loss, Recipe

    lora, quant = training.lora, training.quant
    autocast = runs_autocast(training)
    adapter_element = adapter_element_bytes(training.engine.value, training.precision.value, comp,
                                            training.recipe.value)
    if adapters_stay_fp32(training):  # the Trainer's adapters under ZeRO-3 (estimate/adapters/trainer.py)
        adapter_element = FP32_BYTES
    attn_reads, mlp_reads = input_projections(spec)
    cuda = training.device.value == "cuda"
    extra = adapter_activations(spec, lora, autocast, comp, adapter_element, cuda, attn_reads, mlp_reads,
                                base_views_need_grads(training), adapter_input_recast(training))
    program = training.program
    # the chunked losses that detach the head's input already dropped it (activations.py `_loss_terms`)
    head_input_kept = program.loss == Loss.STANDARD or (program.loss == Loss.CHUNKED and program.recipe != Recipe.TORCHTITAN)
    narrowed = _layer_norm_narrowing(spec, quant, autocast, comp)
    extra = extra._replace(saved_per_token=extra.saved_per_token + named(
        "4-bit MLP outputs cast back to the model's dtype", kbit_mlp_widening(spec, quant, autocast, comp)))
    embedding, final_norm = outside_blocks(spec, lora, autocast, comp, adapter_element, cuda,
                                           training.checkpointing.value != "none", head_input_kept, narrowed)
    # the narrower LayerNorms: two per block (GPT-2 ln_1, ln_2); the first block's first and the final one in outside_blocks
    extra = extra._replace(saved_per_token=extra.saved_per_token - 2 * narrowed, embedding=embedding, final_norm=final_norm)
    extra = with_zero3_kept_inputs(extra, spec, training, comp, adapter_element, autocast, head_input_kept)
    acts = with_dequantized_weight(acts, spec, quant, training.micro_batch * training.seq_len, comp)
    acts = with_dora_weight_norm(acts, extra.forward_temporary)
    dtypes = recompute_dtypes(quant, autocast, comp, adapter_element, cuda, model_element_bytes(quant, autocast, comp))
    tokens = training.micro_batch * training.seq_len
    int8 = int8_inputs(spec, _linears(spec), quant, dtypes.resid)  # estimate/adapters/int8.py
    # a fused SDPA kernel saves its output itself (flash backward reads `out`): o_proj's input then is no extra
    core_saved = int8.core_out if attention_kernel(spec, training) == "fused" else 0
    checkpointed = training.checkpointing.value == "full"
    acts = with_int8_inputs(acts, tokens * (int8.kept - (0 if checkpointed else core_saved)))
    if checkpointed:  # the recomputation's own moment (estimate/adapters/recompute.py)
        # the rebuilt graph's int8 inputs beyond what the rebuilt block saves and the moment holds (the MLP's input, product)
        rebuilt = int8.attention_in + int8.core_out - core_saved
        moment = recompute_moment_bytes(spec, lora, lora_layout(spec, lora), dtypes, tokens, rebuilt,
                                        block_linears_keep_inputs(spec, quant, training, autocast))
        acts = with_recompute_moment(acts, moment)
    casts = 0
    if autocast:
        # autocast caches (and the matmul saves) 16-bit casts of fp32 weights: a 16-bit or quantized
        # base has none; the fp32 adapters have theirs (aten/src/ATen/autocast_mode.cpp cached_cast)
        layout = lora_layout(spec, lora)
        base = sum(t.numel for t in layout.block if t.frozen and t.name.endswith("weight") and "norm" not in t.name)
        adapters = sum(t.numel for t in layout.block if not t.frozen and "lora_" in t.name and "magnitude" not in t.name)
        stored_16bit = quant is not None and quant.base_precision.value != "fp32"
        casts = (comp * base if stored_16bit else 0) - comp * adapters
    # adapted experts and routers save their merged weight W + s*BA per block (estimate/adapters/experts.py)
    merged_element = comp if autocast else model_element_bytes(quant, autocast, comp)
    casts -= merged_weight_bytes(lora_layout(spec, lora).adapted, merged_element)
    acts = with_adapter_activations(acts, training.micro_batch * training.seq_len, extra, casts)
    return without_head_cast(acts, spec, training, autocast, comp)


def without_head_cast(acts, spec: TransformerSpec, training, autocast: bool, comp: int):
    """`acts` without autocast's 16-bit copy of the output head's weight where the head is stored in that dtype
    already (a quantized or 16-bit base not upcast to fp32): aten/src/ATen/autocast_mode.cpp `cached_cast`
    returns a tensor of the target dtype as it is, so nothing is copied (activations.py counts the copy of an
    fp32 head: the torch engine's parameters, or prepare_model_for_kbit_training's upcast)."""
    from zeroplan.spec.program import Loss

    quant = training.quant
    if (acts is None or not autocast or quant is None or unquantized_element_bytes(quant) != comp
            or any(not t.frozen for t in lora_layout(spec, training.lora).final if t.name.startswith("lm_head"))):
        return acts
    head_cast = named("no 16-bit copy of a 16-bit head (autocast)", -comp * spec.vocab_size * spec.hidden_size)
    loss = training.program.loss
    if loss == Loss.STANDARD:
        return replace(acts, final_norm=acts.final_norm + head_cast)
    if loss == Loss.CHUNKED:
        return replace(acts, loss_transient=acts.loss_transient + head_cast)
    return acts


def with_dora_weight_norm(acts, temporary: int):
    """`acts` with DoRA's weight-norm temporaries (peft tuners/lora/dora.py `get_lora_weight`: the in x in
    identity, kept by lora_A's graph until the layer returns, and the LoRA weight; `get_weight_norm`: the
    combined weight). They live inside one adapted layer's forward: in the last block's forward, against
    `block_forward_transient`; under checkpointing the recomputation builds them again in backward with
    the block's recomputed tensors, before its backward has freed any or allocated its gradients."""
    if not temporary or acts is None:
        return acts

    def adjusted(a):
        if a.recompute_block:
            return replace(a, block_backward_transient=max(a.block_backward_transient, temporary + a.block_backward_freed))
        return replace(a, block_forward_transient=max(a.block_forward_transient, temporary))

    return acts.with_each_kind(adjusted)


def with_dequantized_weight(acts, spec: TransformerSpec, quant: QuantSpec | None, tokens: int, comp: int):
    """`acts` with the moments a quantized layer's dequantized weight is alive in (docs/engines/lora.md
    "The base's storage"). It lives only inside that layer's op (autograd/_functions.py MatMul4Bit:
    `dequantize_4bit(B, quant_state)` in forward and again in backward, freed on return), so it is a
    moment of its own, not a term of the modelled ones: in forward the largest layer holds it with its
    output (against `block_forward_transient`); in backward the MLP's last linear holds it with its
    input's gradient while the product it read is still saved, against the product's backward, which
    has freed the product and holds two more intermediate-width gradients (`_block_backward_transient_per_token`)."""
    if quant is None or not quant.base_precision.is_quantized or acts is None:
        return acts
    weight = dequantized_weight_bytes(spec, quant)
    if not weight:
        return acts
    largest = max((linear for linear in _linears(spec) if linear.role == "block" and linear.kind == "linear"),
                  key=lambda linear: linear.in_features * linear.out_features)
    # the weight in the compute dtype, alive with the layer's output; torchao's dequantization peaks before that
    materialized = largest.in_features * largest.out_features * DTYPE_BYTES[quant.compute_dtype]
    forward = max(acts.block_forward_transient, weight, materialized + tokens * comp * largest.out_features)
    backward = acts.block_backward_transient + max(0, weight - tokens * comp * spec.intermediate_size)
    return replace(acts, block_forward_transient=forward, block_backward_transient=backward)


def base_views_need_grads(training) -> bool:
    """FSDP1 with use_orig_params runs each unit's parameters as views of its FlatParameter, which requires grad
    when any of them trains (`_flat_param.py` `_use_unsharded_views`): where the adapters share their block's unit
    (spec/fsdp1.py `adapters_wrapped_apart`), the frozen base weights get gradients and keep their inputs as a
    trained block's do (docs/engines/fsdp1.md, "LoRA")."""
    from zeroplan.spec.fsdp1 import adapters_wrapped_apart

    wrapping = training.fsdp1_wrapping
    return (training.engine.value == "fsdp1" and wrapping.use_orig_params
            and not adapters_wrapped_apart(training.recipe, wrapping.use_orig_params))


def adapter_input_recast(training) -> bool:
    """FSDP1's adapter units under the Trainer's mixed precision: PEFT casts A's input to `lora_A.weight.dtype`
    (tuners/lora/layer.py `_cast_input_dtype`), read while that unit is still sharded, so fp32; the unit's forward
    then runs in bf16 under accelerate's autocast, which casts the input back: a bf16 copy that A's matmul saves."""
    from zeroplan.spec.fsdp1 import adapters_wrapped_apart

    return (training.engine.value == "fsdp1" and training.precision.value in ("bf16", "fp16")
            and training.recipe.value == "hf-trainer"
            and adapters_wrapped_apart(training.recipe, training.fsdp1_wrapping.use_orig_params))


def _sharded(training) -> bool:
    engine = training.engine.value
    return (engine == "fsdp2" or (engine in ("deepspeed", "paper") and training.zero_stage == 3)
            or (engine == "fsdp1" and training.zero_stage != 0))  # FSDP1 shards parameters but under NO_SHARD


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class PackedStorage(NamedTuple):
    """How a sharding engine sees a 4-bit base: each quantized weight as its packed storage, in
    elements of the dtype the engine gathers (docs/engines/lora.md "Sharded 4-bit weights")."""

    quant: QuantSpec
    gathered_element: int  # bytes of one element the engine gathers (FSDP2 param_dtype, DeepSpeed's 16-bit)


def packed_storage(training) -> PackedStorage | None:
    """FSDP2 and DeepSpeed ZeRO-3 shard and gather a 4-bit weight as the tensor it is: bitsandbytes'
    packed storage (nn/modules.py `Params4bit`: `torch.chunk` keeps the whole QuantState on every
    chunk), not the weight it dequantizes to; None for the engines that do not shard parameters."""
    quant = training.quant
    engine = training.engine.value
    if quant is None or not (quant.base_precision.is_4bit or quant.base_precision.value == "torchao-nf4"):
        return None
    if not (engine == "fsdp2" or (engine == "deepspeed" and training.zero_stage == 3)
            or (engine == "fsdp1" and training.zero_stage != 0)):  # FSDP1 flattens the packed storage into its unit's
        return None
    return PackedStorage(quant, FP32_BYTES if training.precision.value == "fp32" else 2)


def _packed_bytes(numel: int, quant: QuantSpec) -> int:
    """What a sharding engine shards and gathers of a 4-bit weight: bitsandbytes' packed storage; torchao's NF4Tensor
    inner tensors, its scalers included (`nf4_inner_bytes`)."""
    if quant.base_precision.value == "torchao-nf4":
        return nf4_inner_bytes(numel, quant)
    return packed_elements(numel, quant) * DTYPE_BYTES[quant.quant_storage]


def _packed_units(numel: int, packed: PackedStorage) -> int:
    """The packed storage of a 4-bit weight of `numel` values, in the engine's gathered elements."""
    return _ceil(_packed_bytes(numel, packed.quant), packed.gathered_element)


def packed_layout(spec: TransformerSpec, layout: LoraLayout, packed: PackedStorage) -> LoraLayout:
    """`layout` with each quantized block weight as its packed storage, a (units, 1) tensor: what
    fully_shard splits on dim 0 and all-gathers, and what DeepSpeed partitions, gathers and compares
    with its persistence threshold."""
    quantized = {linear.module + ".weight" for linear in _linears(spec) if linear.role == "block" and linear.kind == "linear"}

    def storage(tensors: tuple[ParamTensor, ...]) -> tuple[ParamTensor, ...]:
        return tuple([t._replace(numel=_packed_units(t.numel, packed), rows=_packed_units(t.numel, packed))
                      if t.frozen and t.name in quantized else t for t in tensors])

    return layout._replace(block=storage(layout.block), plain_block=storage(layout.plain_block),
                           runs=tuple((storage(tensors), count) for tensors, count in layout.runs))


def base_params_delta(spec: TransformerSpec, training, param: int, shard_ranks: int) -> int:
    """Bytes per rank the base really takes minus what the engine profile counted for it (every
    parameter in the engine's dtype; a 4-bit weight under a sharding engine as its packed storage,
    `packed_layout`): zero without `quant`."""
    quant = training.quant
    if quant is None:
        return 0
    if training.offload_params.value != "none":
        # FSDP1's CPUOffload keeps the packed shards on the host (`base_host_delta`); each 4-bit weight's QuantState,
        # no parameter, stays whole on every GPU (bitsandbytes nn/modules.py Linear4bit.quant_state)
        if not offloaded_base(training):
            return 0
        return named("quantization state kept on the GPU (offloaded base)",
                     sum(t.count * quant_state_bytes(t.numel, quant) for t in base_tensors(spec, quant) if t.packed))
    element = param_element_bytes(training.engine.value, training.precision.value, param)
    n = shard_ranks if _sharded(training) else 1
    packed = packed_storage(training)
    stored = counted = 0
    for t in base_tensors(spec, quant):
        if packed is not None and t.packed and quant.base_precision.value == "torchao-nf4":
            if (t.numel // (NF4_BLOCK * NF4_SCALER_BLOCK)) % n:  # nf4_tensor.py nf4_split: every inner tensor in n chunks
                raise FieldError("quant.base_precision", f"torchao-nf4: a weight of {t.numel:,} elements does not split "
                                 f"into {n} shards (torchao's nf4_split needs its scale factors, one per 16,384 "
                                 f"elements, divisible by the {n} ranks)")
            # torchao shards its three inner tensors and keeps scaler_mean and the code whole (`fsdp_pre_all_gather`)
            stored += t.count * (_ceil(nf4_inner_bytes(t.numel, quant), n) + nf4_whole_bytes(quant))
            counted += t.count * _ceil(_packed_units(t.numel, packed), n) * element
        elif packed is not None and t.packed:
            # the shards of the packed storage, and the QuantState whole on every rank (Params4bit.__torch_function__)
            stored += t.count * (_ceil(packed_elements(t.numel, quant), n) * DTYPE_BYTES[quant.quant_storage]
                                 + quant_state_bytes(t.numel, quant))
            counted += t.count * _ceil(_packed_units(t.numel, packed), n) * element
        else:
            stored += t.count * _ceil(t.stored_bytes, n)
            counted += t.count * _ceil(t.numel, n) * element
    # the base as stored replaces the engine's count of it (the fold takes that off the engine's parameters)
    return named("frozen base as stored (bitsandbytes)", stored) - named("frozen base at the engine's element size", counted)


def nf4_conversion_moment(spec: TransformerSpec, training) -> tuple[int, int] | None:
    """(params, temporaries) at the set-up's conversion of the weights to torchao's NF4Tensor, None for another base.
    A model built whole (init host or device): all of it in the compute dtype, before any weight is converted, and
    `nf4_conversion_bytes` of the largest weight (a bound: the weights converted before it are smaller already).
    torchtune converts one weight at a time (modules/peft/lora.py LoRALinear: `to_nf4` of each new weight, and
    NF4Tensor's `copy_` from the loaded state dict; the distributed recipe's training/_distributed.py
    `load_from_full_model_state_dict` converts each full weight before sharding it), as does a meta-device build:
    the params are the engine's (0 here), the temporaries the largest full weight, its conversion and its NF4 result."""
    quant = training.quant
    if quant is None or quant.base_precision.value != "torchao-nf4":
        return None
    largest = max(linear.in_features * linear.out_features for linear in _linears(spec)
                  if linear.role == "block" and linear.kind == "linear")
    converting = nf4_conversion_bytes(largest, quant)
    if training.program.model_init.value == "meta" or training.recipe.value == "torchtune":
        one = largest * DTYPE_BYTES[quant.compute_dtype] + converting + nf4_inner_bytes(largest, quant)
        return 0, named("torchao to_nf4 conversion", one)
    layout = param_layout(spec)
    whole = sum(t.numel * count for tensors, count in ((layout.embedding, 1), (layout.final, 1), *layout.runs)
                for t in tensors)
    return (named("model before torchao's NF4 conversion", whole * DTYPE_BYTES[quant.compute_dtype]),
            named("torchao to_nf4 conversion", converting))


def offloaded_base(training) -> bool:
    """A quantized base FSDP1 offloads (spec/lora.py lets engine fsdp1 offload a 4-bit base stored in a float dtype)."""
    quant = training.quant
    return (quant is not None and quant.base_precision.is_4bit and training.engine.value == "fsdp1"
            and training.offload_params.value != "none")


def base_host_delta(spec: TransformerSpec, training, param: int, shard_ranks: int) -> int:
    """Per rank, the host bytes of an offloaded quantized base (`offloaded_base`) minus what the engine profile put on
    the host for it (every flat shard in the engine's element size): the packed 4-bit storage in quant_storage and
    the other frozen tensors in their stored dtype, sharded (FlatParamHandle `_local_shard`, pinned)."""
    if not offloaded_base(training):
        return 0
    quant = training.quant
    element = param_element_bytes(training.engine.value, training.precision.value, param)
    packed = packed_storage(training)
    n = shard_ranks
    stored = counted = 0
    for t in base_tensors(spec, quant):
        if t.packed:
            stored += t.count * _ceil(packed_elements(t.numel, quant), n) * DTYPE_BYTES[quant.quant_storage]
            counted += t.count * _ceil(_packed_units(t.numel, packed), n) * element
        else:
            stored += t.count * _ceil(t.stored_bytes, n)
            counted += t.count * _ceil(t.numel, n) * element
    return named("offloaded base as stored (bitsandbytes)", stored) - named("offloaded base at the engine's element size",
                                                                            counted)


def adapter_param_bytes(facts, training, param: int, steady: bool, shard_ranks: int) -> int:
    """The trained tensors' share of the params category per rank (engines/*.py: the engine's dtype,
    sharded as the engine shards; ZeRO-3 keeps tensors under the persistence threshold whole once traced)."""
    element = param_element_bytes(training.engine.value, training.precision.value, param)
    tensors = [(t.numel, g.count) for g in facts.groups for t in g.trainable_tensors]
    copy_element = saved_copy_element(training)
    if copy_element is not None:  # the torch engine: modules_to_save copies in the base's dtype
        return sum(t.numel * g.count * (copy_element if is_saved_copy(t) else element)
                   for g in facts.groups for t in g.trainable_tensors)
    if not _sharded(training):
        return element * sum(numel * count for numel, count in tensors)
    n = shard_ranks
    threshold = training.deepspeed.stage3_param_persistence_threshold if training.engine.value == "deepspeed" else 0
    whole = sum(numel * count for numel, count in tensors if numel <= threshold) if steady else 0
    return element * (sum(_ceil(numel, n) * count for numel, count in tensors) + whole)


# --- modules_to_save under the torch engine ----------------------------------------------------

def is_saved_copy(t: ParamTensor) -> bool:
    return ".modules_to_save." in t.name


def saved_copy_element(training) -> int | None:
    """The bytes of one element of a modules_to_save copy where the torch engine's own dtype is not
    it, else None. `ModulesToSaveWrapper` (peft/utils/other.py) deep-copies the original module, so
    the copy is in the base's dtype, and trains there: autocast casts inputs, not parameters, so the
    Trainer's optimizer sees that 16-bit tensor itself (no fp32 master), its .grad and states alike."""
    quant = training.quant
    if quant is None or training.engine.value != "torch" or not training.lora.modules_to_save:
        return None
    element = unquantized_element_bytes(quant)
    return None if element == param_element_bytes("torch", training.precision.value, 0) else element


def lora_notes(spec: TransformerSpec, training, facts) -> tuple[str, ...]:
    lora, quant = training.lora, training.quant
    share = facts.trainable_params / facts.total_params
    notes = [f"LoRA rank {lora.rank}: {facts.trainable_params:,} of {facts.total_params:,} parameters train "
             f"({share:.4%}); gradients and optimizer states for those only"]
    if quant is not None and quant.base_precision.value == "torchao-nf4":
        notes.append("base torchao NF4Tensor (torchtune's QLoRA): nf4 in blocks of 64 with int8 scalers per 256 blocks; "
                     "each layer dequantizes its weight in forward and backward (get_original_weight: int64 indices, "
                     "a temporary of 7x the bf16 weight)")
        if packed_storage(training) is not None:
            notes.append("FSDP2 shards and gathers the NF4 data, scalers and factors (torchao's fsdp_pre_all_gather); "
                         "only the scaler mean and the 16-value code stay whole on every rank")
    elif quant is not None and quant.base_precision.is_packed_int:
        notes.append(f"base {quant.base_precision.value} int{quant.bits} as its checkpoint stores it (packed int32 weights, "
                     f"fp16 scales and packed zeros per {quant.group_size}-feature group); each layer dequantizes its "
                     "weight in forward and backward (a temporary: the torch kernel PEFT trains with)")
    elif quant is not None and quant.base_precision.is_quantized:
        notes.append(f"base {quant.base_precision.value}{' + double quantization' if quant.double_quant else ''} as "
                     f"bitsandbytes stores it; each quantized layer dequantizes its weight to {quant.compute_dtype} in "
                     "forward and backward (a temporary)")
        if packed_storage(training) is not None:
            notes.append(f"the engine shards and gathers each 4-bit weight as its packed {quant.quant_storage} storage; "
                         "its quantization state stays whole on every rank")
    copy_element = saved_copy_element(training)
    if copy_element is not None:
        notes.append(f"modules_to_save copies train in the base's dtype ({copy_element} bytes per element: PEFT "
                     "deep-copies the module), with their gradients and optimizer states; no fp32 master")
    if any(linear.kind == "experts" for linear in lora_layout(spec, lora).adapted):
        # peft tuners/lora/layer.py ParamWrapper._activate_lora: register_parametrization under parametrize.cached()
        notes.append("adapted experts: peft builds each expert stack's W + BA in every forward and the experts' "
                     "matmuls keep it for backward: counted with each adapted block's activations")
    if training.checkpointing.value != "none":
        notes.append("checkpointing with a frozen base: PEFT/the Trainer call enable_input_require_grads so the "
                     "checkpointed blocks get gradients (no bytes kept)")
    return tuple(notes)
