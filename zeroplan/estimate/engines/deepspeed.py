"""DeepSpeed 0.19.8 ZeRO, as `deepspeed.initialize` builds it: what each rank allocates, per phase.

Every term below is read from DeepSpeed's source (paths relative to `deepspeed/runtime/`) and was
checked by counting live tensors on 2 gloo ranks; the tensor-by-tensor table, with measurements,
is docs/engines/deepspeed.md. Notation: Ψ trainable elements, N ranks, b bytes of the model dtype.

Which optimizer wrapper runs (engine.py `_configure_optimizer`):
- stage 0, fp32: none, the basic optimizer steps the module parameters;
- stage 0, bf16/fp16: `FP16_UnfusedOptimizer` (torch AdamW, the CPU runs) or `FP16_Optimizer`
  (DeepSpeed's FusedAdam, the CUDA default); stage 0 never uses BF16_Optimizer;
- stages 1-2: `DeepSpeedZeroOptimizer` (zero/stage_1_and_2.py);
- stage 3: `DeepSpeedZeroOptimizer_Stage3` (zero/stage3.py, zero/partition_parameters.py).
The basic optimizer for Adam/AdamW is torch's AdamW on a CPU run (the measure runner sets
`torch_adam`), DeepSpeed's FusedAdam on CUDA and DeepSpeedCPUAdam with optimizer offload.
Where the model is when `deepspeed.initialize` takes it (`Setup.program.model_init`) changes the
set-up's peak only: device, built on the GPU in fp32 and cast there; host, cast on the host and
moved (engine.py `_configure_distributed_model`); zero-init, partitioned as built (stage 3).

Speed (the planner asks thousands of times): what does not depend on the activations is built once
per model and configuration (`_stage12_fixed`, `_stage3_fixed`), and the maxima along backward are evaluated
only at the module groups that can hold them (`_contenders`); tests/estimate/engines/test_deepspeed_profile_fast.py
holds the result to the slow path that evaluates every group, over random models and configurations.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from zeroplan.estimate.activations.transformer import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import (
    DeepSpeedSizes,
    EngineEstimate,
    Point,
    Setup,
    ceil_div,
    early_gradients,
    largest_point,
    phase,
    point_total,
    step_temporary_bytes,
)
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import named, register
from zeroplan.spec.optimizer_step import deepspeed_optimizer_step
from zeroplan.spec.program import ModelInit, OptimizerImpl, Recipe
from zeroplan.spec.training import Device, Offload, Optimizer, Precision

# stage_1_and_2.py `__init__`: the flat group is padded to `nccl_start_alignment_factor` (2) x N.
NCCL_START_ALIGNMENT_FACTOR = 2
# engine.py `allreduce_no_retain` / `buffered_allreduce_fallback`: stage 0 all-reduces the
# gradients through flat copies of up to MEMORY_OPT_ALLREDUCE_SIZE elements (a chunk closes once
# it exceeds the limit, so it can be one tensor larger).
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
# zero/utils.py `get_norm_dtype`: gradient norms are taken in fp64 where the device supports it.
NORM_BYTES = 8
# zero/offload_config.py: offload_optimizer.buffer_count default (NVMe swap buffers).
OPTIMIZER_SWAP_BUFFERS = 4

# The ledger's names for what DeepSpeed allocates (estimate/terms.py), each with the DeepSpeed
# source it comes from (paths under deepspeed/runtime/ unless said); the tensor-by-tensor table is
# docs/engines/deepspeed.md. The first three are torch's own allocations, named (with the same
# source) as the torch engine names them (engines/torch_ddp.py).
_TERM_SOURCES = {
    "module parameters":
        "engine.py `_configure_distributed_model` (the module's parameters, cast to the model dtype)",
    "optimizer states (basic optimizer)":
        "engine.py `_configure_basic_optimizer`: torch AdamW, deepspeed/ops/adam FusedAdam or DeepSpeedCPUAdam "
        "(exp_avg, exp_avg_sq; SGD momentum_buffer)",
    # stage 0
    "all-reduce flat gradient copy (allreduce_no_retain)":
        "engine.py `allreduce_gradients` -> `buffered_allreduce_fallback` -> `allreduce_no_retain`",
    "fp32 master copies (fp32_groups)":
        "fp16/unfused_optimizer.py `FP16_UnfusedOptimizer.__init__`",
    "fp32 master gradients (fp32_groups .grad)":
        "fp16/unfused_optimizer.py `step` (`fp16.grad.to(fp32)`), `initialize_optimizer_states` (zeros)",
    "16-bit flat parameters (fp16_groups_flat)":
        "fp16/fused_optimizer.py `FP16_Optimizer.__init__`",
    "fp32 flat master (fp32_groups_flat)":
        "fp16/fused_optimizer.py `FP16_Optimizer.__init__`",
    "fp32 flat gradient (fp32_groups_flat .grad)":
        "fp16/fused_optimizer.py `step` (`_flatten_dense_tensors`), `initialize_optimizer_states` (zeros)",
    "fp32 gradient copies being flattened":
        "fp16/fused_optimizer.py `step` (`p.grad.to(fp32)` per parameter)",
    # stages 1-2 (the bucket and the step's flat gradient partition: stage 3 too)
    "flat parameters (bit16_groups_flat)":
        "zero/stage_1_and_2.py `__init__` (`flatten_dense_tensors_aligned`, padded to 2N; the parameters view it)",
    "parameters before flattening":
        "zero/stage_1_and_2.py `__init__` (the per-parameter storages, alive while `flatten_dense_tensors_aligned` "
        "copies them)",
    "fp32 master partition (single_partition_of_fp32_groups)":
        "zero/stage_1_and_2.py `__init__`",
    "reduce bucket (ipg buffer)":
        "zero/stage_1_and_2.py `setup_buckets` (stages 1-2: at the first gradient hook of every backward); "
        "zero/stage3.py `_setup_for_real_optimizer` (stage 3: at init)",
    "second reduce bucket (overlap_comm)":
        "zero/stage_1_and_2.py `setup_buckets` (the ipg buffer's second half)",
    "gradient partition (grads_in_partition)":
        "zero/stage_1_and_2.py `copy_grads_in_partition`",
    "accumulated gradient partition (all_grad_tensors)":
        "zero/stage_1_and_2.py `independent_gradient_partition_epilogue` (kept between micro-batches)",
    "flattened bucket contents (average_tensor)":
        "zero/stage_1_and_2.py `average_tensor` -> `allreduce_no_retain` / `allreduce_and_scatter` (a flat copy of "
        "the slices reduced)",
    "fp32 gradient partition (single_partition_of_fp32_groups .grad)":
        "zero/stage_1_and_2.py `step` (`flatten(averaged_gradients).to(fp32)`); with cpu_offload "
        "`initialize_optimizer_states`, kept",
    "flat gradient partition (flatten(averaged_gradients))":
        "zero/stage_1_and_2.py `step`; zero/stage3.py `_prepare_fp32_grad_for_sub_group` (freed after `.to(fp32)`)",
    "bit16 partition for CPU offload (param_buffer_of_bit16_for_cpu_offload_groups)":
        "zero/stage_1_and_2.py `__init__`",
    "temp_grad_buffer_for_cpu_offload":
        "zero/stage_1_and_2.py `__init__` (the largest parameter, on the host)",
    "temp_grad_buffer_for_gpu_offload":
        "zero/stage_1_and_2.py `__init__` (the largest parameter, on the device)",
    "accumulated gradients on the host (accumulated_grads_in_cpu)":
        "zero/stage_1_and_2.py `async_accumulate_grad_in_cpu_via_gpu`",
    "gradient norm copy (fp64)":
        "zero/stage_1_and_2.py `set_norm_for_param_grad_in_gpu` (zero/utils.py `get_norm_dtype`)",
    # stage 3
    "fp16 parameter partition (lp_param_buffer)":
        "zero/stage3.py `_create_fp16_partitions_with_defragmentation`; with offload_param "
        "`_create_param_groups_fp16_flat_cpu_memory` (host)",
    "frozen parameter partitions (ds_tensor)":
        "zero/partition_parameters.py `_partition_param` (parameters outside the optimizer's groups keep their own)",
    "parameter partitions before defragmentation (ds_tensor)":
        "zero/stage3.py `_create_fp16_partitions_with_defragmentation` (runtime/utils.py `defragment` copies them)",
    "persistent parameters (ds_persist)":
        "zero/parameter_offload.py `mark_persistent_parameters` (gathered once, never released)",
    "fp32 master partition (fp32_partitioned_groups_flat)":
        "zero/stage3.py `_create_fp32_partitions`",
    "gradient partitions (grad_partitions_flat_buffer)":
        "zero/stage3.py `_setup_for_real_optimizer`",
    "fp32 gradient partition (fp32_partitioned_groups_flat .grad)":
        "zero/stage3.py `_prepare_fp32_grad_for_sub_group` (one sub-group's at a time: `_release_sub_group` frees it)",
    "CPU Adam gradient partition (subgroup_gradient_buffer)":
        "zero/stage3.py `initialize_optimizer_states` (with offload_optimizer, kept as the fp32 master's .grad)",
    "initial step zero gradient (initialize_optimizer_states)":
        "zero/stage3.py `initialize_optimizer_states` (`gradient_buffer`, the largest sub-group)",
    "ZeRO-3 gathered parameters":
        "zero/partitioned_param_coordinator.py `fetch_sub_module`, `__params_to_release` (kept while reused within "
        "stage3_max_reuse_distance); zero/partition_parameters.py `AllGatherCoalescedHandle.wait`",
    "ZeRO-3 gathered parameters (prefetch)":
        "zero/partitioned_param_coordinator.py `fetch_sub_module` (up to stage3_prefetch_bucket_size elements "
        "ahead, under stage3_max_live_parameters)",
    "all-gather flat buffer (coalesced fetch)":
        "zero/partition_parameters.py `_all_gather_dtype`, held until `AllGatherCoalescedHandle.wait` "
        "(docs/engines/deepspeed.md, \"Stage 3: the coalesced fetch, the first step, the epilogue\")",
    "reduce-scatter flat copy (reduce_scatter_coalesced)":
        "zero/stage3.py `__avg_scatter_grads` -> comm/coalesced_collectives.py `reduce_scatter_coalesced`",
    "whole module parameters before partitioning":
        "engine.py `_configure_distributed_model`, partitioned by zero/parameter_offload.py "
        "`_convert_to_zero_parameters`",
    "parameter being cast (p.data.to(dtype))":
        "engine.py `_cast_module_mixed_precision`",
    "tensor being partitioned (zero.Init)":
        "zero/partition_parameters.py `_post_init_method`",
    "optimizer swap buffers (NVMe)":
        "swap_tensor/optimizer_utils.py `OptimizerSwapper` (buffer_count pinned fp32 buffers of the largest sub-group)",
    "parameter swap buffers (NVMe)":
        "swap_tensor/partitioned_param_swapper.py `AsyncPartitionedParameterSwapper` (buffer_count x buffer_size, "
        "pinned)",
}
# flat partitions, buckets and collective buffers are one allocation each (estimate/terms.py PIECES)
# (the per-parameter ds_tensors, and tensors on their way into or out of a flat buffer, are tensors)


def _one_buffer(name: str) -> bool:
    per_tensor = ("ds_tensor", "before flattening", "being flattened", "before partitioning", "being partitioned")
    return any(word in name for word in ("flat", "partition", "bucket", "buffer")) and not any(
        words in name for words in per_tensor)


# the basic optimizer steps the flat fp32 partitions (stage_1_and_2.py: param_group['params'] =
# [single_partition_of_fp32_groups[i]]; stage3.py: fp32_partitioned_groups_flat per sub-group), so its states are
# one tensor per state of each partition (torch/optim/adam.py `_init_group`, ops/adam/fused_adam.py `step`: exp_avg,
# exp_avg_sq = zeros_like(p)); stage 0 in fp32, which steps the module's parameters, is the exception
_PER_STATE = ("optimizer states (basic optimizer)",)
register({name: source for name, source in _TERM_SOURCES.items() if not _one_buffer(name) and name not in _PER_STATE})
register({name: source for name, source in _TERM_SOURCES.items() if _one_buffer(name)}, pieces="whole")
register({name: _TERM_SOURCES[name] for name in _PER_STATE}, pieces="states")
# the optimizer steps one flat partition at a time (stage_1_and_2.py `_optimizer_step`: `self.optimizer.param_groups =
# [original_param_groups[i]]`, whose params are [single_partition_of_fp32_groups[i]]; stage3.py `_optimizer_step`
# per sub-group of fp32_partitioned_groups_flat), so its step temporaries are tensors the size of that partition
# (a list of one: `_multi_tensor_adam`'s `exp_avg_sq_sqrt`, `_single_tensor_adam`'s sqrt and quotient), not one per
# parameter
_FLAT_STEP = "optimizer step temporaries (flat partition)"
register({_FLAT_STEP: "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam over stage_1_and_2.py "
                      "single_partition_of_fp32_groups[i], stage3.py fp32_partitioned_groups_flat[sub_group_id] "
                      "(docs/engines/allocator.md)"}, pieces="step")

def _plus(base: Point, **more: int) -> Point:
    out = dict(base)
    for name, value in more.items():
        out[name] = out.get(name, 0) + value
    return out


# eq=False: hashed and compared by identity, as ModelFacts is (one layout per model, `_layout`),
# so that it keys the caches below without hashing every tensor.
@dataclass(frozen=True, eq=False)
class _Layout:
    """A model's tensors as the profile walks them, derived once per ModelFacts."""

    numels: tuple[int, ...]  # trainable tensors in parameter order (embedding first)
    groups_backward: tuple[tuple[int, ...], ...]  # trainable tensors per module group, backward order
    gathered_backward: tuple[tuple[int, ...], ...]  # all tensors (frozen too) per group, backward order
    tied_head: int  # elements of a tied head's gradient, held by autograd until the embedding's backward
    first_block: int  # elements of a block's first gradients in backward (common.py `early_gradients`)
    largest: int  # the largest trainable tensor


