"""`zeroplan measure`: run real training steps and print the measured memory beside the estimate
(`zeroplan.measure`, printed)."""

from __future__ import annotations

import sys
from typing import Any

import click

from zeroplan.cli.common import apply_options
from zeroplan.cli.measure_options import MEASURE_OPTIONS

EXIT_DOES_NOT_FIT = 3
"""Exit status when a rank ran out of device memory: the result ("does not fit", with the peak
reached) is still printed and written; 2 is a user error or a failed run, as for every command."""


@click.command("measure")
@apply_options(MEASURE_OPTIONS)
def command(**options: Any) -> None:
    """Run real training steps of MODEL on --nproc ranks and print the memory each rank used,
    by category at the peak, beside the estimate for the same configuration, with the error
    (estimate / measured - 1), for the steady state and the first step.

    MODEL and the training options mean what they mean for `zeroplan estimate`; --gpus, if
    given, must equal --nproc. The device is cpu for gloo and --simulate, cuda for nccl.
    With --engine deepspeed, a --config DeepSpeed JSON is passed to deepspeed.initialize as is.
    Exit status: 0 measured; 2 bad options or a failed run (the failing rank named);
    3 a rank ran out of device memory (the result says "does not fit").

    \b
    Examples:
      zeroplan measure tiny-llama --engine torch --zero 1 --nproc 2 --precision fp32 --seq-len 128
      zeroplan measure tiny-gpt2 --engine fsdp2 --zero 3 --nproc 2 --format json --output m.json
      zeroplan measure llama-1b --engine fsdp2 --zero 3 --nproc 64 --simulate --seq-len 512 --units GB
      zeroplan measure llama-2-7b --engine deepspeed --zero 3 --nproc 8 --backend nccl --config ds.json
    """
    from zeroplan.api.measurements import measure_from_options
    from zeroplan.cli.progress import MeasureProgress, StatusLine

    status = StatusLine()  # each rank's phase and DeepSpeed's builds, on a terminal only
    status.show(f"measuring on {options['nproc']} {'simulated ' if options['simulate'] else ''}ranks ...")
    try:
        report = measure_from_options(options, MeasureProgress(status, options["steps"]) if status.tty else None)
    finally:
        status.clear()
    if report is None:  # a node other than 0 of a run across nodes
        first = options["node_rank"] * options["nproc"]
        click.echo(f"node {options['node_rank']} of {options['nnodes']}: ranks {first}-{first + options['nproc'] - 1} "
                   "measured; node 0 prints and writes the result", err=True)
        return
    from zeroplan.spec.files import is_stdout

    text = report.render(options["output_format"], options["units"])
    click.echo(text, nl=False, err=is_stdout(options["output"]))  # `--output -`: standard output holds the JSON alone
    if not report.fits:
        sys.exit(EXIT_DOES_NOT_FIT)
