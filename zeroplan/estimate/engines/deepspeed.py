"""DeepSpeed ZeRO (deepspeed 0.19, deepspeed/runtime/zero/), as `deepspeed.initialize` builds it.

Stages 1-2, `stage_1_and_2.py` DeepSpeedZeroOptimizer:
- `bit16_groups_flat`: the model parameters flattened into one buffer per group, whole on every
  rank (Ψ elements in the model dtype; an fp32 run flattens fp32);
- `single_partition_of_fp32_groups`: the rank's fp32 master partition, Ψ/N elements, kept even in
  an fp32 run;
- the reduce bucket (`ipg_buffer`, `reduce_bucket_size` elements in the model dtype; two when
  overlap_comm), allocated at the first backward;
- stage 2 `grads_in_partition`: the rank's gradient partition in the model dtype (contiguous
  gradients), allocated at the first backward and kept; stage 1 keeps full gradients in .grad
  until the step;
- at the step, the partition's gradients are flattened to fp32 (`single_grad_partition`, Ψ/N) and
  the wrapped torch optimizer creates its states lazily on the fp32 partition (the first step).
Stage 3, `stage3.py` DeepSpeedZeroOptimizer_Stage3 with `partition_parameters.py`:
- each parameter's partition (`ds_tensor`, Ψ/N in the model dtype); parameters with fewer than
  `stage3_param_persistence_threshold` elements stay whole on every rank;
- gathered parameters: the coordinator (`partitioned_param_coordinator.py`) keeps up to
  `stage3_max_live_parameters` gathered elements and prefetches `stage3_prefetch_bucket_size`;
  in the first step (no trace yet) each module is released after use;
- the fp32 master partition and the gradient partitions (`grad_partitions_flat_buffer`, Ψ/N in
  the model dtype) and the reduce bucket (`__ipg_bucket_flat_buffer`, reduce_bucket_size
  elements), all allocated in `deepspeed.initialize`;
- with offload_optimizer an fp32 gradient partition is kept for the CPU Adam step
  (`fp32_partitioned_groups_flat` grads).
Defaults from `runtime/zero/config.py`: reduce_bucket_size 5e8, allgather_bucket_size 5e8,
overlap_comm False for stages 1-2 and True for stage 3, prefetch 5e7, max_live 1e9,
persistence threshold 1e5.
Details that differ from this model, measured with `zeroplan measure`, are listed in
docs/engines/deepspeed.md and docs/accuracy.md.
"""

from __future__ import annotations

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import EngineEstimate, activation_phases, ceil_div, phase, step_temporary_bytes
from zeroplan.estimate.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.spec.training import Device, Offload, Precision, TrainingSpec

# DeepSpeed pads each flat group to a multiple of `nccl_start_alignment_factor` (2) x world size
# (stage_1_and_2.py: alignment = self.nccl_start_alignment_factor * dp_size).
NCCL_START_ALIGNMENT_FACTOR = 2


def _largest(*points: dict[str, int]) -> dict[str, int]:
    return max(points, key=lambda p: sum(p.values()))


