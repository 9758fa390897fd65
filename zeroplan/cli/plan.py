"""`zeroplan plan`: the cheapest configurations that fit, ranked, and the engine config to launch."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import output_options
from zeroplan.cli.grid_options import estimate_options_except, gpu_memory_options
from zeroplan.cli.mesh_options import mesh_options
from zeroplan.cli.plan_options import step_options
from zeroplan.cli.types import FiniteFloatRange
from zeroplan.plan.limits import MAX_MICRO_BATCH


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
    from zeroplan.api.plans import plan_from_options
    from zeroplan.spec.files import is_stdout

    result = plan_from_options(options)
    # `--emit KIND -` puts the file on standard output, so the table goes to standard error
    table_to_stderr = result.emitted is not None and is_stdout(result.emitted)
    click.echo(result.render(options["output_format"], options["units"]), nl=False, err=table_to_stderr)
    if options["output_format"] in ("table", "markdown"):  # the JSON carries them as fields
        for note in result.assumptions:
            click.echo(f"note: {note}", err=True)
    if result.emit_message:
        click.echo(result.emit_message, err=True)
