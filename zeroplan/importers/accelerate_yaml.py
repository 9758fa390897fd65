"""accelerate config YAML (what `accelerate config` writes) -> zeroplan training settings (recipe hf-trainer).

Keys and defaults follow accelerate 1.15.0: commands/config/config_args.py (ClusterConfig; its
`from_yaml_file` refuses unknown top-level keys, and so do we), commands/launch.py
(`_validate_launch_command` copies each key of fsdp_config and deepspeed_config onto the launch
arguments, where a key nothing reads is ignored: we warn), utils/dataclasses.py (FullyShardedDataParallelPlugin,
DeepSpeedPlugin). A DeepSpeed section becomes the DeepSpeed config DeepSpeedPlugin builds from it, read
by the DeepSpeed reader, with "auto" batch sizes filled as the Trainer fills them.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from pathlib import Path

from zeroplan.errors import ZeroplanWarning
from zeroplan.importers.values import Where, as_bool, as_int, as_section, fail

RECIPE = "hf-trainer"

# config_args.py BaseConfig + ClusterConfig fields; "fp16" and "dynamo_backend" are older spellings that
# `process_config` converts.
TOP_LEVEL_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes", "machine_rank",
    "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config",
    "fp16", "dynamo_backend",
})
# launch.py's --fsdp_* options (fsdp_config keys, "fsdp_" prefixed by launch when missing).
FSDP_KEYS = frozenset({
    "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
    "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch", "fsdp_state_dict_type",
    "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
    "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_float8_all_gather",
})
# commands/config/cluster.py: the deepspeed_config keys `accelerate config` writes.
DEEPSPEED_KEYS = frozenset({
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names",
})
# DeepSpeedPlugin._deepspeed_config_checks: with a deepspeed_config_file these come from the file, and
# accelerate refuses them in the accelerate config.
_FILE_OWNS = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
              "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model")
# distributed_type -> engine (utils/dataclasses.py DistributedType); the rest (XLA, MEGATRON_LM, NPUs...) is refused.
_ENGINES = {"NO": "torch", "MULTI_GPU": "torch", "MULTI_CPU": "torch", "FSDP": "fsdp2", "DEEPSPEED": "deepspeed"}  # FSDP: fsdp1 or fsdp2, by fsdp_version
_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}


def is_accelerate(document: Mapping[str, object]) -> bool:
    """`accelerate config` always writes distributed_type (config_args.py: "A `distributed_type` must be specified")."""
    return "distributed_type" in document or "compute_environment" in document


def check_accelerate(document: Mapping[str, object], where: Where) -> tuple[str, ...]:
    """Refuse unknown top-level keys; warn about section keys accelerate never reads; the notes."""
    for key in document:
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(str(key), sorted(TOP_LEVEL_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, str(key), f"is not an accelerate config key{hint} (accelerate refuses unknown keys)")
    for section, known in (("fsdp_config", FSDP_KEYS), ("deepspeed_config", DEEPSPEED_KEYS)):
        for key in _section(document, section, where):
            name = _fsdp_name(key) if section == "fsdp_config" else key
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                warnings.warn(f"{where(f'{section}.{key}')}: {section}.{key} is not read by accelerate{hint}: ignored",
                              ZeroplanWarning)
    notes = []
    if document.get("mixed_precision") == "fp8":
        notes.append("mixed_precision fp8 is not modelled: estimated as bf16 (accelerate keeps bf16 autocast around fp8)")
    dynamo = _section(document, "dynamo_config", where).get("dynamo_backend", document.get("dynamo_backend", "NO"))
    if isinstance(dynamo, str) and dynamo.upper() != "NO":
        notes.append(f"dynamo_backend {dynamo}: torch.compile is not modelled: estimated as the eager program")
    return tuple(notes)


def settings_from_accelerate(document: Mapping[str, object], where: Where, folder: Path, gpus: int | None,
                             hidden_size: int | None) -> dict[str, object]:
    """Partial TrainingSpec mapping for one accelerate config (checked by `check_accelerate`). `folder`
    holds the config, where a relative deepspeed_config_file is also looked for."""
    kind = document.get("distributed_type")
    if kind not in _ENGINES:
        known = ", ".join(_ENGINES)
        raise fail(where, "distributed_type", f"{kind!r} is not modelled (supported: {known})")
    settings: dict[str, object] = {"recipe": RECIPE, "engine": _ENGINES[kind]}
    if kind == "MULTI_CPU" or as_bool(document.get("use_cpu", False), "use_cpu", where):
        settings["device"] = "cpu"
    settings.update(_world(document, where, kind))
    precision = document.get("mixed_precision")
    if precision is None:  # process_config: the older `fp16: true`; launch.py: none given is "no"
        precision = "fp16" if document.get("fp16") is True else "no"
    if precision not in _PRECISIONS:
        raise fail(where, "mixed_precision", f"must be no, fp16, bf16 or fp8, got {precision!r}")
    settings["precision"] = _PRECISIONS[precision]
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        settings["zero_stage"] = 0
    elif kind == "FSDP":
        settings.update(_fsdp(_section(document, "fsdp_config", where), where))
    else:
        # DeepSpeedPlugin.set_mixed_precision fills fp16/bf16 only where the DeepSpeed config leaves them out or "auto".
        settings.update(_deepspeed(_section(document, "deepspeed_config", where), where, folder, gpus, hidden_size))
    return settings


def _section(document: Mapping[str, object], key: str, where: Where) -> Mapping[str, object]:
    value = document.get(key)
    return {} if value is None else as_section(value, key, where)


def _fsdp_name(key: str) -> str:
    return key if key.startswith("fsdp") else f"fsdp_{key}"  # launch.py: fsdp_config.x -> args.fsdp_x


def _world(document: Mapping[str, object], where: Where, kind: str) -> dict[str, int]:
    """num_processes is the total over all machines (launch.py); NO is one process."""
    if kind == "NO":
        return {"gpus": 1}
    processes = document.get("num_processes")
    if processes is None or processes == -1:  # -1: left to the launcher (SLURM): --gpus decides
        return {}
    processes = as_int(processes, "num_processes", where, 1)
    machines = as_int(document.get("num_machines", 1), "num_machines", where, 1)
    if processes % machines:
        raise fail(where, "num_processes", f"{processes} is not divisible by num_machines {machines}")
    return {"gpus": processes, "gpus_per_node": processes // machines}


def _fsdp(fsdp: Mapping[str, object], where: Where) -> dict[str, object]:
    options = {_fsdp_name(key): value for key, value in fsdp.items()}
    version = options.get("fsdp_version", 1)  # utils/launch.py: FSDP_VERSION defaults to "1"
    if version not in (1, 2, "1", "2"):
        raise fail(where, "fsdp_config.fsdp_version", f"must be 1 or 2, got {version!r}")
    settings = _fsdp1(options, where) if int(version) == 1 else _fsdp2(options, where)
    if _flag(options, "fsdp_offload_params", False, where):
        settings.update(offload_optimizer="cpu", offload_params="cpu")  # CPUOffload / CPUOffloadPolicy: params, grads, step
    if _flag(options, "fsdp_activation_checkpointing", False, where):
        settings["checkpointing"] = "full"
    return settings


def _flag(options: Mapping[str, object], key: str, default: bool, where: Where) -> bool:
    """A yes/no key as launch.py passes it on: a YAML boolean, or "true"/"false" (str_to_bool)."""
    value = options.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return as_bool(value, f"fsdp_config.{key}", where)


# FSDP2's keys that FullyShardedDataParallelPlugin refuses or drops under fsdp_version 1 (utils/dataclasses.py
# __post_init__), and FSDP1's under fsdp_version 2: what accelerate does with each, and so zeroplan.
_FSDP2_ONLY = {
    "fsdp_activation_checkpointing_offload": "requires fsdp_version 2 (accelerate refuses it under FSDP1)",
    "fsdp_float8_all_gather": "is FSDP2's float8 all-gather; under FSDP1 accelerate never reads it",
}
_FSDP1_ONLY = {  # key -> (refused, what accelerate does)
    "fsdp_sharding_strategy": (False, "is FSDP1's; under fsdp_version 2 accelerate ignores it (deprecated for "
                               "fsdp_reshard_after_forward): ignored"),
    "fsdp_backward_prefetch": (False, "is FSDP1's; accelerate sets it to None under fsdp_version 2: ignored"),
    "fsdp_use_orig_params": (False, "is FSDP1's; FSDP2 always keeps the original parameters: ignored"),
    "fsdp_sync_module_states": (False, "is FSDP1's; accelerate sets it to None under fsdp_version 2: ignored"),
    "fsdp_forward_prefetch": (True, "is FSDP1's; accelerate refuses it under fsdp_version 2 (\"not yet implemented in "
                              "FSDP2\"): set fsdp_version: 1 or remove it"),
}
# accelerate's FSDP_SHARDING_STRATEGY names (utils/constants.py), 1-based as the plugin numbers them
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_STRATEGY_SETTINGS = {"FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
                      "HYBRID_SHARD": (3, True), "HYBRID_SHARD_ZERO2": (2, True)}


def _fsdp2(options: Mapping[str, object], where: Where) -> dict[str, object]:
    for key, (refused, what) in _FSDP1_ONLY.items():
        if key in options and (refused and _flag(options, key, False, where)):
            raise fail(where, f"fsdp_config.{key}", what)
        if key in options and not refused:
            warnings.warn(f"{where(f'fsdp_config.{key}')}: fsdp_config.{key} {what}", ZeroplanWarning)
    reshard = options.get("fsdp_reshard_after_forward", True)  # FullyShardedDataParallelPlugin: True for FSDP2
    if isinstance(reshard, str) and reshard.lower() in ("true", "false"):
        reshard = reshard.lower() == "true"  # str_to_bool, as the plugin reads the environment variable
    if not isinstance(reshard, bool):  # the plugin: "not supported with FSDP2, please set to a `bool`"
        raise fail(where, "fsdp_config.fsdp_reshard_after_forward", f"must be true or false with FSDP2, got {reshard!r}")
    return {"zero_stage": 3 if reshard else 2}


def _strategy(value: object, key: str, where: Where) -> str:
    """A sharding strategy as the plugin reads it: a name of FSDP_SHARDING_STRATEGY or its 1-based number."""
    text = str(value).upper()
    if text.isdigit() and 1 <= int(text) <= len(_STRATEGIES):
        text = _STRATEGIES[int(text) - 1]
    if text not in _STRATEGIES:
        raise fail(where, f"fsdp_config.{key}", f"must be one of {', '.join(_STRATEGIES)} under FSDP1, got {value!r}")
    return text


def _fsdp1(options: Mapping[str, object], where: Where) -> dict[str, object]:
    """accelerate's FSDP1 plugin as `accelerate launch` builds it from the file (commands/launch.py defaults for the
    keys left out: use_orig_params, sync_module_states and cpu_ram_efficient_loading true, FULL_SHARD, no prefetch)."""
    for key, what in _FSDP2_ONLY.items():
        if key in options:
            raise fail(where, f"fsdp_config.{key}", what)
    strategy = _strategy(options.get("fsdp_sharding_strategy", "FULL_SHARD"), "fsdp_sharding_strategy", where)
    if "fsdp_reshard_after_forward" in options:
        written = options["fsdp_reshard_after_forward"]
        if isinstance(written, bool):  # the plugin: "not supported with FSDP1, please set to a `str`"
            raise fail(where, "fsdp_config.fsdp_reshard_after_forward", f"is a sharding strategy name under FSDP1 "
                       f"({', '.join(_STRATEGIES)}), got {written!r}; true/false is FSDP2's (fsdp_version: 2)")
        asked = _strategy(written, "fsdp_reshard_after_forward", where)
        if asked != strategy and "fsdp_sharding_strategy" not in options:
            # launch.py passes FSDP_SHARDING_STRATEGY=FULL_SHARD (its --fsdp_sharding_strategy default), which the
            # plugin reads before FSDP_RESHARD_AFTER_FORWARD: the run is FULL_SHARD
            warnings.warn(f"{where('fsdp_config.fsdp_reshard_after_forward')}: fsdp_config.fsdp_reshard_after_forward "
                          f"{asked} is not what accelerate 1.15 runs: launch passes its fsdp_sharding_strategy default, "
                          f"FULL_SHARD, which the FSDP1 plugin reads first; estimated as FULL_SHARD (add "
                          f"fsdp_sharding_strategy: {asked} to run {asked})", ZeroplanWarning)
    policy = str(options.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()  # the plugin's default when launch sets none
    if policy != "TRANSFORMER_BASED_WRAP":
        raise fail(where, "fsdp_config.fsdp_auto_wrap_policy", f"is {policy}: zeroplan models FSDP1 with "
                   "TRANSFORMER_BASED_WRAP (one FlatParameter per decoder layer, the rest in the root's); "
                   f"{'NO_WRAP makes the whole model one unit' if policy == 'NO_WRAP' else 'size-based units are not modelled'}")
    stage, hybrid = _STRATEGY_SETTINGS[strategy]
    prefetch = options.get("fsdp_backward_prefetch")
    prefetch = "NO_PREFETCH" if prefetch is None else str(prefetch).upper()
    prefetches = {"BACKWARD_PRE": "backward-pre", "BACKWARD_POST": "backward-post", "NO_PREFETCH": "none"}
    if prefetch not in prefetches:
        raise fail(where, "fsdp_config.fsdp_backward_prefetch", f"must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH, "
                   f"got {options['fsdp_backward_prefetch']!r}")
    efficient = _flag(options, "fsdp_cpu_ram_efficient_loading", True, where)
    sync = _flag(options, "fsdp_sync_module_states", True, where)
    if efficient and not sync:  # utils/launch.py prepare_multi_gpu_env refuses it
        raise fail(where, "fsdp_config.fsdp_sync_module_states", "must be true with fsdp_cpu_ram_efficient_loading "
                   "(accelerate launch refuses the pair)")
    return {"engine": "fsdp1", "zero_stage": stage, "fsdp1": {
        "hybrid": hybrid, "use_orig_params": _flag(options, "fsdp_use_orig_params", True, where),
        "backward_prefetch": prefetches[prefetch], "forward_prefetch": _flag(options, "fsdp_forward_prefetch", False, where),
        "sync_module_states": sync, "cpu_ram_efficient_loading": efficient}}


def _deepspeed(section: Mapping[str, object], where: Where, folder: Path, gpus: int | None,
               hidden_size: int | None) -> dict[str, object]:
    from zeroplan.importers.deepspeed_json import load_json, settings_from_deepspeed

    file = section.get("deepspeed_config_file")
    if file not in (None, "none"):
        clash = [key for key in _FILE_OWNS if key in section]
        if clash:
            raise fail(where, f"deepspeed_config.{clash[0]}", "cannot be given with deepspeed_config_file: accelerate "
                       "refuses it (set it in the DeepSpeed config file)")
        if not isinstance(file, str):
            raise fail(where, "deepspeed_config.deepspeed_config_file", f"must be a path, got {file!r}")
        path = Path(file)
        if not path.is_absolute() and not path.exists():  # accelerate reads it from the working folder
            path = folder / path
        config = load_json(path)
        settings = settings_from_deepspeed(config, lambda _field: str(path), gpus, hidden_size)
    else:
        # DeepSpeedPlugin.__post_init__ without a file: this config, "auto" batch sizes (the Trainer's), stage 2
        # and no offload by default.
        stage = as_int(section.get("zero_stage", 2), "deepspeed_config.zero_stage", where)
        if stage > 3:
            raise fail(where, "deepspeed_config.zero_stage", f"must be 0, 1, 2 or 3, got {stage}")
        for key in ("offload_optimizer_device", "offload_param_device"):
            if section.get(key, "none") not in ("none", "cpu", "nvme"):
                raise fail(where, f"deepspeed_config.{key}", f"must be none, cpu or nvme, got {section[key]!r}")
        for device, path in (("offload_optimizer_device", "offload_optimizer_nvme_path"),
                             ("offload_param_device", "offload_param_nvme_path")):
            # DeepSpeedPlugin passes the path on as nvme_path, "none" when not given: stage 3 swaps under it
            if stage == 3 and section.get(device) == "nvme" and section.get(path, "none") in (None, "", "none"):
                raise fail(where, f"deepspeed_config.{path}", f"is missing, and {device} nvme needs it: the folder on "
                           "the NVMe drive DeepSpeed swaps to (accelerate passes \"none\" on)")
        config: dict[str, object] = {
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": stage,
                                  "offload_optimizer": {"device": section.get("offload_optimizer_device", "none")},
                                  "offload_param": {"device": section.get("offload_param_device", "none")}},
        }
        if "gradient_accumulation_steps" in section:
            config["gradient_accumulation_steps"] = section["gradient_accumulation_steps"]
        settings = settings_from_deepspeed(config, lambda field: f"{where(field)} (deepspeed_config)", gpus, hidden_size)
        settings.pop("precision", None)  # no fp16/bf16 section here: mixed_precision decides
    if settings.get("zero_stage") == 3:
        # DeepSpeedPlugin: zero3_init_flag defaults to is_zero3(); with it the model is built inside zero.Init.
        init = as_bool(section.get("zero3_init_flag", True), "deepspeed_config.zero3_init_flag", where)
        settings["model_init"] = "zero-init" if init else "host"
    return settings