class _Run(NamedTuple):
    """The sizes every stage needs, derived from the model facts and the `Setup` (and hashable: it
    keys the cached parts of each stage, `_stage12_fixed` and `_stage3_fixed`)."""

    n: int
    b: int  # model dtype (params, gradients; DeepSpeed's communication and accumulation default)
    total: int  # all parameter elements
    trainable: int
    layout: _Layout
    step_impl: OptimizerImpl  # the kernel that steps the master (`_step_impl`)
    first_group: int  # trainable elements of the optimizer's first param group (`_first_param_group`)
    cpu_run: bool
    offload_opt: bool
    offload_par: bool
    setup: Setup
    facts: ModelFacts


@memo(maxsize=256)  # measured: DeepSpeed plans take 2-4x longer without it
def _layout(facts: ModelFacts) -> _Layout:
    # parameter order (model.parameters()): each copy of a block in turn
    numels = tuple(t.numel for g in facts.groups for _ in range(g.count) for t in g.trainable_tensors)
    # Module groups in backward order (the head first); a frozen group has no gradients but
    # its parameters are still gathered in stage 3.
    backward: list[tuple[int, ...]] = []
    gathered: list[tuple[int, ...]] = []
    for g in reversed(facts.groups):
        tensors = tuple(reversed([t.numel for t in g.tensors]))
        backward.extend([tuple(reversed([t.numel for t in g.trainable_tensors]))] * g.count)
        gathered.extend([tensors] * g.count)
    _, tied, first_block = early_gradients(facts)
    return _Layout(numels, tuple(backward), tuple(gathered), tied, first_block, max(numels, default=0))


@memo(maxsize=4096)  # as fsdp2.py `_sizes`: every micro-batch of a configuration has the same run
def _run(facts: ModelFacts, setup: Setup) -> _Run:
    b = FP32_BYTES if setup.precision == Precision.FP32 else HALF_BYTES
    layout = _layout(facts)
    offload_opt = setup.offload_optimizer != Offload.NONE
    return _Run(
        n=setup.gpus, b=b, total=facts.total_params, trainable=facts.trainable_params, layout=layout,
        step_impl=_step_impl(setup, offload_opt), first_group=_first_param_group(facts, setup),
        cpu_run=setup.device == Device.CPU, offload_opt=offload_opt,
        offload_par=setup.offload_params != Offload.NONE, setup=setup, facts=facts,
    )


def _step_impl(setup: Setup, offload_opt: bool) -> OptimizerImpl:
    """The kernel that steps the fp32 master: a client torch optimizer's own (a DeepSpeed JSON without
    an `optimizer` section, as the Hugging Face Trainer passes its AdamW); DeepSpeed's config optimizer
    otherwise (spec/optimizer_step.py: DeepSpeedCPUAdam, FusedAdam, or torch's for-loop on a CPU run)."""
    return deepspeed_optimizer_step(cpu_run=setup.device == Device.CPU, offload_optimizer=offload_opt,
                                    client_optimizer=setup.deepspeed.client_optimizer, optimizer=setup.optimizer.value,
                                    program_impl=setup.program.optimizer_impl).impl


def _trainer_param_groups(setup: Setup) -> bool:
    """Does DeepSpeed step the Trainer's AdamW, with its two param groups (transformers trainer.py
    `create_optimizer`): the parameters with weight decay, then those without
    (`get_decay_parameter_names`: biases and norms)? DeepSpeed's config optimizer and the plain
    loop's client optimizer take the parameters as one group."""
    return setup.deepspeed.client_optimizer and setup.program.recipe == Recipe.HF_TRAINER


def _decays(name: str) -> bool:
    """In the Trainer's weight-decay group? (trainer.py `get_decay_parameter_names`: not a norm's, not a bias)"""
    return "norm" not in name and not name.endswith("bias")


def _first_param_group(facts: ModelFacts, setup: Setup) -> int:
    """Trainable elements of the first param group of the optimizer DeepSpeed steps (`_trainer_param_groups`)."""
    if not _trainer_param_groups(setup):
        return facts.trainable_params
    decay = sum(t.numel * g.count for g in facts.groups if not g.frozen for t in g.tensors if _decays(t.name))
    # engine.py `_configure_optimizer` drops an empty group: then the other is the only one
    return decay or facts.trainable_params


