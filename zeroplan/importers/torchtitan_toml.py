"""torchtitan job TOML -> zeroplan training settings (recipe torchtitan).

torchtitan read TOML job configs up to v0.2.2; 0.3.0 replaced them with Python config functions
(commit 9810191b, "Config System Refactor: TOML to Python Dataclass Registry (#2386)"), so a TOML
is one of two older schemas:
- v0.2.2 (torchtitan/config/job_config.py, JobConfig): `[training] local_batch_size,
  global_batch_size`, `[parallelism]`, `[compile]`, `[quantize.linear.float8]`. Its ConfigManager
  (config/manager.py, `_dict_to_dataclass`) refuses any key it does not know, and so do we.
- the 2024 schema of the published benchmarks (commit 9dec370, torchtitan/config_manager.py):
  `[training] batch_size, compile, *_parallel_degree`, `[experimental]`, `[float8]`. Its argparse
  loader merges the TOML over its defaults and never looks at other keys; we warn about them.
What the run does that zeroplan does not model (torch.compile, float8, tensor/pipeline/context
parallelism) is a note or, for the parallelisms, an error.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping

from zeroplan.errors import ZeroplanWarning
from zeroplan.importers.documents import is_torchtitan  # noqa: F401  (the recogniser, shared with catalog.py)
from zeroplan.importers.mesh_options import pipeline_micro_batch, torchtitan_mesh
from zeroplan.importers.values import Where, as_bool, as_int, as_section, fail

RECIPE = "torchtitan"

# (model.name, model.flavor) -> catalogue model. torchtitan's llama3 flavours (v0.2.2
# models/llama3/__init__.py llama3_configs; 9dec370 models/llama/__init__.py) have the layers and sizes of
# Meta's checkpoints: 8B dim 4096, 32 layers, 8 KV heads, ffn 14336 (Llama 3 and 3.1 8B alike), 70B dim
# 8192, 80 layers, ffn 28672, 405B dim 16384, 126 layers, ffn 53248; vocabulary 128256, untied output.
MODELS = {
    ("llama3", "8B"): "llama-3-8b", ("llama3", "8B_flex"): "llama-3-8b", ("llama3", "8B_varlen"): "llama-3-8b",
    ("llama3", "70B"): "llama-3-70b", ("llama3", "405B"): "llama-3.1-405b",
}

# v0.2.2 job_config.py: every section and its fields (read with ast from the v0.2.2 tag); nested
# sections are dicts of their own.
_V022_SECTIONS: dict[str, object] = {
    "job": {"config_file", "dump_folder", "description", "print_config", "save_config_file", "custom_config_module"},
    "profiling": {"enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup",
                  "enable_memory_snapshot", "save_memory_snapshot_folder"},
    "metrics": {"log_freq", "enable_tensorboard", "disable_color_printing", "save_tb_folder", "save_for_all_ranks",
                "enable_wandb"},
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"},
    "lr_scheduler": {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "dataloader"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel", "enable_sequence_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"},
    "checkpoint": {"enable", "enable_ft_dataloader_checkpoints", "folder", "interval", "initial_load_path",
                   "initial_load_model_only", "initial_load_in_hf", "initial_load_in_hf_quantized",
                   "last_save_model_only", "last_save_in_hf", "export_dtype", "async_mode", "keep_latest_k",
                   "load_step", "exclude_from_loading", "enable_first_step_checkpoint", "create_seed_checkpoint",
                   "load_only"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
                              "determinism_check", "debug"},
    "compile": {"enable", "components", "backend"},
    "quantize": {
        "linear": {"float8": {"enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
                              "recipe_name", "filter_fqns", "emulate"},
                   "mx": {"mxfp8_dim1_cast_kernel_choice", "recipe_name", "filter_fqns"}},
        "grouped_mm": {"float8": {"fqns"}, "mx": {"recipe_name", "fqns"}},
    },
    "comm": {"init_timeout_seconds", "train_timeout_seconds", "trace_buf_size", "save_traces_folder",
             "save_traces_file_prefix", "mode"},
    "memory_estimation": {"enable", "disable_fake_mode"},
    "fault_tolerance": {"enable", "process_group", "process_group_timeout_ms", "replica_id", "group_size",
                        "min_replica_size", "semi_sync_method"},
    "experimental": {"custom_import", "custom_args_module"},
    "validation": {"enable", "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps", "dataloader"},
    "debug": {"seed", "deterministic", "deterministic_warn_only", "moe_force_load_balance"},
}
_DATALOADER = {"num_workers", "persistent_workers", "pin_memory", "prefetch_factor"}

# 9dec370 config_manager.py: the keys its argparse parser defines (the rest of a TOML is never read).
_2024_SECTIONS = {
    "job": {"config_file", "description", "dump_folder", "print_args", "use_for_integration_test"},
    "profiling": {"enable_memory_snapshot", "enable_profiling", "profile_freq", "save_memory_snapshot_folder",
                  "save_traces_folder"},
    "metrics": {"disable_color_printing", "enable_tensorboard", "enable_wandb", "log_freq", "rank_0_only",
                "save_tb_folder"},
    "model": {"flavor", "name", "norm_type", "tokenizer_path"},
    "optimizer": {"early_step_in_backward", "fused", "lr", "name"},
    "training": {"batch_size", "compile", "data_parallel_replicate_degree", "data_parallel_shard_degree", "dataset",
                 "dataset_path", "deterministic", "disable_loss_parallel", "enable_cpu_offload", "gc_freq", "max_norm",
                 "mixed_precision_param", "mixed_precision_reduce", "seed", "seq_len", "steps",
                 "tensor_parallel_degree", "warmup_steps"},
    "experimental": {"context_parallel_degree", "context_parallel_rotate_method", "enable_async_tensor_parallel",
                     "enable_compiled_autograd", "pipeline_parallel_degree", "pipeline_parallel_microbatches",
                     "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_split_points"},
    "checkpoint": {"async_mode", "create_seed_checkpoint", "enable_checkpoint", "export_dtype", "folder", "interval",
                   "interval_type", "keep_latest_k", "load_step", "model_weights_only"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "float8": {"enable_float8_linear", "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
               "scaling_type_grad_output", "scaling_type_input", "scaling_type_weight"},
    "comm": {"init_timeout_seconds", "trace_buf_size", "train_timeout_seconds"},
    "memory_estimation": {"disable_fake_mode", "enabled"},
}
# Keys that only the 2024 schema has: one of them marks a TOML of that era.
_2024_MARKERS = {("training", "batch_size"), ("training", "compile"), ("training", "data_parallel_shard_degree"),
                 ("training", "tensor_parallel_degree"), ("optimizer", "fused"), ("float8", None),
                 ("checkpoint", "enable_checkpoint"), ("experimental", "pipeline_parallel_degree"),
                 ("experimental", "context_parallel_degree")}
TORCHTITAN_SECTIONS = frozenset(_V022_SECTIONS) | frozenset(_2024_SECTIONS)

_NOT_MODELLED = "not modelled yet: issue 14 (zeroplan models data parallelism only)"
_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}  # components/optimizer.py build_optimizers: optimizer_classes


def is_2024_schema(document: Mapping[str, object]) -> bool:
    return any(isinstance(document.get(section), Mapping) and (key is None or key in document[section])
               for section, key in _2024_MARKERS)


def model_from_torchtitan(document: Mapping[str, object], where: Where) -> str:
    """The catalogue model that [model] name and flavor name (torchtitan's defaults: llama3, debugmodel)."""
    model = as_section(document.get("model", {}), "model", where)
    name = model.get("name", "llama3")
    flavor = model.get("flavor", "debugmodel")
    if not isinstance(name, str) or not isinstance(flavor, str):
        raise fail(where, "model.flavor", f"and model.name must be strings, got {name!r} and {flavor!r}")
    if name == "llama":  # the 2024 name of the same model family
        name = "llama3"
    if (name, flavor) in MODELS:
        return MODELS[(name, flavor)]
    known = [f"{n} {f}" for n, f in MODELS]
    close = difflib.get_close_matches(f"{name} {flavor}", known, n=3, cutoff=0.5)
    hint = f" (close: {', '.join(close)})" if close else f" (known: {', '.join(known)})"
    raise fail(where, "model.flavor", f"{flavor!r} of model {name!r} is not in zeroplan's catalogue{hint}; give MODEL "
               "(a catalogue name or a config.json) to estimate another model")


def check_torchtitan(document: Mapping[str, object], where: Where) -> tuple[str, ...]:
    """Refuse (v0.2.2) or warn about (2024) unknown keys; the notes on what the run does that is not modelled."""
    old = is_2024_schema(document)
    _check_keys(document, _2024_SECTIONS if old else _V022_SECTIONS, where, strict=not old)
    section = _sections(document, where)
    notes = []
    model = model_from_torchtitan(document, where)
    if model == "llama-3-8b":  # torchtitan's train_configs/llama3_8b.toml trains Llama 3.1 8B
        notes.append("llama3 8B is estimated as llama-3-8b: Llama 3 and 3.1 8B have the same layers and sizes")
    compiled = (as_bool(section["training"].get("compile", False), "training.compile", where) if old
                else as_bool(section["compile"].get("enable", False), "compile.enable", where))
    if compiled:
        notes.append("torch.compile is not modelled: estimated as the eager program (the published torchtitan runs "
                     "show compile lowering the peak)")
    if _float8(section, where, old):
        notes.append("float8 training (torchao Float8Linear) is not modelled: estimated with bf16 matmuls")
    return tuple(notes)


def _sections(document: Mapping[str, object], where: Where) -> dict[str, Mapping[str, object]]:
    return {name: as_section(document.get(name, {}), name, where) for name in TORCHTITAN_SECTIONS}


def settings_from_torchtitan(document: Mapping[str, object], where: Where, gpus: int | None) -> dict[str, object]:
    """Partial TrainingSpec mapping for one torchtitan job TOML (checked by `check_torchtitan`). `gpus`
    is --gpus, which a data_parallel_shard_degree of -1 ("all the ranks") needs."""
    old = is_2024_schema(document)
    section = _sections(document, where)
    training, parallelism = section["training"], section["experimental" if old else "parallelism"]
    settings: dict[str, object] = {"recipe": RECIPE}

    def integer(table: str, key: str, default: int, minimum: int = 1) -> int:
        value = section[table].get(key, default)
        return as_int(value, f"{table}.{key}", where, minimum)

    # Parallel degrees other than data parallelism (v0.2.2 [parallelism]; 2024: [training] tp, [experimental] pp, cp).
    others = ([("training", "tensor_parallel_degree"), ("experimental", "pipeline_parallel_degree"),
               ("experimental", "context_parallel_degree"), ("training", "data_parallel_replicate_degree")] if old else
              [("parallelism", f"{kind}_parallel_degree") for kind in ("tensor", "pipeline", "context", "expert")]
              + [("parallelism", "data_parallel_replicate_degree")])
    if old:
        for table, key in others:
            if integer(table, key, 1) > 1:
                raise fail(where, f"{table}.{key}", f"is {section[table][key]}: {_NOT_MODELLED}")
    mesh = {} if old else torchtitan_mesh(parallelism, _model_layers(document, where), where)  # issue 14
    model_ranks = mesh.get("tp", 1) * mesh.get("cp", 1) * mesh.get("pp", 1) * mesh.get("dp_replicate", 1)
    if model_ranks > 1 or mesh.get("ep", 1) > 1:
        settings["mesh"] = mesh

    shard_table = "training" if old else "parallelism"
    shard = as_int(section[shard_table].get("data_parallel_shard_degree", -1),
                   f"{shard_table}.data_parallel_shard_degree", where, minimum=-1)
    if shard == 0 or shard < -1:
        raise fail(where, f"{shard_table}.data_parallel_shard_degree", f"must be -1 (all ranks) or >= 1, got {shard}")
    if shard > 0 and model_ranks > 1:
        if gpus is not None and gpus != shard * model_ranks:
            raise fail(where, f"{shard_table}.data_parallel_shard_degree", f"is {shard}, so the mesh takes {shard * model_ranks} "
                       f"GPUs (x tp x cp x pp x data_parallel_replicate_degree) but --gpus is {gpus}; make them equal")
        settings["gpus"] = shard * model_ranks
    elif shard > 0:
        if gpus is not None and gpus != shard:
            raise fail(where, f"{shard_table}.data_parallel_shard_degree", f"is {shard} but --gpus is {gpus}; make them equal")
        settings["gpus"] = shard
    if model_ranks > 1:
        # the data-parallel ranks: torchtitan's batch mesh, dp_replicate x dp_shard
        world = mesh["dp_replicate"] * (shard if shard > 0 else max((gpus or model_ranks) // model_ranks, 1))
    else:
        world = shard if shard > 0 else gpus or 1
    if world * model_ranks > 1:
        # parallelize.py apply_fsdp: every block, reshard_after_forward from fsdp_reshard_after_forward
        # ("default": True without pipeline parallelism; "never": False); one rank runs no FSDP.
        settings["engine"] = "fsdp2"
        reshard = "default" if old else parallelism.get("fsdp_reshard_after_forward", "default")
        if reshard not in ("default", "always", "never"):
            raise fail(where, "parallelism.fsdp_reshard_after_forward", f"must be default, always or never, got {reshard!r}")
        # "default" is `not pp_enabled` (torchtitan distributed/fsdp.py): no resharding under pipeline parallelism
        settings["zero_stage"] = 2 if reshard == "never" or (reshard == "default" and mesh.get("pp", 1) > 1) else 3
    else:
        settings.update(engine="torch", zero_stage=0)

    micro_key = "batch_size" if old else "local_batch_size"
    micro = integer("training", micro_key, 8)  # both schemas default to 8
    settings.update(micro_batch=micro, seq_len=integer("training", "seq_len", 2048))
    global_batch = -1 if old else as_int(training.get("global_batch_size", -1), "training.global_batch_size", where, -1)
    if global_batch > 0:
        # trainer.py: gradient_accumulation_steps = global_batch_size // (local_batch_size * dp_degree), divisible.
        if shard < 0 and gpus is None:
            raise fail(where, "training.global_batch_size", "needs the data-parallel degree to give the accumulation "
                       "steps: give --gpus, or parallelism.data_parallel_shard_degree")
        if global_batch % (micro * world):
            raise fail(where, "training.global_batch_size", f"{global_batch} is not a multiple of local_batch_size "
                       f"{micro} x {world} data-parallel ranks")
        settings["grad_accum"] = global_batch // (micro * world)
    if mesh.get("pp", 1) > 1:
        # the pipeline runs each local batch as micro-batches, which zeroplan counts as accumulation steps
        size, count = pipeline_micro_batch(parallelism, micro, where)
        settings.update(micro_batch=size, grad_accum=settings.get("grad_accum", 1) * count)
    settings["precision"] = _precision(training, where)
    if as_bool(training.get("enable_cpu_offload", False), "training.enable_cpu_offload", where):
        settings.update(offload_optimizer="cpu", offload_params="cpu")  # FSDP2 CPUOffloadPolicy
    settings.update(_checkpointing(section["activation_checkpoint"], where))
    settings.update(_optimizer(section["optimizer"], where, old))
    # v0.2.2 components/loss.py and 9dec370 train.py: cross_entropy over the whole fp32-upcast logits.
    settings["loss"] = "standard"
    return settings


def _model_layers(document: Mapping[str, object], where: Where) -> int | None:
    """The layers of the model the TOML names, when the catalogue has it (pipeline stages need them)."""
    from zeroplan.errors import SpecError
    from zeroplan.importers.catalog import resolve_model

    try:
        return getattr(resolve_model(model_from_torchtitan(document, where)), "num_layers", None)
    except SpecError:
        return None


def _check_keys(document: Mapping[str, object], sections: Mapping[str, object], where: Where, strict: bool) -> None:
    """v0.2.2 refuses unknown keys (config/manager.py `_dict_to_dataclass`: "Invalid field names");
    the 2024 loader never reads them."""

    def check(table: Mapping[str, object], known: object, prefix: str) -> None:
        names = set(known)
        for key, value in table.items():
            path = f"{prefix}{key}"
            if key not in names:
                close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                if strict:
                    raise fail(where, path, f"is not a torchtitan v0.2.2 option{hint}")
                warnings.warn(f"{where(path)}: {path} is not read by torchtitan (2024 schema){hint}: ignored",
                              ZeroplanWarning)
                continue
            inner = known.get(key) if isinstance(known, Mapping) else None
            if key == "dataloader" and strict:
                inner = _DATALOADER
            if inner is not None:
                check(as_section(value, path, where), inner, f"{path}.")

    check(document, sections, "")


def _precision(training: Mapping[str, object], where: Where) -> str:
    """training.dtype is the dtype of the sharded parameters, gradients and optimizer states (float32 by
    default); mixed_precision_param is the all-gathered compute dtype (FSDP2 MixedPrecisionPolicy)."""
    dtype = training.get("dtype", "float32")
    param = training.get("mixed_precision_param", "bfloat16")
    for key, value in (("dtype", dtype), ("mixed_precision_param", param)):
        if value not in ("float32", "bfloat16"):
            raise fail(where, f"training.{key}", f"must be float32 or bfloat16, got {value!r}")
    if dtype == "bfloat16":
        return "pure-bf16"
    return "bf16" if param == "bfloat16" else "fp32"


def _checkpointing(ac: Mapping[str, object], where: Where) -> dict[str, object]:
    """[activation_checkpoint] mode and selective_ac_option (defaults "selective" and "2")."""
    mode = ac.get("mode", "selective")
    if mode not in ("none", "selective", "full", "memory_budget"):
        raise fail(where, "activation_checkpoint.mode", f"must be none, selective or full, got {mode!r}")
    if mode == "memory_budget":
        raise fail(where, "activation_checkpoint.mode", "memory_budget (torch.compile's budgeted recomputation) is not "
                   "modelled; use none, selective or full")
    if mode != "selective":
        return {"checkpointing": mode}
    return selective_option(ac.get("selective_ac_option", "2"), "activation_checkpoint.selective_ac_option", where)


def selective_option(option: object, field: str, where: Where) -> dict[str, object]:
    """Selective checkpointing's option: "op" is the per-op policy; an integer N wraps every Nth block in
    full checkpointing (torchtitan v0.2.2 distributed/activation_checkpoint.py `_apply_layer_sac`,
    torchtune training/activations.py: N of 0 or 1 wraps every block)."""
    if option == "op":
        return {"checkpointing": "op"}
    text = str(option).strip() if isinstance(option, (str, int)) and not isinstance(option, bool) else ""
    if not text.isdigit():
        raise fail(where, field, f"must be 'op' or a whole number of blocks, got {option!r}")
    every = int(text)
    return {"checkpointing": "full"} if every <= 1 else {"checkpointing": "full", "checkpoint_every": every}


def _optimizer(optimizer: Mapping[str, object], where: Where, old: bool) -> dict[str, object]:
    name = optimizer.get("name", "AdamW")
    if name not in _OPTIMIZERS:
        raise fail(where, "optimizer.name", f"{name!r} is not a torchtitan optimizer zeroplan models (Adam, AdamW)")
    settings: dict[str, object] = {"optimizer": _OPTIMIZERS[name]}
    if old:  # 9dec370 optimizer.py: {"fused": fused, "foreach": not fused}, fused off by default
        settings["optimizer_impl"] = "fused" if as_bool(optimizer.get("fused", False), "optimizer.fused", where) else "foreach"
    else:  # v0.2.2 job_config.py Optimizer.implementation, default "fused"
        impl = optimizer.get("implementation", "fused")
        if impl not in ("for-loop", "foreach", "fused"):
            raise fail(where, "optimizer.implementation", f"must be for-loop, foreach or fused, got {impl!r}")
        settings["optimizer_impl"] = impl
    if as_bool(optimizer.get("early_step_in_backward", False), "optimizer.early_step_in_backward", where):
        settings["optimizer_in_backward"] = True
    return settings


def _float8(section: Mapping[str, Mapping[str, object]], where: Where, old: bool) -> bool:
    """Whether the run converts its linears to float8: 2024 `[float8] enable_float8_linear`; v0.2.2
    `[model] converters` naming a float8 or mx converter (components/quantization)."""
    if old:
        return as_bool(section["float8"].get("enable_float8_linear", False), "float8.enable_float8_linear", where)
    converters = section["model"].get("converters", [])
    if isinstance(converters, str):
        converters = converters.split(",")
    if not isinstance(converters, list) or not all(isinstance(item, str) for item in converters):
        raise fail(where, "model.converters", f"must be a list of converter names, got {converters!r}")
    return any("float8" in item or "mx" in item for item in converters)
