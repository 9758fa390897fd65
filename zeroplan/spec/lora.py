"""LoRA adapters and quantized bases (issue 12): what PEFT adds to a model and how bitsandbytes
stores the frozen base, as validated data.

- `LoraSpec`: the fields of PEFT's `LoraConfig` (peft 0.21.2 peft/tuners/lora/config.py) that change
  memory, with PEFT's defaults; `lora_spec_from_adapter_config` reads the `adapter_config.json` that
  `PeftModel.save_pretrained` writes.
- `QuantSpec`: the base model's storage: a plain dtype, or bitsandbytes' 8-bit and 4-bit formats
  (bitsandbytes 0.50.2 bitsandbytes/nn/modules.py `Int8Params`, `Params4bit`) with the knobs of
  transformers' `BitsAndBytesConfig`.
- `check_training_lora`: the rules that join them to a `TrainingSpec` (called from its validator).
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from zeroplan.errors import SpecError
from zeroplan.spec.limits import MAX_SMALL_COUNT
from zeroplan.spec.validation import describe_validation_error, shown

if TYPE_CHECKING:
    from zeroplan.spec.training import TrainingSpec

_STRICT = ConfigDict(extra="forbid", frozen=True)

ALL_LINEAR = "all-linear"  # peft/utils/constants.py INCLUDE_LINEAR_LAYERS_SHORTHAND


# peft 0.21.2 peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: what a
# LoraConfig without target_modules adapts
PEFT_DEFAULT_TARGETS = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "gemma": ("q_proj", "v_proj"), "gpt2": ("c_attn",),
    "gpt_neox": ("query_key_value",), "phi3": ("qkv_proj",),
}


class LoraSpec(BaseModel):
    """A LoRA adapter as PEFT's LoraConfig describes it: only what changes memory (alpha is kept for
    the record: it scales, it stores nothing)."""

    model_config = _STRICT

    rank: int = Field(ge=1, le=MAX_SMALL_COUNT, description="LoRA rank r: A is (r, in), B is (out, r) for every adapted linear.")
    alpha: float | None = Field(None, gt=0, allow_inf_nan=False, description="lora_alpha (scaling alpha / r; no bytes). [default: PEFT's, 8]")
    targets: tuple[str, ...] = Field(
        min_length=1, description="Modules to adapt, by name as PEFT matches them (q_proj, v_proj, "
        "c_attn, query_key_value, ...), or all-linear: every linear layer except the output head.")
    dropout: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False, description="lora_dropout on each adapter's input (PEFT's default 0: "
                           "nn.Identity, nothing kept).")
    dora: bool = Field(False, description="use_dora: a magnitude vector (out) per adapted linear, and the weight "
                       "norm computed in every forward.")
    modules_to_save: tuple[str, ...] = Field((), description="Modules trained whole beside the adapters (a copy: "
                                             "embed_tokens, lm_head); a copy of a tied head unties it.")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases train: none, all, or those "
                                                     "of adapted layers (lora_only).")
    lora_bias: bool = Field(False, description="A bias on every adapter's B (out elements).")
    layers_to_transform: tuple[int, ...] | None = Field(None, description="Block indices to adapt. [default: all]")
    exclude_modules: tuple[str, ...] = Field((), description="Module names not to adapt, even if targeted.")

    @field_validator("targets")
    @classmethod
    def _one_all_linear(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"{ALL_LINEAR} stands alone (it means every linear layer but the head)")
        return targets

    @property
    def all_linear(self) -> bool:
        return self.targets == (ALL_LINEAR,)


class BasePrecision(str, Enum):
    """How the frozen base weights are stored."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"  # bitsandbytes Int8Params: int8 weight, fp32 scale per output row (SCB)
    NF4 = "nf4"  # bitsandbytes Params4bit, normal-float 4-bit: two weights per byte, fp32 absmax per block
    FP4 = "fp4"  # as nf4 with the fp4 code (same bytes)
    GPTQ = "gptq"  # a GPTQ checkpoint (gptqmodel QuantLinear): packed int32 qweight, per-group fp16 scales and qzeros, g_idx
    AWQ = "awq"  # an AWQ checkpoint (WQLinear_GEMM): packed int32 qweight, per-group fp16 scales and qzeros
    TORCHAO_NF4 = "torchao-nf4"  # torchao NF4Tensor (torchtune's QLoRA): nf4 in blocks of 64, int8 scalers per 256 blocks

    @property
    def is_4bit(self) -> bool:
        """bitsandbytes' 4-bit formats (Params4bit)."""
        return self in (BasePrecision.NF4, BasePrecision.FP4)

    @property
    def is_packed_int(self) -> bool:
        """A GPTQ or AWQ checkpoint's integer weights (bits and group_size)."""
        return self in (BasePrecision.GPTQ, BasePrecision.AWQ)

    @property
    def is_quantized(self) -> bool:
        return (self in (BasePrecision.INT8, BasePrecision.NF4, BasePrecision.FP4, BasePrecision.TORCHAO_NF4)
                or self.is_packed_int)


