"""torchtune recipe YAML -> zeroplan training settings (recipe torchtune).

The keys are those torchtune 0.6.1's full-finetune recipes read (recipes/full_finetune_single_device.py,
full_finetune_distributed.py). A recipe reads the keys it needs from the config and never looks at
the others, so an unknown top-level key is a warning; the `optimizer` and `loss` sections are keyword
arguments of a constructor (`config.instantiate`), which refuses an unknown one, so there it is an error.
Which recipe runs is read from the `tune run <recipe>` line every shipped config has in its header
comment; without one, one GPU means the single-device recipe and more the distributed one.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Mapping

from zeroplan.errors import ZeroplanWarning
from zeroplan.importers import torchtune_lora
from zeroplan.importers.torchtitan_toml import selective_option
from zeroplan.importers.values import Where, as_bool, as_int, as_section, fail

RECIPE = "torchtune"

# Model builder (`model._component_`) -> catalogue model with the same layers and sizes. Llama 3.1's 8B and
# 70B differ from Llama 3's only in rope scaling and context length (their config.json files on the
# Hugging Face Hub), which change no tensor zeroplan counts.
MODELS = {
    "torchtune.models.llama2.llama2_7b": "llama-2-7b",
    "torchtune.models.llama2.llama2_13b": "llama-2-13b",
    "torchtune.models.llama2.llama2_70b": "llama-2-70b",
    "torchtune.models.llama3.llama3_8b": "llama-3-8b",
    "torchtune.models.llama3.llama3_70b": "llama-3-70b",
    "torchtune.models.llama3_1.llama3_1_8b": "llama-3-8b",
    "torchtune.models.llama3_1.llama3_1_70b": "llama-3-70b",
    "torchtune.models.llama3_1.llama3_1_405b": "llama-3.1-405b",
    "torchtune.models.llama3_2.llama3_2_1b": "llama-3.2-1b",
    "torchtune.models.llama3_2.llama3_2_3b": "llama-3.2-3b",
    "torchtune.models.mistral.mistral_7b": "mistral-7b",
    "torchtune.models.phi3.phi3_mini": "phi-3-mini",
    "torchtune.models.qwen2.qwen2_7b": "qwen2-7b",
    "torchtune.models.gemma.gemma_7b": "gemma-7b",
}

_LLAMA3_1 = ("torchtune.models.llama3_1.llama3_1_8b", "torchtune.models.llama3_1.llama3_1_70b")

# Every key the two recipes read (cfg.<key>, cfg.get("<key>")) in torchtune 0.6.1.
KNOWN_KEYS = frozenset({
    "ac_mode", "ac_option", "batch_size", "checkpointer", "clip_grad_norm", "collate_fn", "compile",
    "cudnn_deterministic_mode", "custom_sharded_layers", "dataset", "device", "dtype", "enable_activation_checkpointing",
    "enable_activation_offloading", "enable_async_checkpointing", "epochs", "fsdp_cpu_offload",
    "fsdp_reshard_after_forward", "gradient_accumulation_steps", "log_every_n_steps", "log_peak_memory_stats", "loss",
    "lr_scheduler", "max_steps_per_epoch", "metric_logger", "model", "optimizer", "optimizer_in_bwd", "output_dir",
    "profiler", "resume_from_checkpoint", "seed", "shuffle", "tensor_parallel_dim", "tensor_parallel_plan", "tokenizer",
})
_DISTRIBUTED_ONLY = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "ac_mode", "ac_option")

# optimizer._component_ -> (zeroplan optimizer, keyword arguments of its constructor or None where not checked).
_TORCH_ADAM = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
               "fused"}  # torch 2.13 torch/optim/adamw.py AdamW.__init__ (Adam adds decoupled_weight_decay)
_BNB_ADAM = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "optim_bits", "args", "min_8bit_size", "is_paged"})
OPTIMIZERS: dict[str, tuple[str, frozenset[str] | None]] = {
    "torch.optim.AdamW": ("adamw", frozenset(_TORCH_ADAM)),
    "torch.optim.Adam": ("adam", frozenset(_TORCH_ADAM | {"decoupled_weight_decay"})),
    "torch.optim.SGD": ("sgd", frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                                          "foreach", "differentiable", "fused"})),
    # bitsandbytes 0.50.2 optim/adam.py, adamw.py: Optimizer2State("adam", ...) with optim_bits 8 (the *8bit classes)
    # or 32 (the others: fp32 states whatever the parameters' dtype); the Paged* ones pass is_paged=True
    # (estimate/engines/bnb_optim.py); the Paged*AdamW ones take no is_paged argument. `_bnb_settings` reads them.
    **{f"bitsandbytes.optim.{paged}{adam}{bits}": ("adam8bit" if bits == "8bit" else "adam32bit",
                                                    _BNB_ADAM - ({"is_paged"} if paged and adam == "AdamW" else set()))
       for paged in ("", "Paged") for adam in ("Adam", "AdamW") for bits in ("", "8bit", "32bit")},
}
_CHUNKED_LOSS = "torchtune.modules.loss.CEWithChunkedOutputLoss"  # __init__(num_output_chunks=8, ignore_index=-100)
_STANDARD_LOSS = "torch.nn.CrossEntropyLoss"
_RECIPE_NAME = re.compile(r"\b(full|lora)_finetune_(single_device|distributed)\b")


def is_torchtune(document: Mapping[str, object]) -> bool:
    """torchtune's configs name their model by a builder: `model: {_component_: torchtune.models...}`."""
    model = document.get("model")
    return isinstance(model, Mapping) and "_component_" in model


