"""The step time of one configuration, term by term, in seconds: the planner's one cost model.

`step_time(model, training, rates)` prices a configuration (its mesh included); `StepModel` is the same
arithmetic with everything that does not depend on the micro-batch and accumulation done once, so that the
planner prices thousands of them cheaply; `estimate --gpu`, `plan` and `plan --mesh` all go through it, so a
configuration costs the same in each. The work (FLOPs, matmul shapes) comes from zeroplan/plan/work.py, the
rates from zeroplan/plan/rates.py; docs/throughput.md derives each term and checks the whole against
published throughput.

Terms of one optimizer step of `grad_accum` micro-batches on the slowest rank:
- compute: matmul FLOPs at the GPU's step efficiency (published MFU), scaled by the roofline of the
  micro-batch's matmul shapes (a matmul whose operands take longer to read from HBM than to multiply runs
  at the memory's pace: Williams et al. 2009, "Roofline"), and FlashAttention at its own utilisation;
  float8 runs the blocks' linears at torchao's measured float8 speed, torch.compile the compute COMPILE_SPEEDUP
  faster.
- recompute: the checkpointing policy's FLOPs (zeroplan/plan/work.py), at the same rates.
- data parallel: ring collectives ((N-1)/N of the data per rank, NCCL's ring algorithm) of ZeRO's volumes
  (Rajbhandari et al. 2020 section 7): stages 0-1 reduce gradients at the accumulation boundary (DeepSpeed
  `is_gradient_accumulation_boundary`; DDP and FSDP2 per their grad_sync), stage 2 reduce-scatters at every
  micro-batch and all-gathers the updated shards after the step (DeepSpeed stage_1_and_2.py); FSDP2's
  stage 2 (reshard_after_forward=False) gathers at every forward, and once per step under a pipeline
  (torch pipelining reduces at the end of the schedule: stage.py `perform_reduce_grad`); stage 3 gathers in
  forward and in backward and reduce-scatters at every micro-batch. Only the exposed part is charged: FSDP
  and ZeRO-3 prefetch the next unit's gather under the current unit's compute (Zhao et al. 2023, PyTorch
  FSDP, section 3.3; DeepSpeed stage3 prefetch, overlap_comm on by default), DDP reduces its buckets under
  backward (Li et al. 2020, PyTorch Distributed, section 3.2.3), DeepSpeed stages 1-2 overlap the reduction
  only with overlap_comm (off by default); the updated shards' gather after the optimizer step has no
  compute to hide under.
- hsdp all-reduce: each reduce-scattered shard all-reduced across the dp_replicate replicas
  (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`), under backward too.
- tp: with or without sequence parallelism four collectives per block and pass moving (t-1)/t of the
  block's activations (Korthikanti et al. 2022 section 4.2.2), on the critical path unless async TP
  decomposes them into tp chunks under the block's matmuls (Wang et al. 2022, "Overlap communication with
  dependent computation via decomposition"; torchtitan enable_async_tensor_parallel): the first chunk exposed.
- cp: the ring passes keys and values cp - 1 times per block in forward, and keys, values and their
  gradients in backward (torch _context_parallel/_attention.py), under the attention of the block held
  (ring attention: Liu et al. 2023); DeepSpeed's Ulysses all-to-alls q, k, v and the output (Jacobs et al.
  2023, section 3), not overlapped.
- pp bubble: (p - 1) / (v m) of the ideal time for GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021
  section 2.2), a third of 1F1B's for zero bubble (Qi et al. 2023, ZB-H1); pp send: each micro-batch's
  activation and gradient to the next stage, v times under a looped schedule, sequence-sharded under SP.
- ep: each MoE layer's all-to-all dispatch and combine (torchtitan expert_parallel.py), in forward, in
  backward and in a recomputed forward, (ep - 1)/ep of the rank's routed tokens each time, not overlapped.
- offload: ZeRO-Offload's PCIe traffic (Ren et al. 2021 section 4.1) and ZeRO-Infinity's parameter fetches
  (Rajbhandari et al. 2021), NVMe swapping; not overlapped.
- optimizer: the update reads and writes the master weights and states and reads the gradient, over HBM,
  or over the node's CPU memory (shared by its GPUs) when offloaded (DeepSpeed's CPU Adam is memory-bound).
A collective over a group whose GPUs span more than a node runs at the network's bandwidth per GPU, once, and
pays NCCL's ring latency (`ring_latency`) per call: one per FSDP unit, bucket or TP collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from zeroplan.estimate.dtypes import StateBytes, state_bytes
from zeroplan.plan.rates import COMPILE_SPEEDUP, Rates
from zeroplan.plan.work import Pace, Work, pace, precision_peak, recompute_share, work
from zeroplan.spec.mesh import PPSchedule
from zeroplan.spec.program import GradSync
from zeroplan.spec.training import Checkpointing, Engine, Offload, TrainingSpec

DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's bucket_cap_mb default (torch/nn/parallel/distributed.py): the last bucket's
all-reduce is what backward cannot hide."""