@memo(maxsize=4096)  # one walk over the tensors per (model, N, sub_group_size, groups), not per estimate
def sub_groups_of(facts: ModelFacts, n: int, sub_group_size: int, trainer_groups: bool) -> tuple[int, ...]:
    """Elements of each optimizer sub-group of a rank's stage-3 partition, in the order `step` takes
    them, exactly as stage3.py `_create_fp16_partitions_with_defragmentation` ->
    `_create_fp16_sub_groups` cuts each param group (in parameter order) from the tensors'
    `partition_numel()` (ceil(n_t / N), partition_parameters.py `_partition_param`)."""
    if trainer_groups:  # the Trainer's decay group, then its no-decay group (`_trainer_param_groups`)
        tensors = [t for g in facts.groups for _ in range(g.count) for t in g.trainable_tensors]
        ordered = [t.numel for t in tensors if _decays(t.name)], [t.numel for t in tensors if not _decays(t.name)]
        param_groups = [group for group in ordered if group]  # engine.py `_configure_optimizer` drops an empty group
    else:
        param_groups = [facts.trainable_numels()]
    sizes: list[int] = []
    for group in param_groups:
        parts = [ceil_div(numel, n) for numel in group]
        if sub_group_size >= sum(parts):  # the whole param group is one sub-group
            sizes.append(sum(parts))
            continue
        # a sub-group closes once it holds sub_group_size elements (so it can hold up to one
        # tensor's partition, less one element, more), or at the group's last tensor
        filled = 0
        for part in parts:
            filled += part
            if filled >= sub_group_size:
                sizes.append(filled)
                filled = 0
        if filled:
            sizes.append(filled)
    return tuple(sizes)


def _step_temporaries(run: _Run, largest: int, total: int) -> int:
    """Step temporaries over the module's or per-parameter fp32 master tensors: `largest` the largest tensor
    stepped, `total` all of one optimizer call (common.py `step_temporary_bytes`). Only Adam/AdamW allocate any."""
    if run.setup.optimizer not in (Optimizer.ADAM, Optimizer.ADAMW):
        return 0
    return named("optimizer step temporaries",
                 step_temporary_bytes(largest, total, FP32_BYTES, run.setup.optimizer, run.step_impl))


def _flat_step_temporaries(run: _Run, numel: int) -> int:
    """Step temporaries over one flat fp32 partition of `numel` elements, the only tensor of the optimizer's
    param group (`_FLAT_STEP`): the kernel's temporaries, each the partition's size."""
    if run.setup.optimizer not in (Optimizer.ADAM, Optimizer.ADAMW):
        return 0
    return named(_FLAT_STEP, step_temporary_bytes(numel, numel, FP32_BYTES, run.setup.optimizer, run.step_impl))


def _states(run: _Run, numel: int) -> int:
    """Adam moments (fp32, lazily at the first step) or SGD momentum of `numel` master elements."""
    return named("optimizer states (basic optimizer)", optimizer_state_bytes(numel, run.setup.optimizer, FP32_BYTES))


# -- activations along backward ----------------------------------------------------------------


def _activation_along(run: _Run, acts: ActivationBytes | None, index: int) -> int:
    """Activation bytes while backward computes module group `index`'s gradients (backward order:
    final norm and head, blocks from the last, embedding), from activations.py's terms. The
    loss's own backward comes before any parameter gradient: `_backward_start`. A tied head's
    gradient waits in autograd's input buffer from the head's backward to the embedding's
    (common.py `early_gradients`), counted with the activations as `zeroplan measure` does."""
    groups = len(run.layout.groups_backward)
    if acts is None or acts.num_blocks + 2 != groups:  # a count-only model: no activations
        return 0
    if index == groups - 1:
        return acts.embedding
    # the head (index 0) runs with every block's saved tensors, as the last block (index 1) does
    left = acts.num_blocks + 1 - max(index, 1)
    return acts.block_backward_peak(left) + _tied_head(run)


def _hook_along(run: _Run, acts: ActivationBytes | None, index: int) -> int:
    """Activations at a weight gradient's hook inside module group `index`: a block's saved (and
    recomputed) tensors without the activation gradients in flight at its peak (activations.py
    `block_backward_transient`): they do not coincide with a block's peak (measured: see
    docs/engines/deepspeed.md, "Where the hooks fire")."""
    along = _activation_along(run, acts, index)
    if along and 0 < index < len(run.layout.groups_backward) - 1:
        # the hooks fire as the weights' gradients come: at the MLP's moment of the block, also
        # where its attention core peaks later (eager attention)
        left = acts.num_blocks + 1 - index
        return max(acts.block_mlp_peak(left) + _tied_head(run) - acts.block_backward_transient, 0)
    return along


def _tied_head(run: _Run) -> int:
    return named("tied head gradient pending in autograd", run.layout.tied_head * run.b)


def _contenders(entries: tuple[tuple[int, ...], ...], last: int) -> tuple[tuple[int, ...], ...]:
    """The entries (backward index, cost, ...), in backward order, that can be the first largest of
    cost + the activations at their index (`_activation_along`, or `_hook_along` for every entry),
    whatever the micro-batch: the others need not be evaluated. `last` is the embedding's index;
    the blocks are 1 .. last - 1, the head 0.

    Exact because the activations are convex along the blocks and never grow from the head to
    the first block: the proof is in docs/engines/deepspeed.md ("Why `_contenders` is exact").
    """
    ends: list[tuple[int, ...]] = []
    line: list[tuple[int, ...]] = []  # block entries on one line in the index
    for entry in entries:
        if not 0 < entry[0] < last:
            ends += line[:1] + line[1:][-1:]
            line = []
            ends.append(entry)
        elif len(line) < 2 or _on_line(line[-2], line[-1], entry):
            line.append(entry)
        else:
            ends += line[:1] + line[1:][-1:]
            line = [entry]
    ends += line[:1] + line[1:][-1:]
    kept, best = [], -1
    for entry in ends:
        if entry[0] == last:
            kept.append(entry)
        elif entry[1] > best:
            kept.append(entry)
            best = entry[1]
    return tuple(kept)


def _on_line(a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...]) -> bool:
    """Are the costs of entries a, b, c (index, cost, ...) on one line in the index?"""
    return (b[1] - a[1]) * (c[0] - b[0]) == (c[1] - b[1]) * (b[0] - a[0])


def _backward_start(acts: ActivationBytes | None) -> int:
    """log_softmax's backward, before the first parameter gradient (and its hook) exists."""
    return acts.backward_start_peak if acts is not None else 0


def _activations_before_head(acts: ActivationBytes | None) -> int:
    """When the head's forward starts: the blocks' saved tensors and the final norm's."""
    return acts.blocks_saved + acts.final_norm if acts is not None else 0


def _forward_activations(acts: ActivationBytes | None) -> int:
    return acts.forward_peak if acts is not None else 0


def _block_moment(run: _Run, acts: ActivationBytes | None, grads_along: tuple[tuple[int, int], ...]) -> Point | None:
    """Stages 0 and 1, where every gradient stays in .grad until backward ends: the largest block moment of
    backward. At a block's backward peak, the gradients of the modules before it exist, and the block's
    output projection's (common.py `early_gradients`, its first gradients); `grads_along` is `_stage1_grads`."""
    best: tuple[int, int] | None = None
    for index, grads_now in grads_along:
        along = _activation_along(run, acts, index)
        if best is None or along + grads_now > best[0] + best[1]:
            best = (along, grads_now)
    if best is None:
        return None
    return {"activations": best[0], "grads": named("gradients (.grad)", best[1])}


# -- stage 0 --------------------------------------------------------------------------------------


