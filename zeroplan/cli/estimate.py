"""`zeroplan estimate`: the per-GPU memory of one training configuration (`zeroplan.estimate`, printed)."""

from __future__ import annotations

from typing import Any

import click

from zeroplan.cli.common import apply_options, estimate_option_list


@click.command("estimate")
@apply_options(estimate_option_list())
@click.option("--explain", "explain", is_flag=True, help="Also list the terms live at the peak (name, category, bytes, "
              "source), largest first; with --format csv, the terms instead of the phases. The JSON always has them.")
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
      zeroplan estimate llama-2-7b --gpus 8 --zero 3 --explain
      zeroplan estimate llama-3.1-8b --gpus 128 --gpu h100-80gb --engine fsdp2 --zero 3 --recipe torchtitan --seq-len 8192 --micro-batch 2
    """
    from zeroplan.api.estimates import estimate_from_options

    explain = options.pop("explain")
    result = estimate_from_options(options)
    click.echo(result.render(options["output_format"], options["units"], explain=explain), nl=False)