FloatDtype = Literal["bf16", "fp16", "fp32"]


class QuantSpec(BaseModel):
    """The base model's storage (transformers BitsAndBytesConfig for the quantized ones)."""

    model_config = _STRICT

    base_precision: BasePrecision = Field(description="Storage of the frozen base weights: bf16, fp16, fp32, or "
                                          "bitsandbytes int8, nf4, fp4.")
    double_quant: bool = Field(False, description="bnb_4bit_use_double_quant: quantize the 4-bit absmax to uint8 in "
                               "blocks of 256 (functional.py quantize_4bit, compress_statistics).")
    compute_dtype: FloatDtype = Field("bf16", description="bnb_4bit_compute_dtype: the dtype a quantized layer "
                                      "dequantizes to and computes in; the dtype of the layers left unquantized.")
    quant_storage: Literal["uint8", "bf16", "fp16", "fp32"] = Field(
        "uint8", description="bnb_4bit_quant_storage: the dtype the packed 4-bit bytes are viewed as; a sharding "
        "engine (FSDP2, DeepSpeed ZeRO-3) needs it equal to the other parameters' dtype.")
    blocksize: int = Field(64, description="Elements per absmax block of a 4-bit weight (Params4bit's default 64).")
    upcast_non_quantized: bool = Field(
        False, description="prepare_model_for_kbit_training: cast the layers left unquantized (embeddings, norms, "
        "head) to fp32, as PEFT's examples, TRL's SFTTrainer and the QLoRA paper's script do. [default: off, as the "
        "Hugging Face Trainer alone leaves them]")

    bits: int = Field(4, description="Bits per weight of a GPTQ or AWQ checkpoint (quantization_config.bits).")
    group_size: int = Field(128, description="Input features per scale and zero of a GPTQ or AWQ checkpoint "
                            "(quantization_config.group_size; -1: one group per row).")

    @field_validator("blocksize")
    @classmethod
    def _valid_blocksize(cls, blocksize: int) -> int:
        # functional.py quantize_4bit: "invalid blocksize"
        if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError("must be one of 32, 64, 128, 256, 512, 1024, 2048, 4096 (bitsandbytes quantize_4bit)")
        return blocksize

    @model_validator(mode="after")
    def _check_4bit_knobs(self) -> "QuantSpec":
        if not self.base_precision.is_4bit:
            if self.double_quant:
                raise ValueError(f"double_quant applies to a 4-bit base (nf4, fp4), not {self.base_precision.value}")
            if self.quant_storage != "uint8":
                raise ValueError(f"quant_storage applies to a 4-bit base (nf4, fp4), not {self.base_precision.value}")
        if not self.base_precision.is_quantized and self.upcast_non_quantized:
            raise ValueError("upcast_non_quantized applies to a quantized base (int8, nf4, fp4)")
        if self.base_precision.is_packed_int:
            if self.bits not in (2, 3, 4, 8):
                raise ValueError(f"bits {self.bits}: GPTQ and AWQ pack 2, 3, 4 or 8 bits per weight")
            if self.group_size != -1 and self.group_size < 1:
                raise ValueError(f"group_size {self.group_size}: give a positive group size, or -1 for one per row")
            if self.base_precision == BasePrecision.GPTQ and self.upcast_non_quantized:
                # peft utils/other.py prepare_model_for_kbit_training: `is_gptq_quantized` skips the fp32 cast
                raise ValueError("upcast_non_quantized: prepare_model_for_kbit_training casts nothing on a GPTQ model")
        elif self.base_precision == BasePrecision.TORCHAO_NF4 and self.upcast_non_quantized:
            # torchtune never calls it, and peft's `is_torchao_quantized` branch casts nothing
            raise ValueError("upcast_non_quantized: prepare_model_for_kbit_training casts nothing on a torchao model")
        if not self.base_precision.is_packed_int and (self.bits, self.group_size) != (4, 128):
            raise ValueError(f"bits and group_size describe a GPTQ or AWQ checkpoint, not {self.base_precision.value}")
        return self


