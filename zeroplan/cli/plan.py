"""`zeroplan plan`: the cheapest configurations that fit, ranked, and the engine config to launch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from zeroplan.cli.common import FiniteFloatRange, output_options
from zeroplan.cli.grid_options import estimate_options_except, gpu_memory_options
from zeroplan.cli.mesh_options import mesh_options
from zeroplan.cli.plan_options import step_options
from zeroplan.plan.limits import MAX_MICRO_BATCH

MESH_DIMENSIONS = ("tp", "cp", "pp", "ep", "dp_replicate")
DEFAULT_CHECKPOINTING = "none,selective,op,full,every-2"


@click.command("plan")
@estimate_options_except({"gpus", "zero_stage", "offload_optimizer", "offload_params", "micro_batch", "checkpointing", "gpu_memory"})
@click.option("--gpus", "gpu_counts", default="8", show_default=True, metavar="N|LIST|A-B",
              help="GPU count, a list (8,16,64) or a doubling range (8-64 = 8,16,32,64).")
@gpu_memory_options
@click.option("--cpu-memory", "cpu_memory", metavar="SIZE", help="Host memory per node for offload (e.g. 1TiB); unlimited if not given.")
@click.option("--nvme", "nvme", metavar="SIZE", help="NVMe space per node; NVMe offload is searched only when given.")
@click.option("--headroom", type=FiniteFloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="Fraction of GPU memory kept free: a config fits when its peak <= (1 - headroom) x GPU memory.")
@click.option("--global-batch", "global_batch", type=click.IntRange(min=1), metavar="N",
              help="Sequences per optimizer step over all GPUs; grad accumulation = N / (micro-batch x data-parallel ranks).")
@click.option("--zero", "zero_stages", metavar="LIST", help="ZeRO stages to search [default: every stage the engine runs].")
@click.option("--offload", "offloads", default="none,cpu", show_default=True, metavar="LIST",
              help="Offload targets to search (none, cpu, nvme); nvme also needs --nvme.")
@click.option("--checkpointing", "checkpointing_modes", default=None, metavar="LIST",
              help="Activation checkpointing policies to search: none, selective, op (torchtitan's per-op policy), full, "
              "every-N (full checkpointing of every Nth block); --checkpoint-every N turns full into every-N. "
              "[default: none,selective,op,full,every-2; none,full with --emit torchtitan, what its TOML writes]")
@click.option("--micro-batches", "micro_batches", type=click.Choice(["pow2", "all"]), default="pow2", show_default=True,
              help="Micro-batches searched: powers of two, or every whole number, up to --max-micro-batch.")
@click.option("--max-micro-batch", "max_micro_batch", type=click.IntRange(1, MAX_MICRO_BATCH), default=1024, show_default=True, metavar="N",
              help=f"Largest micro-batch searched (at most {MAX_MICRO_BATCH:,}).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="How many configurations to show.")
@step_options
@click.option("--emit", nargs=2, type=(click.Choice(["deepspeed", "fsdp", "torchtitan"]), click.Path(dir_okay=False)),
              metavar="deepspeed|fsdp|torchtitan FILE",
              help="Write the best plan as a DeepSpeed JSON config (with --mesh and AutoTP/Ulysses degrees for "
              "--engine deepspeed), as an FSDP2 Python snippet (with --engine fsdp2), or (with --mesh) as a torchtitan "
              "job TOML (FSDP2: the engine is fsdp2 when none is given).")
@click.option("--mesh", "mesh_search", is_flag=True, default=False,
              help="Search tensor, context, pipeline and expert parallel degrees, HSDP and the pipeline schedule too "
              "(engine fsdp2, or deepspeed: AutoTP and Ulysses): the cheapest configurations whose worst rank fits. "
              "Mesh options given (--tp 8) stay fixed; without --mesh, the mesh they (or --config) give is planned as "
              "it is.")
@mesh_options
@output_options
def command(**options: Any) -> None:
    """Find the configurations of MODEL that fit the GPUs (ZeRO stage x offload x checkpointing x
    micro-batch, GPU counts when a list or range is given, and meshes with --mesh), rank them by
    their step time, and say why each ranks where it does. If nothing fits, say the smallest
    change that would.

    The step-time model (zeroplan/plan/step_time.py, docs/throughput.md) states its assumptions;
    override any of them with the bandwidth and efficiency options, or calibrate it from a
    measured step (--calibrate).

    \b
    Examples:
      zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8
      zeroplan plan llama-2-13b --gpu a100-40gb --gpus 8-64 --global-batch 512 --seq-len 4096
      zeroplan plan llama-3-70b --gpu h100-80gb --gpus 16 --cpu-memory 2TiB --nvme 8TB --offload none,cpu,nvme
      zeroplan plan llama-3-70b --gpu h100-80gb --gpus 64 --seq-len 8192 --mesh --emit torchtitan job.toml
      zeroplan plan llama-2-7b --gpu-memory 24GiB --gpus 4 --emit deepspeed ds_config.json
    """
    from zeroplan.cli.grid_options import base_training, list_items, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.cli.plan_options import rates_from_options
    from zeroplan.errors import SpecError
    from zeroplan.importers.options import load_config, model_from_options
    from zeroplan.plan.policies import Policy
    from zeroplan.plan.search import Limits, SearchSpace, parse_gpu_counts, plan
    from zeroplan.plan.serialize import plan_to_dict
    from zeroplan.report.plan import render_plan
    from zeroplan.spec.mesh import MeshSpec
    from zeroplan.spec.training import Checkpointing, Engine, Offload
    from zeroplan.spec.units import parse_size_bytes

    from zeroplan.spec.files import writable_file

    emit = options["emit"]
    if emit:
        writable_file(emit[1], "--emit")  # before the search, not after it
    preset, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    if gpu_memory is None:
        raise click.UsageError("give the GPU: --gpu NAME (e.g. h100-80gb) or --gpu-memory SIZE (e.g. 80GiB)")
    if options["global_batch"] is not None and options["grad_accum"] is not None:
        raise click.UsageError("--global-batch sets the gradient accumulation; do not give --grad-accum too")
    offload_choices = parse_choice_list(options["offloads"], "--offload", [o.value for o in Offload])
    if "nvme" in offload_choices and options["nvme"] is None:
        raise click.UsageError("--offload nvme needs --nvme SIZE, the NVMe space per node (e.g. --nvme 8TB)")
    modes = options["checkpointing_modes"]
    if modes is None:  # torchtitan v0.2.2's TOML states mode none or full (importers/torchtitan_write.py)
        modes = "none,full" if emit and emit[0] == "torchtitan" else DEFAULT_CHECKPOINTING
    policies = [Policy.parse(text) for text in list_items(modes, "--checkpointing")]
    if options["checkpoint_every"] is not None:  # full checkpointing of every Nth block, not of every block
        if Policy(Checkpointing.FULL) not in policies:
            raise click.UsageError("--checkpoint-every chooses which blocks full checkpointing recomputes: put full in "
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
    limits = Limits(
        gpu_memory_bytes=gpu_memory,
        headroom=options["headroom"],
        cpu_memory_bytes=None if options["cpu_memory"] is None else parse_size_bytes(options["cpu_memory"], "--cpu-memory"),
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
        raise click.UsageError("--emit torchtitan writes a torchtitan job of a mesh plan: add --mesh (or use --emit fsdp)")
    if emit and emit[0] == "fsdp" and base.engine != Engine.FSDP2:
        raise SpecError("--emit fsdp: plan with --engine fsdp2, so that the plan models FSDP2's memory")
    if emit and emit[0] == "fsdp" and meshed:
        raise click.UsageError("--emit fsdp writes a data-parallel FSDP2 snippet: use --emit torchtitan for a mesh plan")
    result = plan(model, base, space, limits, rates, top=options["top"])
    if notes:
        result = replace(result, notes=notes + result.notes)
    click.echo(render_plan(plan_to_dict(result), options["output_format"], options["units"]), nl=False)
    if emit:
        if not result.top:
            raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
        _emit(emit[0], emit[1], model, result)


def _mesh_engine(options: dict, emit) -> tuple[dict, bool]:
    """The engine a mesh plan runs: the one given; else the --config's; else FSDP2 for --emit torchtitan and
    DeepSpeed (AutoTP, Ulysses; TrainingSpec's default) otherwise. Whether it is DeepSpeed."""
    engine = options["engine"]
    if engine is None and options["config_file"] is not None:
        engine = _config_engine(options)
    if engine is None and emit and emit[0] == "torchtitan":
        engine = "fsdp2"  # a torchtitan job runs FSDP2: the engine follows the emitter asked for
    deepspeed = engine in (None, "deepspeed")
    if emit and emit[0] not in ("fsdp",) and emit[0] != ("deepspeed" if deepspeed else "torchtitan"):
        raise click.UsageError(f"--emit {emit[0]}: a mesh plan of engine {engine or 'deepspeed'} writes a "
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


def _emit(kind: str, path: str, model, result) -> None:
    best = result.top[0]
    training = best.training
    if kind == "torchtitan":
        return _emit_torchtitan(path, model, result)
    if kind == "deepspeed" and not training.mesh.is_trivial:
        from zeroplan.cli.plan_deepspeed_mesh import emit_deepspeed_mesh

        return emit_deepspeed_mesh(path, model, best)
    import json

    from zeroplan.importers.lora_options import lora_command_options
    from zeroplan.importers.training_config import write_deepspeed_config, write_fsdp2_snippet
    from zeroplan.spec.files import write_atomic

    text = json.dumps(write_deepspeed_config(training), indent=2) + "\n" if kind == "deepspeed" else write_fsdp2_snippet(training)
    write_atomic(path, text, "--emit")
    extra = f" --checkpointing {training.checkpointing.value}" if training.checkpointing.value != "none" else ""
    if training.checkpoint_every:
        extra += f" --checkpoint-every {training.checkpoint_every}"
    extra += lora_command_options(training)  # a DeepSpeed JSON carries no adapters
    click.echo(
        f"wrote {path} ({kind}, plan #1); check it with: zeroplan estimate MODEL --config {path} --gpus {training.gpus} "
        f"--seq-len {training.seq_len}{extra}" if kind == "deepspeed" else f"wrote {path} ({kind}, plan #1)",
        err=True,
    )


def _emit_torchtitan(path: str, model, result) -> None:
    """The best configuration as a torchtitan job TOML, read back as `zeroplan estimate --config` reads it."""
    from zeroplan.estimate.mesh import estimate_mesh
    from zeroplan.importers.options import training_spec_from_options
    from zeroplan.importers.torchtitan_write import write_torchtitan_toml
    from zeroplan.spec.files import write_atomic

    best = result.top[0]
    write_atomic(path, write_torchtitan_toml(best.training, result.model_name), "--emit")
    back = estimate_mesh(model, training_spec_from_options({"gpus": best.training.gpus}, path, model))
    peaks = [rank.estimate.peak_bytes for rank in back.ranks]
    same = peaks == [rank.estimate.peak_bytes for rank in best.estimate.ranks]
    verdict = "it reads back to the same estimate" if same else (
        f"it reads back to a worst rank of {back.worst.estimate.peak_bytes:,} bytes, not "
        f"{best.worst.peak_bytes:,}: the TOML states torchtitan's program (recipe torchtitan)")
    click.echo(f"wrote {path} (torchtitan, plan #1); {verdict}; check it with: zeroplan estimate --config "
               f"{path} --gpus {best.training.gpus}", err=True)
