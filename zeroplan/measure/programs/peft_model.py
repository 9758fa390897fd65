"""A LoRA / QLoRA model as users build it: a Hugging Face model, its linear layers quantized by
bitsandbytes, then PEFT's adapters (`training.lora`, `training.quant`; zeroplan/spec/lora.py).

The steps, in the order the usual QLoRA script runs them:
1. quantize (`training.quant` with an int8/nf4/fp4 base): every `nn.Linear` (GPT-2's `Conv1D`,
   transposed) outside the output head becomes `bnb.nn.Linear8bitLt` or `bnb.nn.Linear4bit`, and
   its weight is quantized where it lies, as `from_pretrained(quantization_config=BitsAndBytesConfig(...))`
   does (transformers/integrations/bitsandbytes.py `replace_with_bnb_linear`, `Bnb4bitQuantize`,
   `Bnb8bitQuantize`; the head stays whole: transformers/quantizers/base.py `get_keys_to_not_convert`).
   `from_config` takes no quantization config, hence the replacement here. A bf16/fp16/fp32 base
   is the model in that dtype, no bitsandbytes;
2. `peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)` on a k-bit
   base with `quant.upcast_non_quantized` (off by default, as the Hugging Face Trainer leaves it):
   it freezes every parameter and casts the non-quantized bf16/fp16 ones (embeddings, norms, head)
   to fp32 (peft/utils/other.py);
3. `peft.get_peft_model(model, LoraConfig(...))`: adapters (kept in fp32 by default, peft's
   `autocast_adapter_dtype=True`), the base frozen, `modules_to_save` copied;
4. with checkpointing, `enable_input_require_grads()`, as PEFT does for a model with gradient
   checkpointing on (peft/peft_model.py `_prepare_model_for_gradient_checkpointing`): the
   embeddings' output requires grad, so that checkpointed blocks get a gradient to recompute for.

The model the workload keeps is the transformers model itself: PEFT edits it in place (its
`LoraModel` swaps each target for a `lora.Linear` holding the base layer), and the forward of
`PeftModelForCausalLM` for LoRA is the base model's forward. Adapter parameters (what PEFT
creates: lora_A, lora_B, lora_magnitude_vector and the modules_to_save copies) are marked, so that
the accounting can split the parameter bytes into base and adapter (`adapter_parameters`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroplan.errors import MeasureError, MissingDependencyError
from zeroplan.measure import quant_rules

ADAPTER_MARK = "zeroplan_adapter"
"""Attribute set to True on the modules whose parameters PEFT created (see `adapter_parameters`)."""

_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save")

_QUANT_STORAGE = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _value(field: Any) -> Any:
    """An enum member's value, or the field itself."""
    return getattr(field, "value", field)


def uses_peft(training: Any) -> bool:
    """Whether the training spec asks for adapters or a quantized base."""
    return getattr(training, "lora", None) is not None or getattr(training, "quant", None) is not None


def kbit_precision(quant: Any) -> str | None:
    """"int8", "nf4" or "fp4" for a bitsandbytes base; None for a bf16/fp16/fp32 one (or no quant)."""
    if quant is None:
        return None
    precision = _value(quant.base_precision)
    return precision if precision in ("int8", "nf4", "fp4") else None


def base_dtype(quant: Any, default: torch.dtype) -> torch.dtype:
    """The dtype the model is built in: the base precision for a 16/32-bit base; for a k-bit base
    the compute dtype (what `from_pretrained(dtype=...)` loads the layers that stay whole in)."""
    if quant is None:
        return default
    precision = _value(quant.base_precision)
    if precision in _DTYPES:
        return _DTYPES[precision]
    return _DTYPES[quant.compute_dtype]


def _import(name: str):
    try:
        return __import__(name)
    except ImportError as error:
        raise MissingDependencyError(
            f"training.lora: measuring LoRA/QLoRA needs {name} ({error}); install it with: pip install 'zeroplan[lora]'"
        ) from None