# adapter_config.json keys that change no byte zeroplan counts, or that PEFT fills itself
_IGNORED_KEYS = {
    "alpha_pattern", "auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode",
    "fan_in_fan_out", "use_rslora", "init_lora_weights", "layers_pattern", "loftq_config", "megatron_config",
    "megatron_core", "eva_config", "corda_config", "lora_ga_config", "runtime_config", "layer_replication",
    "peft_version", "peft_type", "use_qalora", "qalora_group_size", "trainable_token_indices", "target_parameters",
    "rank_pattern", "alora_invocation_tokens", "velora_config", "monteclora_config", "ensure_weight_tying",
    "arrow_config",
}
_READ_KEYS = {"r", "lora_alpha", "target_modules", "lora_dropout", "use_dora", "bias", "lora_bias", "modules_to_save",
              "layers_to_transform", "exclude_modules"}
_SUPPORTED_PEFT_MAJOR = 0  # peft 0.x writes the file this reader knows


def lora_spec_from_adapter_config(path: str | Path) -> LoraSpec:
    """The `LoraSpec` of a PEFT `adapter_config.json`; a SpecError names the file and field."""
    import json  # here, not at start-up: only --lora's adapter_config.json needs it

    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{where}: cannot read: {error.strerror if isinstance(error, OSError) else error}") from None
    except json.JSONDecodeError as error:
        raise SpecError(f"{where}: not JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where}: an adapter_config.json is a JSON object")
    return lora_spec_from_adapter_dict(data, where)


def lora_spec_from_adapter_dict(data: dict[str, Any], where: str = "adapter_config.json") -> LoraSpec:
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise SpecError(f"{where}: peft_type: only LORA adapters are modelled (got {peft_type!r})")
    version = data.get("peft_version")
    if version is not None and not _known_version(version):
        raise SpecError(f"{where}: peft_version: unknown version {version!r} (this reader knows peft 0.x)")
    for key in ("rank_pattern", "target_parameters", "layer_replication", "trainable_token_indices"):
        if data.get(key):
            raise SpecError(f"{where}: {key}: not modelled (adapters on every target must share one shape)")
    if data.get("use_qalora"):
        raise SpecError(f"{where}: use_qalora: not modelled")
    unknown = sorted(set(data) - _IGNORED_KEYS - _READ_KEYS)
    if unknown:
        raise SpecError(f"{where}: {unknown[0]}: unknown key of a LoRA adapter_config.json")
    targets = data.get("target_modules")
    if targets is None:
        raise SpecError(f"{where}: target_modules: missing (PEFT fills it from the model type; give the names)")
    if isinstance(targets, str):
        if targets.lower() != ALL_LINEAR:
            # peft/tuners/tuners_utils.py check_target_module_exists: a str is re.fullmatch-ed against each module's
            # whole name (model.layers.0.self_attn.q_proj); a list is matched by the names' last parts
            raise SpecError(f"{where}: target_modules: {shown(targets)} is a string, which PEFT reads as a regular "
                            "expression over whole module names (model.layers.0.self_attn.q_proj); zeroplan reads "
                            "a list of module names: write e.g. [\"q_proj\", \"v_proj\"]")
        targets = [ALL_LINEAR]
    layers = data.get("layers_to_transform")
    values = {
        "rank": data.get("r", 8), "alpha": data.get("lora_alpha"), "targets": _tuple(targets),
        "dropout": data.get("lora_dropout", 0.0), "dora": bool(data.get("use_dora", False)),
        "modules_to_save": _tuple(data.get("modules_to_save") or ()), "bias": data.get("bias", "none"),
        "lora_bias": bool(data.get("lora_bias", False)),
        "layers_to_transform": None if layers is None else _tuple([layers] if isinstance(layers, int) else layers),
        "exclude_modules": _tuple(data.get("exclude_modules") or ()),
    }
    try:
        return LoraSpec.model_validate(values)
    except ValidationError as error:
        message = describe_validation_error(error, schema=LoraSpec)
        for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha"), ("targets", "target_modules"),
                             ("dropout", "lora_dropout"), ("dora", "use_dora")):
            message = message.replace(f"{ours}:", f"{theirs}:", 1) if message.startswith(f"{ours}:") else message
        raise SpecError(f"{where}: {message}") from None


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _known_version(version: Any) -> bool:
    if not isinstance(version, str):
        return False
    major = version.split(".", 1)[0]
    return major.isdigit() and int(major) == _SUPPORTED_PEFT_MAJOR


