"""`zeroplan plan`: the cheapest configurations that fit, ranked, and the engine config to launch."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import FiniteFloatRange, output_options
from zeroplan.cli.grid_options import estimate_options_except, gpu_memory_options
from zeroplan.cli.mesh_options import mesh_options
from zeroplan.plan.limits import MAX_MICRO_BATCH


def _rate(name: str, field: str, unit: str, help_text: str):
    return click.option(name, field, type=FiniteFloatRange(min=0, min_open=True), metavar=unit, help=help_text)


@click.command("plan")
@estimate_options_except({"gpus", "zero_stage", "offload_optimizer", "offload_params", "micro_batch", "checkpointing", "gpu_memory"})
@click.option("--gpus", "gpu_counts", default="8", show_default=True, metavar="N|LIST|A-B",
              help="GPU count, a list (8,16,64) or a doubling range (8-64 = 8,16,32,64).")
@gpu_memory_options
@click.option("--cpu-memory", "cpu_memory", metavar="SIZE", help="Host memory per node for offload (e.g. 1TiB). "
              "[default: twice the node's GPU memory, an assumption the plan states]")
@click.option("--nvme", "nvme", metavar="SIZE", help="NVMe space per node; NVMe offload is searched only when given.")
@click.option("--headroom", type=FiniteFloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="Fraction of GPU memory kept free: a config fits when its peak <= (1 - headroom) x GPU memory.")
@click.option("--global-batch", "global_batch", type=click.IntRange(min=1), metavar="N",
              help="Sequences per optimizer step over all GPUs; grad accumulation = N / (micro-batch x GPUs).")
@click.option("--zero", "zero_stages", metavar="LIST", help="ZeRO stages to search [default: every stage the engine runs].")
@click.option("--offload", "offloads", default="none,cpu", show_default=True, metavar="LIST",
              help="Offload targets to search (none, cpu, nvme); nvme also needs --nvme.")
@click.option("--checkpointing", "checkpointing_modes", default="none,selective,full", show_default=True, metavar="LIST",
              help="Activation checkpointing modes to search.")
@click.option("--micro-batches", "micro_batches", type=click.Choice(["pow2", "all"]), default="pow2", show_default=True,
              help="Micro-batches searched: powers of two, or every whole number, up to --max-micro-batch.")
@click.option("--max-micro-batch", "max_micro_batch", type=click.IntRange(1, MAX_MICRO_BATCH), default=1024, show_default=True, metavar="N",
              help=f"Largest micro-batch searched (at most {MAX_MICRO_BATCH:,}).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="How many configurations to show.")
@_rate("--gpu-tflops", "gpu_tflops", "TFLOPS", "Override the GPU's dense BF16 peak.")
@_rate("--gpu-link-bandwidth", "intra_node_gbps", "GB/s", "GPU-to-GPU bandwidth inside a node, one direction [default: half the preset's NVLink].")
@_rate("--network-bandwidth", "inter_node_gbps", "GB/s", "Network bandwidth per GPU between nodes, one direction [default: 50].")
@_rate("--pcie-bandwidth", "pcie_gbps", "GB/s", "GPU-host bandwidth, one direction [default: half the preset's PCIe].")
@_rate("--cpu-memory-bandwidth", "cpu_memory_gbps", "GB/s", "CPU memory bandwidth per node for the offloaded optimizer [default: 300].")
@_rate("--nvme-bandwidth", "nvme_gbps", "GB/s", "NVMe bandwidth per node [default: 7].")
@click.option("--max-efficiency", type=FiniteFloatRange(0, 1, min_open=True), help="Best fraction of peak FLOP/s a step reaches [default: 0.5].")
@click.option("--half-efficiency-tokens", type=click.IntRange(min=0), help="Tokens per micro-batch at half of --max-efficiency [default: 1024].")
@click.option("--emit", nargs=2, type=(click.Choice(["deepspeed", "fsdp", "torchtitan"]), click.Path(dir_okay=False)),
              metavar="deepspeed|fsdp|torchtitan FILE",
              help="Write the best plan as a DeepSpeed JSON config, or as an FSDP2 Python snippet (with --engine fsdp2), "
              "or (with --mesh) as a torchtitan job TOML (a DeepSpeed JSON with AutoTP/Ulysses for --engine deepspeed).")
@click.option("--mesh", "mesh_search", is_flag=True, default=False,
              help="Search tensor, context, pipeline and expert parallel degrees, HSDP and the pipeline schedule too "
              "(engine fsdp2, or deepspeed: AutoTP and Ulysses; one GPU count): the cheapest meshes whose worst rank "
              "fits. Mesh options given (--tp 8) stay fixed; without --mesh, the mesh they (or --config) give is "
              "planned as it is.")
@mesh_options
@output_options
def command(**options: Any) -> None:
    """Find the configurations of MODEL that fit the GPUs (ZeRO stage x offload x checkpointing x
    micro-batch, and GPU counts when a range is given), rank them by an estimated step cost, and
    say why each ranks where it does. If nothing fits, say the smallest change that would.

    The cost model (zeroplan/plan/cost.py) states its assumptions; override any of them with the
    bandwidth and efficiency options.

    \b
    Examples:
      zeroplan plan llama-2-7b --gpu h100-80gb --gpus 8
      zeroplan plan llama-2-13b --gpu a100-40gb --gpus 8-64 --global-batch 512 --seq-len 4096
      zeroplan plan llama-3-70b --gpu h100-80gb --gpus 16 --cpu-memory 2TiB --nvme 8TB --offload none,cpu,nvme
      zeroplan plan llama-2-7b --gpu-memory 24GiB --gpus 4 --emit deepspeed ds_config.json
    """
    from zeroplan.cli.grid_options import base_training, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.plan.cost import assumptions_for
    from zeroplan.errors import SpecError
    from zeroplan.importers.options import host_memory_bytes, load_config, model_from_options
    from zeroplan.plan.search import Limits, SearchSpace, parse_gpu_counts, plan
    from zeroplan.report.plan import render_plan
    from zeroplan.spec.training import Checkpointing, Engine, Offload
    from zeroplan.spec.units import parse_size_bytes

    from zeroplan.spec.files import is_stdout, writable_file

    if options["emit"]:
        writable_file(options["emit"][1], "--emit", stdout=True)  # before the search, not after it
    # `--emit KIND -` puts the file on standard output, so the table goes to standard error
    options["table_to_stderr"] = bool(options["emit"]) and is_stdout(options["emit"][1])
    preset, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    if gpu_memory is None:
        raise click.UsageError("give the GPU: --gpu NAME (e.g. h100-80gb) or --gpu-memory SIZE (e.g. 80GiB)")
    if options["global_batch"] is not None and options["grad_accum"] is not None:
        raise click.UsageError("--global-batch sets the gradient accumulation; do not give --grad-accum too")
    offload_choices = parse_choice_list(options["offloads"], "--offload", [o.value for o in Offload])
    if "nvme" in offload_choices and options["nvme"] is None:
        raise click.UsageError("--offload nvme needs --nvme SIZE, the NVMe space per node (e.g. --nvme 8TB)")
    gpu_counts = parse_gpu_counts(options["gpu_counts"])
    space = SearchSpace(
        zero_stages=None if options["zero_stages"] is None else parse_int_list(options["zero_stages"], "--zero", 0, 3),
        offload_targets=tuple(Offload(o) for o in offload_choices),
        checkpointing=tuple(Checkpointing(c) for c in parse_choice_list(options["checkpointing_modes"], "--checkpointing", [c.value for c in Checkpointing])),
        gpu_counts=gpu_counts,
        max_micro_batch=options["max_micro_batch"],
        micro_batches=options["micro_batches"],
        global_batch=options["global_batch"],
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
    rates = ("gpu_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_memory_gbps", "nvme_gbps",
             "max_efficiency", "half_efficiency_tokens")
    assumptions = assumptions_for(preset, **{name: options[name] for name in rates})

    options["config_file"] = config = load_config(options["config_file"])  # read once, for every grid point
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    emit_kind = (options["emit"] or ("",))[0]
    if options["mesh_search"]:
        _plan_mesh(options, model, space, limits, assumptions, gpu_counts, fixed=False)
        return
    if any(options[f"mesh_{name}"] is not None for name in ("tp", "cp", "pp", "ep", "dp_replicate")):
        _plan_mesh(options, model, space, limits, assumptions, gpu_counts, fixed=True)  # the mesh given, as it is
        return
    base = base_training(options, space.zero_stages or (0, 1, 2, 3), max(gpu_counts), model)
    if not base.mesh.is_trivial:  # a --config's mesh (torchtitan [parallelism])
        _plan_mesh(options, model, space, limits, assumptions, gpu_counts, fixed=True)
        return
    if emit_kind == "torchtitan":
        raise click.UsageError(f"--emit {emit_kind} writes a mesh plan: add --mesh")
    emit = options["emit"]
    if emit and emit[0] == "fsdp" and base.engine != Engine.FSDP2:
        raise SpecError("--emit fsdp: plan with --engine fsdp2, so that the plan models FSDP2's memory")
    result = plan(model, base, space, limits, assumptions, top=options["top"])
    click.echo(render_plan(result, options["output_format"], options["units"]), nl=False, err=options["table_to_stderr"])
    if cpu_memory_note and "cpu" in offload_choices and options["output_format"] in ("table", "markdown"):
        # the assumption bounds what CPU offload may use: say it (the json carries it as cpu_memory_per_node)
        click.echo(f"note: {cpu_memory_note}", err=True)
    if emit:
        if not result.top:
            raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
        _emit(emit[0], emit[1], result.top[0].training)


def _emit(kind: str, path: str, training) -> None:
    import json

    from zeroplan.importers.training_config import write_deepspeed_config, write_fsdp2_snippet
    from zeroplan.spec.files import write_atomic

    if kind == "deepspeed":
        text = json.dumps(write_deepspeed_config(training), indent=2) + "\n"
    else:
        text = write_fsdp2_snippet(training)
    write_atomic(path, text, "--emit")
    where, path = _written(path, kind)
    extra = f" --checkpointing {training.checkpointing.value}" if training.checkpointing.value != "none" else ""
    from zeroplan.importers.lora_options import lora_command_options

    extra += lora_command_options(training)  # a DeepSpeed JSON carries no adapters
    nvme = ""
    if kind == "deepspeed" and "nvme" in (training.offload_optimizer.value, training.offload_params.value):
        from zeroplan.importers.deepspeed_json import NVME_PATH_PLACEHOLDER

        nvme = f"; set nvme_path (written as {NVME_PATH_PLACEHOLDER}) to a folder on your NVMe drive"
    click.echo(
        f"wrote {where} ({kind}, plan #1); check it with: zeroplan estimate MODEL --config {path} --gpus {training.gpus} "
        f"--seq-len {training.seq_len}{extra}{nvme}" if kind == "deepspeed" else f"wrote {where} ({kind}, plan #1)",
        err=True,
    )


def _written(path: str, kind: str) -> tuple[str, str]:
    """(what was written where, the name to give it back as) for the message after --emit: `-` is standard output."""
    from zeroplan.spec.files import is_stdout

    return (f"the {kind} file to standard output", "FILE") if is_stdout(path) else (path, path)


def _config_engine(options: dict, space, gpus: int, model) -> str | None:
    """The engine a --config names (a DeepSpeed JSON: deepspeed), or None where it does not validate yet."""
    from zeroplan.cli.grid_options import base_training
    from zeroplan.errors import SpecError

    try:
        return base_training(options, space.zero_stages or (2, 1, 3), gpus, model).engine.value
    except SpecError:
        return None


def _plan_mesh(options: dict, model, space, limits, assumptions, gpu_counts: tuple[int, ...], fixed: bool) -> None:
    """`--mesh`: the mesh search of zeroplan.plan.mesh (the dimensions given fixed), its table, and --emit
    torchtitan (issue 14); `fixed`: the mesh the options or --config give, planned as it is."""
    from zeroplan.cli.grid_options import base_training
    from zeroplan.errors import SpecError
    from zeroplan.plan.mesh import mesh_plan_to_dict, plan_mesh
    from zeroplan.report.mesh import render_mesh_plan
    from zeroplan.spec.mesh import MeshSpec
    from zeroplan.spec.training import Engine

    if len(gpu_counts) != 1:
        raise click.UsageError(f"{'a mesh is planned on' if fixed else '--mesh searches the meshes of'} one GPU count: "
                               "give --gpus N")
    emit = options["emit"]
    # AutoTP and Ulysses, written as a DeepSpeed JSON (issue 14): --engine deepspeed, or a DeepSpeed --config
    deepspeed = options["engine"] == "deepspeed" or (options["engine"] is None and options["config_file"] is not None
                                                     and _config_engine(options, space, gpu_counts[0], model) == "deepspeed")
    if emit and options["engine"] is None and options["config_file"] is None:
        # no engine named: the file asked for names it (a torchtitan TOML runs FSDP2), rather than the default
        # engine (deepspeed) refusing the torchtitan recipe after --emit deepspeed was refused for the mesh
        deepspeed = emit[0] == "deepspeed"
        if not deepspeed:
            options = {**options, "engine": "fsdp2"}
    wanted = "deepspeed" if deepspeed else "torchtitan"
    if emit and emit[0] != wanted:
        raise click.UsageError(f"{'a mesh plan' if fixed else '--mesh'} writes a "
                               f"{'DeepSpeed JSON' if deepspeed else 'torchtitan TOML'}: use --emit {wanted} FILE, "
                               f"not {emit[0]}")
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
    click.echo(render_mesh_plan(mesh_plan_to_dict(result), options["output_format"], options["units"]), nl=False,
               err=options["table_to_stderr"])
    if emit:
        if not result.top:
            raise SpecError(f"--emit {emit[0]}: nothing fits, so there is no plan to write")
        if deepspeed:
            from zeroplan.cli.plan_deepspeed_mesh import emit_deepspeed_mesh

            return emit_deepspeed_mesh(emit[1], model, result.top[0])
        from zeroplan.importers.torchtitan_write import write_torchtitan_toml
        from zeroplan.spec.files import write_atomic

        from zeroplan.estimate import estimate_mesh
        from zeroplan.importers.options import training_spec_from_options

        best = result.top[0]
        write_atomic(emit[1], write_torchtitan_toml(best.training, result.model_name), "--emit")
        if options["table_to_stderr"]:  # nothing to read back from standard output
            return click.echo(f"wrote the torchtitan TOML to standard output (plan #1); check it with: zeroplan "
                              f"estimate --config FILE --gpus {best.training.gpus}", err=True)
        # read it back as `zeroplan estimate --config` does: the same per-rank peaks, or say where it differs
        back = estimate_mesh(model, training_spec_from_options({"gpus": best.training.gpus, "gpu": options["gpu"]}, emit[1], model))
        peaks = [rank.estimate.peak_bytes for rank in back.ranks]
        same = peaks == [rank.estimate.peak_bytes for rank in best.estimate.ranks]
        verdict = "it reads back to the same estimate" if same else (
            f"it reads back to a worst rank of {back.worst.estimate.peak_bytes:,} bytes, not "
            f"{best.estimate.worst.estimate.peak_bytes:,}: the TOML states torchtitan's program (recipe torchtitan)")
        click.echo(f"wrote {emit[1]} (torchtitan, plan #1); {verdict}; check it with: zeroplan estimate --config "
                   f"{emit[1]} --gpus {best.training.gpus}", err=True)