def quantize_linears(lm: nn.Module, quant: Any) -> int:
    """Swap every linear layer but the output head for its bitsandbytes k-bit layer, quantizing
    the weight on its device (replace_with_bnb_linear + Bnb4bitQuantize / Bnb8bitQuantize in
    transformers/integrations/bitsandbytes.py). Returns the number of layers swapped."""
    bnb = _import("bitsandbytes")
    from transformers.pytorch_utils import Conv1D

    precision = kbit_precision(quant)
    head = lm.get_output_embeddings()
    compute = _DTYPES[quant.compute_dtype]
    storage = _QUANT_STORAGE[quant.quant_storage]
    blocksize = quant.blocksize
    swapped = 0
    for name, module in list(lm.named_modules()):
        if module is head or not (type(module) is nn.Linear or isinstance(module, Conv1D)):
            continue
        weight = module.weight.data.T if isinstance(module, Conv1D) else module.weight.data
        out_features, in_features = weight.shape
        has_bias = module.bias is not None
        with torch.device("meta"):
            if precision == "int8":
                new = bnb.nn.Linear8bitLt(in_features, out_features, has_bias, has_fp16_weights=False, threshold=6.0)
            else:
                new = bnb.nn.Linear4bit(in_features, out_features, has_bias, compute, compress_statistics=bool(quant.double_quant),
                                        quant_type=precision, quant_storage=storage)
        if precision == "int8":
            new.weight = bnb.nn.Int8Params(weight.contiguous(), requires_grad=False, has_fp16_weights=False).to(weight.device)
        else:
            new.weight = bnb.nn.Params4bit(weight.contiguous(), requires_grad=False, blocksize=blocksize,
                                           compress_statistics=bool(quant.double_quant), quant_type=precision,
                                           quant_storage=storage, module=new).to(weight.device)
        if has_bias:
            new.bias = nn.Parameter(module.bias.data, requires_grad=False)
        new.source_cls = type(module)
        lm.set_submodule(name, new)
        swapped += 1
    # what from_pretrained sets on a quantized model; prepare_model_for_kbit_training reads it
    setattr(lm, "is_loaded_in_8bit" if precision == "int8" else "is_loaded_in_4bit", True)
    return swapped


