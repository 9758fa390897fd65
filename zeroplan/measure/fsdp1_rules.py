"""What an FSDP1 run cannot do on a CPU-only machine, checked before any worker starts (no torch here); the runner
and the Trainer's path raise the same messages (measure/engines/fsdp1_engine.py, programs/hf_trainer.py).

- `CPUOffload(offload_params=True)` pins host memory (torch fsdp/_flat_param.py `init_flat_param_attributes`), which
  fails without an accelerator, and FSDP1 has no switch to turn pinning off: derived from the source and checked on a
  GPU (docs/engines/fsdp1.md, "CPU offload").
- The Trainer through accelerate 1.15.0: the FSDP1 plugin builds `sync_module_states`' `param_init_fn` on the current
  accelerator or raises (utils/dataclasses.py `__post_init__`), and FSDP1 sizes HYBRID_SHARD's node groups by the GPU
  count (`_init_intra_and_inter_node_groups`); zeroplan's loop gives those groups explicitly.
"""

from __future__ import annotations

from zeroplan.errors import MeasureError
from zeroplan.spec.training import Engine, Offload, TrainingSpec

OFFLOAD = ("offload: FSDP1's CPUOffload pins host memory, which fails without a GPU; measure it with --backend nccl "
           "(docs/engines/fsdp1.md, CPU offload)")
SYNC = ("fsdp1.sync_module_states: accelerate's FSDP1 plugin needs a GPU for it (its param_init_fn moves to the current "
        "accelerator); measure on CPU with --no-fsdp1-sync-module-states (and no cpu_ram_efficient_loading)")
HYBRID = ("fsdp1.hybrid: FSDP1 builds HYBRID_SHARD's node groups from the GPU count, which a CPU run has not; measure it "
          "with --recipe plain (explicit process groups)")


def refuse_unmeasurable_fsdp1(training: TrainingSpec, on_gpu: bool) -> None:
    """Raise MeasureError where an FSDP1 run cannot run here (module docstring); nothing for other engines or GPUs."""
    if training.engine != Engine.FSDP1 or on_gpu:
        return
    if Offload.CPU in (training.offload_optimizer, training.offload_params):
        raise MeasureError(OFFLOAD)
    if training.recipe.value == "hf-trainer":
        wrapping = training.fsdp1_wrapping
        if wrapping.sync_module_states:
            raise MeasureError(SYNC)
        if wrapping.hybrid:
            raise MeasureError(HYBRID)
