"""`zeroplan compare`: the memory of a grid of ZeRO configurations, side by side (`zeroplan.compare`, printed)."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import apply_options
from zeroplan.cli.grid_options import compare_option_list


@click.command("compare")
@apply_options(compare_option_list())
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
    from zeroplan.api.estimates import compare_from_options

    result = compare_from_options(options)
    click.echo(result.render(options["output_format"], options["units"]), nl=False)
    if options["plot_file"]:
        path = result.plot(options["plot_file"], options["units"])
        click.echo(f"wrote {path}", err=True)