def model_from_torchtune(document: Mapping[str, object], where: Where) -> str:
    builder = as_section(document["model"], "model", where).get("_component_")
    if not isinstance(builder, str):
        raise fail(where, "model._component_", f"must be a builder name, got {builder!r}")
    if builder in MODELS:
        return MODELS[builder]
    base = torchtune_lora.base_builder(builder)  # lora_/qlora_ builders: importers/torchtune_lora.py
    if base in MODELS:
        torchtune_lora.check_lora_model(as_section(document["model"], "model", where), where)
        return MODELS[base]
    close = difflib.get_close_matches(builder, list(MODELS), n=3, cutoff=0.6)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise fail(where, "model._component_", f"{builder} is not in zeroplan's catalogue{hint}; give MODEL (a catalogue "
               "name or a config.json) to estimate another model")


def check_torchtune(document: Mapping[str, object], text: str, where: Where) -> tuple[str, ...]:
    """Warn about keys the recipes never read; the notes on what the run does that is not modelled."""
    for key in document:
        if key not in KNOWN_KEYS and key not in torchtune_lora.RECIPE_KEYS:
            close = difflib.get_close_matches(str(key), sorted(KNOWN_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.warn(f"{where(str(key))}: {key} is not read by torchtune's full-finetune recipes{hint}: ignored",
                          ZeroplanWarning)
    if _recipe(text, where) == "single_device":
        for key in _DISTRIBUTED_ONLY:
            if key in document:
                warnings.warn(f"{where(key)}: {key} is read by the distributed recipe only: ignored", ZeroplanWarning)
    notes = []
    model = document.get("model")
    builder = model.get("_component_") if isinstance(model, Mapping) else None
    if builder in _LLAMA3_1:
        notes.append(f"{builder} is estimated as {MODELS[builder]}: Llama 3.1 has Llama 3's layers and sizes")
    tokenizer = as_section(document.get("tokenizer") or {}, "tokenizer", where)
    if tokenizer.get("max_seq_len") is None:
        notes.append("tokenizer.max_seq_len is null: the batches are as long as their longest sample; estimated at "
                     "--seq-len (2048 unless given)")
    if as_bool(document.get("compile", False), "compile", where):
        notes.append("compile: torch.compile is not modelled: estimated as the eager program")
    return tuple(notes)


def _bnb_settings(component: str, arguments: Mapping[str, object], where: Where) -> dict[str, object]:
    """A bitsandbytes optimizer's own arguments that change memory: optim_bits and is_paged of the plain
    classes (the *8bit/*32bit and Paged* ones fix them), min_8bit_size at its default only."""
    settings: dict[str, object] = {"paged_optimizer": ".Paged" in component}
    fixed = component.endswith(("8bit", "32bit"))
    if "optim_bits" in arguments:
        bits = arguments["optim_bits"]
        if fixed or bits not in (8, 32):
            raise fail(where, "optimizer.optim_bits", f"{bits!r}: {component} takes 8 or 32 in its plain form only "
                       "(the *8bit and *32bit classes fix it)")
        settings["optimizer"] = "adam8bit" if bits == 8 else "adam32bit"
    if "is_paged" in arguments:
        if ".Paged" in component:
            raise fail(where, "optimizer.is_paged", f"{component} is paged already")
        settings["paged_optimizer"] = as_bool(arguments["is_paged"], "optimizer.is_paged", where)
    if arguments.get("min_8bit_size", 4096) != 4096:
        raise fail(where, "optimizer.min_8bit_size", f"{arguments['min_8bit_size']!r}: only bitsandbytes' default, "
                   "4096, is modelled")
    return settings


def _recipe(text: str, where: Where) -> str | None:
    """single_device or distributed, from the `tune run <recipe>` line of the config's header comment."""
    found = _RECIPE_NAME.search(text)
    return found.group(2) if found else None


def settings_from_torchtune(document: Mapping[str, object], text: str, where: Where, gpus: int | None) -> dict[str, object]:
    """Partial TrainingSpec mapping for one torchtune recipe config (checked by `check_torchtune`);
    `text` is the file, whose comments name the recipe."""
    recipe = _recipe(text, where)
    single = recipe == "single_device" if recipe else (gpus or 1) == 1
    settings: dict[str, object] = {"recipe": RECIPE}
    if single:
        if gpus not in (None, 1):
            raise fail(where, "model", f"the config is for full_finetune_single_device, which trains on one GPU; "
                       f"leave out --gpus {gpus}")
        settings.update(engine="torch", zero_stage=0, gpus=1)
    else:
        # _distributed.py shard_model: fully_shard with the config's reshard_after_forward (default True).
        reshard = as_bool(document.get("fsdp_reshard_after_forward", True), "fsdp_reshard_after_forward", where)
        settings.update(engine="fsdp2", zero_stage=3 if reshard else 2)
        if as_bool(document.get("fsdp_cpu_offload", False), "fsdp_cpu_offload", where):
            settings.update(offload_optimizer="cpu", offload_params="cpu")  # CPUOffloadPolicy
        if as_int(document.get("tensor_parallel_dim", 1), "tensor_parallel_dim", where, 1) > 1:
            raise fail(where, "tensor_parallel_dim", "is more than 1: not modelled yet: issue 14 (zeroplan models "
                       "data parallelism only)")

    settings["micro_batch"] = as_int(_required(document, "batch_size", where), "batch_size", where, 1)
    settings["grad_accum"] = as_int(document.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", where, 1)
    settings["precision"] = _precision(document.get("dtype"), where)
    device = document.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise fail(where, "device", f"must be cuda or cpu, got {device!r}")
    settings["device"] = device
    seq_len = as_section(document.get("tokenizer") or {}, "tokenizer", where).get("max_seq_len")
    if seq_len is not None:
        settings["seq_len"] = as_int(seq_len, "tokenizer.max_seq_len", where, 1)
    settings.update(_checkpointing(document, where, single))
    if as_bool(document.get("enable_activation_offloading", False), "enable_activation_offloading", where):
        settings["activation_offload"] = "cpu"
    settings["optimizer_in_backward"] = as_bool(document.get("optimizer_in_bwd", False), "optimizer_in_bwd", where)
    settings.update(_loss(document.get("loss"), where))
    settings.update(_optimizer(document.get("optimizer"), where))
    settings.update(torchtune_lora.lora_settings(document, where))
    return settings


def _required(document: Mapping[str, object], key: str, where: Where) -> object:
    if key not in document:  # the recipes read cfg.batch_size: a missing key fails there too
        raise fail(where, key, "is missing (torchtune's recipes require it)")
    return document[key]


def _precision(dtype: object, where: Where) -> str:
    """training/precision.py get_dtype: None is fp32; bf16 trains everything in bf16, with no fp32 copy."""
    if dtype in (None, "fp32"):
        return "fp32"
    if dtype == "bf16":
        return "pure-bf16"
    if dtype == "fp16":  # full_finetune_single_device.py __init__: "full fp16 training is not supported"
        raise fail(where, "dtype", "fp16 is refused by torchtune's full-finetune recipes; use bf16 or fp32")
    raise fail(where, "dtype", f"must be bf16 or fp32, got {dtype!r}")


def _checkpointing(document: Mapping[str, object], where: Where, single: bool) -> dict[str, object]:
    """enable_activation_checkpointing wraps every layer; the distributed recipe's ac_mode/ac_option apply
    only with it off (full_finetune_distributed.py, `apply_selective_activation_checkpointing`)."""
    enabled = as_bool(document.get("enable_activation_checkpointing", False), "enable_activation_checkpointing", where)
    mode = None if single else document.get("ac_mode")
    if enabled or mode is None:
        return {"checkpointing": "full" if enabled else "none"}
    if mode == "full":
        return {"checkpointing": "full"}
    if mode == "selective":
        return selective_option(document.get("ac_option"), "ac_option", where)
    if mode == "none":
        return {"checkpointing": "none"}
    raise fail(where, "ac_mode", f"must be none, selective or full, got {mode!r}")


def _loss(loss: object, where: Where) -> dict[str, object]:
    if loss is None:
        raise fail(where, "loss", "is missing (torchtune's recipes require it)")
    loss = as_section(loss, "loss", where)
    component = loss.get("_component_")
    arguments = {key: value for key, value in loss.items() if key != "_component_"}
    if component == _CHUNKED_LOSS:
        _check_arguments(arguments, {"num_output_chunks", "ignore_index"}, "loss", where)
        chunks = as_int(arguments.get("num_output_chunks", 8), "loss.num_output_chunks", where, 1)
        return {"loss": "chunked", "loss_chunks": chunks}
    if component == _STANDARD_LOSS:
        return {"loss": "standard"}
    raise fail(where, "loss._component_", f"{component!r} is not modelled (supported: {_CHUNKED_LOSS}, {_STANDARD_LOSS})")


def _optimizer(optimizer: object, where: Where) -> dict[str, object]:
    if optimizer is None:
        raise fail(where, "optimizer", "is missing (torchtune's recipes require it)")
    optimizer = as_section(optimizer, "optimizer", where)
    component = optimizer.get("_component_")
    if component not in OPTIMIZERS:
        close = difflib.get_close_matches(str(component), list(OPTIMIZERS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (supported: {', '.join(OPTIMIZERS)})"
        raise fail(where, "optimizer._component_", f"{component!r} is not modelled{hint}")
    name, known = OPTIMIZERS[component]
    arguments = {key: value for key, value in optimizer.items() if key != "_component_"}
    settings: dict[str, object] = {"optimizer": name}
    if component.startswith("bitsandbytes."):
        _check_arguments(arguments, known, "optimizer", where)
        return settings | _bnb_settings(component, arguments, where)
    if known is not None:
        _check_arguments(arguments, known, "optimizer", where)
        # torch/optim/optimizer.py: fused=True runs the fused kernel; foreach=False with fused unset, the for-loop.
        if arguments.get("fused") is True:
            settings["optimizer_impl"] = "fused"
        elif arguments.get("foreach") is not None:
            settings["optimizer_impl"] = "foreach" if as_bool(arguments["foreach"], "optimizer.foreach", where) else "for-loop"
    return settings


def _check_arguments(arguments: Mapping[str, object], known: set[str] | frozenset[str], field: str, where: Where) -> None:
    for key in arguments:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, f"{field}.{key}", f"is not an argument of {field}._component_{hint}")
