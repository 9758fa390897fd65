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
The measure runner builds the model in fp32 before `deepspeed.initialize` casts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import (
    EngineEstimate,
    ceil_div,
    early_gradients,
    phase,
)
from zeroplan.estimate.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.spec.training import Device, Offload, Optimizer, Precision, TrainingSpec

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
# zero/config.py: sub_group_size default; stage 3 steps the fp32 partition sub-group by sub-group.
SUB_GROUP_SIZE = 1_000_000_000

Point = dict[str, int]


def _total(point: Point) -> int:
    return sum(point.values())


def _largest(*points: Point) -> Point:
    return max(points, key=_total)


def _plus(base: Point, **more: int) -> Point:
    out = dict(base)
    for name, value in more.items():
        out[name] = out.get(name, 0) + value
    return out


@dataclass(frozen=True)
class _Run:
    """The sizes every stage needs, derived once from the model facts and the training spec."""

    n: int
    b: int  # model dtype (params, gradients; DeepSpeed's communication and accumulation default)
    total: int  # all parameter elements
    trainable: int
    numels: tuple[int, ...]  # trainable tensors in parameter order (embedding first)
    groups_backward: tuple[tuple[int, ...], ...]  # trainable tensors per module group, backward order
    gathered_backward: tuple[tuple[int, ...], ...]  # all tensors (frozen too) per group, backward order
    largest: int  # largest trainable tensor
    tied_head: int  # elements of a tied head's gradient, held by autograd until the embedding's backward
    adam_temporary_rate: int  # bytes of step temporaries per element of the tensor stepped at once
    cpu_run: bool
    offload_opt: bool
    offload_par: bool
    training: TrainingSpec
    facts: ModelFacts


@lru_cache(maxsize=256)
def _layout(facts: ModelFacts) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(trainable tensors in parameter order, trainable tensors per module group in backward
    order, all tensors per group in backward order); cached, the planner asks thousands of times."""
    # parameter order (model.parameters()): each copy of a block in turn
    numels = tuple(t.numel for g in facts.groups if not g.frozen for _ in range(g.count) for t in g.tensors)
    # Module groups in backward order (the head first); a frozen group has no gradients but
    # its parameters are still gathered in stage 3.
    backward: list[tuple[int, ...]] = []
    gathered: list[tuple[int, ...]] = []
    for g in reversed(facts.groups):
        tensors = tuple(reversed([t.numel for t in g.tensors]))
        backward.extend([() if g.frozen else tensors] * g.count)
        gathered.extend([tensors] * g.count)
    return numels, tuple(backward), tuple(gathered)


def _run(facts: ModelFacts, training: TrainingSpec) -> _Run:
    b = FP32_BYTES if training.precision == Precision.FP32 else HALF_BYTES
    numels, backward, gathered = _layout(facts)
    offload_opt = training.offload_optimizer != Offload.NONE
    # Optimizer step temporaries. torch AdamW on CPU is the single-tensor path
    # (torch/optim/adam.py `_single_tensor_adam`: `denom = (exp_avg_sq.sqrt() / c).add_(eps)`,
    # two fp32 temporaries of the tensor being stepped). FusedAdam (ops/adam/fused_adam.py,
    # multi_tensor_applier) and DeepSpeedCPUAdam (ops/adam/cpu_adam.py) update in place; SGD
    # updates in place.
    adamish = training.optimizer in (Optimizer.ADAM, Optimizer.ADAMW)
    rate = 2 * FP32_BYTES if (adamish and training.device == Device.CPU and not offload_opt) else 0
    return _Run(
        n=training.gpus, b=b, total=facts.total_params, trainable=facts.trainable_params, numels=numels,
        groups_backward=backward, gathered_backward=gathered, largest=max(numels, default=0),
        tied_head=early_gradients(facts)[1], adam_temporary_rate=rate,
        cpu_run=training.device == Device.CPU, offload_opt=offload_opt,
        offload_par=training.offload_params != Offload.NONE, training=training, facts=facts,
    )


def _states(run: _Run, numel: int) -> int:
    """Adam moments (fp32, lazily at the first step) or SGD momentum of `numel` master elements."""
    return optimizer_state_bytes(numel, run.training.optimizer, FP32_BYTES)


# -- activations along backward ----------------------------------------------------------------


def _backward_activations(run: _Run, acts: ActivationBytes | None) -> list[int]:
    """Activation bytes while backward computes each module group's gradients, in backward order
    (final norm and head, blocks from the last, embedding), from activations.py's terms. The
    loss's own backward comes before any parameter gradient: `_backward_start`. A tied head's
    gradient waits in autograd's input buffer from the head's backward to the embedding's
    (common.py `early_gradients`), counted with the activations as `zeroplan measure` does."""
    groups = len(run.groups_backward)
    if acts is None:
        return [0] * groups
    points = [acts.block_backward_peak(acts.num_blocks)]  # the head: the blocks' saved tensors
    for left in range(acts.num_blocks, 0, -1):
        points.append(acts.block_backward_peak(left))
    points = [p + run.tied_head * run.b for p in points]
    points.append(acts.embedding)
    return points if len(points) == groups else [0] * groups  # a count-only model: no activations


def _hook_activations(points: list[int], acts: ActivationBytes | None) -> list[int]:
    """Activations at a weight gradient's hook inside each module group: a block's saved (and
    recomputed) tensors without the activation gradients in flight at its peak (activations.py
    `block_backward_transient`). Measured: stage 3's bucket reductions and stage 2's offload
    norms do not coincide with a block's peak (tiny-llama and tiny-gpt2, with checkpointing)."""
    transient = acts.block_backward_transient if acts is not None else 0
    return [max(a - transient, 0) if 0 < i < len(points) - 1 else a for i, a in enumerate(points)]


