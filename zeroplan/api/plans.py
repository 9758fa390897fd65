"""What `zeroplan.plan(...)` and `zeroplan plan` compute from the command's options (its click
parameters are the keyword arguments): one search over ZeRO stage x offload x checkpointing policy x
micro-batch (x GPU counts, x meshes with `mesh_search`), ranked by the step-time model, and with
`emit` the best configuration written as an engine config (api/plan_emit.py)."""

from __future__ import annotations

from typing import Any

from zeroplan.api.results import PlanResult
from zeroplan.errors import SpecError

MESH_DIMENSIONS = ("tp", "cp", "pp", "ep", "dp_replicate")
DEFAULT_CHECKPOINTING = "none,selective,op,full,every-2"


def plan_from_options(options: dict[str, Any]) -> PlanResult:
    from dataclasses import replace

    from zeroplan.api.plan_emit import emit_plan
    from zeroplan.cli.grid_options import base_training, list_items, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.api.pricing import rates_from_options
    from zeroplan.importers.options import host_memory_bytes, load_config, model_from_options
    from zeroplan.plan.policies import Policy
    from zeroplan.plan.search import Limits, SearchSpace, parse_gpu_counts, plan
    from zeroplan.spec.files import writable_file
    from zeroplan.spec.mesh import MeshSpec
    from zeroplan.spec.training import Checkpointing, Engine, Offload
    from zeroplan.spec.units import parse_size_bytes

    emit = options["emit"]
    if emit:
        writable_file(emit[1], "--emit", stdout=True)  # before the search, not after it
    preset, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    if gpu_memory is None:
        raise SpecError("give the GPU: --gpu NAME (e.g. h100-80gb) or --gpu-memory SIZE (e.g. 80GiB)")
    if options["global_batch"] is not None and options["grad_accum"] is not None:
        raise SpecError("--global-batch sets the gradient accumulation; do not give --grad-accum too")
    offload_choices = parse_choice_list(options["offloads"], "--offload", [o.value for o in Offload])
    if "nvme" in offload_choices and options["nvme"] is None:
        raise SpecError("--offload nvme needs --nvme SIZE, the NVMe space per node (e.g. --nvme 8TB)")
    modes = options["checkpointing_modes"]
    if modes is None:  # torchtitan v0.2.2's TOML states mode none or full (importers/torchtitan_write.py)
        modes = "none,full" if emit and emit[0] == "torchtitan" else DEFAULT_CHECKPOINTING
    policies = [Policy.parse(text) for text in list_items(modes, "--checkpointing")]
    if options["checkpoint_every"] is not None:  # full checkpointing of every Nth block, not of every block
        if Policy(Checkpointing.FULL) not in policies:
            raise SpecError("--checkpoint-every chooses which blocks full checkpointing recomputes: put full in "
                            "--checkpointing")
        policies = [Policy(Checkpointing.FULL, options["checkpoint_every"]) if p == Policy(Checkpointing.FULL) else p
                    for p in policies]
    options = {**options, "checkpoint_every": None}  # each policy sets it; the base validates without
    gpu_counts = parse_gpu_counts(options["gpu_counts"])
    mesh_given = {name: options[f"mesh_{name}"] for name in MeshSpec.model_fields if options.get(f"mesh_{name}") is not None}
    deepspeed_mesh = False
    if options["mesh_search"] or any(name in mesh_given for name in MESH_DIMENSIONS):
        options, deepspeed_mesh = _mesh_engine(options, emit)
    space = SearchSpace(
        zero_stages=None if options["zero_stages"] is None else parse_int_list(options["zero_stages"], "--zero", 0, 3),
        offload_targets=tuple(Offload(o) for o in offload_choices),
        checkpointing=tuple(dict.fromkeys(policies)),
        gpu_counts=gpu_counts,
        max_micro_batch=options["max_micro_batch"],
        micro_batches=options["micro_batches"],
        global_batch=options["global_batch"],
        mesh="search" if options["mesh_search"] else "none",
        given=tuple(mesh_given.items()),
    )
    # the host of a server's size, not an unlimited one, unless --cpu-memory says (importers/options.py)
    cpu_memory, cpu_memory_note = host_memory_bytes(options["cpu_memory"], gpu_memory, max(gpu_counts),
                                                    options["gpus_per_node"])
    limits = Limits(
        gpu_memory_bytes=gpu_memory,
        headroom=options["headroom"],
        cpu_memory_bytes=cpu_memory,
        nvme_bytes=None if options["nvme"] is None else parse_size_bytes(options["nvme"], "--nvme"),
    )
    options["config_file"] = config = load_config(options["config_file"])  # read once, for every grid point
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    rates, notes = rates_from_options(options, preset, model)
    if options["mesh_search"]:
        options = {**options, **{f"mesh_{name}": None for name in MESH_DIMENSIONS}}  # searched, not the base's
    stages = space.zero_stages or ((2, 1, 3) if deepspeed_mesh else (3, 2, 1, 0))  # the base validates; the search varies it
    base = base_training(options, stages, max(gpu_counts), model)
    if options["mesh_search"] and base.engine not in (Engine.FSDP2, Engine.DEEPSPEED):
        raise SpecError("--mesh: meshes are searched with FSDP2 (torchtitan) or DeepSpeed (AutoTP, Ulysses); give "
                        "--engine fsdp2 or deepspeed")
    meshed = options["mesh_search"] or not base.mesh.is_trivial
    if emit and emit[0] == "torchtitan" and not meshed:
        raise SpecError("--emit torchtitan writes a torchtitan job of a mesh plan: add --mesh (or use --emit fsdp)")
    if emit and emit[0] == "fsdp" and base.engine != Engine.FSDP2:
        raise SpecError("--emit fsdp: plan with --engine fsdp2, so that the plan models FSDP2's memory")
    if emit and emit[0] == "fsdp" and meshed:
        raise SpecError("--emit fsdp writes a data-parallel FSDP2 snippet: use --emit torchtitan for a mesh plan")
    result = plan(model, base, space, limits, rates, top=options["top"])
    if notes:
        result = replace(result, notes=notes + result.notes)
    # the assumption bounds what CPU offload may use: the plan states it (its JSON carries it as cpu_memory_per_node)
    assumptions = [cpu_memory_note] if cpu_memory_note and "cpu" in offload_choices else []
    if not emit:
        return PlanResult(result, assumptions=assumptions)
    if not result.top:
        raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
    message = emit_plan(emit[0], emit[1], model, result, gpu=options["gpu"])
    return PlanResult(result, assumptions=assumptions, emitted=str(emit[1]), emit_message=message)