def _stage0(run: _Run, acts: ActivationBytes | None) -> list[PhaseBytes]:
    b, psi = run.b, run.trainable
    params = named("module parameters", run.total * b)
    grads = named("gradients (.grad)", psi * b)
    # engine.py `allreduce_gradients` -> `buffered_allreduce_fallback` -> `allreduce_no_retain`:
    # a flat copy of the gradients (chunks of MEMORY_OPT_ALLREDUCE_SIZE) at the end of backward.
    flat_allreduce = named("all-reduce flat gradient copy (allreduce_no_retain)",
                           min(psi, MEMORY_OPT_ALLREDUCE_SIZE + run.layout.largest) * b)
    states = _states(run, psi)
    fwd = _forward_activations(acts)
    bwd = _backward_start(acts)
    # a block's backward, the gradients of the groups before it in .grad (under checkpointing the recomputed
    # block can hold more than the loss's backward)
    block = _block_moment(run, acts, _stage1_grads(run.layout, b)) if acts is not None else None
    phases = []
    if run.setup.precision == Precision.FP32:
        # No wrapper: torch AdamW/FusedAdam on the module parameters, states at the first step;
        # per-tensor step temporaries.
        temps = _step_temporaries(run, run.layout.largest, run.trainable)
        for step in (Step.FIRST, Step.STEADY):
            held = states if step == Step.STEADY else 0
            if step == Step.FIRST:
                phases.append(phase(step, Phase.INIT, params=params))
            phases.append(phase(step, Phase.FORWARD, params=params, optimizer_states=held, activations=fwd))
            end = {"params": params, "optimizer_states": held, "grads": grads, "buffers": flat_allreduce}
            start = {"params": params, "optimizer_states": held, "activations": bwd}
            blocks = {"params": params, "optimizer_states": held, **(block or {})}
            phases.append(phase(step, Phase.BACKWARD, **largest_point(start, end, *([blocks] if block else []))))
            phases.append(phase(step, Phase.OPTIMIZER_STEP, params=params, grads=grads, optimizer_states=states,
                                temporaries=temps))
        return phases
    # bf16/fp16: fp32 master of every parameter and the states exist from init:
    # `initialize_optimizer_states` steps the optimizer on zero gradients (fp16/unfused_optimizer.py,
    # fp16/fused_optimizer.py).
    if run.setup.device == Device.CPU or run.setup.deepspeed.client_optimizer:
        # FP16_UnfusedOptimizer (engine.py `_configure_fp16_optimizer`: any optimizer but FusedAdam):
        # per-parameter fp32 clones; step: `fp32.grad = fp16.grad.to(fp32)` per parameter, the 16-bit
        # gradients still alive; torch AdamW over the per-parameter masters.
        master = named("fp32 master copies (fp32_groups)", psi * FP32_BYTES)
        step_grads = grads + named("fp32 master gradients (fp32_groups .grad)", psi * FP32_BYTES)
        step_temps = _step_temporaries(run, run.layout.largest, psi)
        init_extra = {"grads": step_grads, "temporaries": step_temps}  # the zero-gradient step, 16-bit and fp32
    else:
        # FP16_Optimizer.step: `p.grad.to(fp32)` per parameter, then `_flatten_dense_tensors` of
        # them (both Ψ x 4 alive while flattening), the 16-bit grads freed after. The module's
        # trainable parameters are views of the flat 16-bit group.
        params = (named("16-bit flat parameters (fp16_groups_flat)", psi * b)
                  + named("module parameters", (run.total - psi) * b))
        master = named("fp32 flat master (fp32_groups_flat)", psi * FP32_BYTES)
        flat_grad = named("fp32 flat gradient (fp32_groups_flat .grad)", psi * FP32_BYTES)
        step_grads = grads + flat_grad
        step_temps = named("fp32 gradient copies being flattened", psi * FP32_BYTES)
        init_extra = {"grads": flat_grad}  # zero fp32 flat gradient for the init step
    base = {"params": params, "optimizer_states": master + states}
    for step in (Step.FIRST, Step.STEADY):
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base, **init_extra))
        phases.append(phase(step, Phase.FORWARD, **base, activations=fwd))
        end = {"grads": grads, "buffers": flat_allreduce}
        phases.append(phase(step, Phase.BACKWARD, **base, **largest_point({"activations": bwd}, end,
                                                                          *([block] if block else []))))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, **base, grads=step_grads, temporaries=step_temps))
    return phases


# -- stages 1 and 2 -------------------------------------------------------------------------------


