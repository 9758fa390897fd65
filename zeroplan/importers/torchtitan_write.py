"""A torchtitan job TOML (v0.2.2 schema, the last with TOMLs) for a planned configuration: what
`zeroplan plan --mesh --emit torchtitan FILE` writes, and what `zeroplan estimate --config FILE` reads back
(importers/torchtitan_toml.py) to the same training spec."""

from __future__ import annotations

from zeroplan.errors import SpecError
from zeroplan.importers.torchtitan_toml import MODELS
from zeroplan.spec.mesh import TORCHTITAN_SCHEDULES
from zeroplan.spec.training import Checkpointing, Engine, Precision, TrainingSpec

_PRECISIONS = {Precision.BF16: ("float32", "bfloat16"), Precision.FP32: ("float32", "float32"),
               Precision.PURE_BF16: ("bfloat16", "bfloat16")}
_OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam"}


def write_torchtitan_toml(training: TrainingSpec, model_name: str) -> str:
    """The TOML text; a SpecError names what torchtitan cannot express (engine, precision, optimizer, checkpointing)."""
    if training.engine != Engine.FSDP2:
        raise SpecError("--emit torchtitan: torchtitan runs FSDP2; plan with --engine fsdp2")
    if training.precision not in _PRECISIONS:
        raise SpecError(f"--emit torchtitan: precision {training.precision.value} is not a torchtitan dtype "
                        "(fp32, bf16, pure-bf16)")
    if training.optimizer.value not in _OPTIMIZER_NAMES:
        raise SpecError(f"--emit torchtitan: optimizer {training.optimizer.value} is not a torchtitan optimizer (adamw, adam)")
    if training.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL):
        raise SpecError(f"--emit torchtitan: checkpointing {training.checkpointing.value} is written as none or full only")
    mesh, gpus = training.mesh, training.gpus
    data_parallel = mesh.dp_replicate * mesh.dp_shard(gpus)
    pipeline = mesh.pp > 1
    # a pipeline splits each local batch into micro-batches; zeroplan counts them as accumulation steps
    local = training.micro_batch * (training.grad_accum if pipeline else 1)
    global_batch = training.micro_batch * training.grad_accum * data_parallel
    dtype, param = _PRECISIONS[training.precision]
    flavour = next(((name, flavor) for (name, flavor), catalogue in MODELS.items() if catalogue == model_name), None)
    # "default" reshards after forward unless pipelined (torchtitan distributed/fsdp.py)
    default_stage = 2 if pipeline else 3
    reshard = "default" if training.zero_stage == default_stage else ("never" if training.zero_stage == 2 else "always")
    lines = [f"# zeroplan plan: {model_name} on {gpus} GPUs; check it with: zeroplan estimate "
             f"{'' if flavour else model_name + ' '}--config FILE --gpus {gpus}"]
    if flavour:
        lines += ["[model]", f'name = "{flavour[0]}"', f'flavor = "{flavour[1]}"', ""]
    lines += ["[training]", f"local_batch_size = {local}", f"global_batch_size = {global_batch}",
              f"seq_len = {training.seq_len}", f'dtype = "{dtype}"', f'mixed_precision_param = "{param}"', "",
              "[optimizer]", f'name = "{_OPTIMIZER_NAMES[training.optimizer.value]}"',
              f'implementation = "{training.program.optimizer_impl.value}"', "",
              "[activation_checkpoint]", f'mode = "{training.checkpointing.value}"', "",
              "[parallelism]", f"data_parallel_replicate_degree = {mesh.dp_replicate}",
              f"data_parallel_shard_degree = {mesh.dp_shard(gpus)}", f'fsdp_reshard_after_forward = "{reshard}"',
              f"tensor_parallel_degree = {mesh.tp}", f"context_parallel_degree = {mesh.cp}",
              f"pipeline_parallel_degree = {mesh.pp}", f"expert_parallel_degree = {mesh.ep}",
              f"disable_loss_parallel = {'false' if mesh.loss_parallel else 'true'}"]
    if pipeline:
        if mesh.pp_virtual_stages not in (1, 2):
            raise SpecError("--emit torchtitan: torchtitan's looped schedules default to 2 stages per rank; "
                            f"{mesh.pp_virtual_stages} needs pipeline_parallel_layers_per_stage, not written")
        lines += [f'pipeline_parallel_schedule = "{TORCHTITAN_SCHEDULES[mesh.pp_schedule]}"',
                  f"pipeline_parallel_microbatch_size = {training.micro_batch}"]
    return "\n".join(lines) + "\n"
