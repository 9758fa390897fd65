"""What `zeroplan.plan(...)` computes from the options of `zeroplan plan`: the same library calls, in the
same order, as the command (zeroplan/cli/plan.py), whose options (its click parameters) are the
keyword arguments. The command does not call this yet: the planner's command line is being
rewritten (one planner for plan and plan --mesh), and will then print `plan_from_options`'s result."""

from __future__ import annotations

import json
from typing import Any

from zeroplan.api.results import PlanResult
from zeroplan.errors import SpecError


def plan_from_options(options: dict[str, Any]) -> PlanResult:
    from zeroplan.cli.grid_options import base_training, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.importers.options import host_memory_bytes, load_config, model_from_options
    from zeroplan.plan.cost import assumptions_for
    from zeroplan.plan.search import Limits, SearchSpace, parse_gpu_counts, plan
    from zeroplan.spec.files import writable_file
    from zeroplan.spec.training import Checkpointing, Engine, Offload
    from zeroplan.spec.units import parse_size_bytes

    emit = options["emit"]
    if emit:
        writable_file(emit[1], "--emit")  # before the search, not after it
    preset, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    if gpu_memory is None:
        raise SpecError("give the GPU: --gpu NAME (e.g. h100-80gb) or --gpu-memory SIZE (e.g. 80GiB)")
    if options["global_batch"] is not None and options["grad_accum"] is not None:
        raise SpecError("--global-batch sets the gradient accumulation; do not give --grad-accum too")
    offload_choices = parse_choice_list(options["offloads"], "--offload", [o.value for o in Offload])
    if "nvme" in offload_choices and options["nvme"] is None:
        raise SpecError("--offload nvme needs --nvme SIZE, the NVMe space per node (e.g. --nvme 8TB)")
    gpu_counts = parse_gpu_counts(options["gpu_counts"])
    space = SearchSpace(
        zero_stages=None if options["zero_stages"] is None else parse_int_list(options["zero_stages"], "--zero", 0, 3),
        offload_targets=tuple(Offload(o) for o in offload_choices),
        checkpointing=tuple(Checkpointing(c) for c in parse_choice_list(
            options["checkpointing_modes"], "--checkpointing", [c.value for c in Checkpointing])),
        gpu_counts=gpu_counts, max_micro_batch=options["max_micro_batch"], micro_batches=options["micro_batches"],
        global_batch=options["global_batch"],
    )
    # the host of a server's size, not an unlimited one, unless --cpu-memory says (importers/options.py)
    cpu_memory, _ = host_memory_bytes(options["cpu_memory"], gpu_memory, max(gpu_counts), options["gpus_per_node"])
    limits = Limits(
        gpu_memory_bytes=gpu_memory, headroom=options["headroom"], cpu_memory_bytes=cpu_memory,
        nvme_bytes=None if options["nvme"] is None else parse_size_bytes(options["nvme"], "--nvme"),
    )
    rates = ("gpu_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_memory_gbps", "nvme_gbps",
             "max_efficiency", "half_efficiency_tokens")
    assumptions = assumptions_for(preset, **{name: options[name] for name in rates})
    options = {**options, "config_file": load_config(options["config_file"])}  # read once, for every grid point
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               options["config_file"])
    given_mesh = any(options[f"mesh_{name}"] is not None for name in ("tp", "cp", "pp", "ep", "dp_replicate"))
    if options["mesh_search"] or given_mesh:
        return _plan_mesh(options, model, space, limits, assumptions, gpu_counts, fixed=not options["mesh_search"])
    base = base_training(options, space.zero_stages or (0, 1, 2, 3), max(gpu_counts), model)
    if not base.mesh.is_trivial:  # a --config's mesh (torchtitan [parallelism])
        return _plan_mesh(options, model, space, limits, assumptions, gpu_counts, fixed=True)
    if emit and emit[0] == "torchtitan":
        raise SpecError(f"--emit {emit[0]} writes a mesh plan: add --mesh")
    if emit and emit[0] == "fsdp" and base.engine != Engine.FSDP2:
        raise SpecError("--emit fsdp: plan with --engine fsdp2, so that the plan models FSDP2's memory")
    result = plan(model, base, space, limits, assumptions, top=options["top"])
    if not emit:
        return PlanResult(result, mesh=False)
    if not result.top:
        raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
    from zeroplan.importers.training_config import write_deepspeed_config, write_fsdp2_snippet
    from zeroplan.spec.files import write_atomic

    best = result.top[0].training
    text = json.dumps(write_deepspeed_config(best), indent=2) + "\n" if emit[0] == "deepspeed" else write_fsdp2_snippet(best)
    write_atomic(emit[1], text, "--emit")
    return PlanResult(result, mesh=False, emitted=str(emit[1]))


