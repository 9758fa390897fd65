"""DeepSpeed JSON config <-> zeroplan training settings.

`settings_from_deepspeed` maps a parsed DeepSpeed config to a partial `TrainingSpec` mapping;
`write_deepspeed_config` is its inverse. Names, aliases, defaults and limits follow DeepSpeed 0.19.8:
deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig), zero/offload_config.py, runtime/precision_config.py,
runtime/config.py (batch sizes, optimizer names).

Unknown keys: DeepSpeed's pydantic sections (zero_optimization, offload_*, fp16, bf16) forbid extra keys
(config_utils.py, DeepSpeedConfigModel: extra="forbid"), so inside them we reject any key DeepSpeed does
not know, with a did-you-mean hint, and ignore known keys that do not change memory. At the top level
DeepSpeed ignores keys it does not read: a misspelt `train_micro_batch_size` runs with micro-batch 1, so
zeroplan refuses every top-level key DeepSpeed does not read (TOP_LEVEL_KEYS), naming the nearest one.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from zeroplan.importers.deepspeed_mesh import batch_ranks, mesh_from_deepspeed, mesh_section
from zeroplan.importers.files import check_nesting, invalid_json, read_text
from zeroplan.importers.hf_config import is_hf_config
from zeroplan.importers.values import (
    check_nvme_path,
    fail,
    as_bool,
    as_int,
    as_section,
    check_keys,
    is_auto,
    merge_pin_memory,
    pick,
    read_offload,
    Where,
)
from zeroplan.errors import SpecError
from zeroplan.spec.limits import MAX_GPUS, MAX_GRAD_ACCUM, MAX_MICRO_BATCH
from zeroplan.spec.training import Offload, Optimizer, Precision, TrainingSpec
from zeroplan.spec.validation import shown

ENGINE = "DeepSpeed"

# DeepSpeedKnobs field -> (DeepSpeed names: field name first, then alias; minimum). DeepSpeed's own
# limits: reduce_bucket_size gt=0, the others ge=0 (zero/config.py).
_INT_KNOBS: dict[str, tuple[tuple[str, ...], int]] = {
    "reduce_bucket_size": (("reduce_bucket_size",), 1),
    "allgather_bucket_size": (("allgather_bucket_size",), 0),
    "stage3_prefetch_bucket_size": (("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 0),
    "stage3_max_live_parameters": (("stage3_max_live_parameters", "max_live_parameters"), 0),
    "stage3_max_reuse_distance": (("stage3_max_reuse_distance", "max_reuse_distance"), 0),
    "stage3_param_persistence_threshold": (("stage3_param_persistence_threshold", "param_persistence_threshold"), 0),
    "sub_group_size": (("sub_group_size",), 0),
}
# The Hugging Face Trainer fills these "auto" values from the model's hidden size h (transformers
# integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize): the stage3_ ones at stage 3 only.
_TRAINER_FILLED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
_BOOL_KNOBS = ("overlap_comm", "contiguous_gradients")

# Every other key DeepSpeedZeroConfig accepts (field names and aliases), which we read past: they change
# speed or checkpointing, not the memory zeroplan models. The last group was accepted by older releases
# (MiCS, ZeRO++ LoCo), kept so that older configs still read.
_ZERO_OTHER_KEYS = frozenset({
    "stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "reduce_scatter", "use_multi_rank_bucket_allreduce", "allgather_partitions", "compute_grad_norm",
    "load_from_fp32_weights", "elastic_checkpoint", "zenflow",
    "model_persistence_threshold", "stage3_model_persistence_threshold",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    "mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param",
})
ZERO_KEYS = _ZERO_OTHER_KEYS | {name for names, _ in _INT_KNOBS.values() for name in names} | set(_BOOL_KNOBS)

# precision_config.py, DeepSpeedFP16Config / DeepSpeedBF16Config.
FP16_KEYS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                       "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"})
BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                       "bf16_optimizer_states"})

# optimizer.type, lower-cased (DeepSpeed lower-cases its own names: config.py, DEEPSPEED_OPTIMIZERS; other
# names are looked up in torch.optim by engine.py _configure_basic_optimizer, e.g. "SGD").
_OPTIMIZERS = {"adam": Optimizer.ADAM, "adamw": Optimizer.ADAMW, "sgd": Optimizer.SGD}

# Every top-level key DeepSpeed 0.19.8 reads: those `DeepSpeedConfig(config)` looks up (runtime/config.py,
# `_initialize_params` and the get_*_config functions it calls, recorded by running it on a dict that logs
# each lookup), "bfloat16" (precision_config.py, the old name of bf16), "allgather_size" (zero/config.py,
# read_zero_config_deprecated), and "sequence_parallel_size" / "data_parallel_size" (deepspeed/__init__.py
# `initialize`, runtime/config.py: Ulysses).
TOP_LEVEL_KEYS = frozenset({
    "activation_checkpointing", "aio", "allgather_size", "amp", "autotuning", "bf16", "bfloat16", "checkpoint",
    "comet", "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_parallel_size", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity",
    "expert_parallel", "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
    "gradient_clipping", "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline", "prescale_gradients",
    "progressive_layer_drop", "quantize_training", "scheduler", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "sparse_attention", "sparse_gradients", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
})


def load_json(path: Path) -> dict[str, object]:
    """The config as DeepSpeed reads it (runtime/config.py, DeepSpeedConfig: `hjson.load` with
    `object_pairs_hook=dict_raise_error_on_duplicate_keys`): JSON, or hjson (comments, trailing
    commas) where the hjson package is installed; duplicate keys refused."""
    text = read_text(path, "DeepSpeed config")
    check_nesting(text, str(path))
    if not text.strip():
        raise SpecError(f"{path}: is empty; a DeepSpeed config is a JSON object")
    hook = partial(_no_duplicate_keys, path)
    try:
        config = json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as error:
        config = _read_hjson(text, hook)
        if config is None:
            hint = "" if _hjson() is not None else (
                " (DeepSpeed reads its config with hjson, which allows comments and trailing commas: "
                "pip install hjson, or zeroplan[deepspeed], to read it the same way)")
            raise SpecError(invalid_json(str(path), error) + hint) from None
    except ValueError as error:  # an integer of more than 4,300 digits (sys.get_int_max_str_digits)
        raise SpecError(invalid_json(str(path), error)) from None
    if not isinstance(config, dict):
        raise SpecError(f"{path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}")
    if not config:
        raise SpecError(f"{path}: is an empty JSON object: no DeepSpeed settings to read")
    if is_hf_config(config):
        raise SpecError(f"{path}: is a model config (it has model_type), not a DeepSpeed config; give it as MODEL")
    return config


def _no_duplicate_keys(path: Path, pairs: list[tuple[str, object]]) -> dict[str, object]:
    config = dict(pairs)
    if len(config) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _value in pairs if key in seen or seen.add(key))
        raise SpecError(f"{path}: duplicate key {duplicate!r}; DeepSpeed refuses duplicate keys")
    return config


def _hjson():
    try:
        import hjson
    except ImportError:
        return None
    return hjson


def _read_hjson(text: str, hook) -> dict[str, object] | None:
    """The hjson reading of a document that is not JSON, or None where hjson is missing, fails,
    or reads something other than an object (it reads a lone word as a string)."""
    hjson = _hjson()
    if hjson is None:
        return None
    try:
        config = hjson.loads(text, object_pairs_hook=hook)
    except (ValueError, OverflowError, RecursionError):  # HjsonDecodeError is a ValueError; 1e400 overflows
        return None
    return config if isinstance(config, dict) else None


def settings_from_deepspeed(config: Mapping[str, object], where: Where, gpus: int | None = None,
                            hidden_size: int | None = None) -> dict[str, object]:
    """Partial TrainingSpec mapping for one DeepSpeed config (see the module docstring).

    `hidden_size` is the model's, for the "auto" values the Hugging Face Trainer fills from it;
    None where the model has none (a parameter count), which makes such an "auto" an error.
    """
    _check_top_level(config, where)
    settings: dict[str, object] = {"engine": "deepspeed"}
    settings.update(_zero_settings(config, where, hidden_size))
    precision = _precision(config, where)
    if precision is not None:
        settings["precision"] = precision
    optimizer = _optimizer(config, where)
    if optimizer is not None:
        settings["optimizer"] = optimizer
    else:
        # engine.py `_configure_optimizer`: without an optimizer section the client optimizer passed to
        # deepspeed.initialize steps (the Trainer's own torch AdamW: integrations/deepspeed.py
        # `deepspeed_optim_sched` calls `trainer.create_optimizer()`).
        settings["deepspeed"] = {**settings.get("deepspeed", {}), "client_optimizer": True}
    mesh = mesh_from_deepspeed(config, where)  # AutoTP and Ulysses (importers/deepspeed_mesh.py)
    if mesh:
        settings["mesh"] = mesh
    settings.update(_batch(config, where, gpus, mesh.get("cp", 1)))
    return settings


def is_deepspeed_config(config: Mapping[str, object]) -> bool:
    """Whether a JSON object reads as a DeepSpeed config: one of the keys that say how DeepSpeed trains."""
    return any(key in config for key in ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps", "fp16", "bf16", "optimizer", "scheduler"))


def _check_top_level(config: Mapping[str, object], where: Where) -> None:
    for key in config:
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(str(key), sorted(TOP_LEVEL_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, key if len(str(key)) <= 80 else shown(key), f"is not a DeepSpeed option{hint}; DeepSpeed "
                       "ignores a key it does not read, so the run would go without it: correct or remove it")
    for key in ("torch_autocast", "amp"):
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            raise fail(where, f"{key}.enabled", "is true: zeroplan does not model this precision mode; use fp16 or bf16")


def _zero_settings(config: Mapping[str, object], where: Where, hidden_size: int | None) -> dict[str, object]:
    zero = config.get("zero_optimization")
    if zero is None:
        return {"zero_stage": 0}  # DeepSpeedZeroConfig.stage defaults to 0
    if isinstance(zero, bool):
        # Deprecated form, read_zero_config_deprecated (zero/config.py): true = stage 1 with the
        # top-level "allgather_size" as bucket.
        if not zero:
            return {"zero_stage": 0}
        knobs = {}
        if "allgather_size" in config:
            knobs["allgather_bucket_size"] = as_int(config["allgather_size"], "allgather_size", where)
        return {"zero_stage": 1, **({"deepspeed": knobs} if knobs else {})}
    zero = as_section(zero, "zero_optimization", where)
    check_keys(zero, ZERO_KEYS, "zero_optimization", where, ENGINE)

    stage = 0
    if is_auto(zero.get("stage")):
        # accelerate's DeepSpeedPlugin (the Trainer's) fills it with its zero_stage (2, or $ACCELERATE_DEEPSPEED_ZERO_STAGE:
        # utils/dataclasses.py `fill_match`); DeepSpeed alone drops it and runs stage 0 (config_utils.py)
        raise fail(where, "zero_optimization.stage", "is \"auto\", which the Hugging Face Trainer (accelerate) runs as "
                   "stage 2 and DeepSpeed alone as stage 0: write the stage, 0-3")
    if "stage" in zero:
        raw = zero["stage"]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw not in (0, 1, 2, 3):
            raise fail(where, "zero_optimization.stage", f"must be 0, 1, 2 or 3, got {raw!r}")
        stage = int(raw)
    zero = {**zero, **_trainer_filled(zero, stage, hidden_size, where)}

    knobs: dict[str, object] = {}
    for knob, (names, minimum) in _INT_KNOBS.items():
        found = pick(zero, names, "zero_optimization", where)
        if found is not None:
            name, value = found
            knobs[knob] = as_int(value, f"zero_optimization.{name}", where, minimum)
    for knob in _BOOL_KNOBS:
        if knob in zero and not is_auto(zero[knob]):
            knobs[knob] = as_bool(zero[knob], f"zero_optimization.{knob}", where)

    opt_device, opt_pin, _ = read_offload(zero.get("offload_optimizer"), "zero_optimization.offload_optimizer",
                                          where, ENGINE, param=False)
    par_device, par_pin, par_knobs = read_offload(zero.get("offload_param"), "zero_optimization.offload_param",
                                                  where, ENGINE, param=True)
    # Deprecated booleans (zero/config.py, json_schema_extra new_param_fn): cpu_offload -> offload_optimizer
    # {device: cpu}, cpu_offload_param -> offload_param {device: cpu}; cpu_offload_use_pin_memory sets
    # nothing (set_new_param=False). DeepSpeed refuses a deprecated key next to its replacement.
    for old, new, current in (("cpu_offload", "offload_optimizer", opt_device),
                              ("cpu_offload_param", "offload_param", par_device)):
        if old in zero and not is_auto(zero[old]) and as_bool(zero[old], f"zero_optimization.{old}", where):
            if current is not None:
                raise fail(where, f"zero_optimization.{old}", f"is deprecated and cannot be given with {new}; keep {new}")
            if new == "offload_optimizer":
                opt_device = "cpu"
            else:
                par_device = "cpu"
    if stage == 3:  # only stage3.py swaps to NVMe; stages 1-2 keep an "nvme" optimizer in CPU memory
        check_nvme_path(zero.get("offload_optimizer"), "zero_optimization.offload_optimizer", where)
        check_nvme_path(zero.get("offload_param"), "zero_optimization.offload_param", where)
    knobs.update(par_knobs)
    pin = merge_pin_memory([("zero_optimization.offload_optimizer", opt_device, opt_pin),
                            ("zero_optimization.offload_param", par_device, par_pin)], where)
    if pin is not None:
        knobs["offload_pin_memory"] = pin

    settings: dict[str, object] = {"zero_stage": stage}
    # Offload is read only where DeepSpeed reads it: the stage 1-2 optimizer (stage_1_and_2.py,
    # offload_optimizer_config) and stage 3 (stage3.py, offload_optimizer_config and offload_param_config).
    # At stage 0 no ZeRO optimizer is built and offload_optimizer is unused; below stage 3 offload_param
    # is unused (engine.py _configure_zero_optimizer). Such settings are dropped, not reported.
    if opt_device is not None and stage >= 1:
        # Stages 1-2 offload whenever device != "none" and never swap to NVMe (stage_1_and_2.py __init__:
        # `self.cpu_offload = True`; only stage3.py builds an optimizer swapper): "nvme" there means CPU memory.
        settings["offload_optimizer"] = "cpu" if opt_device == "nvme" and stage < 3 else opt_device
    if par_device is not None and stage == 3:
        settings["offload_params"] = par_device
    if knobs:
        settings["deepspeed"] = knobs
    return settings


def _trainer_filled(zero: Mapping[str, object], stage: int, hidden_size: int | None, where: Where) -> dict[str, int]:
    """The values the Hugging Face Trainer writes over "auto" (see _TRAINER_FILLED)."""
    auto = [key for key in _TRAINER_FILLED if is_auto(zero.get(key))]
    if not auto:
        return {}
    if hidden_size is None:
        raise fail(where, f"zero_optimization.{auto[0]}", "is \"auto\", which the Hugging Face Trainer fills from "
                   "the model's hidden size, unknown here (a --params model has none): write a number")
    filled = trainer_filled_buckets(hidden_size, stage)
    return {key: value for key, value in filled.items() if key in auto}


def trainer_filled_buckets(hidden_size: int, stage: int) -> dict[str, int]:
    """What the Hugging Face Trainer writes over an "auto" bucket of a model with this hidden size
    (integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize)."""
    filled = {"reduce_bucket_size": hidden_size * hidden_size}
    if stage == 3:  # the Trainer's is_zero3(): an "auto" stage is not 3
        filled.update(stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
                      stage3_param_persistence_threshold=10 * hidden_size)
    return filled


def _precision(config: Mapping[str, object], where: Where) -> str | None:
    fp16 = _enabled(config, "fp16", FP16_KEYS, where)
    bf16_key = "bf16" if "bf16" in config else "bfloat16"  # "bfloat16" is the old name (precision_config.py)
    bf16 = _enabled(config, bf16_key, BF16_KEYS, where)
    if fp16 is True and bf16 is True:
        raise fail(where, f"{bf16_key}.enabled", "and fp16.enabled are both true; DeepSpeed allows one of them")
    if fp16 is True:
        if _flag(config["fp16"], "fp16_master_weights_and_grads", "fp16", where):
            raise fail(where, "fp16.fp16_master_weights_and_grads", "is true: fp16 master weights are not modelled")
        return Precision.FP16.value
    if bf16 is True:
        section = config[bf16_key]
        master = _flag(section, "bf16_master_weights_and_grads", bf16_key, where)
        states = _flag(section, "bf16_optimizer_states", bf16_key, where)
        if master and states:
            # bf16 master weights, gradients and optimizer states: no fp32 copy anywhere (stage_1_and_2.py
            # and stage3.py, bf16_master_weights_and_grads / bf16_optimizer_states).
            return Precision.PURE_BF16.value
        if master or states:
            raise fail(where, f"{bf16_key}.bf16_master_weights_and_grads",
                       "and bf16_optimizer_states must be set together to model pure bf16 (one alone is not modelled)")
        return Precision.BF16.value
    if fp16 is None or bf16 is None:  # "auto": the HF Trainer decides
        return None
    return Precision.FP32.value


def _enabled(config: Mapping[str, object], key: str, known: frozenset[str], where: Where) -> bool | None:
    """False when the section is absent or disabled, None when "auto"."""
    if key not in config:
        return False
    section = as_section(config[key], key, where)
    check_keys(section, known, key, where, ENGINE)
    value = section.get("enabled", False)
    if is_auto(value):
        return None
    return as_bool(value, f"{key}.enabled", where)


def _flag(section: object, key: str, field: str, where: Where) -> bool:
    value = section.get(key, False) if isinstance(section, Mapping) else False
    return False if is_auto(value) else as_bool(value, f"{field}.{key}", where)


def _optimizer(config: Mapping[str, object], where: Where) -> str | None:
    if "optimizer" not in config or config["optimizer"] is None:
        return None  # a client optimizer is passed to deepspeed.initialize
    section = as_section(config["optimizer"], "optimizer", where)
    name = section.get("type")
    if name is None or is_auto(name):
        return None
    if not isinstance(name, str) or name.lower() not in _OPTIMIZERS:
        raise fail(where, "optimizer.type", f"{name!r} is not modelled by zeroplan (supported: Adam, AdamW, SGD)")
    # SGD keeps a momentum buffer only when momentum > 0; zeroplan's "sgd" counts one buffer, so a
    # momentum-free SGD is over-estimated by one state per parameter.
    return _OPTIMIZERS[name.lower()].value


def _batch(config: Mapping[str, object], where: Where, gpus: int | None, sequence_parallel: int = 1) -> dict[str, int]:
    """Micro batch and accumulation as DeepSpeed derives them (config.py, _set_batch_related_parameters,
    _batch_assertion): train_batch_size = micro * accumulation * world size."""
    if sequence_parallel > 1:  # Ulysses: the world DeepSpeed counts is gpus / sequence_parallel_size (deepspeed_mesh.py)
        counted = _batch(config, where, None if gpus is None else gpus // sequence_parallel)
        return counted | ({"gpus": counted["gpus"] * sequence_parallel} if "gpus" in counted else {})

    def get(key: str, maximum: int) -> int | None:
        value = config.get(key)
        return None if value is None or is_auto(value) else as_int(value, key, where, 1, maximum)

    # the spec's bounds (spec/limits.py), checked here to name the key
    total = get("train_batch_size", MAX_MICRO_BATCH * MAX_GRAD_ACCUM * MAX_GPUS)
    micro = get("train_micro_batch_size_per_gpu", MAX_MICRO_BATCH)
    accum = get("gradient_accumulation_steps", MAX_GRAD_ACCUM)
    out: dict[str, int] = {}
    if total is None:
        if micro is not None:
            out["micro_batch"] = micro
        if accum is not None:
            out["grad_accum"] = accum
        elif micro is not None and not is_auto(config.get("gradient_accumulation_steps")):
            out["grad_accum"] = 1  # DeepSpeed's default when only the micro batch is given
        return out
    if micro is not None and accum is not None:
        if gpus is None:
            if total % (micro * accum):
                raise fail(where, "train_batch_size", f"{total} is not train_micro_batch_size_per_gpu {micro} x "
                           f"gradient_accumulation_steps {accum} x a whole number of GPUs")
            gpus = total // (micro * accum)
            out["gpus"] = gpus  # DeepSpeed requires this world size: the three values fix it
    elif gpus is None:
        raise fail(where, "train_batch_size", "is given without both train_micro_batch_size_per_gpu and "
                   "gradient_accumulation_steps: the split depends on the GPU count; give the GPU count or both values")
    elif micro is not None:
        accum = total // micro // gpus
    elif accum is not None:
        micro = total // gpus // accum
    else:
        micro, accum = total // gpus, 1
    if micro < 1 or accum < 1 or total != micro * accum * gpus:
        raise fail(where, "train_batch_size", f"{total} != train_micro_batch_size_per_gpu {micro} x "
                   f"gradient_accumulation_steps {accum} x {gpus} GPUs")
    out.update(micro_batch=micro, grad_accum=accum)
    return out


NVME_PATH_PLACEHOLDER = "/local_nvme"
"""The nvme_path a written config carries: a placeholder (memory does not depend on it) the user replaces."""


def write_deepspeed_config(training: TrainingSpec) -> dict[str, object]:
    """A complete DeepSpeed config dict that runs the plan, and reads back to the same settings.

    Only what zeroplan models is written; learning rate and other hyper-parameters are left to the user
    (DeepSpeed then uses the optimizer's defaults).
    """
    knobs = training.deepspeed
    stage = training.zero_stage
    if training.precision == Precision.PURE_BF16 and stage == 0:
        # precision_config / config.py _do_error_check: bf16_master_weights_and_grads needs ZeRO stage 1-3.
        raise SpecError("precision pure-bf16 needs zero_stage 1, 2 or 3 in DeepSpeed (bf16_master_weights_and_grads)")
    if training.offload_optimizer == Offload.NVME and stage < 3:
        # stage_1_and_2.py offloads any device != "none" to CPU memory; NVMe swapping is stage 3 only.
        raise SpecError(f"DeepSpeed offloads optimizer states to nvme only at zero_stage 3; at stage {stage} "
                        "they would stay in CPU memory: use offload_optimizer cpu")
    if training.optimizer not in _OPTIMIZERS.values():
        raise SpecError(f"optimizer {training.optimizer.value} has no DeepSpeed optimizer.type; use adam, adamw or sgd")
    zero: dict[str, object] = {
        "stage": stage,
        "reduce_bucket_size": knobs.reduce_bucket_size,
        "allgather_bucket_size": knobs.allgather_bucket_size,
        "contiguous_gradients": knobs.contiguous_gradients,
        "stage3_prefetch_bucket_size": knobs.stage3_prefetch_bucket_size,
        "stage3_max_live_parameters": knobs.stage3_max_live_parameters,
        "stage3_max_reuse_distance": knobs.stage3_max_reuse_distance,
        "stage3_param_persistence_threshold": knobs.stage3_param_persistence_threshold,
        "sub_group_size": knobs.sub_group_size,
        "offload_optimizer": _offload_section(training.offload_optimizer, knobs.offload_pin_memory),
        "offload_param": {
            **_offload_section(training.offload_params, knobs.offload_pin_memory),
            "buffer_count": knobs.offload_buffer_count,
            "buffer_size": knobs.offload_buffer_size,
            "max_in_cpu": knobs.offload_max_in_cpu,
        },
    }
    if knobs.overlap_comm is not None:  # None: DeepSpeed's stage-dependent default (overlap_comm_valid)
        zero["overlap_comm"] = knobs.overlap_comm
    bf16: dict[str, object] = {"enabled": training.precision in (Precision.BF16, Precision.PURE_BF16)}
    if training.precision == Precision.PURE_BF16:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    optimizer: dict[str, object] = {"type": {Optimizer.ADAM: "Adam", Optimizer.ADAMW: "AdamW",
                                             Optimizer.SGD: "SGD"}[training.optimizer]}
    if training.optimizer == Optimizer.SGD:
        # torch.optim.SGD keeps a momentum buffer only with momentum > 0, which zeroplan's "sgd" counts.
        optimizer["params"] = {"lr": 0.01, "momentum": 0.9}
    return {
        "train_batch_size": training.micro_batch * training.grad_accum * training.gpus // batch_ranks(training),
        "train_micro_batch_size_per_gpu": training.micro_batch,
        "gradient_accumulation_steps": training.grad_accum,
        "optimizer": optimizer,
        "fp16": {"enabled": training.precision == Precision.FP16},
        "bf16": bf16,
        "zero_optimization": zero,
        **mesh_section(training),  # AutoTP and Ulysses (importers/deepspeed_mesh.py)
    }


def _offload_section(device: Offload, pin_memory: bool) -> dict[str, object]:
    section: dict[str, object] = {"device": device.value, "pin_memory": pin_memory}
    if device == Offload.NVME:
        section["nvme_path"] = NVME_PATH_PLACEHOLDER  # DeepSpeed needs a real NVMe folder here
    return section