def _mesh_engine(options: dict, emit) -> tuple[dict, bool]:
    """The engine a mesh plan runs: the one given; else the --config's; else FSDP2 for --emit torchtitan and
    DeepSpeed (AutoTP, Ulysses; TrainingSpec's default) otherwise. Whether it is DeepSpeed."""
    engine = options["engine"]
    if engine is None and options["config_file"] is not None:
        engine = _config_engine(options)
    if engine is None and emit and emit[0] == "torchtitan":
        engine = "fsdp2"  # a torchtitan job runs FSDP2: the engine follows the emitter asked for
    deepspeed = engine in (None, "deepspeed")
    if emit and emit[0] != "fsdp" and emit[0] != ("deepspeed" if deepspeed else "torchtitan"):
        raise SpecError(f"--emit {emit[0]}: a mesh plan of engine {engine or 'deepspeed'} writes a "
                        f"{'DeepSpeed JSON (--emit deepspeed)' if deepspeed else 'torchtitan TOML (--emit torchtitan)'}; "
                        f"or give --engine {'fsdp2' if deepspeed else 'deepspeed'}")
    updates: dict[str, Any] = {"engine": engine}
    if emit and emit[0] == "torchtitan" and options["config_file"] is None:
        # the plan models the program the TOML will state (torchtitan v0.2.2: whole-logits cross-entropy)
        updates.update(recipe=options["recipe"] or "torchtitan", loss=options["loss"] or "standard")
    return {**options, **updates}, deepspeed


def _config_engine(options: dict) -> str | None:
    """The engine a --config names (a DeepSpeed JSON: deepspeed), or None where it does not say."""
    from zeroplan.importers.options import load_config

    config = load_config(options["config_file"])
    return "deepspeed" if config is not None and config.kind == "DeepSpeed JSON" else None
