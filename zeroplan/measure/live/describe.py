"""A training program zeroplan did not write, read from its live objects: the model spec and the
training spec that `zeroplan estimate` needs to estimate it (docs/api.md, "Inside your program").

What is read, and from where:
- the model: its Hugging Face config (`model.config`; the base model's under PEFT), read as
  `zeroplan estimate` reads a config.json (importers/hf_config.py);
- adapters and base: PEFT's `peft_config` as an adapter_config.json (spec/lora.py), a bitsandbytes
  `quantization_config` as the base's storage, else the frozen base's dtype;
- the world: the process group's size (one rank without one), LOCAL_WORLD_SIZE per node;
- the engine: what the program calls the model through (DistributedDataParallel, a DeepSpeedEngine
  and its config, as accelerate filled it), `fully_shard`'s FSDPModule (its units and resharding),
  and the optimizer (ZeroRedundancyOptimizer is ZeRO-1);
- precision: the trainable parameters' dtype and the mixed precision the program runs (the
  Trainer's bf16/fp16, accelerate's state, else an autocast active at the first forward);
- the optimizer: its class and kernel (its `fused`/`foreach` defaults, else torch's choice for the
  device: torch/optim/optimizer.py `_default_to_fused_or_foreach`);
- the batch: micro-batch and sequence length from the first forward's input_ids;
- gradient checkpointing (`is_gradient_checkpointing`), attention (`_attn_implementation`), device.
What cannot be read raises `Undescribed`, whose message names it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from zeroplan.errors import SpecError
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec


class Undescribed(Exception):
    """What zeroplan could not read from the program; the message names it."""


@dataclass
class LiveRun:
    """The program's objects at its first forward."""

    model: Any  # what the program trains: a transformers model, or a PeftModel over one
    optimizer: Any | None  # the program's optimizer (accelerate's or DeepSpeed's wrapper included)
    wrapper: Any | None  # the module the program calls instead of the model: DDP, a DeepSpeedEngine
    batch_shape: tuple[int, ...]  # the first forward's input_ids
    autocast_dtype: torch.dtype | None  # the autocast active at the first forward
    recipe: str  # hf-trainer (the Trainer runs it), plain (the user's loop)
    grad_accum: int | None = None  # given by the program (the Trainer's arguments) or the user
    mixed_precision: str | None = None  # "bf16", "fp16" or "no", given by the program or the user
    freeze: tuple[str, ...] = ()  # frozen module groups the user names (the estimate cannot see them)


_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "AdamW8bit": "adam8bit", "Adam8bit": "adam8bit",
               "PagedAdamW8bit": "adam8bit", "PagedAdam8bit": "adam8bit"}
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def base_model(model: Any) -> Any:
    """The transformers model under a PeftModel (peft/peft_model.py `get_base_model`), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def innermost_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that steps: under accelerate's AcceleratedOptimizer, DeepSpeed's wrappers,
    and a ZeroRedundancyOptimizer's local optimizer (this rank's shard of the states)."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return getattr(optimizer, "optim", optimizer) if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else optimizer


def describe(run: LiveRun) -> tuple[TransformerSpec, TrainingSpec, list[str]]:
    """The specs of the run, and notes on what was assumed; `Undescribed` names what cannot be read."""
    from pydantic import ValidationError

    from zeroplan.spec.validation import describe_validation_error

    spec = model_spec(run.model)
    params = list(run.model.parameters())
    if not params:
        raise Undescribed("the model: it has no parameters")
    device = params[0].device
    world = torch.distributed.get_world_size() if _distributed() else 1
    values: dict[str, Any] = {"recipe": run.recipe, "gpus": world, "device": "cuda" if device.type == "cuda" else "cpu"}
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and 0 < int(local) <= world and world % int(local) == 0:
        values["gpus_per_node"] = int(local)
    notes: list[str] = []
    values.update(_engine(run, spec, world, notes))
    values.update(_batch(run))
    grad_accum = run.grad_accum
    if grad_accum is None and "accelerate" in sys.modules:
        grad_accum = _accelerate_accumulation()
    if grad_accum is not None and "grad_accum" not in values:  # DeepSpeed's config has its own
        values["grad_accum"] = grad_accum
    values.update(_precision(run, params, values))
    if "optimizer" not in values:  # DeepSpeed's own optimizer is its config's; else the program's torch optimizer
        values.update(_optimizer(run, device))
        if values.get("engine") == "torch" and values.get("zero_stage") == 0:
            notes += _parameter_groups(run)
    base = base_model(run.model)
    # transformers 5 names it is_activation_checkpointing (is_gradient_checkpointing: deprecated)
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(base, name, False):
        values["checkpointing"] = "full"
    if getattr(base.config, "_attn_implementation", "sdpa") == "eager":
        values["attention"] = "eager"
    values.update(_adapters(run.model, values))
    if run.freeze:
        values["freeze"] = tuple(run.freeze)
    try:
        training = TrainingSpec.model_validate(values)
    except ValidationError as error:
        raise Undescribed(f"the training setup: {describe_validation_error(error, schema=TrainingSpec)}") from None
    return spec, training, notes


def model_spec(model: Any) -> TransformerSpec:
    """The model's Hugging Face config as `zeroplan estimate` reads a config.json."""
    from zeroplan.importers.hf_config import spec_from_hf_config

    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise Undescribed(f"the model: {type(base).__name__} has no Hugging Face config (model.config)")
    name = getattr(config, "_name_or_path", "") or type(base).__name__
    try:
        return spec_from_hf_config(config.to_dict(), name, source=f"{type(base).__name__}.config")
    except SpecError as error:
        raise Undescribed(f"the model's config: {error}") from None


