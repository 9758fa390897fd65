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
    """
    from zeroplan.importers.options import input_notes, load_config, model_from_options, training_spec_from_options

    config = load_config(options["config_file"])
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    training = training_spec_from_options(options, config, model)
    notes = input_notes(model, training, config, options["model"])

    if not training.mesh.is_trivial:  # tp, cp, pp, ep or HSDP: one estimate per rank kind (issue 14)
        from zeroplan.estimate.mesh import estimate_mesh
        from zeroplan.estimate.serialize_mesh import mesh_estimate_to_dict
        from zeroplan.report.mesh import render_mesh_estimate

        data = mesh_estimate_to_dict(estimate_mesh(model, training), training, gpu_memory_bytes=options["gpu_memory"],
                                     notes=notes)
        click.echo(render_mesh_estimate(data, options["output_format"], options["units"]), nl=False)
        return

    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.report.estimate import render_estimate

    data = estimate_to_dict(estimate(model, training), training, gpu_memory_bytes=options["gpu_memory"],
                            notes=notes)
    click.echo(render_estimate(data, options["output_format"], options["units"]), nl=False)