def nf4_linears(lm: nn.Module, quant: Any) -> int:
    """Every linear layer but the output head with its weight as torchao's NF4Tensor, as torchtune's QLoRA builds
    it (torchtune modules/peft/lora.py LoRALinear and FrozenNF4Linear: `to_nf4(weight)`, blocks of 64, scalers per
    256 blocks); nn.Linear's F.linear then runs torchao's `linear_nf4` (its __torch_function__). Returns the count."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # torchao 0.18
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4  # torchao before 0.16, torchtune 0.6.1's import
        except ImportError as error:
            raise MissingDependencyError(f"training.quant: torchao-nf4 needs torchao ({error}); install it with: pip "
                                         "install 'zeroplan[torchao]'") from None
    head, compute, swapped = lm.get_output_embeddings(), _DTYPES[quant.compute_dtype], 0
    for module in lm.modules():
        if module is not head and type(module) is nn.Linear:
            module.weight = nn.Parameter(to_nf4(module.weight.data.to(compute).contiguous()), requires_grad=False)
            swapped += 1
    return swapped


def lora_config(lora: Any):
    """peft's LoraConfig of a LoraSpec (zeroplan/spec/lora.py; its fields are LoraConfig's)."""
    peft = _import("peft")
    targets = "all-linear" if lora.all_linear else list(lora.targets)
    optional = {"lora_alpha": lora.alpha, "layers_to_transform": list(lora.layers_to_transform or ()) or None,
                "exclude_modules": list(lora.exclude_modules) or None}
    return peft.LoraConfig(
        r=lora.rank, target_modules=targets, lora_dropout=lora.dropout, use_dora=lora.dora, bias=lora.bias,
        lora_bias=lora.lora_bias, modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM",
        **{key: value for key, value in optional.items() if value is not None},
    )


def apply_peft(lm: nn.Module, training: Any, *, program_checkpoints: bool = False) -> nn.Module:
    """Quantize `lm` and add PEFT's adapters as `training.quant` and `training.lora` say (module
    docstring, steps 1-4); `lm` is edited in place and returned. Returns the PeftModel's
    transformers model, with its adapter modules marked. With `program_checkpoints` step 4 is left
    to the program (the Trainer's `activation_checkpointing_enable` adds the same hook)."""
    quant, lora = getattr(training, "quant", None), getattr(training, "lora", None)
    if quant is not None and _value(quant.base_precision) in ("gptq", "awq"):
        raise MeasureError(f"base_precision {_value(quant.base_precision)}: measure builds bitsandbytes bases only (a "
                           "GPTQ/AWQ checkpoint needs gptqmodel and a GPU); use nf4, fp4 or int8")
    # the launcher refuses these before any worker starts (measure/quant_rules.py); here, the model as built
    if kbit_precision(quant) is not None and any(p.is_meta for p in lm.parameters()):
        # Params4bit.to("meta") does not quantize (bitsandbytes/nn/modules.py): nothing to shard after
        raise MeasureError(quant_rules.META_DEVICE.format(default=""))
    if kbit_precision(quant) is not None and any(hasattr(p, "ds_tensor") for p in lm.parameters()):
        # under deepspeed.zero.Init each weight is an empty placeholder (partition_parameters.py): nothing to quantize
        raise MeasureError(quant_rules.ZERO_INIT.format(default=""))
    if kbit_precision(quant) is not None and _is_fake(lm):
        # Params4bit(FakeTensor) fails: "Creating a new Tensor subclass Params4bit but the raw Tensor
        # object is already associated to a python object of type FakeTensor" (docs/measure.md)
        raise MeasureError(quant_rules.SIMULATED)
    if quant is not None and _value(quant.base_precision) == "torchao-nf4":
        if any(p.is_meta for p in lm.parameters()) or _is_fake(lm):  # to_nf4 reads the weights' values
            raise MeasureError(quant_rules.META_DEVICE.format(default=""))
        nf4_linears(lm, quant)
    if kbit_precision(quant) is not None:
        quantize_linears(lm, quant)
        if quant.upcast_non_quantized:
            peft = _import("peft")
            peft.prepare_model_for_kbit_training(lm, use_gradient_checkpointing=False)
    if lora is None:
        if quant is not None and quant.base_precision.is_quantized:
            raise MeasureError("training.quant: a quantized base trains nothing without adapters; add --lora-rank")
        return lm
    peft = _import("peft")
    try:
        peft_model = peft.get_peft_model(lm, lora_config(lora))
    except ValueError as error:  # e.g. "Target modules {...} not found in the base model"
        raise MeasureError(f"training.lora: {str(error).splitlines()[0]}") from None
    lm.zeroplan_peft_model = [peft_model]  # kept, not registered as a submodule (it wraps lm)
    mark_adapters(lm)
    if _value(training.checkpointing) != "none" and not program_checkpoints:
        lm.enable_input_require_grads()
    return lm


def mark_adapters(model: nn.Module) -> None:
    """Mark the modules that own PEFT-created parameters (ADAPTER_MARK)."""
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(part in _ADAPTER_NAMES for part in parts):
            setattr(module, ADAPTER_MARK, True)


def is_adapter_module(module: nn.Module) -> bool:
    return bool(getattr(module, ADAPTER_MARK, False))


def adapter_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters PEFT created (lora_A/lora_B/lora_magnitude_vector, modules_to_save copies)."""
    found, seen = [], set()
    for module in model.modules():
        if is_adapter_module(module):
            for param in module.parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    found.append(param)
    return found


def quantization_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of bitsandbytes quantization states (absmax, nested absmax and code, int8 row
    scales): part of a quantized base weight, held outside the parameter (bitsandbytes/functional.py QuantState)."""
    found = []
    for module in model.modules():
        weight = _own_weight(module)
        state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
        if state is not None:
            found.extend(_state_tensors(state))
        # Int8Params' row scales; Linear8bitLt's first forward moves them to `module.state`
        # (bitsandbytes nn/modules.py `init_8bit_state`: `self.weight.SCB = None`)
        scb = getattr(weight, "SCB", None)
        if scb is None:
            scb = getattr(getattr(module, "state", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            found.append(scb)
    return found


def _own_weight(module: nn.Module) -> torch.Tensor | None:
    """`module.weight` read without its getter: under DeepSpeed ZeRO-3 reading a partitioned
    parameter in forward gathers it (parameter_offload.py ZeROOrderedDict.__getitem__), on the
    counting rank only, which leaves the ranks' collectives mismatched."""
    weight = next((param for name, param in module._parameters.items() if name == "weight"), None)
    return weight if weight is not None else module.__dict__.get("weight")


def _state_tensors(state: Any) -> list[torch.Tensor]:
    tensors = [getattr(state, name, None) for name in ("absmax", "code", "offset")]
    nested = getattr(state, "state2", None)
    found = [t for t in tensors if isinstance(t, torch.Tensor)]
    return found + (_state_tensors(nested) if nested is not None else [])


def implementation_suffix(training: Any) -> str:
    """What the workload's implementation name adds, e.g. "+peft-0.21.2:lora-r8+bnb-0.50.2:nf4"."""
    parts = []
    lora = getattr(training, "lora", None)
    if lora is not None:
        parts.append(f"+peft-{_import('peft').__version__}:{'dora' if lora.dora else 'lora'}-r{lora.rank}")
    quant = getattr(training, "quant", None)
    precision = kbit_precision(quant)
    if precision is not None:
        parts.append(f"+bitsandbytes-{_import('bitsandbytes').__version__}:{precision}")
    elif quant is not None and _value(quant.base_precision) == "torchao-nf4":
        parts.append(f"+torchao-{_import('torchao').__version__}:nf4")
    return "".join(parts)


def peft_categories(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """What the accounting adds to an engine's categories for a PEFT model: the quantization
    states as parameters (part of the base weight), and the adapter parameters, with their
    DeepSpeed ZeRO-3 partitions (`ds_tensor`), as the adapter subset of the parameters."""
    from zeroplan.measure.accounting import ADAPTER_KEY

    adapters = adapter_parameters(model)
    partitions = [p.ds_tensor for p in adapters if getattr(p, "ds_tensor", None) is not None]
    return {"params": quantization_state_tensors(model), ADAPTER_KEY: adapters + partitions}


def with_peft_categories(categories: dict[str, list[torch.Tensor]], model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """An engine's categories with `peft_categories` added (the engine's own names come first)."""
    extra = peft_categories(model)
    merged = dict(categories)
    for key, tensors in extra.items():
        merged[key] = list(merged.get(key, ())) + tensors
    return merged


def _is_fake(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in model.parameters())