def trainable_count(model: Any) -> int:
    """Elements that train (a ZeRO-3 partitioned parameter by its whole size, `ds_numel`), tied ones once."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            total += getattr(param, "ds_numel", param.numel())
    return total


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _engine(run: LiveRun, spec: TransformerSpec, world: int, notes: list[str]) -> dict[str, Any]:
    """engine, zero_stage and their knobs, from what wraps the model and the optimizer."""
    wrapper = run.wrapper
    if type(wrapper).__name__ == "DeepSpeedEngine":
        from zeroplan.importers.deepspeed_json import settings_from_deepspeed

        config = _deepspeed_config(wrapper)
        try:
            # the config as the program filled it ("auto" resolved by accelerate or the Trainer)
            return settings_from_deepspeed(config, lambda key: f"DeepSpeed config: {key}", world, spec.hidden_size)
        except SpecError as error:
            raise Undescribed(f"the DeepSpeed config: {error}") from None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(run.model, FSDPModule) or isinstance(base_model(run.model), FSDPModule):
        return _fsdp2(run, notes)
    from torch.nn.parallel import DistributedDataParallel

    optimizer = run.optimizer
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    zero1 = type(optimizer).__name__ == "ZeroRedundancyOptimizer"
    if isinstance(wrapper, DistributedDataParallel):
        if wrapper.find_unused_parameters and run.recipe != "hf-trainer":
            notes.append("DDP find_unused_parameters=True clones the outputs (_DDPSink), which the estimate models "
                         "for the Trainer only")
        return {"engine": "torch", "zero_stage": 1 if zero1 else 0, "ddp": True}
    if world > 1:
        raise Undescribed(f"the engine: {world} ranks, but the model is called without DistributedDataParallel, "
                          "fully_shard or DeepSpeed")
    return {"engine": "torch", "zero_stage": 0, "ddp": False}


def _deepspeed_config(engine: Any) -> dict[str, Any]:
    parsed = getattr(getattr(engine, "_config", None), "_param_dict", None)  # runtime/config.py DeepSpeedConfig
    config = parsed if isinstance(parsed, dict) else engine.config
    if not isinstance(config, dict):
        raise Undescribed("the DeepSpeed config: the engine holds no config dict")
    return json.loads(json.dumps(config, default=str))


def _fsdp2(run: LiveRun, notes: list[str]) -> dict[str, Any]:
    """FSDP2: ZeRO-3 when the blocks reshard after forward, else ZeRO-2; its units as the modules
    `fully_shard` was applied to (the root alone holds embeddings and head: units root)."""
    from torch.distributed.fsdp import FSDPModule

    base = base_model(run.model)

    def reshards(module: Any) -> bool | None:
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        return None if group is None else group.post_forward_mesh_info is not None  # _fsdp_param_group.py

    units = [m for m in base.modules() if isinstance(m, FSDPModule) and m is not base and m is not run.model]
    embeddings = base.get_input_embeddings()
    blocks = [m for m in units if m is not embeddings and reshards(m) is not None]
    if not blocks:
        raise Undescribed("the FSDP2 wrapping: no block was sharded on its own (fully_shard per decoder layer)")
    stage = 3 if reshards(blocks[0]) else 2
    split = isinstance(embeddings, FSDPModule)
    knobs: dict[str, Any] = {"units": "split" if split else "root"}
    root = reshards(run.model if isinstance(run.model, FSDPModule) else base)
    if root is not None and not split:
        knobs["reshard_root_after_forward"] = root
    notes.append(f"FSDP2 read from the modules: {len(units)} units, blocks reshard after forward: {bool(stage == 3)}; "
                 "the head unit's resharding is the recipe's default")
    return {"engine": "fsdp2", "zero_stage": stage, "fsdp2": knobs}


def _batch(run: LiveRun) -> dict[str, int]:
    if len(run.batch_shape) != 2:
        raise Undescribed(f"the first batch: input_ids of shape {tuple(run.batch_shape)}, not (micro-batch, sequence)")
    return {"micro_batch": int(run.batch_shape[0]), "seq_len": int(run.batch_shape[1])}


def _precision(run: LiveRun, params: list[torch.Tensor], values: dict[str, Any]) -> dict[str, str]:
    if values.get("engine") == "deepspeed" and "precision" in values:
        return {}  # the DeepSpeed config's bf16/fp16 section
    trainable = [p for p in params if p.requires_grad] or params
    dtype = trainable[0].dtype
    mixed = run.mixed_precision
    if mixed is None and "accelerate" in sys.modules:
        mixed = _accelerate_mixed_precision()
    if mixed is None and run.autocast_dtype is not None:
        mixed = _DTYPES.get(run.autocast_dtype)
    if dtype == torch.bfloat16:
        return {"precision": "pure-bf16"}
    if dtype != torch.float32:
        raise Undescribed(f"precision: {dtype} parameters train without an fp32 master copy, which is not modelled")
    return {"precision": mixed if mixed in ("bf16", "fp16") else "fp32"}


def _accelerate_mixed_precision() -> str | None:
    """accelerate's mixed precision ("no", "bf16", "fp16"), if the program made an Accelerator."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:  # nothing initialised: not an accelerate program
        return None
    return str(AcceleratorState().mixed_precision)