TERMS = ("compute", "recompute", "data parallel", "hsdp all-reduce", "tp", "cp", "ep", "pp bubble", "pp send",
         "offload", "optimizer")
"""Every term's name, in the order reports list them."""


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of a configuration on its slowest GPU."""

    seconds: float
    tokens: float  # tokens one GPU trains per step: the global batch's over the GPUs
    model_flops_per_token: float  # the model FLOPs (MFU's numerator) of one token
    peak_flops_per_s: float  # the GPU's peak at the run's precision (MFU's denominator)
    terms: dict[str, float] = field(hash=False)  # seconds by TERMS name, summing to `seconds`

    @property
    def tokens_per_s(self) -> float:
        """Tokens one GPU trains per second."""
        return self.tokens / self.seconds

    @property
    def gpu_seconds_per_token(self) -> float:
        """The ranking key: GPU time per trained token (lower is cheaper)."""
        return self.seconds / self.tokens

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model FLOPs of the tokens trained per second over the peak."""
        return self.tokens_per_s * self.model_flops_per_token / self.peak_flops_per_s


def exposed(comm_s: float, window_s: float, units: float) -> float:
    """The part of a collective split over `units` (FSDP units, buckets) that a pipelined schedule cannot
    hide under `window_s` of compute: the first unit's (nothing runs before it), and whatever exceeds the
    compute it overlaps (prefetching one unit ahead, the collectives of the others run under the compute of
    their neighbours)."""
    if comm_s <= 0:
        return 0.0
    units = max(units, 1.0)
    return max(comm_s - window_s * (units - 1) / units, comm_s / units)


def _link(span: int, training: TrainingSpec, rates: Rates) -> float:
    """Bandwidth per GPU of a collective whose group spans `span` consecutive GPUs: a node's links, or the network."""
    return rates.intra_node_bytes_per_s if span <= training.node_gpus else rates.inter_node_bytes_per_s


