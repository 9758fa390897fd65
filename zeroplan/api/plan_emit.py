"""`plan --emit KIND FILE`: the best configuration of a plan written as the engine config that runs it
(a DeepSpeed JSON, with AutoTP's and Ulysses' degrees for a DeepSpeed mesh: importers/deepspeed_mesh.py;
an FSDP2 snippet; a torchtitan job TOML), and the line that says what was written and how to check it.
A file that can be read back (every one but standard output) is read back as `zeroplan estimate --config`
reads it, and the line says whether it gives the same per-rank peaks."""

from __future__ import annotations

import json


def emit_plan(kind: str, path: str, model, result, gpu: str | None = None) -> str:
    """Write plan #1 of `result` as `kind` to `path` (`-`: standard output); the message for standard error."""
    best = result.top[0]
    if kind == "torchtitan":
        return _emit_torchtitan(path, model, result, gpu)
    if kind == "deepspeed" and not best.training.mesh.is_trivial:
        return _emit_deepspeed_mesh(path, model, best)
    from zeroplan.importers.lora_options import lora_command_options
    from zeroplan.importers.training_config import write_deepspeed_config, write_fsdp2_snippet
    from zeroplan.spec.files import write_atomic

    training = best.training
    text = json.dumps(write_deepspeed_config(training), indent=2) + "\n" if kind == "deepspeed" else write_fsdp2_snippet(training)
    write_atomic(path, text, "--emit")
    where, path = _written(path, kind)
    if kind != "deepspeed":
        return f"wrote {where} ({kind}, plan #1)"
    extra = f" --checkpointing {training.checkpointing.value}" if training.checkpointing.value != "none" else ""
    if training.checkpoint_every:
        extra += f" --checkpoint-every {training.checkpoint_every}"
    extra += lora_command_options(training)  # a DeepSpeed JSON carries no adapters
    nvme = ""
    if "nvme" in (training.offload_optimizer.value, training.offload_params.value):
        from zeroplan.importers.deepspeed_json import NVME_PATH_PLACEHOLDER

        nvme = f"; set nvme_path (written as {NVME_PATH_PLACEHOLDER}) to a folder on your NVMe drive"
    return (f"wrote {where} ({kind}, plan #1); check it with: zeroplan estimate MODEL --config {path} --gpus "
            f"{training.gpus} --seq-len {training.seq_len}{extra}{nvme}")


def _written(path: str, kind: str) -> tuple[str, str]:
    """(what was written where, the name to give it back as) for the message after --emit: `-` is standard output."""
    from zeroplan.spec.files import is_stdout

    return (f"the {kind} file to standard output", "FILE") if is_stdout(path) else (path, path)


def _readback_verdict(back, best) -> str:
    """Whether the file read back gives the plan's per-rank peaks, or the worst rank it gives instead."""
    if [r.estimate.peak_bytes for r in back.ranks] == [r.estimate.peak_bytes for r in best.estimate.ranks]:
        return "it reads back to the same estimate"
    return (f"it reads back to a worst rank of {back.worst.estimate.peak_bytes:,} bytes, not "
            f"{best.estimate.worst.estimate.peak_bytes:,}")


def readback_options(training) -> dict:
    """What a DeepSpeed JSON cannot carry, given beside it on the command line."""
    options = {"gpus": training.gpus, "seq_len": training.seq_len, "checkpointing": training.checkpointing.value,
               "recipe": training.recipe.value}
    return options | ({"gpu": training.gpu.name} if training.gpu is not None else {})


def _emit_deepspeed_mesh(path: str, model, best) -> str:
    """A DeepSpeed mesh (AutoTP, Ulysses) as a DeepSpeed JSON, read back with the options it cannot carry."""
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
        return (f"wrote the DeepSpeed config to standard output (deepspeed, plan #1); check it with: "
                f"zeroplan estimate {model.name} --config FILE {flags}")
    back = estimate_mesh(model, training_spec_from_options(options, path, model))
    return (f"wrote {path} (deepspeed, plan #1); {_readback_verdict(back, best)}; check it with: zeroplan estimate "
            f"{model.name} --config {path} {flags}")


def _emit_torchtitan(path: str, model, result, gpu: str | None) -> str:
    """The best configuration as a torchtitan job TOML, read back as `zeroplan estimate --config` reads it."""
    from zeroplan.estimate import estimate_mesh
    from zeroplan.importers.options import training_spec_from_options
    from zeroplan.importers.torchtitan_write import write_torchtitan_toml
    from zeroplan.spec.files import is_stdout, write_atomic

    best = result.top[0]
    write_atomic(path, write_torchtitan_toml(best.training, result.model_name), "--emit")
    if is_stdout(path):  # nothing to read back from standard output
        return (f"wrote the torchtitan TOML to standard output (plan #1); check it with: zeroplan "
                f"estimate --config FILE --gpus {best.training.gpus}")
    back = estimate_mesh(model, training_spec_from_options({"gpus": best.training.gpus, "gpu": gpu}, path, model))
    verdict = _readback_verdict(back, best)
    if not verdict.endswith("same estimate"):
        verdict += ": the TOML states torchtitan's program (recipe torchtitan)"
    return (f"wrote {path} (torchtitan, plan #1); {verdict}; check it with: zeroplan estimate --config "
            f"{path} --gpus {best.training.gpus}")