def _backward_start(acts: ActivationBytes | None) -> int:
    """log_softmax's backward, before the first parameter gradient (and its hook) exists."""
    return acts.backward_start_peak if acts is not None else 0


def _activations_before_head(acts: ActivationBytes | None) -> int:
    """When the head's forward starts: the blocks' saved tensors and the final norm's."""
    return acts.blocks_saved + acts.final_norm if acts is not None else 0


def _forward_activations(acts: ActivationBytes | None) -> int:
    return acts.forward_peak if acts is not None else 0


# -- stage 0 --------------------------------------------------------------------------------------


def _stage0(run: _Run, acts: ActivationBytes | None) -> list[PhaseBytes]:
    b, psi = run.b, run.trainable
    params = run.total * b
    grads = psi * b
    # engine.py `allreduce_gradients` -> `buffered_allreduce_fallback` -> `allreduce_no_retain`:
    # a flat copy of the gradients (chunks of MEMORY_OPT_ALLREDUCE_SIZE) at the end of backward.
    flat_allreduce = min(psi, MEMORY_OPT_ALLREDUCE_SIZE + run.largest) * b
    states = _states(run, psi)
    fwd = _forward_activations(acts)
    bwd = _backward_start(acts)
    phases = []
    if run.training.precision == Precision.FP32:
        # No wrapper: torch AdamW/FusedAdam on the module parameters, states at the first step;
        # per-tensor step temporaries.
        temps = run.adam_temporary_rate * run.largest
        for step in (Step.FIRST, Step.STEADY):
            held = states if step == Step.STEADY else 0
            if step == Step.FIRST:
                phases.append(phase(step, Phase.INIT, params=params))
            phases.append(phase(step, Phase.FORWARD, params=params, optimizer_states=held, activations=fwd))
            end = {"params": params, "optimizer_states": held, "grads": grads, "buffers": flat_allreduce}
            start = {"params": params, "optimizer_states": held, "activations": bwd}
            phases.append(phase(step, Phase.BACKWARD, **_largest(start, end)))
            phases.append(phase(step, Phase.OPTIMIZER_STEP, params=params, grads=grads, optimizer_states=states,
                                temporaries=temps))
        return phases
    # bf16/fp16: fp32 master of every parameter and the states exist from init:
    # `initialize_optimizer_states` steps the optimizer on zero gradients (fp16/unfused_optimizer.py,
    # fp16/fused_optimizer.py).
    master = psi * FP32_BYTES
    if run.training.device == Device.CPU:
        # FP16_UnfusedOptimizer: per-parameter fp32 clones; step: `fp32.grad = fp16.grad.to(fp32)`
        # per parameter, the 16-bit gradients still alive; torch AdamW per tensor.
        step_grads = grads + psi * FP32_BYTES
        step_temps = run.adam_temporary_rate * run.largest
        init_extra = {"grads": grads + psi * FP32_BYTES, "temporaries": step_temps}  # the zero-gradient step
    else:
        # FP16_Optimizer.step: `p.grad.to(fp32)` per parameter, then `_flatten_dense_tensors` of
        # them (both Ψ x 4 alive while flattening), the 16-bit grads freed after.
        step_grads = grads + psi * FP32_BYTES
        step_temps = psi * FP32_BYTES
        init_extra = {"grads": psi * FP32_BYTES}  # zero fp32 flat gradient for the init step
    base = {"params": params, "optimizer_states": master + states}
    for step in (Step.FIRST, Step.STEADY):
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base, **init_extra))
        phases.append(phase(step, Phase.FORWARD, **base, activations=fwd))
        end = {"grads": grads, "buffers": flat_allreduce}
        phases.append(phase(step, Phase.BACKWARD, **base, **_largest({"activations": bwd}, end)))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, **base, grads=step_grads, temporaries=step_temps))
    return phases