def _parameter_groups(run: LiveRun) -> list[str]:
    """A note when the optimizer's parameter groups step other parameters than those that require
    gradients (the estimate gives optimizer states to every parameter that trains)."""
    stepped: dict[int, int] = {}
    for group in innermost_optimizer(run.optimizer).param_groups:
        for param in group["params"]:
            stepped[id(param)] = param.numel()
    steps, trains = sum(stepped.values()), trainable_count(run.model)
    if steps == trains:
        return []
    return [f"the optimizer's parameter groups step {steps:,} parameters, {trains:,} require gradients: the estimate "
            "gives optimizer states to those that require gradients"]


def _accelerate_accumulation() -> int | None:
    """The micro-batches accelerate's `accumulate` counts per step, if the program made an Accelerator."""
    from accelerate.state import GradientState

    if not GradientState._shared_state:
        return None
    return int(GradientState().num_steps)


def _optimizer(run: LiveRun, device: torch.device) -> dict[str, str]:
    optimizer = innermost_optimizer(run.optimizer) if run.optimizer is not None else None
    if optimizer is None:
        raise Undescribed("the optimizer: none was given (pass it to zeroplan.track)")
    name = type(optimizer).__name__
    if name not in _OPTIMIZERS:
        raise Undescribed(f"the optimizer: {name} is not one zeroplan models (AdamW, Adam, SGD, bitsandbytes' 8-bit Adam)")
    values = {"optimizer": _OPTIMIZERS[name]}
    defaults = getattr(optimizer, "defaults", {})
    fused, foreach = defaults.get("fused"), defaults.get("foreach")
    if values["optimizer"] != "adam8bit":
        if fused:
            values["optimizer_impl"] = "fused"
        elif foreach or (foreach is None and not fused and device.type == "cuda"):
            values["optimizer_impl"] = "foreach"  # torch's default for CUDA tensors
        else:
            values["optimizer_impl"] = "for-loop"
    return values


def _adapters(model: Any, values: dict[str, Any]) -> dict[str, Any]:
    """lora (PEFT's LoraConfig) and quant (the base's storage), when the model has them."""
    from zeroplan.spec.lora import QuantSpec, lora_spec_from_adapter_dict

    found: dict[str, Any] = {}
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        adapter = peft_config.get(getattr(model, "active_adapter", "default")) or next(iter(peft_config.values()))
        data = json.loads(json.dumps(adapter.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
        try:
            found["lora"] = lora_spec_from_adapter_dict(data, "the model's peft_config")
        except SpecError as error:
            raise Undescribed(str(error)) from None
    quant = _quantization(base_model(model))
    if quant is None and found:
        frozen = [p.dtype for p in model.parameters() if not p.requires_grad]
        default = "bf16" if values.get("precision") == "pure-bf16" else "fp32"
        if frozen and _DTYPES.get(frozen[0], default) != default:
            quant = {"base_precision": _DTYPES[frozen[0]]}
    if quant is not None:
        try:
            found["quant"] = QuantSpec.model_validate(quant)
        except Exception as error:  # noqa: BLE001 - a pydantic ValidationError: named below
            raise Undescribed(f"the base's quantization: {str(error).splitlines()[0]}") from None
    return found


def _quantization(base: Any) -> dict[str, Any] | None:
    """A bitsandbytes quantization_config as QuantSpec fields (transformers BitsAndBytesConfig)."""
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is None:
        return None
    data = config if isinstance(config, dict) else config.to_dict()
    if data.get("load_in_8bit"):
        return {"base_precision": "int8"}
    if not data.get("load_in_4bit"):
        raise Undescribed(f"the base's quantization: {data.get('quant_method', 'unknown')} is not modelled (bitsandbytes only)")
    dtype_name = str(data.get("bnb_4bit_compute_dtype", "float32")).replace("torch.", "")
    storage = str(data.get("bnb_4bit_quant_storage", "uint8")).replace("torch.", "")
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "uint8"}
    return {"base_precision": data.get("bnb_4bit_quant_type", "fp4"), "double_quant": bool(data.get("bnb_4bit_use_double_quant")),
            "compute_dtype": names.get(dtype_name, dtype_name), "quant_storage": names.get(storage, storage)}
