"""`zeroplan estimate`: the per-GPU memory of one training configuration."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import estimate_options, output_options
from zeroplan.cli.plan_options import estimate_step_options


@click.command("estimate")
@estimate_options
@estimate_step_options
@output_options
def command(**options: Any) -> None:
    """Estimate the memory per GPU of training MODEL: by category at the peak, phase by phase,
    and per node under offload.

    MODEL is a catalogue name (see `zeroplan models`), a model spec file, or a Hugging Face
    config.json; or give --params instead, or leave it to a --config file that names the model
    (a torchtitan TOML, a torchtune YAML). Options override the --config file.

    \b
    Examples:
      zeroplan estimate llama-2-7b --gpus 8 --zero 3
      zeroplan estimate llama-2-7b --gpus 8 --zero 2 --micro-batch 4 --seq-len 4096 --gpu-memory 80GiB
      zeroplan estimate mixtral-8x7b --gpus 64 --zero 3 --offload-optimizer cpu --checkpointing full
      zeroplan estimate gpt2 --engine fsdp2 --zero 3 --gpus 2 --device cpu --format json
      zeroplan estimate ./config.json --gpus 16 --config ds_config.json
      zeroplan estimate --config llama3_8b.toml --gpus 8
      zeroplan estimate --config 1B_full_single_device.yaml
      zeroplan estimate --params 7.5e9 --gpus 64 --zero 3 --engine paper --units GB
      zeroplan estimate llama-3-70b --gpus 64 --tp 8 --zero 3 --engine fsdp2 --seq-len 8192
      zeroplan estimate llama-3-70b --gpus 64 --tp 8 --pp 4 --grad-accum 8 --zero 3 --engine fsdp2
      zeroplan estimate llama-3.1-8b --gpus 128 --gpu h100-80gb --engine fsdp2 --zero 3 --recipe torchtitan --seq-len 8192 --micro-batch 2
    """
    from zeroplan.cli.grid_options import resolve_gpu
    from zeroplan.cli.plan_options import priced
    from zeroplan.importers.options import load_config, model_from_options, training_spec_from_options

    preset, options["gpu_memory"] = resolve_gpu(options["gpu"], options["gpu_memory"])
    config = load_config(options["config_file"])
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    training = training_spec_from_options(options, config, model)

    if not training.mesh.is_trivial:  # tp, cp, pp, ep or HSDP: one estimate per rank kind (issue 14)
        from zeroplan.estimate.mesh import estimate_mesh
        from zeroplan.estimate.serialize_mesh import mesh_estimate_to_dict
        from zeroplan.report.mesh import render_mesh_estimate

        data = mesh_estimate_to_dict(estimate_mesh(model, training), training, gpu_memory_bytes=options["gpu_memory"],
                                     notes=config.notes if config else ())
        lines = priced(data, model, training, preset, options["gpu_memory"], options)  # `step`, `suggestions`
        click.echo(render_mesh_estimate(data, options["output_format"], options["units"]), nl=False)
        _echo_lines(lines, options["output_format"])
        return

    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.report.estimate import render_estimate

    data = estimate_to_dict(estimate(model, training), training, gpu_memory_bytes=options["gpu_memory"],
                            notes=config.notes if config else ())
    lines = priced(data, model, training, preset, options["gpu_memory"], options)  # `step`, `suggestions`
    click.echo(render_estimate(data, options["output_format"], options["units"]), nl=False)
    _echo_lines(lines, options["output_format"])


def _echo_lines(lines: list[str], output_format: str) -> None:
    """The step and the suggestions under a table or Markdown (JSON carries them as keys, CSV has no room)."""
    if lines and output_format in ("table", "markdown"):
        click.echo("\n" + "\n".join(lines))