# -- stages 1 and 2 -------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _owned_elements(numels: tuple[int, ...], partition: int, n: int) -> tuple[int, ...]:
    """Each rank's `grads_in_partition` elements: stage_1_and_2.py `copy_grads_in_partition`
    sizes it as the sum of the whole tensors that intersect the rank's [r·P, (r+1)·P) slice."""
    if len(numels) <= 1:
        # A model given by a parameter count has no tensor boundaries: partitions are exact, as
        # in DeepSpeed's own estimate_zero2_model_states_mem_needs.
        return (partition,) * n
    owned = [0] * n
    start = 0
    for numel in numels:
        end = start + numel
        first, last = min(start // partition, n - 1), min((end - 1) // partition, n - 1)
        for rank in range(first, last + 1):
            owned[rank] += numel
        start = end
    return tuple(owned)


@lru_cache(maxsize=1024)
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


@lru_cache(maxsize=1024)
def _last_fill(numels: tuple[int, ...], bucket_elements: int) -> int:
    """Gradient elements in the reduce bucket when the epilogue reduces it (after the last
    overflow, `reduce_independent_p_g_buckets_and_remove_grads`)."""
    pending = 0
    for numel in numels:
        if pending and pending + numel > bucket_elements:
            pending = 0
        pending += numel
    return pending


@lru_cache(maxsize=1024)
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


def _stage12(run: _Run, acts: ActivationBytes | None) -> tuple[list[PhaseBytes], int]:
    training, knobs = run.training, run.training.deepspeed
    b, n = run.b, run.n
    stage = training.zero_stage
    overlap = bool(knobs.overlap_comm)  # zero/config.py: overlap_comm defaults to False for 1-2
    alignment = NCCL_START_ALIGNMENT_FACTOR * n
    flat = ceil_div(run.trainable, alignment) * alignment
    partition = flat // n  # P12: `partition_size`, the padding sits in the last rank's slice
    params = (flat + run.total - run.trainable) * b  # `bit16_groups_flat` + frozen module params
    master = partition * FP32_BYTES  # `single_partition_of_fp32_groups`, also in an fp32 run
    states = _states(run, partition)
    owned_by_rank = _owned_elements(run.numels, partition, n)
    owned = max(owned_by_rank) * b
    # The last rank owns the head, whose gradients come first in backward: it allocates its
    # partition at the first reduction during backward, the others later.
    owned_early = owned_by_rank[-1] * b
    # `setup_buckets`: `reduce_bucket_size` elements, always (not capped by the model), two with
    # overlap_comm; at the first gradient hook of every backward, freed by
    # `independent_gradient_partition_epilogue` -> `_release_ipg_buffers`.
    bucket = knobs.reduce_bucket_size * b * (2 if overlap else 1)
    first_index = _first_reduction(run.groups_backward, knobs.reduce_bucket_size)
    last_fill = _last_fill(tuple(x for g in run.groups_backward for x in g), knobs.reduce_bucket_size)
    last_fill_forward = _last_fill(run.numels, knobs.reduce_bucket_size)
    acts_bwd = _backward_activations(run, acts)
    acts_at_first = acts_bwd[first_index] if first_index < len(acts_bwd) else 0
    fwd = _forward_activations(acts)

    # Optimizer offload (stage_1_and_2.py `__init__`, `initialize_optimizer_states`): the fp32
    # master, its fp32 gradient (kept from init), a P12 x b copy of the partition
    # (`param_buffer_of_bit16_for_cpu_offload_groups`) and `temp_grad_buffer_for_cpu_offload` live
    # on the host; `temp_grad_buffer_for_gpu_offload` (largest tensor) on the device. Gradients go
    # straight into the host fp32 gradient (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`).
    host_grads = host_buffers = 0
    device_buffers = 0
    if run.offload_opt:
        host_grads = partition * FP32_BYTES
        host_buffers = partition * b + run.largest * b
        device_buffers = run.largest * b
        if training.grad_accum > 1:  # `accumulated_grads_in_cpu`: owned slices, model dtype
            host_grads += partition * b
    on_device = not run.offload_opt or run.cpu_run  # a CPU run has one memory

    def host(value: int) -> int:
        return value if on_device else 0

    ga = training.grad_accum
    phases = []
    for step in (Step.FIRST, Step.STEADY):
        held = states if step == Step.STEADY else 0
        base = {"params": params, "optimizer_states": host(master + held), "grads": host(host_grads),
                    "buffers": host(host_buffers) + device_buffers}
        if step == Step.FIRST:
            # `flatten_dense_tensors_aligned`: the old per-parameter storages and the flat copy.
            flatten = {"params": params + run.trainable * b}
            after = {"params": params, "optimizer_states": host(master), "grads": host(host_grads),
                         "buffers": host(host_buffers) + device_buffers}
            phases.append(phase(step, Phase.INIT, **_largest(flatten, after)))
        # Between micro-batches (grad_accum > 1): stage 1 keeps every .grad and the bucket
        # (allocated at the first micro-batch's first hook, released by the boundary's epilogue,
        # since only the boundary reduces); stage 2 keeps the owned partition (`all_grad_tensors`)
        # or, offloaded, `accumulated_grads_in_cpu` (in host_grads).
        carried: Point = {}
        if ga > 1 and stage == 1:
            carried = {"grads": run.trainable * b, "buffers": bucket}
        elif ga > 1 and not run.offload_opt:
            carried = {"grads": owned}
        during = _plus(base, **carried)
        phases.append(phase(step, Phase.FORWARD, **_plus(during, activations=fwd)))

        bucket_now = 0 if stage == 1 and ga > 1 else bucket  # already carried
        kept = 0 if run.offload_opt else owned  # offload copies straight to the host gradient
        # The bucket appears at the first parameter's gradient hook, after the loss's backward.
        points = [_plus(during, activations=_backward_start(acts))]
        if stage == 2 or overlap:
            # Stage 2 (and stage 1 with overlap_comm, at the boundary: `process_gradients`) moves
            # each gradient into the bucket at its hook. The rank owning the last parameters
            # allocates its `grads_in_partition` at the first reduction; a later micro-batch
            # fills a second one, added into the first at its end.
            if first_index:  # modules before the first reduction: the bucket, no partition yet
                points.append(_plus(during, activations=max(acts_bwd[:first_index]), buffers=bucket_now))
            points.append(_plus(during, activations=acts_at_first, buffers=bucket_now,
                                grads=0 if run.offload_opt else owned_early))
            if run.offload_opt:
                # Offloaded, each owned gradient is copied to the host after
                # `set_norm_for_param_grad_in_gpu` takes its norm in `get_norm_dtype()` (fp64
                # where supported: a copy of the tensor), while the next gradient waits in .grad.
                hook = _hook_activations(acts_bwd, acts)
                points.append(_plus(during, activations=hook[first_index] if first_index < len(hook) else 0,
                                    buffers=bucket_now, grads=run.largest * b, temporaries=run.largest * NORM_BYTES))
            points.append(_plus(during, buffers=bucket_now, grads=kept))
            # The epilogue reduces what is left in the bucket (`average_tensor` ->
            # `allreduce_no_retain` / `allreduce_and_scatter` flatten the slices they reduce:
            # a copy of the bucket's contents), before those gradients reach the partition.
            earlier = kept if first_index < len(run.groups_backward) else 0
            points.append(_plus(during, buffers=bucket_now + last_fill * b, grads=earlier))
        else:
            # Stage 1: the hooks only allocate the bucket; every gradient stays in .grad until the
            # boundary's `reduce_gradients` walks them through the bucket, freeing each .grad as
            # it is copied in and filling the owned partition (the last micro-batch accumulates
            # into the kept .grad).
            # At a block's backward peak, the gradients of the modules before it exist, and the
            # block's output projection's (common.py `early_gradients`, its first gradients).
            done = 0
            first_block = early_gradients(run.facts)[2]
            best_acts = best_grads = -1
            for index, group in enumerate(run.groups_backward):
                in_block = first_block if 0 < index < len(run.groups_backward) - 1 and group else 0
                grads_now = 0 if carried else (done + in_block) * b
                if acts_bwd[index] + grads_now > best_acts + best_grads:
                    best_acts, best_grads = acts_bwd[index], grads_now
                done += sum(group)
            if best_acts >= 0:
                points.append(_plus(during, activations=best_acts, buffers=bucket_now, grads=best_grads))
            # `reduce_gradients` walks the parameters in their order, so the first rank
            # allocates its partition at the first overflow, with the rest still in .grad.
            filled = _bucket_fill(run.numels, knobs.reduce_bucket_size)
            first_rank = 0 if run.offload_opt else owned_by_rank[0] * b
            points.append(_plus(base, buffers=bucket, grads=(run.trainable - filled) * b + first_rank))
            # Each reduction flattens the bucket's contents (`average_tensor`): at the first one
            # every gradient is still a .grad or in the bucket; at the last, the partition is full.
            points.append(_plus(base, buffers=bucket + filled * b, grads=(run.trainable - filled) * b))
            points.append(_plus(base, buffers=bucket + last_fill_forward * b, grads=kept))
        phases.append(phase(step, Phase.BACKWARD, **_largest(*points)))

        # `step`: `flatten(averaged_gradients)` (P12 x b) then `.to(fp32)` becomes the master's
        # .grad (P12 x 4, a second copy only when b != 4) while `grads_in_partition` is alive;
        # then it is freed and the optimizer steps (states created at the first step).
        if run.offload_opt:
            step_point = dict(base, optimizer_states=host(master + states))
        else:
            convert = dict(base, grads=owned + partition * FP32_BYTES,
                           temporaries=partition * b if b != FP32_BYTES else 0)
            stepping = dict(base, optimizer_states=master + states, grads=partition * FP32_BYTES,
                            temporaries=run.adam_temporary_rate * partition)
            step_point = _largest(convert, stepping)
        phases.append(phase(step, Phase.OPTIMIZER_STEP, **step_point))
    host_bytes = (master + states + host_grads + host_buffers) if run.offload_opt and not run.cpu_run else 0
    return phases, host_bytes


# -- stage 3 --------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _leaf_gathered(gathered_backward: tuple[tuple[int, ...], ...], n: int) -> tuple[int, ...]:
    """The largest tensor of each module group, padded to a multiple of N (gathered alone)."""
    return tuple(max((ceil_div(x, n) * n for x in grp), default=0) for grp in gathered_backward)


@lru_cache(maxsize=1024)
def _stage3_sizes(facts: ModelFacts, n: int, threshold: int) -> tuple[int, int, int, int]:
    """(partition elements of all tensors, of the trainable ones, persistent elements, padded
    elements of the gatherable ones) per rank.

    partition_parameters.py `_partition_param`: each tensor is padded to a multiple of N and
    split evenly (`ds_tensor`, ceil(n_t / N)). `ds_persist` for n_t <=
    stage3_param_persistence_threshold (parameter_offload.py `mark_persistent_parameters`):
    gathered once, never released, on top of their partition.
    """
    all_numels = [t.numel for g in facts.groups for t in g.tensors for _ in range(g.count)]
    p3_all = sum(ceil_div(x, n) for x in all_numels)
    p3 = sum(ceil_div(x, n) for x in _layout(facts)[0])
    persistent = sum(x for x in all_numels if x <= threshold)
    gatherable = sum(ceil_div(x, n) * n for x in all_numels if x > threshold)
    return p3_all, p3, persistent, gatherable


def _stage3(run: _Run, facts: ModelFacts, acts: ActivationBytes | None) -> tuple[list[PhaseBytes], tuple[int, int]]:
    training, knobs = run.training, run.training.deepspeed
    b, n = run.b, run.n
    threshold = knobs.stage3_param_persistence_threshold
    p3_all, p3, persistent, gatherable = _stage3_sizes(facts, n, threshold)
    partitions = p3_all * b  # `lp_param_buffer` (or the offload_param host buffer)
    master = p3 * FP32_BYTES  # `fp32_partitioned_groups_flat`, a separate copy even in fp32
    states = _states(run, p3)
    grad_partitions = p3 * b  # `grad_partitions_flat_buffer`, init (host with optimizer offload)
    # `_setup_for_real_optimizer`: one bucket in the communication dtype, not doubled by overlap.
    bucket = knobs.reduce_bucket_size * b
    fp32_grad = p3 * FP32_BYTES  # offload: `subgroup_gradient_buffer` from init; else at step
    gathered_at_head, gathered_in_backward = _steady_gathering(
        run.gathered_backward, n, threshold, knobs.stage3_max_reuse_distance, knobs.stage3_max_live_parameters,
        knobs.stage3_prefetch_bucket_size)
    reductions = _stage3_reductions(run.groups_backward, n, knobs.reduce_bucket_size)
    # A coalesced fetch (`_all_gather_dtype`) holds its flat buffer until the handle's `wait()`
    # has copied each parameter out (`AllGatherCoalescedHandle.wait`): measured with the whole
    # model kept, the forward's prefetch (up to `stage3_prefetch_bucket_size` elements) is alive
    # twice until the head's forward.
    keep_all = gathered_at_head >= gatherable
    prefetch = min(gatherable, knobs.stage3_prefetch_bucket_size) if keep_all else 0

    on_device_opt = not run.offload_opt or run.cpu_run
    on_device_par = not run.offload_par or run.cpu_run

    def opt(value: int) -> int:
        return value if on_device_opt else 0

    fwd = _forward_activations(acts)
    acts_bwd = _backward_activations(run, acts)
    acts_hook = _hook_activations(acts_bwd, acts)
    partitions_dev = partitions if on_device_par else 0
    offload_grads = fp32_grad if run.offload_opt else 0
    phases = []
    for step in (Step.FIRST, Step.STEADY):
        held = states if step == Step.STEADY else 0
        # persistent parameters stay gathered once the trace is complete (after the first micro-batch)
        persist = persistent * b if step == Step.STEADY or training.grad_accum > 1 else 0
        base = {"params": partitions_dev + persist, "optimizer_states": opt(master + held),
                    "grads": opt(grad_partitions + offload_grads), "buffers": bucket}
        if step == Step.FIRST:
            # The model is built whole, partitioned in `deepspeed.initialize`; then
            # `_create_fp16_partitions_with_defragmentation` copies the partitions into one buffer,
            # `_create_fp32_partitions`, and `initialize_optimizer_states` makes a P3 x 4 zero
            # gradient (temporary without offload) before the bucket and gradient partitions.
            built = {"params": run.total * b}
            defrag = {"params": 2 * partitions}
            opt_init = {"params": partitions, "optimizer_states": opt(master),
                            "temporaries": 0 if run.offload_opt else opt(fp32_grad), "grads": opt(offload_grads)}
            phases.append(phase(step, Phase.INIT, **_largest(built, defrag, opt_init, dict(base, params=partitions))))
        if step == Step.FIRST and training.grad_accum == 1:  # no trace yet
            # No trace yet: each submodule's parameters are gathered at its pre-forward and
            # pre-backward hooks and released after it (`release_sub_module`), persistent ones
            # too (measured: a run with every tensor persistent peaks as one with none in its
            # first step). Hooks sit on the leaf modules (a Linear holds one weight, as each of
            # the model's tensors here), so one tensor is gathered at a time.
            module_all = [x * b for x in _leaf_gathered(run.gathered_backward, n)]
            forward = _largest(_plus(base, activations=fwd), _plus(base, buffers=max(module_all, default=0)))
            extras = [{"activations": _backward_start(acts)}]
            extras.append(max(({"buffers": g, "activations": a} for g, a in zip(module_all, acts_bwd)),
                              key=_total, default={}))
            extras += [{"buffers": module_all[i] + flat * b, "grads": trigger * b, "activations": acts_hook[i]}
                       for i, flat, trigger in reductions]
        else:
            # The trace is complete (from the second micro-batch of the first step on).
            head = gathered_at_head * b
            forward = _largest(_plus(base, buffers=head + prefetch * b, activations=_activations_before_head(acts)),
                               _plus(base, buffers=head, activations=fwd))
            extras = [{"buffers": head, "activations": _backward_start(acts)}]
            extras.append(max(({"buffers": g * b, "activations": a} for g, a in zip(gathered_in_backward, acts_bwd)),
                              key=_total, default={}))
            extras += [{"buffers": (gathered_in_backward[i] + flat) * b, "grads": trigger * b, "activations": acts_hook[i]}
                       for i, flat, trigger in reductions]
        phases.append(phase(step, Phase.FORWARD, **forward))
        phases.append(phase(step, Phase.BACKWARD, **_plus(base, **max(extras, key=_total))))
        # `step`: all parameters are released, persistent ones included, and re-gathered after
        # the update. `_prepare_fp32_grad_for_sub_group`: flatten(averaged_gradients).to(fp32)
        # as the sub-group's .grad (an extra P3 x b flatten when b != 4), then the optimizer
        # steps the sub-group (torch AdamW: two temporaries of the sub-group).
        sub_group = min(p3, SUB_GROUP_SIZE)
        stepping_base = dict(base, params=partitions_dev)
        if run.offload_opt:
            stepping = dict(stepping_base, optimizer_states=opt(master + states))
        else:
            convert = dict(stepping_base, grads=grad_partitions + fp32_grad, temporaries=p3 * b if b != FP32_BYTES else 0)
            update = dict(stepping_base, optimizer_states=master + states, grads=grad_partitions + fp32_grad,
                          temporaries=run.adam_temporary_rate * sub_group)
            stepping = _largest(convert, update)
        after = dict(base, params=partitions_dev + persistent * b, optimizer_states=opt(master + states))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, **_largest(stepping, after)))
    return phases, _stage3_host(run, p3, partitions, master + states, grad_partitions + fp32_grad)


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
    knobs = run.training.deepspeed
    host = nvme = 0
    if run.training.offload_optimizer == Offload.CPU:
        host += optimizer + grads
    elif run.training.offload_optimizer == Offload.NVME:
        nvme += optimizer
        host += grads + OPTIMIZER_SWAP_BUFFERS * min(p3, SUB_GROUP_SIZE) * FP32_BYTES
    if run.training.offload_params == Offload.CPU:
        host += partitions
    elif run.training.offload_params == Offload.NVME:
        nvme += partitions
        host += knobs.offload_buffer_count * knobs.offload_buffer_size * run.b
    return host, nvme


