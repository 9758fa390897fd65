"""`zeroplan validate`: estimate and measure the accuracy grid, and write docs/accuracy.md and .json."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from zeroplan.cli.common import units_option
from zeroplan.cli.types import FiniteFloatRange
from zeroplan.cli.progress import StatusLine, bar

from zeroplan.measure.validate import BACKENDS, DEFAULT_STEPS, DEFAULT_TIMEOUT_S, MEASURE_MODES


@click.command("validate")
@click.option("--rows", "patterns", metavar="PATTERN[,PATTERN]",
              help="Only the rows whose id matches: a glob (tiny-llama/fsdp2-*) or a substring (deepspeed-3). "
                   "The other rows keep their cached measurements in the report.")
@click.option("--quick", is_flag=True, help="Only the CI slice (a few fast rows; tests/measure/test_accuracy_slice.py).")
@click.option("--grid", "grid_name", type=click.Choice(("accuracy", "gpu-1", "gpu-8", "gpu-1-quant")), default="accuracy",
              show_default=True,
              help="accuracy: the CPU accuracy grid (docs/accuracy.md); gpu-1, gpu-8: the GPU checks of allocated, "
                   "reserved and device memory on 1 or 8 GPUs, each under 10 minutes; gpu-1-quant: bitsandbytes' paged "
                   "and 8-bit optimizers and QLoRA on one GPU (needs --backend nccl; docs/measure.md).")
@click.option("--skip-deepspeed-offload", is_flag=True,
              help="Leave out the DeepSpeed optimizer-offload rows (they need the cpu_adam JIT build: ~1 min, 2 GB RAM).")
@click.option("--backend", type=click.Choice(BACKENDS), default="gloo", show_default=True,
              help="gloo: CPU worker processes; nccl: one process per GPU (simulated rows always run the fake backend).")
@click.option("--measure", "measure", type=click.Choice(MEASURE_MODES), default="all", show_default=True,
              help="Measure all selected rows, only those missing from the cache (the JSON), or none (re-estimate "
                   "every row against the cached measurements).")
@click.option("--steps", type=click.IntRange(min=2), default=DEFAULT_STEPS, show_default=True,
              help="Training steps per measurement (step 1 is the first step, later ones the steady state).")
@click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=1), default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds allowed per row.")
@click.option("--output-md", type=click.Path(dir_okay=False, path_type=Path),
              help="Markdown report [default: docs/accuracy.md; docs/accuracy_gpu.md with --backend nccl].")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON report, also the measurement cache [default: docs/accuracy.json; docs/accuracy_gpu.json with nccl].")
@click.option("--reasons", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Why rows miss the targets: \"row id or glob\" = \"reason\" [default: the checkout's docs/accuracy_reasons.toml].")
@click.option("--format", "output_format", type=click.Choice(["table", "html"]), default="table", show_default=True,
              help="What standard output gets at the end: the table of the rows run, or the whole JSON report as one "
                   "self-contained HTML page (the error distribution, every row, the published runs).")
@units_option("MiB", " The terminal's table and progress lines; the markdown report is in MiB.")
def command(patterns, quick, grid_name, skip_deepspeed_offload, backend, measure, steps, timeout_s, output_md, output_json,
            reasons, output_format, units):
    """Estimate and measure a grid of configurations (models x engines x stages x precision x offload x
    checkpointing x batch x world size), one row at a time, and report the estimate's error per row
    and category with its distribution. Measurements are cached by row id in the JSON report.

    \b
    Examples:
      zeroplan validate                              # the whole grid (about an hour on 2 cores)
      zeroplan validate --quick                      # the CI slice, a couple of minutes
      zeroplan validate --rows 'tiny-llama/fsdp2-*'  # re-measure some rows, keep the rest
      zeroplan validate --measure none               # re-estimate against cached measurements
      zeroplan validate --measure none --format html > accuracy.html
      zeroplan validate --backend nccl               # the same grid on 2 GPUs
      zeroplan validate --backend nccl --grid gpu-8  # allocated/reserved/device on 8 GPUs
    """
    from zeroplan.measure import validate as v
    from zeroplan.measure.grid import GRID, select_rows
    from zeroplan.measure.grid_gpu import GRIDS
    from zeroplan.report.accuracy import render_terminal, row_line, write_report

    from zeroplan.spec.files import writable_file

    if grid_name != "accuracy" and backend != "nccl":
        raise click.UsageError(f"--grid {grid_name} runs on GPUs: add --backend nccl")
    grid = GRID if grid_name == "accuracy" else GRIDS[grid_name]
    selected = select_rows(grid, patterns, quick=quick, skip_deepspeed_offload=skip_deepspeed_offload)
    v.check_gpus(selected, backend)  # before anything is written
    defaults = v.default_outputs(backend, grid_name)
    if defaults is None and (output_md is None or output_json is None):
        raise click.UsageError("outside a zeroplan checkout there is no docs/ folder to write to: give --output-md and --output-json")
    output_md, output_json = output_md or defaults[0], output_json or defaults[1]
    writable_file(output_md, "--output-md")  # checked before the first row runs, lock file's folder included
    writable_file(output_json, "--output-json")
    if reasons is None and v.checkout_docs() is not None:
        reasons = v.checkout_docs() / "accuracy_reasons.toml"
    options = v.RunOptions(backend=backend, steps=steps, timeout_s=timeout_s, measure=measure)
    reason_map = v.load_reasons(reasons) if reasons is not None else {}
    command_text = "zeroplan validate" + (" --backend nccl" if backend == "nccl" else "") \
        + (f" --grid {grid_name}" if grid_name != "accuracy" else "")
    started = time.monotonic()
    measured: dict = {}  # this run's records, merged into the JSON after every row

    def update(wall_seconds=None):
        return v.update_report(grid, measured, reason_map, backend=backend, steps=steps, command=command_text,
                               json_path=output_json, write=lambda report: write_report(report, output_md, output_json),
                               wall_seconds=wall_seconds)

    status = StatusLine()
    finished = {"rows": 0}

    def on_start(row):
        status.show(f"{bar(finished['rows'], len(selected))} {row.id} ...")

    def on_done(row, record, measured_now):
        finished["rows"] += 1
        if record is not None and measured_now:
            measured[row.id] = record
            update()
        one = v.build_report([row], {row.id: record} if record else {}, reason_map, backend=backend, steps=steps,
                             command=command_text)
        status.line(f"{bar(finished['rows'], len(selected))} {row_line(one.rows[0], units, measured_now)}")

    records = v.load_records(output_json)
    v.check_files(grid, selected, records)  # before the first row runs: the report estimates every cached row too
    v.run_rows(selected, records, options, on_start=on_start, on_done=on_done)
    whole = measure == "all" and len(selected) == len(grid)
    report = update(time.monotonic() - started if whole else None)
    shown = v.Report([r for r in report.rows if r.row in selected], backend, command_text, steps)
    if output_format == "html":
        from zeroplan.report.accuracy import report_json
        from zeroplan.report.html.validate import validate_page

        click.echo(validate_page(report_json(report), units), nl=False)
    else:
        click.echo(render_terminal(shown, report, units))
    failed = [r.row.id for r in shown.rows if r.status == "failed"]
    click.echo(f"wrote {output_md} and {output_json}", err=True)
    if failed:  # a grid with holes is not a result: the status says so, not only the text
        click.echo(f"{len(failed)} of {len(shown.rows)} rows could not be measured (see the report): {', '.join(failed)}", err=True)
        sys.exit(1)
