"""`zeroplan compare`: the memory of a grid of ZeRO configurations, side by side."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import FiniteFloatRange, output_options
from zeroplan.cli.grid_options import estimate_options_except, gpu_memory_options
from zeroplan.cli.mesh_options import mesh_options


@click.command("compare")
@estimate_options_except({"gpus", "zero_stage", "offload_optimizer", "offload_params", "gpu_memory"})
@click.option("--zero", "zero_stages", default="0,1,2,3", show_default=True, metavar="LIST", help="ZeRO stages to compare, e.g. 0,1,2,3.")
@click.option("--gpus", "gpu_counts", default="8", show_default=True, metavar="N|LIST|A-B",
              help="GPU counts to compare: a count, a list (8,64) or a doubling range (8-64 = 8,16,32,64).")
@click.option("--offload", "offloads", default="none", show_default=True, metavar="LIST",
              help="Offload choices: none, cpu, nvme (optimizer states at stages 1-2, optimizer states and parameters at "
                   "stage 3), cpu-optimizer, nvme-optimizer (optimizer states only, any stage >= 1).")
@gpu_memory_options
@click.option("--headroom", type=FiniteFloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Fraction of GPU memory to keep free when deciding whether a config fits.")
@mesh_options
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), metavar="FILE.png",
              help="Also draw the per-GPU breakdown as stacked bars (needs matplotlib: pip install 'zeroplan[plot]').")
@output_options
def command(**options: Any) -> None:
    """Compare the per-GPU memory of MODEL over ZeRO stages x GPU counts x offload targets: one
    row per configuration with its breakdown at the peak, host memory per node, the saving against
    ZeRO-0 on the same GPU count, and whether it fits. Combinations the engine cannot run are
    skipped and listed.

    \b
    Examples:
      zeroplan compare llama-2-7b --zero 0,1,2,3 --gpus 8,64 --offload none,cpu --gpu h100-80gb
      zeroplan compare llama-2-13b --gpus 16 --offload none,cpu,cpu-optimizer --plot zero.png
      zeroplan compare --params 7.5e9 --engine paper --gpus 64 --units GB --format markdown
    """
    from zeroplan.cli.grid_options import base_training, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.plan.grid import OFFLOAD_CHOICES, compare
    from zeroplan.plan.search import parse_gpu_counts
    from zeroplan.report.compare import render_comparison
    from zeroplan.importers.options import load_config, model_from_options

    from zeroplan.spec.files import writable_file

    if options["plot_file"]:  # before the grid is estimated
        from zeroplan.report.plot import check_plotting

        writable_file(options["plot_file"], "--plot")
        check_plotting()
    stages = parse_int_list(options["zero_stages"], "--zero", 0, 3)
    gpu_counts = parse_gpu_counts(options["gpu_counts"])  # plan's parser: a list, or a doubling range 8-64
    offloads = parse_choice_list(options["offloads"], "--offload", OFFLOAD_CHOICES)
    _, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    options["config_file"] = config = load_config(options["config_file"])  # read once, for every grid point
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    base = base_training(options, stages, max(gpu_counts), model)
    estimator = None
    if not base.mesh.is_trivial:  # every row is the worst rank of the mesh (issue 14)
        from zeroplan.estimate.mesh import worst_rank_estimate as estimator
    comparison = compare(model, base, stages, gpu_counts, offloads, gpu_memory, options["headroom"], estimator)
    click.echo(render_comparison(comparison, options["output_format"], options["units"]), nl=False)
    if options["plot_file"]:
        from zeroplan.report.plot import plot_comparison

        path = plot_comparison(comparison, options["plot_file"], options["units"])
        click.echo(f"wrote {path}", err=True)