@lru_cache(maxsize=1024)
def _stage3_reductions(groups_backward: tuple[tuple[int, ...], ...], n: int, bucket: int) -> tuple[tuple[int, int, int], ...]:
    """(backward module index, padded elements reduced, elements of the gradient that triggered
    it) for each bucket reduction during backward, the largest per module.

    stage3.py `__add_grad_to_ipg_bucket` reduces the bucket when the next gradient does not fit
    (`__reduce_and_partition_ipg_grads`); with `reduce_scatter` on (the default)
    `__avg_scatter_grads` -> comm/coalesced_collectives.py `reduce_scatter_coalesced` builds a
    flat copy of every gradient in the bucket, each padded to a multiple of N (`torch.cat`),
    while the triggering gradient waits in its .grad. The epilogue reduces what is left at the
    end of backward; measured (llama-100m, whole model in one bucket): the last gradient produced
    is still held then, beside the flat copy.
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


@lru_cache(maxsize=1024)
def _steady_gathering(gathered_backward: tuple[tuple[int, ...], ...], n: int, threshold: int, reuse: int, live: int,
                      prefetch_bucket: int) -> tuple[int, tuple[int, ...]]:
    """Gathered non-persistent elements once the trace is recorded: at the head's forward, and
    while each module group (backward order) runs its backward.

    partitioned_param_coordinator.py `__params_to_release`: after a module runs, its parameters
    are kept if they reappear within `stage3_max_reuse_distance` elements of the upcoming trace.
    A tensor used in forward is next used in backward, after the tensors that follow it in
    forward have each been used twice (2 x the elements after it); a tensor used in backward is
    next used in the next forward, after 2 x the elements before it. `fetch_sub_module` gathers
    the running module and prefetches up to `stage3_prefetch_bucket_size` elements ahead while
    fewer than `stage3_max_live_parameters` are gathered. `step` releases everything
    (`_partition_all_parameters`).
    """
    groups = [[ceil_div(x, n) * n for x in grp if x > threshold] for grp in gathered_backward]
    sizes = [sum(g) for g in groups]
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
    for index, size in enumerate(sizes):
        not_reached = sum(kept_forward[index + 1:])
        done = sum(kept_backward[:index])
        ahead = sum(sizes[index + 1:]) - not_reached
        prefetch = min(prefetch_bucket, ahead) if not_reached + done + size < live else 0
        in_backward.append(min(not_reached + done, live) + size + prefetch)
    return at_head, tuple(in_backward)


# -- entry point ----------------------------------------------------------------------------------


def estimate_deepspeed(facts: ModelFacts, training: TrainingSpec, acts: ActivationBytes | None) -> EngineEstimate:
    run = _run(facts, training)
    notes = []
    if training.precision == Precision.PURE_BF16:
        notes.append("pure-bf16: DeepSpeed keeps an fp32 master and fp32 states; estimated as bf16 mixed precision")
    host = nvme = 0
    if training.zero_stage == 0:
        phases = _stage0(run, acts)
    elif training.zero_stage in (1, 2):
        phases, host = _stage12(run, acts)  # spec: stages 1-2 offload to cpu only
    else:
        phases, (host, nvme) = _stage3(run, facts, acts)
    cpu = host
    per_node = NodeBytes(cpu_bytes=cpu * training.node_gpus,
                         pinned_bytes=cpu * training.node_gpus if training.deepspeed.offload_pin_memory else 0,
                         nvme_bytes=nvme * training.node_gpus)
    bucket = training.deepspeed.reduce_bucket_size * run.b
    if training.zero_stage >= 1 and bucket >= 2**30:
        notes.append(f"reduce bucket of {bucket:,} bytes (reduce_bucket_size {training.deepspeed.reduce_bucket_size:,} "
                     "elements, allocated whole whatever the model size); lower it to save memory")
    return EngineEstimate(tuple(phases), per_node, tuple(notes))