def _owned_elements(numels: tuple[int, ...], partition: int, n: int) -> tuple[tuple[int, int], ...]:
    """Each rank's `grads_in_partition` elements, as runs of (ranks, elements) in rank order:
    stage_1_and_2.py `copy_grads_in_partition` sizes it as the sum of the whole tensors that
    intersect the rank's [r·P, (r+1)·P) slice (the last rank's slice holds the padding, so it runs
    to the end). Neighbouring ranks whose slices meet the same tensors own the same elements, so
    each run is computed once: at most two per tensor, however many ranks there are."""
    if len(numels) <= 1:
        # A model given by a parameter count has no tensor boundaries: partitions are exact, as
        # in DeepSpeed's own estimate_zero2_model_states_mem_needs.
        return ((n, partition),)
    # Prefix sums over the flat order: the tensors meeting a slice are a run, found by bisection.
    prefix = [0, *accumulate(numels)]
    starts, ends = prefix[:-1], prefix[1:]
    runs = []
    rank = 0
    while rank < n - 1:
        first = bisect_right(ends, rank * partition)  # the first tensor ending inside or after the slice
        after = bisect_left(starts, (rank + 1) * partition)  # the first tensor starting after it
        # The next rank meeting other tensors: its slice starts at or past the end of `first`,
        # or ends past the start of `after`.
        next_rank = n - 1
        if first < len(numels):
            next_rank = min(next_rank, -(-ends[first] // partition))
        if after < len(numels):
            next_rank = min(next_rank, starts[after] // partition)
        runs.append((next_rank - rank, prefix[after] - prefix[first] if after > first else 0))
        rank = next_rank
    first = bisect_right(ends, (n - 1) * partition)
    runs.append((1, prefix[-1] - prefix[first]))
    return tuple(runs)


def _bucket_fill(numels: tuple[int, ...], bucket_elements: int) -> int:
    """Gradient elements already copied into the reduce bucket (their .grad freed) when the first
    reduction allocates the owned partition. `reduce_independent_p_g_buckets_and_remove_grads`
    reduces the bucket when the next gradient does not fit; a gradient larger than the bucket
    is not copied in but reduced alone (`extra_large_param_to_reduce`), so its .grad stays."""
    pending = copied = 0
    for numel in numels:
        if pending and pending + numel > bucket_elements:
            return copied
        pending += numel
        if numel <= bucket_elements:
            copied += numel
    return copied


def _last_fill(numels: tuple[int, ...], bucket_elements: int) -> int:
    """Gradient elements in the reduce bucket when the epilogue reduces it (after the last
    overflow, `reduce_independent_p_g_buckets_and_remove_grads`)."""
    pending = 0
    for numel in numels:
        if pending and pending + numel > bucket_elements:
            pending = 0
        pending += numel
    return pending


def _first_reduction(groups_backward: tuple[tuple[int, ...], ...], bucket_elements: int) -> int:
    """Backward module index at which the reduce bucket first overflows during backward (the
    number of modules when the epilogue reduces it after the last one)."""
    filled = 0
    for index, group in enumerate(groups_backward):
        for numel in group:
            if filled and filled + numel > bucket_elements:
                return index
            filled += numel
    return len(groups_backward)


def _first_reduction_after_peak(groups_backward: tuple[tuple[int, ...], ...], bucket_elements: int,
                                first_block: int) -> bool:
    """Does the first reduction, in a block, come at a hook after the block's backward peak? Its
    first gradients (the output projection's, common.py `early_gradients`) come before the peak,
    the others after it: the bucket overflows after the peak when those first gradients still fit
    (`reduce_independent_p_g_buckets_and_remove_grads` reduces when the next one does not)."""
    index = _first_reduction(groups_backward, bucket_elements)
    if not 0 < index < len(groups_backward) - 1:
        return False
    filled = sum(sum(group) for group in groups_backward[:index])
    return filled + first_block <= bucket_elements


@memo(maxsize=4096)  # shared by stages and offloads: a cold 70B plan over 8-256 GPUs takes 12% longer without it
def _owned_runs(layout: _Layout, partition: int, n: int) -> tuple[tuple[int, int], ...]:
    return _owned_elements(layout.numels, partition, n)


@memo(maxsize=4096)  # shared by stages and offloads: cold plans take 16-21% longer without it
def _bucket_walks(layout: _Layout, buckets: int) -> tuple[int, int, int, bool]:
    """(`_first_reduction`, `_last_fill` in backward order, `_last_fill` in parameter order,
    `_first_reduction_after_peak`)."""
    backward = tuple(x for g in layout.groups_backward for x in g)
    return (_first_reduction(layout.groups_backward, buckets), _last_fill(backward, buckets),
            _last_fill(layout.numels, buckets), _first_reduction_after_peak(layout.groups_backward, buckets, layout.first_block))


@memo(maxsize=4096)  # shared by offloads: a cold 70B plan over 8-256 GPUs takes 12% longer without it
def _stage1_grads(layout: _Layout, b: int) -> tuple[tuple[int, int], ...]:
    """Stage 1 (`_contenders` of): (backward index, gradient bytes at that module group's
    backward peak): the gradients of the groups before it, and a block's first gradients."""
    entries, done = [], 0
    groups = layout.groups_backward
    for index, group in enumerate(groups):
        in_block = layout.first_block if 0 < index < len(groups) - 1 and group else 0
        entries.append((index, (done + in_block) * b))
        done += sum(group)
    return _contenders(tuple(entries), len(groups) - 1)


class _StepMoments(NamedTuple):
    """One step's moments that do not depend on the activations."""

    step: Step
    during: Point  # what forward and backward hold besides the activations and what backward adds
    settled: Point | None  # the largest of backward's moments without activations (stages 1-2)
    optimizer_step: PhaseBytes


class _Fixed12(NamedTuple):
    """Stages 1-2 apart from the activations: cached per model and `Setup` (not the micro-batch,
    sequence length or checkpointing)."""

    init: PhaseBytes
    steps: tuple[_StepMoments, ...]  # first, steady
    host_bytes: int  # per rank
    moving: bool  # gradients move into the bucket at their hooks (stage 2, or stage 1 with overlap_comm)
    first_index: int  # backward module index of the first reduction (`_first_reduction`)
    first_after_peak: bool  # it comes after that block's backward peak (`_first_reduction_after_peak`)
    groups: int  # module groups
    bucket_now: int  # bytes of the reduce bucket allocated in this micro-batch
    owned_early: int  # bytes of the partition allocated at the first reduction (the last rank's)
    before: tuple[tuple[int, ...], ...]  # `_contenders` among the module groups before the first reduction
    after: tuple[tuple[int, ...], ...]  # `_contenders` among the module groups after it
    grads_along: tuple[tuple[int, int], ...]  # stage 1: `_stage1_grads`


def _stage12(run: _Run, acts: ActivationBytes | None) -> tuple[list[PhaseBytes], int]:
    fixed = _stage12_fixed(run)
    first_index, groups, bucket_now = fixed.first_index, fixed.groups, fixed.bucket_now
    fwd = _forward_activations(acts)
    # Backward's moments with activations are the same in both steps; each step adds its own
    # `during` to them (the largest is the one that adds the most), so they are found once.
    # The bucket appears at the first parameter's gradient hook, after the loss's backward.
    points = [{"activations": _backward_start(acts)}]
    if fixed.moving:
        # Stage 2 (and stage 1 with overlap_comm, at the boundary: `process_gradients`) moves
        # each gradient into the bucket at its hook. The rank owning the last parameters
        # allocates its `grads_in_partition` at the first reduction; a later micro-batch
        # fills a second one, added into the first at its end.
        if first_index:  # modules before the first reduction: the bucket, no partition yet
            most = max(_activation_along(run, acts, i) for i, _ in fixed.before)
            points.append({"activations": most, "buffers": bucket_now})
        acts_at_first = _activation_along(run, acts, first_index) if first_index < groups else 0
        if fixed.first_after_peak and not run.offload_opt:
            # The block peaks with the bucket only; the partition (`copy_grads_in_partition`)
            # comes at the overflowing gradient's hook and stays through the later module groups.
            points.append({"activations": acts_at_first, "buffers": bucket_now})
            acts_at_first = max([_hook_along(run, acts, first_index)]
                                + [_activation_along(run, acts, i) for i, _ in fixed.after])
        points.append({"activations": acts_at_first, "buffers": bucket_now,
                       "grads": 0 if run.offload_opt else fixed.owned_early})
        if run.offload_opt:
            # Offloaded, each owned gradient is copied to the host after
            # `set_norm_for_param_grad_in_gpu` takes its norm in `get_norm_dtype()` (fp64
            # where supported: a copy of the tensor), while the next gradient waits in .grad.
            hook = _hook_along(run, acts, first_index) if first_index < groups else 0
            points.append({"activations": hook, "buffers": bucket_now,
                           "grads": named("gradients (.grad)", run.layout.largest * run.b),
                           "temporaries": named("gradient norm copy (fp64)", run.layout.largest * NORM_BYTES)})
    else:
        # Stage 1: the hooks only allocate the bucket; every gradient stays in .grad until the
        # boundary's `reduce_gradients` walks them through the bucket (`_stage12_fixed`).
        moment = _block_moment(run, acts, fixed.grads_along)
        if moment is not None:
            points.append({**moment, "buffers": bucket_now})
    moment = largest_point(*points)
    phases = [fixed.init]
    for step, during, settled, optimizer_step in fixed.steps:
        phases.append(phase(step, Phase.FORWARD, **_plus(during, activations=fwd)))
        # the moments without activations come after these in backward: they win only if larger
        peak = _plus(during, **moment)
        if settled is not None and point_total(settled) > point_total(peak):
            peak = settled
        phases.append(phase(step, Phase.BACKWARD, **peak))
        phases.append(optimizer_step)
    return phases, fixed.host_bytes


@memo(maxsize=4096)  # the planner varies the micro-batch most: warm plans take 14-26% longer without it
def _stage12_fixed(run: _Run) -> _Fixed12:
    setup, knobs = run.setup, run.setup.deepspeed
    b, n = run.b, run.n
    stage = setup.zero_stage
    overlap = bool(knobs.overlap_comm)  # zero/config.py: overlap_comm defaults to False for 1-2
    alignment = NCCL_START_ALIGNMENT_FACTOR * n
    flat = ceil_div(run.trainable, alignment) * alignment
    partition = flat // n  # P12: `partition_size`, the padding sits in the last rank's slice
    params = (named("flat parameters (bit16_groups_flat)", flat * b)
              + named("module parameters", (run.total - run.trainable) * b))  # the frozen ones
    # also in an fp32 run
    master = named("fp32 master partition (single_partition_of_fp32_groups)", partition * FP32_BYTES)
    states = _states(run, partition)
    layout, buckets = run.layout, knobs.reduce_bucket_size
    # (The walks over every tensor below are cached by the few integers they depend on, so that
    # the stages and offload targets of one model share them.)
    owned_runs = _owned_runs(layout, partition, n)
    owned_elements = max(elements for _, elements in owned_runs)
    owned = named("gradient partition (grads_in_partition)", owned_elements * b)
    # `setup_buckets`: `reduce_bucket_size` elements, always (not capped by the model), two with
    # overlap_comm; at the first gradient hook of every backward, freed by
    # `independent_gradient_partition_epilogue` -> `_release_ipg_buffers`.
    one_bucket = knobs.reduce_bucket_size * b
    bucket = (named("reduce bucket (ipg buffer)", one_bucket)
              + (named("second reduce bucket (overlap_comm)", one_bucket) if overlap else 0))
    first_index, last_fill, last_fill_forward, first_after_peak = _bucket_walks(layout, buckets)
    groups = len(run.layout.groups_backward)

    # Optimizer offload (stage_1_and_2.py `__init__`, `initialize_optimizer_states`): the fp32
    # master, its fp32 gradient (kept from init), a P12 x b copy of the partition
    # (`param_buffer_of_bit16_for_cpu_offload_groups`) and `temp_grad_buffer_for_cpu_offload` live
    # on the host; `temp_grad_buffer_for_gpu_offload` (largest tensor) on the device. Gradients go
    # straight into the host fp32 gradient (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`).
    host_grads = host_buffers = 0
    device_buffers = 0
    if run.offload_opt:
        host_grads = named("fp32 gradient partition (single_partition_of_fp32_groups .grad)", partition * FP32_BYTES)
        host_buffers = (named("bit16 partition for CPU offload (param_buffer_of_bit16_for_cpu_offload_groups)",
                              partition * b)
                        + named("temp_grad_buffer_for_cpu_offload", run.layout.largest * b))
        device_buffers = named("temp_grad_buffer_for_gpu_offload", run.layout.largest * b)
        if setup.accumulating:  # `accumulated_grads_in_cpu`: owned slices, model dtype
            host_grads += named("accumulated gradients on the host (accumulated_grads_in_cpu)", partition * b)
    on_device = not run.offload_opt or run.cpu_run  # a CPU run has one memory

    def host(value: int) -> int:
        return value if on_device else 0

    accumulating = setup.accumulating
    moving = stage == 2 or overlap
    bucket_now = 0 if stage == 1 and accumulating else bucket  # already carried
    kept = 0 if run.offload_opt else owned  # offload copies straight to the host gradient
    # `flatten_dense_tensors_aligned`: the old per-parameter storages and the flat copy. A model that
    # reaches the GPU cast (model_init host) needs no room for both: `__init__` flattens on the host
    # when the accelerator lacks it (`flatten_on_accelerator`), so only the flat copy is required.
    from_host = setup.program.model_init == ModelInit.HOST and not run.cpu_run
    flatten = {"params": params if from_host else params + named("parameters before flattening", run.trainable * b)}
    after = {"params": params, "optimizer_states": host(master), "grads": host(host_grads),
             "buffers": host(host_buffers) + device_buffers}
    init = phase(Step.FIRST, Phase.INIT, **largest_point(flatten, after))
    steps = []
    for step in (Step.FIRST, Step.STEADY):
        held = states if step == Step.STEADY else 0
        base = {"params": params, "optimizer_states": host(master + held), "grads": host(host_grads),
                "buffers": host(host_buffers) + device_buffers}
        # Between micro-batches (grad_accum > 1): stage 1 keeps every .grad and the bucket
        # (allocated at the first micro-batch's first hook, released by the boundary's epilogue,
        # since only the boundary reduces); stage 2 keeps the owned partition (`all_grad_tensors`)
        # or, offloaded, `accumulated_grads_in_cpu` (in host_grads).
        carried: Point = {}
        if accumulating and stage == 1:
            carried = {"grads": named("gradients (.grad)", run.trainable * b), "buffers": bucket}
        elif accumulating and not run.offload_opt:
            carried = {"grads": named("accumulated gradient partition (all_grad_tensors)", owned_elements * b)}
        during = _plus(base, **carried)

        # backward's moments without activations, in backward order after those with them
        if moving:
            settled = [_plus(during, buffers=bucket_now, grads=kept)]
            # The epilogue reduces what is left in the bucket (`average_tensor` ->
            # `allreduce_no_retain` / `allreduce_and_scatter` flatten the slices they reduce:
            # a copy of the bucket's contents), before those gradients reach the partition.
            earlier = kept if first_index < groups else 0
            settled.append(_plus(during, buffers=bucket_now + _flattened(last_fill * b), grads=earlier))
        else:
            # Stage 1, at the boundary: `reduce_gradients` walks the parameters in their order,
            # freeing each .grad as it is copied into the bucket and filling the owned partition
            # (the last micro-batch accumulates into the kept .grad); the first rank allocates its
            # partition at the first overflow, with the rest still in .grad.
            filled = _bucket_fill(run.layout.numels, buckets)
            first_rank = 0
            if not run.offload_opt:
                first_rank = named("gradient partition (grads_in_partition)", owned_runs[0][1] * b)
            left = named("gradients (.grad)", (run.trainable - filled) * b)
            settled = [_plus(base, buffers=bucket, grads=left + first_rank)]
            # Each reduction flattens the bucket's contents (`average_tensor`): at the first one
            # every gradient is still a .grad or in the bucket; at the last, the partition is full.
            settled.append(_plus(base, buffers=bucket + _flattened(filled * b), grads=left))
            settled.append(_plus(base, buffers=bucket + _flattened(last_fill_forward * b), grads=kept))

        # `step`, one param group after the other: `flatten(averaged_gradients)` (P x b) then
        # `.to(fp32)` becomes the group's master .grad (P x 4, a second copy only when b != 4) while
        # `grads_in_partition` is alive; the group's gradients are freed and the optimizer steps it
        # (states created at the first step). `grads_in_partition` is one buffer for all groups
        # (`copy_grads_in_partition`), so it lives on while a later group's .grad still views it.
        if run.offload_opt:
            step_point = dict(base, optimizer_states=host(master + states))
        else:
            several = run.first_group < run.trainable
            first = ceil_div(run.first_group, alignment) * alignment // n if several else partition
            fp32_grad = named("fp32 gradient partition (single_partition_of_fp32_groups .grad)", first * FP32_BYTES)
            flat_grad = named("flat gradient partition (flatten(averaged_gradients))", first * b)
            convert = dict(base, grads=owned + fp32_grad, temporaries=flat_grad if b != FP32_BYTES else 0)
            stepping = dict(base, optimizer_states=master + max(held, _states(run, first)),
                            grads=(owned if several else 0) + fp32_grad,
                            temporaries=_flat_step_temporaries(run, first))
            step_point = largest_point(convert, stepping)
        steps.append(_StepMoments(step, during, largest_point(*settled), phase(step, Phase.OPTIMIZER_STEP, **step_point)))
    host_bytes = (master + states + host_grads + host_buffers) if run.offload_opt and not run.cpu_run else 0
    # with gradients carried between micro-batches, none are added along backward
    grads_b = 0 if accumulating and (stage == 1 or not run.offload_opt) else b
    return _Fixed12(
        init, tuple(steps), host_bytes, moving, first_index, first_after_peak, groups, bucket_now,
        # The last rank owns the head, whose gradients come first in backward: it allocates its
        # partition at the first reduction during backward, the others later.
        owned_early=named("gradient partition (grads_in_partition)", owned_runs[-1][1] * b),
        before=_contenders(tuple((i, 0) for i in range(first_index)), groups - 1),
        after=_contenders(tuple((i, 0) for i in range(first_index + 1, groups)), groups - 1),
        grads_along=_stage1_grads(layout, grads_b),
    )


def _flattened(value: int) -> int:
    """A flat copy of the bucket's contents made by a reduction (`average_tensor`)."""
    return named("flattened bucket contents (average_tensor)", value)


# -- stage 3 --------------------------------------------------------------------------------------


def _per_group(gathered_backward: tuple[tuple[int, ...], ...], size: Callable[[tuple[int, ...]], int]) -> list[int]:
    """`size(group)` for each module group, computed once per distinct group (the blocks repeat)."""
    sizes: dict[tuple[int, ...], int] = {}
    return [sizes[grp] if grp in sizes else sizes.setdefault(grp, size(grp)) for grp in gathered_backward]


def _leaf_gathered(gathered_backward: tuple[tuple[int, ...], ...], n: int) -> tuple[int, ...]:
    """The largest tensor of each module group, padded to a multiple of N (gathered alone)."""
    return tuple(_per_group(gathered_backward, lambda grp: max((ceil_div(x, n) * n for x in grp), default=0)))


def _stage3_sizes(facts: ModelFacts, n: int, threshold: int) -> tuple[int, int, int, int]:
    """(partition elements of all tensors, of the trainable ones, persistent elements, padded
    elements of the gatherable ones) per rank.

    partition_parameters.py `_partition_param`: each tensor is padded to a multiple of N and
    split evenly (`ds_tensor`, ceil(n_t / N)). `ds_persist` for n_t <=
    stage3_param_persistence_threshold (parameter_offload.py `mark_persistent_parameters`):
    gathered once, never released, on top of their partition.
    """
    # per distinct tensor of a group, times the group's copies (the blocks are identical)
    tensors = [(t.numel, g.count, g.frozen or t.frozen) for g in facts.groups for t in g.tensors]
    p3_all = sum(ceil_div(x, n) * count for x, count, _ in tensors)
    p3 = sum(ceil_div(x, n) * count for x, count, frozen in tensors if not frozen)
    persistent = sum(x * count for x, count, _ in tensors if x <= threshold)
    gatherable = sum(ceil_div(x, n) * n * count for x, count, _ in tensors if x > threshold)
    return p3_all, p3, persistent, gatherable


class _Walk3(NamedTuple):
    """What stage 3 holds along a step apart from activations (elements, or bytes where named):
    the same for every micro-batch, so cached per (model, N, b, knobs). Plain ints: the terms are
    named when a moment is chosen (`_backward_extra`), so that the walks compare ints."""

    p3_all: int
    p3: int
    persistent: int
    gathered_at_head: int
    prefetch: int
    largest_leaf: int  # bytes: the largest tensor gathered alone (first micro-batch, no trace)
    # `_contenders` of (backward index, gathered bytes) without a trace (`cold`) and with one,
    # and of (backward index, bytes, gathered bytes, flat copy bytes, gradient bytes) at each
    # bucket reduction
    cold: tuple[tuple[int, ...], ...]
    cold_reductions: tuple[tuple[int, ...], ...]
    warm: tuple[tuple[int, ...], ...]
    warm_reductions: tuple[tuple[int, ...], ...]
    prefetched: tuple[int, ...]  # bytes of `warm`'s gathered bytes that were prefetched, by backward index


@memo(maxsize=4096)  # shared by offloads: cold plans take 20-78% longer without it
def _stage3_walk(facts: ModelFacts, n: int, b: int, knobs: DeepSpeedSizes, recompute_held_element: int = 0) -> _Walk3:
    layout = _layout(facts)
    threshold = knobs.stage3_param_persistence_threshold
    p3_all, p3, persistent, gatherable = _stage3_sizes(facts, n, threshold)
    gathered_at_head, gathered_in_backward = _steady_gathering(
        layout.gathered_backward, n, threshold, knobs.stage3_max_reuse_distance, knobs.stage3_max_live_parameters,
        knobs.stage3_prefetch_bucket_size)
    reductions = _stage3_reductions(layout.groups_backward, n, knobs.reduce_bucket_size)
    # `AllGatherCoalescedHandle.wait` holds the flat buffer until every parameter is copied out:
    # with the whole model kept, the forward's prefetch is alive twice (docs/engines/deepspeed.md).
    keep_all = gathered_at_head >= gatherable
    prefetch = min(gatherable, knobs.stage3_prefetch_bucket_size) if keep_all else 0
    module_all = [x * b for x in _leaf_gathered(layout.gathered_backward, n)]
    last = len(layout.groups_backward) - 1
    cold = [(i, g) for i, g in enumerate(module_all)]
    if recompute_held_element:  # a rebuilt LoRA block stays gathered (estimate/adapters/zero3.py)
        from zeroplan.estimate.adapters.zero3 import recomputed_block_gathered

        cold = recomputed_block_gathered(cold, layout.gathered_backward, layout.groups_backward, n, b, threshold,
                                         recompute_held_element)
    warm = [(i, (held + ahead) * b) for i, (held, ahead) in enumerate(gathered_in_backward)]
    cold_reductions = [(i, module_all[i] + (flat + trigger) * b, module_all[i], flat * b, trigger * b)
                       for i, flat, trigger in reductions]
    warm_reductions = [(i, warm[i][1] + (flat + trigger) * b, warm[i][1], flat * b, trigger * b)
                       for i, flat, trigger in reductions]
    return _Walk3(p3_all, p3, persistent, gathered_at_head, prefetch, max(module_all, default=0),
                  *(_contenders(tuple(entries), last) for entries in (cold, cold_reductions, warm, warm_reductions)),
                  tuple(ahead * b for _, ahead in gathered_in_backward))


def _gathered(buffers: int, prefetched: int) -> int:
    """`buffers` bytes of gathered parameters, `prefetched` of them fetched ahead of their module."""
    return (named("ZeRO-3 gathered parameters", buffers - prefetched)
            + named("ZeRO-3 gathered parameters (prefetch)", prefetched))


def _backward_extra(run: _Run, acts: ActivationBytes | None, start: Point, gathered: tuple[tuple[int, ...], ...],
                    reductions: tuple[tuple[int, ...], ...], prefetched: tuple[int, ...] | None) -> Point:
    """What backward adds to the base at its peak, the first largest of: the loss's backward
    (`start`), the module group with the most gathered parameters and activations, and each bucket
    reduction (its flat copy beside the gathered parameters, the triggering gradient waiting).
    `prefetched`: the bytes of the gathered ones fetched ahead, by backward index (None: none)."""
    most: Point = {}
    most_index = 0
    for index, buffers in gathered:
        along = _activation_along(run, acts, index)
        if not most or buffers + along > most["buffers"] + most["activations"]:
            most, most_index = {"buffers": buffers, "activations": along}, index
    if most:
        most["buffers"] = _gathered(most["buffers"], prefetched[most_index] if prefetched else 0)
    best = start if point_total(start) >= point_total(most) else most
    best_total = point_total(best)
    reduction = None
    for entry in reductions:
        hook = _hook_along(run, acts, entry[0])
        if entry[1] + hook > best_total:
            reduction, best_total = (entry, hook), entry[1] + hook
    if reduction is None:
        return best
    (index, _, held, flat, trigger), hook = reduction
    return {"buffers": _gathered(held, prefetched[index] if prefetched else 0)
            + named("reduce-scatter flat copy (reduce_scatter_coalesced)", flat),
            "grads": named("gradients (.grad)", trigger), "activations": hook}


class _Fixed3(NamedTuple):
    """Stage 3 apart from the activations: cached per model and `Setup`."""

    init: PhaseBytes
    steps: tuple[_StepMoments, ...]  # first, steady
    host: tuple[int, int]  # (host, NVMe) bytes per rank
    walk: _Walk3


def _stage3(run: _Run, acts: ActivationBytes | None) -> tuple[list[PhaseBytes], tuple[int, int]]:
    fixed = _stage3_fixed(run)
    walk, b = fixed.walk, run.b
    fwd = _forward_activations(acts)
    # The trace is complete from the second micro-batch of the first step on: the steady step's
    # moments, also the first step's when it accumulates.
    head = named("ZeRO-3 gathered parameters", walk.gathered_at_head * b)
    coalesced = named("all-gather flat buffer (coalesced fetch)", walk.prefetch * b)
    warm = (largest_point({"buffers": head + coalesced, "activations": _activations_before_head(acts)},
                          {"buffers": head, "activations": fwd}),
            _backward_extra(run, acts, {"buffers": head, "activations": _backward_start(acts)}, walk.warm,
                            walk.warm_reductions, walk.prefetched))
    phases = [fixed.init]
    for step, base, _, optimizer_step in fixed.steps:
        if step == Step.FIRST and not run.setup.accumulating:  # no trace yet
            # `release_sub_module` frees each leaf module's parameters after its hook, persistent
            # ones too: one tensor gathered at a time (docs/engines/deepspeed.md, "The first step").
            forward = largest_point({"activations": fwd}, {"buffers": _gathered(walk.largest_leaf, 0)})
            extra = _backward_extra(run, acts, {"activations": _backward_start(acts)}, walk.cold, walk.cold_reductions,
                                    None)
        else:
            forward, extra = warm
        # (the moments of a phase share `base`: the largest is the one that adds the most)
        phases.append(phase(step, Phase.FORWARD, **_plus(base, **forward)))
        phases.append(phase(step, Phase.BACKWARD, **_plus(base, **extra)))
        phases.append(optimizer_step)
    return phases, fixed.host


@memo(maxsize=4096)  # warm plans take 13-19% longer without it
def _stage3_fixed(run: _Run) -> _Fixed3:
    knobs = run.setup.deepspeed
    b = run.b
    walk = _stage3_walk(run.facts, run.n, b, knobs, run.setup.recompute_held_element)
    p3_all, p3, persistent = walk.p3_all, walk.p3, walk.persistent
    # `lp_param_buffer` (or the offload_param host buffer) and the frozen parameters' own partitions
    partitions = (named("fp16 parameter partition (lp_param_buffer)", p3 * b)
                  + named("frozen parameter partitions (ds_tensor)", (p3_all - p3) * b))
    # `fp32_partitioned_groups_flat`, a separate copy even in fp32
    master = named("fp32 master partition (fp32_partitioned_groups_flat)", p3 * FP32_BYTES)
    states = _states(run, p3)
    # `grad_partitions_flat_buffer`, init (host with optimizer offload)
    grad_partitions = named("gradient partitions (grad_partitions_flat_buffer)", p3 * b)
    # `_setup_for_real_optimizer`: one bucket in the communication dtype, not doubled by overlap.
    bucket = named("reduce bucket (ipg buffer)", knobs.reduce_bucket_size * b)
    # `step` works one sub-group at a time (`_create_fp16_sub_groups`)
    sub_groups = _sub_groups(run)
    sub_group = max(sub_groups, default=0)

    on_device_opt = not run.offload_opt or run.cpu_run
    on_device_par = not run.offload_par or run.cpu_run

    def opt(value: int) -> int:
        return value if on_device_opt else 0

    partitions_dev = partitions if on_device_par else 0
    offload_grads = 0
    if run.offload_opt:  # `subgroup_gradient_buffer`, from init
        offload_grads = named("CPU Adam gradient partition (subgroup_gradient_buffer)", p3 * FP32_BYTES)
    steps = []
    for step in (Step.FIRST, Step.STEADY):
        held = states if step == Step.STEADY else 0
        # persistent parameters stay gathered once the trace is complete (after the first micro-batch)
        persist = 0
        if step == Step.STEADY or run.setup.accumulating:
            persist = named("persistent parameters (ds_persist)", persistent * b)
        base = {"params": partitions_dev + persist, "optimizer_states": opt(master + held),
                "grads": opt(grad_partitions + offload_grads), "buffers": bucket}
        # `step`: all parameters are released, persistent ones included, and re-gathered after
        # the update. Without optimizer offload, one sub-group after the other (`_stage3_sub_group_steps`).
        stepping_base = dict(base, params=partitions_dev)
        if run.offload_opt:
            stepping = dict(stepping_base, optimizer_states=opt(master + states))
        else:
            # the first step creates the states sub-group by sub-group; later ones hold them all,
            # so the largest sub-group is the step's largest moment
            order = sub_groups if step == Step.FIRST else (sub_group,)
            stepping = largest_point(*_stage3_sub_group_steps(run, stepping_base, master, grad_partitions, order,
                                                              states if step == Step.STEADY else None))
        after = dict(base, params=partitions_dev + named("persistent parameters (ds_persist)", persistent * b),
                     optimizer_states=opt(master + states))
        steps.append(_StepMoments(step, base, None, phase(step, Phase.OPTIMIZER_STEP, **largest_point(stepping, after))))
    # Under `deepspeed.zero.Init` (partition_parameters.py `_post_init_method`) each module's
    # parameters are partitioned as the module is built, onto the host with offload_param
    # (`remote_device`): at most one whole tensor exists beside the partitions. Otherwise the model
    # is whole on the GPU before `deepspeed.initialize` partitions it (`_built_whole`). Then
    # `_create_fp16_partitions_with_defragmentation` copies the partitions into one buffer (on the
    # host with offload_param: `param_groups_fp16_flat_cpu_memory`), `_create_fp32_partitions`, and
    # `initialize_optimizer_states` makes a zero gradient of the largest sub-group in fp32
    # (`gradient_buffer`, temporary without offload) before the bucket and gradient partitions.
    if run.setup.program.model_init == ModelInit.ZERO_INIT:
        built = {"params": partitions_dev + named("tensor being partitioned (zero.Init)", run.layout.largest * b)}
    else:
        built = {"params": _built_whole(run)}
    # the partitions, and their copy into one buffer
    defrag = {"params": partitions_dev + (named("parameter partitions before defragmentation (ds_tensor)", p3_all * b)
                                          if on_device_par else 0)}
    zero_grad = named("initial step zero gradient (initialize_optimizer_states)", sub_group * FP32_BYTES)
    opt_init = {"params": partitions_dev, "optimizer_states": opt(master),
                "temporaries": 0 if run.offload_opt else opt(zero_grad), "grads": opt(offload_grads)}
    first_base = steps[0].during
    init = phase(Step.FIRST, Phase.INIT, **largest_point(built, defrag, opt_init, dict(first_base, params=partitions_dev)))
    host = _stage3_host(run, p3, partitions, master + states, grad_partitions + offload_grads)
    return _Fixed3(init, tuple(steps), host, walk)


def _stage3_sub_group_steps(run: _Run, base: Point, master: int, grad_partitions: int, order: tuple[int, ...],
                            held: int | None) -> list[Point]:
    """The moments of stage3.py `step`'s loop over the sub-groups of `order` (elements each), without
    optimizer offload; `held`: the optimizer states of every sub-group, there from the start (steps 2
    on), or None: the first step, which creates them as it goes.

    Per sub-group: `_prepare_fp32_grad_for_sub_group` builds flatten(averaged_gradients) (a copy in
    the model dtype) and `.to(fp32)` of it as the sub-group's .grad (the same tensor when b = 4);
    `_optimizer_step` steps it, torch's AdamW creating the sub-group's states at its first step
    (`_init_group`) and allocating its temporaries; `_release_sub_group` sets the .grad to None
    before the next sub-group. `averaged_gradients[i]` are views of `grad_partitions_flat_buffer`
    (`independent_gradient_partition_epilogue`: `__param_id_to_grad_partition`), so setting them to
    None frees nothing: that buffer stays whole."""
    moments: list[Point] = []
    for before, size in zip(accumulate(order, initial=0), order):
        fp32_grad = named("fp32 gradient partition (fp32_partitioned_groups_flat .grad)", size * FP32_BYTES)
        flat_grad = named("flat gradient partition (flatten(averaged_gradients))", size * run.b) if run.b != FP32_BYTES else 0
        grads = grad_partitions + fp32_grad
        states_before = held if held is not None else _states(run, before)
        states_after = held if held is not None else _states(run, before + size)
        moments.append(dict(base, optimizer_states=master + states_before, grads=grads, temporaries=flat_grad))
        moments.append(dict(base, optimizer_states=master + states_after, grads=grads,
                            temporaries=_flat_step_temporaries(run, size)))
    return moments


def _built_whole(run: _Run) -> int:
    """Bytes of a whole model on the GPU before stage 3 partitions it: cast on the host and moved
    (model_init host: engine.py `_configure_distributed_model`, `_cast_module_mixed_precision` then
    `module.to(device)`), or built there in fp32 and cast one parameter at a time (device; on a CPU
    run the host is the same memory)."""
    if run.setup.program.model_init == ModelInit.HOST and not run.cpu_run:
        return named("whole module parameters before partitioning", run.total * run.b)
    built = HALF_BYTES if run.setup.precision == Precision.PURE_BF16 else FP32_BYTES
    # `p.data = p.data.to(dtype)`, the largest
    cast = named("parameter being cast (p.data.to(dtype))", run.layout.largest * run.b) if run.b != built else 0
    return named("whole module parameters before partitioning", run.total * built) + cast


def _sub_groups(run: _Run) -> tuple[int, ...]:
    """Elements of each optimizer sub-group of a rank's partition, in step order (`sub_groups_of`)."""
    return sub_groups_of(run.facts, run.n, run.setup.deepspeed.sub_group_size, _trainer_param_groups(run.setup))


def _largest_sub_group(run: _Run) -> int:
    return max(_sub_groups(run), default=0)


def _stage3_host(run: _Run, p3: int, partitions: int, optimizer: int, grads: int) -> tuple[int, int]:
    """(host, NVMe) bytes per rank of stage 3 offload on a GPU machine.

    offload_optimizer cpu: the fp32 master, the states and both gradient partitions on the host.
    nvme: master and states on NVMe; `OptimizerSwapper` (swap_tensor/optimizer_utils.py) pins
    `buffer_count` (4) buffers of the largest sub-group in fp32 to swap them through.
    offload_param cpu: the partitions on the host (`param_groups_fp16_flat_cpu_memory`); nvme:
    on NVMe, through `AsyncPartitionedParameterSwapper.buffers` (swap_tensor/
    partitioned_param_swapper.py), `buffer_count` x `buffer_size` elements of the model dtype.
    """
    if run.cpu_run:
        return 0, 0
    knobs = run.setup.deepspeed
    host = nvme = 0
    if run.setup.offload_optimizer == Offload.CPU:
        host += optimizer + grads
    elif run.setup.offload_optimizer == Offload.NVME:
        nvme += optimizer
        swap = OPTIMIZER_SWAP_BUFFERS * _largest_sub_group(run) * FP32_BYTES
        host += grads + named("optimizer swap buffers (NVMe)", swap)
    if run.setup.offload_params == Offload.CPU:
        host += partitions
    elif run.setup.offload_params == Offload.NVME:
        nvme += partitions
        swap = knobs.offload_buffer_count * knobs.offload_buffer_size * run.b
        host += named("parameter swap buffers (NVMe)", swap)
    return host, nvme


def _stage3_reductions(groups_backward: tuple[tuple[int, ...], ...], n: int, bucket: int) -> tuple[tuple[int, int, int], ...]:
    """(backward module index, padded elements reduced, elements of the gradient that triggered
    it) for each bucket reduction during backward, the largest per module.

    stage3.py `__add_grad_to_ipg_bucket` reduces the bucket when the next gradient does not fit
    (`__reduce_and_partition_ipg_grads`); with `reduce_scatter` on (the default)
    `__avg_scatter_grads` -> comm/coalesced_collectives.py `reduce_scatter_coalesced` builds a
    flat copy of every gradient in the bucket, each padded to a multiple of N (`torch.cat`),
    while the triggering gradient waits in its .grad. The epilogue reduces what is left at the
    end of backward, the last gradient produced still held (measured: docs/engines/deepspeed.md).
    """
    found: dict[int, tuple[int, int, int]] = {}
    filled = last = 0
    for index, group in enumerate(groups_backward):
        for numel in group:
            if filled and filled + numel > bucket:
                best = found.get(index)
                if best is None or filled > best[1]:
                    found[index] = (index, filled, numel)
                filled = 0
            filled += ceil_div(numel, n) * n
            last = numel
    if filled:
        end = len(groups_backward) - 1
        best = found.get(end)
        if best is None or filled > best[1]:
            found[end] = (end, filled, last)
    return tuple(found.values())


def _steady_gathering(gathered_backward: tuple[tuple[int, ...], ...], n: int, threshold: int, reuse: int, live: int,
                      prefetch_bucket: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Gathered non-persistent elements once the trace is recorded: at the head's forward, and
    while each module group (backward order) runs its backward, as (held, prefetched).

    partitioned_param_coordinator.py `__params_to_release`: after a module runs, its parameters
    are kept if they reappear within `stage3_max_reuse_distance` elements of the upcoming trace.
    A tensor used in forward is next used in backward, after the tensors that follow it in
    forward have each been used twice (2 x the elements after it); a tensor used in backward is
    next used in the next forward, after 2 x the elements before it. `fetch_sub_module` gathers
    the running module and prefetches up to `stage3_prefetch_bucket_size` elements ahead while
    fewer than `stage3_max_live_parameters` are gathered. `step` releases everything
    (`_partition_all_parameters`).
    """
    sizes = _per_group(gathered_backward, lambda grp: sum(ceil_div(x, n) * n for x in grp if x > threshold))
    total = sum(sizes)
    # forward order is the reverse of backward order; `after` = elements after a group in forward
    kept_forward, kept_backward = [], []
    after = 0
    for size in sizes:  # backward order: the head first, i.e. the last in forward
        kept_forward.append(size if 2 * after < reuse else 0)
        after += size
        kept_backward.append(size if 2 * (total - after) < reuse else 0)
    at_head = min(sum(kept_forward), max(live, sizes[0] if sizes else 0))
    in_backward = []
    # running sums over backward order: kept_forward after `index`, kept_backward before it, sizes after it
    not_reached, done, after = sum(kept_forward), 0, total
    for index, size in enumerate(sizes):
        not_reached -= kept_forward[index]
        after -= size
        if index:
            done += kept_backward[index - 1]
        ahead = after - not_reached
        prefetch = min(prefetch_bucket, ahead) if not_reached + done + size < live else 0
        in_backward.append((min(not_reached + done, live) + size, prefetch))
    return at_head, tuple(in_backward)


# -- entry point ----------------------------------------------------------------------------------


def estimate_deepspeed(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    run = _run(facts, setup)
    host = nvme = 0
    if setup.zero_stage == 0:
        phases = _stage0(run, acts)
    elif setup.zero_stage in (1, 2):
        phases, host = _stage12(run, acts)  # spec: stages 1-2 offload to cpu only
    else:
        phases, (host, nvme) = _stage3(run, acts)
    per_node, notes = _per_node_and_notes(setup, run.b, host, nvme)
    return EngineEstimate(tuple(phases), per_node, notes)


def _per_node_and_notes(setup: Setup, b: int, host: int, nvme: int) -> tuple[NodeBytes, tuple[str, ...]]:
    notes = []
    if setup.precision == Precision.PURE_BF16:
        notes.append("pure-bf16: DeepSpeed keeps an fp32 master and fp32 states; estimated as bf16 mixed precision")
    per_node = NodeBytes(cpu_bytes=host * setup.node_gpus,
                         pinned_bytes=host * setup.node_gpus if setup.deepspeed.offload_pin_memory else 0,
                         nvme_bytes=nvme * setup.node_gpus)
    bucket = setup.deepspeed.reduce_bucket_size * b
    if setup.zero_stage >= 1 and bucket >= 2**30:
        notes.append(f"reduce bucket of {bucket:,} bytes (reduce_bucket_size {setup.deepspeed.reduce_bucket_size:,} "
                     "elements, allocated whole whatever the model size); lower it to save memory")
    return per_node, tuple(notes)