def check_training_lora(training: "TrainingSpec") -> None:
    """The rules joining `lora` and `quant` to the rest of a training spec (TrainingSpec's validator)."""
    quant = training.quant
    if training.lora is None:
        if quant is not None and quant.base_precision.is_quantized:
            raise ValueError(f"quant.base_precision {quant.base_precision.value}: a quantized base cannot train; "
                             "add LoRA adapters (lora)")
        return
    if training.freeze:
        raise ValueError("freeze: with LoRA the base is frozen already (modules_to_save names what trains whole)")
    if quant is None:
        return
    engine, stage = training.engine.value, training.zero_stage
    if quant.base_precision.is_4bit and quant.quant_storage == "uint8":
        # DeepSpeed ZeRO-3 partitions every parameter of the module in one float dtype (PEFT's DeepSpeed
        # QLoRA guide sets bnb_4bit_quant_storage to the model dtype for this). FSDP2 runs it: a non-float
        # parameter gets no param_dtype cast and a unit of mixed dtypes is all-gathered as bytes (torch
        # _fully_shard/_fsdp_param.py init_dtype_attrs, _fsdp_collectives.py _get_all_gather_input_metadatas).
        if engine == "deepspeed" and stage == 3:
            raise ValueError(f"quant.quant_storage uint8: engine {engine} at zero_stage {stage} shards the packed 4-bit "
                             "weights with the other parameters and needs them in one float dtype: set quant_storage bf16")
    if quant.base_precision == BasePrecision.INT8 and (engine == "fsdp2" or (engine == "deepspeed" and stage == 3)):
        raise ValueError(f"quant.base_precision int8: Int8Params cannot be sharded by engine {engine} at zero_stage "
                         f"{stage} (its row scales live outside the tensor); use nf4 with quant_storage bf16, or ZeRO 0-2")
    if quant.base_precision == BasePrecision.TORCHAO_NF4 and engine == "deepspeed":
        # torchao nf4_tensor.py implements FSDP2's extension points (fsdp_pre_all_gather / fsdp_post_all_gather)
        raise ValueError("quant.base_precision torchao-nf4: torchao's NF4Tensor is sharded by FSDP2 (torchtune's "
                         "recipes); under DeepSpeed it is not modelled: use engine fsdp2 or torch")
    if quant.base_precision.is_packed_int and (engine == "fsdp2" or (engine == "deepspeed" and stage == 3)):
        # their qweight, qzeros, scales and g_idx are buffers (register_buffer), which neither engine shards
        raise ValueError(f"quant.base_precision {quant.base_precision.value}: its packed weights are module buffers, "
                         f"which engine {engine} at zero_stage {stage} does not shard: not modelled; use ZeRO 0-2")
    if quant.base_precision.is_quantized and training.offload_params.value != "none":
        # FSDP1's CPUOffload moves whole FlatParameters, the packed 4-bit storage among them when it is a float dtype
        # (the FSDP-QLoRA recipe of Answer.AI and PEFT: bnb_4bit_quant_storage bf16); its QuantState is no parameter
        # and stays on the GPU (estimate/adapters/lora.py `offloaded_base`)
        if not (engine == "fsdp1" and quant.base_precision.is_4bit and quant.quant_storage != "uint8"):
            raise ValueError("offload_params: a quantized base is offloaded by engine fsdp1 only, as a 4-bit base stored in "
                             "a float dtype (quant_storage bf16); the other engines keep bitsandbytes' weights on the GPU")
