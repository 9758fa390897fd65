"""`zeroplan measure`: run real training steps and print the measured memory beside the estimate."""

from __future__ import annotations

import sys
from typing import Any

import click

from zeroplan.cli.common import FiniteFloatRange, model_options, training_options
from zeroplan.cli.mesh_options import MESH_OPTIONS
from zeroplan.errors import MissingDependencyError
from zeroplan.spec.units import REPORT_UNITS, REPORT_UNITS_HELP

def mesh_options(function):
    """--tp, --pp, ... (cli/mesh_options.py): measure runs a mesh as zeroplan/measure/mesh.py says."""
    for option in reversed(MESH_OPTIONS):
        function = option(function)
    return function


IMPLEMENTATIONS = ("auto", "hf", "reference")  # zeroplan.measure.workload.IMPLEMENTATIONS (that module imports torch)
EXIT_DOES_NOT_FIT = 3
"""Exit status when a rank ran out of device memory: the result ("does not fit", with the peak
reached) is still printed and written; 2 is a user error or a failed run, as for every command."""


@click.command("measure")
@model_options
@training_options
@mesh_options
@click.option("--nproc", type=click.IntRange(min=1), required=True, help="Ranks to run (local worker processes; simulated ranks with --simulate).")
@click.option("--simulate", is_flag=True, help="One process simulating --nproc ranks (fake tensors and process group; fsdp2 only).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), help="gloo: CPU processes; nccl: one process per GPU. [default: nccl where GPUs are visible, else gloo]")
@click.option("--steps", type=click.IntRange(min=2), default=2, show_default=True, help="Training steps (step 1 creates the optimizer states; 2 and later are the steady state).")
@click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True, help="Seconds before every worker is stopped.")
@click.option("--implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True, help="Model code: hf (transformers), reference (zeroplan's own), auto (hf where installed).")
@click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table", show_default=True, help="Output on stdout; json is a stable contract with sizes in bytes.")
@click.option("--output", type=click.Path(dir_okay=False), metavar="FILE", help="Also write the JSON to FILE (atomically; nothing is written when the run fails); - writes it to standard output and the table to standard error.")
@click.option("--units", type=click.Choice(REPORT_UNITS), default="GiB", show_default=True, help=REPORT_UNITS_HELP)
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
    from zeroplan.importers.options import load_config, model_from_options, training_spec_from_options
    from zeroplan.measure.launcher import DEFAULT_RECIPE, choose_backend, measured_device, run_measurement
    from zeroplan.spec.files import is_stdout, writable_file

    if options["output"] is not None:
        writable_file(options["output"], "--output", stdout=True)  # before the run, not after it
    nproc, simulate = options["nproc"], options["simulate"]
    if simulate and options["backend"]:
        raise click.UsageError(f"--simulate runs the fake backend; leave out --backend {options['backend']}")
    if options["gpus"] not in (None, nproc):
        raise click.UsageError(f"--gpus {options['gpus']} must equal --nproc {nproc} (the ranks measured); leave out --gpus")
    _require("torch", "zeroplan measure runs PyTorch; install it with: pip install torch")
    backend = choose_backend(options["backend"], simulate)
    device = measured_device(backend).value
    if options["device"] not in (None, device):
        raise click.UsageError(f"--device {options['device']} does not match a {backend} run, which measures {device} memory; leave out --device")

    config = load_config(options["config_file"])
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    recipe = options["recipe"] or DEFAULT_RECIPE
    training = training_spec_from_options(options | {"gpus": nproc, "device": device, "recipe": recipe}, config, model)
    engine_config = None
    if training.engine.value == "deepspeed":
        _require("deepspeed", "engine deepspeed needs DeepSpeed; install it with: pip install 'zeroplan[deepspeed]'")
        if config is not None and config.kind == "DeepSpeed JSON":
            from zeroplan.importers.deepspeed_json import load_json

            engine_config = load_json(config.path)
            from zeroplan.measure.engines.deepspeed_engine import user_config

            user_config(engine_config, training, nproc)  # a stage or batch that disagrees fails here, before any rank starts

    from zeroplan.estimate.mesh import estimate_mesh
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.measure.comparison import compare, run_peaks
    from zeroplan.report.measure import render_table, report_data

    # the worst rank kind on a mesh, set against the rank that peaks highest; before the run: its errors come first
    estimated = estimate_to_dict(estimate_mesh(model, training).worst.estimate, training)
    result = run_measurement(
        model, training, nproc=nproc, backend=backend, simulate=simulate,
        steps=options["steps"], timeout_s=options["timeout_s"], implementation=options["implementation"],
        engine_config=engine_config,
    )
    if training.mesh.ep > 1 and options.get("mesh_moe_imbalance") is None:  # estimated with the routing the run had
        from zeroplan.measure.grid_ep import with_measured_imbalance

        estimated = estimate_to_dict(estimate_mesh(model, with_measured_imbalance(training, result.notes)).worst.estimate,
                                     training)
    measured = result.to_json_dict()
    comparison = compare(estimated["phases"], run_peaks(measured))
    data = report_data(estimated, measured, comparison)
    import json

    if options["output"] is not None:
        from zeroplan.spec.files import write_atomic  # temp file + os.replace, through symlinks; - is stdout

        write_atomic(options["output"], json.dumps(data), "--output")
    report_to_stderr = is_stdout(options["output"])  # `--output -`: standard output holds the JSON alone
    if options["output_format"] == "json":
        click.echo(json.dumps(data, indent=2), err=report_to_stderr)
    else:
        click.echo(render_table(data, comparison, options["units"]), nl=False, err=report_to_stderr)
    if not result.fits:
        sys.exit(EXIT_DOES_NOT_FIT)


def _require(package: str, message: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise MissingDependencyError(message)