def estimate_deepspeed(facts: ModelFacts, training: TrainingSpec, acts: ActivationBytes | None) -> EngineEstimate:
    n = training.gpus
    knobs = training.deepspeed
    model_bytes = FP32_BYTES if training.precision == Precision.FP32 else HALF_BYTES
    stage = training.zero_stage
    overlap = knobs.overlap_comm if knobs.overlap_comm is not None else stage == 3
    alignment = NCCL_START_ALIGNMENT_FACTOR * n
    psi = ceil_div(facts.total_params, alignment) * alignment
    trainable = ceil_div(facts.trainable_params, alignment) * alignment
    # Stage 0 is not ZeRO: runtime/bf16_optimizer.py (and fp16/fused_optimizer.py) keep the fp32
    # master and states for every parameter on every rank.
    partition = trainable // (n if stage >= 1 else 1)
    state_element = HALF_BYTES if training.precision == Precision.PURE_BF16 else FP32_BYTES
    master = 0 if training.precision == Precision.PURE_BF16 else partition * FP32_BYTES
    offload_opt = training.offload_optimizer != Offload.NONE
    offload_par = training.offload_params != Offload.NONE
    cpu_run = training.device == Device.CPU

    states = optimizer_state_bytes(partition, training.optimizer, state_element)
    reduce_bucket = min(knobs.reduce_bucket_size, trainable) * model_bytes * (2 if overlap else 1)
    fp32_grad_partition = partition * FP32_BYTES
    temporaries = step_temporary_bytes(partition, partition, state_element, training)
    if stage == 0:
        # BF16_Optimizer.step flattens the fp32 gradients and unscales them: measured on 2 gloo
        # ranks (shared/NOTES.md), about twice the fp32 model size of temporaries.
        temporaries = 2 * trainable * FP32_BYTES

    if stage == 3:
        persistent = sum(g.count * t.numel for g in facts.groups for t in g.tensors if t.numel < knobs.stage3_param_persistence_threshold)
        sharded = ceil_div(facts.total_params - persistent, alignment) * alignment // n
        params = (sharded + persistent) * model_bytes
        live_limit = knobs.stage3_max_live_parameters + knobs.stage3_prefetch_bucket_size
        steady_gathered = min(facts.total_params - persistent, live_limit) * model_bytes
        first_gathered = facts.largest_group_params * model_bytes
        grads_held = partition * model_bytes  # grad_partitions_flat_buffer
        init_buffers = reduce_bucket  # stage 3 allocates it in deepspeed.initialize
    else:
        params = psi * model_bytes  # bit16_groups_flat, whole on every rank
        grads_held = partition * model_bytes if stage == 2 else 0
        init_buffers = 0
    full_grads = trainable * model_bytes  # stage 1: .grad of every parameter until the step

    # Offload: the fp32 master, states and the fp32 gradient partition go to the host (ZeRO-Offload).
    host_opt = master + states + fp32_grad_partition if offload_opt else 0
    host_params = params if offload_par else 0
    if offload_opt and not cpu_run:
        master_dev, states_dev, temps_dev, fp32_grad_dev = 0, 0, 0, 0
    else:
        master_dev, states_dev, temps_dev, fp32_grad_dev = master, states, temporaries, fp32_grad_partition
    params_dev = 0 if (offload_par and not cpu_run) else params

    fwd_acts, bwd_acts, recompute = activation_phases(acts)
    phases: list[PhaseBytes] = []
    for step in (Step.FIRST, Step.STEADY):
        # Optimizer states appear at the first step(); stage 0's BF16_Optimizer creates them at
        # construction.
        held_states = states_dev if (step == Step.STEADY or stage == 0) else 0
        gathered = (steady_gathered if step == Step.STEADY else first_gathered) if stage == 3 else 0
        bucket = init_buffers if step == Step.FIRST else reduce_bucket
        grads_kept = grads_held if step == Step.STEADY or stage == 3 else 0
        base = dict(params=params_dev, optimizer_states=master_dev + held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base, buffers=init_buffers, grads=grads_held if stage == 3 else 0))
        phases.append(phase(step, Phase.FORWARD, **base, buffers=bucket + gathered, grads=grads_kept, activations=fwd_acts))
        end_grads = grads_held + (full_grads if stage < 2 else 0)
        backward = _largest(
            dict(buffers=bucket + gathered, grads=grads_kept, activations=bwd_acts),
            dict(buffers=reduce_bucket + gathered, grads=end_grads, activations=recompute),
        )
        phases.append(phase(step, Phase.BACKWARD, **base, **backward))
        step_grads = grads_held + (full_grads if stage < 2 else 0) + fp32_grad_dev
        phases.append(phase(step, Phase.OPTIMIZER_STEP, params=params_dev, optimizer_states=master_dev + states_dev,
                            buffers=reduce_bucket + gathered, grads=step_grads, temporaries=temps_dev))
    nvme = 0
    cpu = 0
    if training.offload_optimizer == Offload.NVME:
        nvme += host_opt
    else:
        cpu += host_opt
    if training.offload_params == Offload.NVME:
        nvme += host_params
    else:
        cpu += host_params
    per_node = NodeBytes(cpu_bytes=cpu * training.node_gpus,
                         pinned_bytes=(cpu * training.node_gpus) if knobs.offload_pin_memory and not cpu_run else 0,
                         nvme_bytes=nvme * training.node_gpus)
    notes = []
    if reduce_bucket >= 2**30:
        notes.append(f"reduce bucket of {reduce_bucket:,} bytes (reduce_bucket_size {knobs.reduce_bucket_size:,}); lower it to save memory")
    return EngineEstimate(tuple(phases), per_node, tuple(notes))