def _plan_mesh(options: dict, model, space, limits, assumptions, gpu_counts: tuple[int, ...], fixed: bool) -> PlanResult:
    """The mesh search of zeroplan.plan.mesh, the dimensions given fixed; `fixed`: the mesh the options
    or --config give, planned as it is (cli/plan.py `_plan_mesh`)."""
    from zeroplan.cli.grid_options import base_training
    from zeroplan.plan.mesh import plan_mesh
    from zeroplan.spec.mesh import MeshSpec
    from zeroplan.spec.training import Engine

    if len(gpu_counts) != 1:
        raise SpecError(f"{'a mesh is planned on' if fixed else '--mesh searches the meshes of'} one GPU count: give --gpus N")
    emit = options["emit"]
    deepspeed = options["engine"] == "deepspeed" or (options["engine"] is None and options["config_file"] is not None
                                                     and _config_engine(options, space, gpu_counts[0], model) == "deepspeed")
    wanted = "deepspeed" if deepspeed else "torchtitan"
    if emit and emit[0] != wanted:
        raise SpecError(f"{'a mesh plan' if fixed else '--mesh'} writes a {'DeepSpeed JSON' if deepspeed else 'torchtitan TOML'}: "
                        f"use --emit {wanted} FILE, not {emit[0]}")
    if emit and options["config_file"] is None and not deepspeed:
        # the plan models the program the TOML will state (torchtitan v0.2.2: whole-logits cross-entropy)
        options = {**options, "recipe": options["recipe"] or "torchtitan", "loss": options["loss"] or "standard"}
    base = base_training(options, (space.zero_stages or (2, 1)) if deepspeed else (3, 2), gpu_counts[0], model)
    if base.engine not in (Engine.FSDP2, Engine.DEEPSPEED):
        raise SpecError(f"{'mesh: a mesh is planned' if fixed else '--mesh: meshes are searched'} with FSDP2 "
                        "(torchtitan) or DeepSpeed (AutoTP, Ulysses); give --engine fsdp2 or deepspeed")
    given = {name: options[f"mesh_{name}"] for name in MeshSpec.model_fields if options.get(f"mesh_{name}") is not None}
    result = plan_mesh(model, base, limits.budget_bytes, assumptions, space.checkpointing,
                       max_micro_batch=min(space.max_micro_batch, 64), global_batch=space.global_batch, top=options["top"],
                       given=given, fixed=fixed)
    if not emit:
        return PlanResult(result, mesh=True)
    if not result.top:
        raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
    from zeroplan.spec.files import write_atomic

    best = result.top[0].training
    if deepspeed:
        from zeroplan.importers.training_config import write_deepspeed_config

        text = json.dumps(write_deepspeed_config(best), indent=2) + "\n"
    else:
        from zeroplan.importers.torchtitan_write import write_torchtitan_toml

        text = write_torchtitan_toml(best, result.model_name)
    write_atomic(emit[1], text, "--emit")
    return PlanResult(result, mesh=True, emitted=str(emit[1]))


def _config_engine(options: dict, space, gpus: int, model) -> str | None:
    """The engine a --config names (a DeepSpeed JSON: deepspeed), or None where it does not validate yet."""
    from zeroplan.cli.grid_options import base_training

    try:
        return base_training(options, space.zero_stages or (2, 1, 3), gpus, model).engine.value
    except SpecError:
        return None