def ring_latency(ranks: int, span: int, training: TrainingSpec, rates: Rates) -> float:
    """The latency of one ring all-gather or reduce-scatter over `ranks` GPUs spanning `span` consecutive ones, as
    NCCL's tuning model adds it (src/graph/tuning.cc `ncclTopoTuneModel`: the base latency, then each of the
    ranks - 1 steps at the latency of its hop, nodes - 1 of them across the network)."""
    if ranks <= 1:
        return 0.0
    nodes = max(1, -(-span // training.node_gpus))
    return (rates.ring_base_latency_s + (ranks - nodes) * rates.ring_step_latency_intra_s
            + (nodes - 1) * rates.ring_step_latency_inter_s)


def updated_weight_bytes(sizes: StateBytes) -> int:
    """Bytes of the weight the optimizer updates: the fp32 master in mixed precision, else the parameter."""
    return sizes.master or sizes.param


def optimizer_bytes_per_param(sizes: StateBytes) -> float:
    """Bytes the update touches per trained parameter: read and write the updated weight and each state, read
    the gradient at the weight's width, write the 16-bit working copy in mixed precision."""
    weight = updated_weight_bytes(sizes)
    return 2 * weight + 2 * sizes.optimizer_states + weight + (sizes.param if sizes.master else 0)


@dataclass(frozen=True)
class _Collectives:
    """Seconds of one rank's data-parallel traffic, by when it runs."""

    forward: float = 0.0  # per micro-batch, under forward (prefetched gathers)
    backward: float = 0.0  # per micro-batch, under backward (gathers, reduce-scatters, DDP buckets)
    backward_exposed: float = 0.0  # per micro-batch, on the critical path (DeepSpeed without overlap_comm)
    step_backward: float = 0.0  # once per step, under the last micro-batch's backward
    step_forward: float = 0.0  # once per step, under the first micro-batch's forward
    step_exposed: float = 0.0  # once per step, after the optimizer step (updated shards' gather) or unhidden
    replicate: float = 0.0  # HSDP all-reduce, per gradient sync, under backward
    replicate_per_micro: bool = True
    units: float = 1.0  # FSDP units or DDP buckets the traffic is split into


class StepModel:
    """The step time of one (model, mesh, stage, offload, checkpointing, GPU count) choice as a function of the
    micro-batch and accumulation (`at`), the choice's constants computed once."""

    def __init__(self, model, training: TrainingSpec, rates: Rates, shared: SharedWork | None = None):
        """`shared`: the choice's work, slowest rank and matmul rooflines when the caller has them (`shared_work`
        of a spec that differs from `training` in its ZeRO stage or offload only: the planner's choices share them)."""
        self.training, self.rates = training, rates
        shared = shared or shared_work(model, training)
        self.work, slowest, self._rooflines = shared.work, shared.pace, shared.rooflines
        mesh, gpus = training.mesh, training.gpus
        self.cp, self.tp, self.pp = mesh.cp, mesh.tp, mesh.pp
        self.seq = training.seq_len
        self.model_ranks = mesh.model_ranks
        peak = precision_peak(training.precision, rates)
        self.peak = peak
        speed = rates.calibration * (COMPILE_SPEEDUP if rates.compile else 1.0)
        self.matmul_rate = peak * rates.step_efficiency * speed
        # FlashAttention at its own utilisation, keeping the share of the matmul rate the step keeps
        self.attention_rate = peak * rates.attention_utilization * rates.step_efficiency / rates.matmul_efficiency * speed
        self.roofline_rate = peak * rates.matmul_efficiency  # what a matmul reaches when it is compute-bound
        fp8 = rates.float8_linear_speedup if rates.float8 else 1.0
        # float8 linears: the blocks' linears at the measured float8 speed, the head's at bf16 (torchtitan's float8
        # converter skips the output layer: components/quantization/float8.py `filter_fqns` default ["output"])
        self.matmul_scale = self.work.linear_share / fp8 + (1 - self.work.linear_share)
        # FSDP units: the blocks, the embedding and the head (a model known by its size: one per largest layer)
        self.units = slowest.layers + 2 if self.work.shape.q_width else slowest.gathered_tensors
        self.sizes = sizes = state_bytes(training.precision, training.optimizer)
        self.collectives = self._collectives(training, rates, slowest, sizes)
        self.offload_step, self.offload_micro, self.optimizer_s = self._offload(training, rates, slowest, sizes)
        self._mesh_traffic(model, training, rates)

    # -- one micro-batch --------------------------------------------------------------------------
    def roofline(self, tokens: int) -> float:
        """The share of the compute-bound rate the rank's matmuls keep at `tokens` local tokens: each runs at
        the slower of its multiplies and its operands' reads and writes (the same for forward, input gradient
        and weight gradient: the three read and write the same three matrices)."""
        found = self._rooflines.get(tokens)
        if found is None:
            element = self.work.element_bytes
            compute = memory = 0.0
            for m, k, n, count in self.work.gemms(tokens):
                flops_s = 2 * m * k * n * count / self.roofline_rate
                bytes_s = element * (m * k + k * n + m * n) * count / self.rates.hbm_bytes_per_s
                compute += flops_s
                memory += max(flops_s, bytes_s)
            found = self._rooflines[tokens] = compute / memory if memory else 1.0
        return found

    def at(self, micro_batch: int, grad_accum: int) -> StepTime:
        """The step time of `grad_accum` micro-batches of `micro_batch` sequences."""
        seconds, terms = self._terms(micro_batch, grad_accum)
        tokens_per_gpu = micro_batch * self.seq * grad_accum / self.model_ranks
        return StepTime(seconds, tokens_per_gpu, self.work.model_flops, self.peak, dict(zip(TERMS, terms)))

    def seconds_per_token(self, micro_batch: int, grad_accum: int) -> float:
        """GPU seconds per trained token (the ranking key): `at(...).gpu_seconds_per_token`, without its record."""
        return self._terms(micro_batch, grad_accum)[0] * self.model_ranks / (micro_batch * self.seq * grad_accum)

    def _terms(self, micro_batch: int, grad_accum: int) -> tuple[float, tuple[float, ...]]:
        """The step's seconds and its terms in TERMS order."""
        w, rates = self.work, self.rates
        tokens = micro_batch * self.seq // self.cp
        matmul_rate = self.matmul_rate * self.roofline(tokens) / self.matmul_scale
        matmul = w.matmul_flops * tokens / matmul_rate
        attention = w.attention_flops * tokens / self.attention_rate
        recompute_attention = w.recompute_attention_flops * tokens / self.attention_rate
        recompute = w.recompute_matmul_flops * tokens / matmul_rate + recompute_attention
        forward = (matmul + attention) * w.forward_share
        backward = matmul + attention - forward + recompute
        c = self.collectives
        data_parallel = (exposed(c.forward, forward, c.units) + exposed(c.backward, backward, c.units)
                         + c.backward_exposed)
        step_data_parallel = (exposed(c.step_forward, forward, c.units) + exposed(c.step_backward, backward, c.units)
                              + c.step_exposed)
        replicate = exposed(c.replicate, backward, c.units) * (grad_accum if c.replicate_per_micro else 1)
        tp = self.tp_bytes_per_token * tokens / self.tp_link + self.tp_latency
        if rates.async_tp:  # each collective cut in tp chunks, each under a chunk of its matmul (the first exposed)
            tp = exposed(tp, matmul + recompute, self.tp)
        cp = self.cp_bytes_per_token * tokens / self.cp_link
        if self.cp_ring:
            cp = exposed(cp, attention + recompute_attention, self.cp)
        ep = self.ep_bytes_per_token * tokens / self.ep_link
        bubble = self.bubble_share * (matmul + attention + recompute + tp + cp + ep)
        send = grad_accum * self.pp_bytes_per_token * tokens / self.pp_link
        offload = grad_accum * self.offload_micro + self.offload_step
        terms = (grad_accum * (matmul + attention), grad_accum * recompute,
                 grad_accum * data_parallel + step_data_parallel, replicate, grad_accum * tp, grad_accum * cp,
                 grad_accum * ep, bubble, send, offload, self.optimizer_s)
        return sum(terms), terms

    # -- the choice's constants -------------------------------------------------------------------
    def _collectives(self, training: TrainingSpec, rates: Rates, slowest: Pace, sizes: StateBytes) -> _Collectives:
        mesh, gpus = training.mesh, training.gpus
        params, trained = slowest.params, slowest.trained_params
        shards = mesh.fsdp_degree(gpus) if not mesh.is_trivial else gpus
        if shards <= 1 and mesh.dp_replicate <= 1:
            return _Collectives()
        span = mesh.tp * mesh.cp * mesh.dp_shard(gpus) if not mesh.is_trivial else gpus
        link = _link(span, training, rates)
        ring = (shards - 1) / shards
        stage, engine = training.zero_stage, training.engine
        units = self.units  # FSDP2: one collective per unit (blocks, embedding, head)
        if engine == Engine.DEEPSPEED and stage == 3:  # one per parameter tensor above the persistence threshold
            units = float(slowest.gathered_tensors)
        elif engine == Engine.DEEPSPEED:  # stages 1-2 reduce and gather in buckets of reduce_bucket_size elements
            units = max(1.0, trained / training.deepspeed.reduce_bucket_size)
        latency = units * ring_latency(shards, span, training, rates)
        gather = ring * params * sizes.param / link + latency  # every parameter the rank holds, for compute
        reduce = ring * trained * sizes.grad / link + latency  # the trained parameters' gradients
        updated = ring * trained * sizes.param / link + latency  # the updated shards, shared after the step
        program = training.program
        pipeline = mesh.pp > 1
        # pipelines reduce once per step (torch pipelining stage.py: no gradient sync before the last backward)
        per_micro_sync = program.grad_sync == GradSync.EVERY and engine != Engine.DEEPSPEED and not pipeline
        overlap = training.deepspeed.overlap_comm if training.deepspeed.overlap_comm is not None else stage == 3
        replicate = 0.0
        if mesh.dp_replicate > 1:
            replicas = mesh.dp_replicate
            replicate = 2 * (replicas - 1) / replicas * trained / shards * sizes.grad / _link(gpus, training, rates)
        if stage == 0 or (stage == 1 and engine == Engine.TORCH):
            buckets = max(1.0, trained * sizes.grad / DDP_BUCKET_BYTES)
            all_reduce = 2 * (reduce - latency + buckets * ring_latency(shards, span, training, rates))
            broadcast = updated if stage == 1 else 0.0  # ZeroRedundancyOptimizer broadcasts each updated shard
            if engine == Engine.DEEPSPEED and not overlap:
                return _Collectives(step_exposed=all_reduce, units=buckets)
            if per_micro_sync and engine != Engine.DEEPSPEED:
                return _Collectives(backward=all_reduce, step_exposed=broadcast, units=buckets)
            return _Collectives(step_backward=all_reduce, step_exposed=broadcast, units=buckets)
        if stage == 1:  # DeepSpeed: reduce at the boundary, gather the updated shards after the step
            if overlap:
                return _Collectives(step_backward=reduce, step_exposed=updated, units=units)
            return _Collectives(step_exposed=reduce + updated, units=units)
        if stage == 2 and engine == Engine.DEEPSPEED:
            if overlap:
                return _Collectives(backward=reduce, step_exposed=updated, units=units)
            return _Collectives(backward_exposed=reduce, step_exposed=updated, units=units)
        if stage == 2:  # FSDP2 reshard_after_forward=False: gathers at every forward (or once under a pipeline)
            if pipeline:
                return _Collectives(step_forward=gather, step_backward=reduce, replicate=replicate,
                                    replicate_per_micro=False, units=units)
            if per_micro_sync:
                return _Collectives(forward=gather, backward=reduce, replicate=replicate, units=units)
            return _Collectives(forward=gather, step_backward=reduce, replicate=replicate, replicate_per_micro=False,
                                units=units)
        # stage 3: gather in forward and backward, reduce-scatter at every micro-batch (FSDP2 without no_sync)
        if engine == Engine.FSDP2 and not per_micro_sync:
            return _Collectives(forward=gather, backward=gather, step_backward=reduce, replicate=replicate,
                                replicate_per_micro=False, units=units)
        return _Collectives(forward=gather, backward=gather + reduce, replicate=replicate, units=units)

    def _offload(self, training: TrainingSpec, rates: Rates, slowest, sizes: StateBytes) -> tuple[float, float, float]:
        """Seconds of offload traffic (per step, per micro-batch) and of the optimizer step."""
        mesh = training.mesh
        shards = (mesh.fsdp_degree(training.gpus) if not mesh.is_trivial else training.gpus) if training.zero_stage else 1
        partition = slowest.params / shards
        trained_partition = slowest.trained_params / shards
        element = sizes.param
        node_share = training.node_gpus  # GPUs of a node share its CPU memory and NVMe bandwidth
        step = micro = 0.0
        optimizer_bytes = optimizer_bytes_per_param(sizes) * trained_partition
        if training.offload_optimizer != Offload.NONE:
            grads_out = trained_partition * element / rates.pcie_bytes_per_s
            step += trained_partition * element / rates.pcie_bytes_per_s  # the updated 16-bit parameters come back
            if training.zero_stage >= 2:
                micro += grads_out
            else:
                step += grads_out
            optimizer = optimizer_bytes / (rates.cpu_memory_bytes_per_s / node_share)
            if training.offload_optimizer == Offload.NVME:
                swapped = (updated_weight_bytes(sizes) + sizes.optimizer_states) * trained_partition
                step += 2 * swapped / (rates.nvme_bytes_per_s / node_share)  # read and write back
        else:
            optimizer = optimizer_bytes / rates.hbm_bytes_per_s
        if training.offload_params != Offload.NONE:
            fetch = 2 * partition * element  # the partition comes to the GPU in forward and again in backward
            micro += fetch / rates.pcie_bytes_per_s
            if training.offload_params == Offload.NVME:
                micro += fetch / (rates.nvme_bytes_per_s / node_share)
        return step, micro, optimizer

    def _mesh_traffic(self, model, training: TrainingSpec, rates: Rates) -> None:
        """Bytes per local token of the TP, CP, EP and PP traffic, their links, and the pipeline's bubble."""
        mesh, w = training.mesh, self.work
        shape, layers = w.shape, w.layers
        element = w.element_bytes
        recompute = recompute_share(training, layers) if training.checkpointing == Checkpointing.FULL else 0.0
        passes = 2 + recompute  # forward, backward, and the recomputed forward of checkpointed blocks
        self.tp_bytes_per_token = self.cp_bytes_per_token = self.ep_bytes_per_token = self.pp_bytes_per_token = 0.0
        self.tp_latency = 4 * layers * passes * ring_latency(mesh.tp, mesh.tp, training, rates)
        self.tp_link = _link(mesh.tp, training, rates)
        self.cp_link = _link(mesh.tp * mesh.cp, training, rates)
        self.ep_link = _link(mesh.ep, training, rates)
        self.pp_link = _link(training.gpus // mesh.pp, training, rates) if mesh.pp > 1 else rates.intra_node_bytes_per_s
        self.cp_ring = training.engine != Engine.DEEPSPEED
        self.bubble_share = 0.0
        if mesh.tp > 1:
            self.tp_bytes_per_token = layers * passes * 4 * (mesh.tp - 1) / mesh.tp * shape.hidden * element
        if mesh.cp > 1:
            kv = shape.kv_width / mesh.tp * element
            if self.cp_ring:  # keys and values forward, keys, values and their gradients backward
                self.cp_bytes_per_token = layers * (mesh.cp - 1) * kv * (2 * (1 + recompute) + 4)
            else:  # Ulysses: q, k, v and the output re-split over heads, forward and backward
                width = (2 * shape.q_width + 2 * shape.kv_width) / mesh.tp * element
                self.cp_bytes_per_token = layers * passes * (mesh.cp - 1) / mesh.cp * width
        if mesh.ep > 1 and shape.experts > 1:
            moe_layers = layers if model.moe is None else sum(1 for i in range(layers) if model.moe.sparse(i))
            self.ep_bytes_per_token = (moe_layers * 2 * passes * (mesh.ep - 1) / mesh.ep * shape.experts_per_token
                                       * shape.hidden * element * mesh.moe_imbalance)
        if mesh.pp > 1:
            boundary = shape.hidden * element / (mesh.tp if mesh.sequence_parallel else 1)
            self.pp_bytes_per_token = 2 * mesh.pp_virtual_stages * boundary
            share = (mesh.pp - 1) / mesh.pp_virtual_stages
            self.bubble_share = share / 3 if mesh.pp_schedule == PPSchedule.ZERO_BUBBLE else share


class SharedWork(NamedTuple):
    """What the step-time model reads of the model and mesh, the same for every ZeRO stage and offload; and the
    matmul rooflines by local tokens, filled as they are asked for (they depend on the work and the rates)."""

    work: Work
    pace: Pace
    rooflines: dict[int, float]


def shared_work(model, training: TrainingSpec) -> SharedWork:
    return SharedWork(work(model, training), pace(model, training), {})


def step_time(model, training: TrainingSpec, rates: Rates) -> StepTime:
    """The step time of one configuration (its mesh included) on its slowest GPU."""
    return StepModel(model, training, rates).at(training.micro_batch, training.grad_accum)
