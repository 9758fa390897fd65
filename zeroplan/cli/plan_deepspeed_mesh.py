"""`zeroplan plan --mesh --engine deepspeed --emit deepspeed FILE`: the best mesh as a DeepSpeed JSON (AutoTP's
`tensor_parallel.autotp_size`, Ulysses' `sequence_parallel_size`: importers/deepspeed_mesh.py), read back as
`zeroplan estimate --config` reads it."""

from __future__ import annotations

import json

import click


def readback_options(training) -> dict:
    """What a DeepSpeed JSON cannot carry, given beside it on the command line."""
    options = {"gpus": training.gpus, "seq_len": training.seq_len, "checkpointing": training.checkpointing.value,
               "recipe": training.recipe.value}
    return options | ({"gpu": training.gpu.name} if training.gpu is not None else {})


def emit_deepspeed_mesh(path: str, model, best) -> None:
    from zeroplan.estimate import estimate_mesh
    from zeroplan.importers.options import training_spec_from_options
    from zeroplan.importers.training_config import write_deepspeed_config
    from zeroplan.spec.files import is_stdout, write_atomic

    training = best.training
    write_atomic(path, json.dumps(write_deepspeed_config(training), indent=2) + "\n", "--emit")
    options = readback_options(training)
    # the GPU is named to estimate by --gpu-memory NAME
    flags = " ".join(f"--{'gpu-memory' if name == 'gpu' else name.replace('_', '-')} {value}" for name, value in options.items())
    if is_stdout(path):  # nothing to read back from standard output
        return click.echo(f"wrote the DeepSpeed config to standard output (deepspeed, plan #1); check it with: "
                          f"zeroplan estimate {model.name} --config FILE {flags}", err=True)
    back = estimate_mesh(model, training_spec_from_options(options, path, model))
    same = [r.estimate.peak_bytes for r in back.ranks] == [r.estimate.peak_bytes for r in best.estimate.ranks]
    verdict = "it reads back to the same estimate" if same else (
        f"it reads back to a worst rank of {back.worst.estimate.peak_bytes:,} bytes, not "
        f"{best.estimate.worst.estimate.peak_bytes:,}")
    click.echo(f"wrote {path} (deepspeed, plan #1); {verdict}; check it with: zeroplan estimate {model.name} "
               f"--config {path} {flags}", err=True)
