"""`zeroplan estimate`: the per-GPU memory of one training configuration."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import estimate_options, output_options


@click.command("estimate")
@estimate_options
@output_options
def command(**options: Any) -> None:
    """Estimate the memory per GPU of training MODEL: by category at the peak, phase by phase,
    and per node under offload.

    MODEL is a catalogue name (see `zeroplan models`), a model spec file, or a Hugging Face
    config.json; or give --params instead. Options override the --config file.

    \b
    Examples:
      zeroplan estimate llama-2-7b --gpus 8 --zero 3
      zeroplan estimate llama-2-7b --gpus 8 --zero 2 --micro-batch 4 --seq-len 4096 --gpu-memory 80GiB
      zeroplan estimate mixtral-8x7b --gpus 64 --zero 3 --offload-optimizer cpu --checkpointing full
      zeroplan estimate gpt2 --engine fsdp2 --zero 3 --gpus 2 --device cpu --format json
      zeroplan estimate ./config.json --gpus 16 --config ds_config.json
      zeroplan estimate --params 7.5e9 --gpus 64 --zero 3 --engine paper --units GB
    """
    from zeroplan.importers.options import model_from_options, training_spec_from_options

    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"])
    training = training_spec_from_options(options, options["config_file"], model)

    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.report.estimate import render_estimate

    data = estimate_to_dict(estimate(model, training), training, gpu_memory_bytes=options["gpu_memory"])
    click.echo(render_estimate(data, options["output_format"], options["units"]), nl=False)
