"""FSDP1's knobs (torch.distributed.fsdp.FullyShardedDataParallel, torch 2.13), each with the default of the
program that runs it, and their resolution into the `FSDP1Wrapping` the estimator and `measure` follow.

The sharding strategy is the ZeRO stage (`FullyShardedDataParallel` `sharding_strategy`, torch
fsdp/api.py ShardingStrategy): FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2, NO_SHARD stage 0;
`hybrid` shards within a node and replicates across nodes (HYBRID_SHARD at stage 3,
_HYBRID_SHARD_ZERO2 at stage 2). The other knobs are the constructor's, under the names accelerate's
`FullyShardedDataParallelPlugin` (utils/dataclasses.py, accelerate 1.15.0) gives them.

Program defaults (None: the recipe's):
- hf-trainer: transformers 5.23.0 training_args.py `_process_fsdp_args` builds the plugin with
  use_orig_params "true", sync_module_states "true", backward_prefetch "NO_PREFETCH" unless fsdp_config
  says otherwise (an accelerate config YAML says what it says: importers/accelerate_yaml.py).
- plain (zeroplan measure's loop): torch's constructor defaults, use_orig_params False,
  sync_module_states False, backward_prefetch BACKWARD_PRE (fully_sharded_data_parallel.py __init__).
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from enum import Enum
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.spec.program import Recipe


class BackwardPrefetch(str, Enum):
    """When FSDP1 all-gathers the next unit in backward (torch fsdp/api.py BackwardPrefetch)."""

    BACKWARD_PRE = "backward-pre"  # in the current unit's pre-backward: two units unsharded through its backward
    BACKWARD_POST = "backward-post"  # in its post-backward, after it reshards and before its gradient is reduced
    NONE = "none"  # no prefetch: each unit is all-gathered in its own pre-backward (accelerate's NO_PREFETCH)


class FSDP1Knobs(BaseModel):
    """FullyShardedDataParallel settings that change memory (engine fsdp1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hybrid: bool = Field(False, description="Shard within a node and replicate across nodes (HYBRID_SHARD at "
                         "zero_stage 3, _HYBRID_SHARD_ZERO2 at 2); the shards are gpus_per_node ranks wide.")
    use_orig_params: bool | None = Field(None, description="Keep the original parameters as views into the flat "
                                         "parameter (needed when a unit mixes frozen and trained tensors, as LoRA's "
                                         "blocks). [default: the recipe's: the Trainer true, plain false]")
    limit_all_gathers: bool = Field(True, description="Rate-limit all-gathers to two in flight (the CPU thread waits "
                                    "for the GPU); false lets the GPU's reserved memory grow with the run-ahead.")
    backward_prefetch: BackwardPrefetch | None = Field(None, description="All-gather the next unit in backward "
                                                       "before (backward-pre) or after (backward-post) the current "
                                                       "unit's gradient, or not (none). [default: the recipe's: the "
                                                       "Trainer none, plain backward-pre]")
    forward_prefetch: bool = Field(False, description="All-gather the next unit while the current one runs its "
                                   "forward.")
    sync_module_states: bool | None = Field(None, description="Broadcast rank 0's parameters and buffers to the "
                                            "other ranks at wrapping, in 250 MB buckets. [default: the recipe's: the "
                                            "Trainer true, plain false]")
    cpu_ram_efficient_loading: bool = Field(False, description="Only rank 0 loads the weights (on the host); the "
                                            "others build on the meta device and are filled by sync_module_states, "
                                            "which it needs.")


class FSDP1Wrapping(NamedTuple):
    """FSDP1's settings of a program, every value resolved."""

    hybrid: bool
    use_orig_params: bool
    limit_all_gathers: bool
    backward_prefetch: BackwardPrefetch
    forward_prefetch: bool
    sync_module_states: bool
    cpu_ram_efficient_loading: bool


def resolve_fsdp1_wrapping(recipe: Recipe, knobs: FSDP1Knobs) -> FSDP1Wrapping:
    """The recipe's FSDP1 settings, overridden by every knob given (not None)."""
    trainer = recipe == Recipe.HF_TRAINER
    use_orig = trainer if knobs.use_orig_params is None else knobs.use_orig_params
    prefetch = knobs.backward_prefetch or (BackwardPrefetch.NONE if trainer else BackwardPrefetch.BACKWARD_PRE)
    sync = trainer if knobs.sync_module_states is None else knobs.sync_module_states
    return FSDP1Wrapping(knobs.hybrid, use_orig, knobs.limit_all_gathers, prefetch, knobs.forward_prefetch,
                         sync or knobs.cpu_ram_efficient_loading, knobs.cpu_ram_efficient_loading)


def adapters_wrapped_apart(recipe: Recipe, use_orig_params: bool) -> bool:
    """Whether a PEFT model's adapter Linear layers are FSDP1 units of their own (PEFT 0.21 utils/other.py
    `fsdp_auto_wrap_policy`), which leaves every block's unit frozen: the Trainer applies that policy to a PeftModel
    whatever use_orig_params (transformers 5.23.0 trainer.py -> distributed/fsdp.py `update_fsdp_plugin_peft`);
    zeroplan's loop when use_orig_params is false, since a FlatParameter cannot mix frozen and trained tensors then
    (`_flat_param.py` `_validate_tensors_to_flatten`)."""
    return recipe == Recipe.HF_TRAINER or not use_orig_params


def sharding_strategy(zero_stage: int, hybrid: bool) -> str:
    """torch's ShardingStrategy name for a stage (fsdp/api.py): the one line every report and runner uses."""
    if zero_stage == 0:
        return "NO_SHARD"
    if hybrid:
        return "HYBRID_SHARD" if zero_stage == 3 else "_HYBRID_SHARD_ZERO2"
    return "FULL_SHARD" if zero_stage == 3 else "SHARD_GRAD_OP"


def fsdp1_reduces_in_param_dtype(recipe: Recipe) -> bool:
    """accelerate's FSDP1 policy (the Trainer's) is `MixedPrecision(param_dtype=dtype, reduce_dtype=dtype,
    buffer_dtype=dtype)` (utils/dataclasses.py `set_mixed_precision`); zeroplan's loop reduces in fp32, as its
    FSDP2 does."""
    return recipe == Recipe.HF_TRAINER
