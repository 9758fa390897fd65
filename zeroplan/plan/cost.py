"""A step-cost model to rank configurations that fit: seconds per optimizer step, term by term.

It ranks; it does not predict wall-clock time. Every term is a volume (FLOPs or bytes) over a
stated rate, and every rate is an `Assumptions` field with its source, overridable from the CLI.
No overlap between terms is assumed (the step time is their sum, an upper bound): DeepSpeed's
overlap_comm and FSDP2's prefetching hide part of the communication on real hardware.

Terms, per GPU and per optimizer step of `grad_accum` micro-batches:
- compute: 6 FLOPs per trained parameter per token (forward 2, backward 4: the gradient of the
  layer's input and of its weight; Kaplan et al. 2020 section 2.1, Narayanan et al. 2021 section
  5.1) and 4 per frozen one (forward 2, input gradient 2: a frozen weight gets no gradient, as in
  LoRA), over the active parameters, plus the attention score and value products,
  12 * L * q_width * seq per token (PaLM, Chowdhery et al. 2022, appendix B), at the GPU's dense
  BF16 peak times an efficiency that grows with the tokens of a micro-batch (`efficiency` below:
  throughput lost to small micro-batches).
- recompute: full checkpointing runs each block's forward again (2 FLOPs per parameter and the
  attention's forward third); selective recomputes only the attention core's forward,
  4 * L * q_width * seq per token (Korthikanti et al. 2022, sections 4-5).
- communication: the ZeRO paper (Rajbhandari et al. 2020) section 7: stages 0-2 move 2 Psi
  elements per rank per step (all-reduce = reduce-scatter + all-gather), stage 3 moves 3 Psi
  (all-gather in forward and in backward, reduce-scatter of gradients). With frozen parameters
  the gradients and the updated parameters are the trained ones (Psi_t); stage 3 and FSDP2 still
  gather every parameter for compute. Ring collectives send
  (N-1)/N of that (NCCL ring algorithm). Under gradient accumulation stage 2 reduce-scatters at
  every micro-batch (DeepSpeed stage_1_and_2.py, reduce_ready_partitions_and_remove_grads runs in
  every backward when gradients are partitioned) and stage 3 gathers and reduces at every
  micro-batch (stage3.py); stages 0-1 reduce once per step. Engine differences: FSDP2's stage 2
  gathers at every forward too; DDP + ZeroRedundancyOptimizer (torch, stage 1) all-reduces the
  gradients and broadcasts the updated shards, 3 Psi.
- offload: ZeRO-Offload (Ren et al. 2021, section 4.1): 16-bit gradients go GPU->CPU and 16-bit
  parameters come back CPU->GPU, each rank its partition of Psi/N; with parameter offload
  (ZeRO-Infinity, Rajbhandari et al. 2021) each rank fetches its parameter partition in forward
  and again in backward. NVMe adds reading and writing the fp32 master and states each step
  (optimizer on NVMe) or reading the parameter partition twice per micro-batch (params on NVMe).
- optimizer: the update reads and writes the master weights and states and reads the gradient:
  bytes over HBM bandwidth, or over the node's CPU memory bandwidth (shared by its GPUs) when the
  optimizer is offloaded (DeepSpeed's CPU Adam is memory-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.estimate.dtypes import StateBytes, state_bytes
from zeroplan.estimate.activations.moe import idle_expert_params
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, Engine, Offload

_GB = 10**9


class Assumptions(BaseModel):
    """Rates the cost model divides by. GPU figures come from a preset (`zeroplan.importers.gpus`);
    the cluster figures are typical values, stated with where they come from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_flops_per_s: float = Field(gt=0, description="Peak dense BF16 FLOP/s of one GPU (datasheet).")
    hbm_bytes_per_s: float = Field(gt=0, description="GPU memory bandwidth, bytes/s (datasheet).")
    intra_node_bytes_per_s: float = Field(
        gt=0, description="GPU-to-GPU bandwidth inside a node, one direction, bytes/s (NVLink: half the datasheet total)."
    )
    inter_node_bytes_per_s: float = Field(
        50 * _GB,
        gt=0,
        description="Network bandwidth per GPU between nodes, one direction: 400 Gb/s = 50 GB/s, one ConnectX-7 "
        "InfiniBand NDR port per GPU as in NVIDIA DGX H100.",
    )
    pcie_bytes_per_s: float = Field(gt=0, description="GPU-host bandwidth, one direction, bytes/s (PCIe, half the datasheet total).")
    cpu_memory_bytes_per_s: float = Field(
        300 * _GB,
        gt=0,
        description="CPU memory bandwidth per node, bytes/s: two sockets of 8-channel DDR5-4800 give about 600 GB/s "
        "peak (8 x 4800 MT/s x 8 bytes x 2); half of peak is assumed reachable by CPU Adam.",
    )
    nvme_bytes_per_s: float = Field(
        7 * _GB,
        gt=0,
        description="NVMe bandwidth per node, bytes/s: one PCIe Gen4 SSD, about 7 GB/s sequential "
        "(e.g. Samsung 990 PRO datasheet: 7,450 MB/s read).",
    )
    max_efficiency: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Best fraction of peak FLOP/s a training step reaches (model FLOPs utilisation): PaLM reports "
        "46.2% (Chowdhery et al. 2022, table 3), Megatron-LM 52% on A100 (Narayanan et al. 2021).",
    )
    half_efficiency_tokens: int = Field(
        1024,
        ge=0,
        description="Tokens per micro-batch at which efficiency is half of max_efficiency (an assumption, not a "
        "measurement: GEMMs with few rows leave the GPU idle); efficiency = max * t / (t + this).",
    )
    source: str = Field("", description="Where the GPU figures come from.")


class PerToken:
    """The rates of a step cost that has `step_s` and `tokens` (StepCost, plan/mesh_cost.MeshStepCost)."""

    step_s: float
    tokens: float

    @property
    def tokens_per_s(self) -> float:
        """Tokens one GPU trains per second."""
        return self.tokens / self.step_s

    @property
    def gpu_seconds_per_token(self) -> float:
        """The ranking key: GPU time per trained token (lower is cheaper)."""
        return self.step_s / self.tokens


@dataclass(frozen=True)
class StepCost(PerToken):
    """Seconds per optimizer step on one GPU, by term; `tokens` is what the GPU processes in it."""

    compute_s: float
    recompute_s: float
    communication_s: float
    offload_s: float
    optimizer_s: float
    tokens: int

    @property
    def step_s(self) -> float:  # spelled out, not summed over terms(): the planner asks for it per configuration
        return self.compute_s + self.recompute_s + self.communication_s + self.offload_s + self.optimizer_s

    def terms(self) -> dict[str, float]:
        return {
            "compute": self.compute_s,
            "recompute": self.recompute_s,
            "communication": self.communication_s,
            "offload": self.offload_s,
            "optimizer": self.optimizer_s,
        }


@dataclass(frozen=True)
class ModelFlops:
    """What the cost model needs to know about a model."""

    params: int  # Psi: every parameter (gathered and updated)
    trainable_params: int  # parameters with gradients and optimizer states
    dense_flops_per_token: float  # forward + backward: 6 per trained active parameter, 4 per frozen one
    attention_flops_per_token_per_seq: float  # 12 * L * q_width; times seq_len gives FLOPs per token
    dense_forward_flops_per_token: float = 0.0  # 2 * active params: what full checkpointing runs again
    gathered_params: int | None = None  # elements an all-gather of every parameter moves, when not `params`


def gathered_params(facts) -> int:
    """Elements one all-gather of the whole model moves, as the estimate's facts hold them: a 4-bit
    base under FSDP2 or ZeRO-3 as its packed storage in the gathered dtype (estimate/adapters/lora.py
    `packed_layout`); its QuantState stays whole on every rank and is not gathered."""
    return sum(g.params * g.count for g in facts.groups)


def model_flops(model, params: int, trainable_params: int) -> ModelFlops:
    """FLOP counts for `model`; `params` and `trainable_params` come from an estimate's summary."""
    active = params
    attention = 0.0
    if isinstance(model, TransformerSpec):
        if model.is_moe:
            # Each token runs experts_per_token of num_experts gated MLPs (3 h x i matrices each).
            expert = 3 * model.hidden_size * model.intermediate_size
            active = params - model.num_layers * (model.num_experts - model.experts_per_token) * expert
        if model.moe is not None:  # Qwen3-MoE, DeepSeek-V3, GPT-OSS: experts of their own width
            active = params - idle_expert_params(model)
        # PaLM appendix B: 12 * L * H * Q * T for forward + backward of QK^T and AV.
        attention = 12.0 * model.num_layers * model.num_heads * model.dim_per_head
    # trained parameters among the active ones (all of them when everything trains; for an MoE with
    # frozen parameters, in proportion: LoRA's expert adapters run for the routed tokens only)
    trained_active = active if trainable_params >= params else trainable_params * active // params
    # forward 2 and the input's gradient 2 for every parameter, the weight's gradient 2 for trained ones
    return ModelFlops(params, trainable_params, 4.0 * active + 2.0 * trained_active, attention, 2.0 * active)


def _updated_weight_bytes(sizes: StateBytes) -> int:
    """Bytes of the weight the optimizer updates: the fp32 master in mixed precision, else the parameter."""
    return sizes.master or sizes.param


def _optimizer_bytes_per_param(sizes: StateBytes) -> float:
    """Bytes the update touches per trainable parameter: read and write the updated weight and each
    state, read the gradient at the weight's width (mixed precision updates from fp32 gradients),
    write the 16-bit working copy in mixed precision."""
    weight = _updated_weight_bytes(sizes)
    working_copy = sizes.param if sizes.master else 0
    return 2 * weight + 2 * sizes.optimizer_states + weight + working_copy


@dataclass(frozen=True)
class StepCostModel:
    """The cost of one (stage, offload, checkpointing, GPU count) choice as a function of the
    micro-batch and the accumulation steps, with everything that does not depend on them folded
    into constants so that evaluating a micro-batch costs a few float operations."""

    per_step_s: float  # communication, offload and optimizer paid once per optimizer step
    per_micro_s: float  # communication and offload paid at every micro-batch
    seconds_per_token_compute: float  # (compute + recompute) FLOPs per token / (peak * max_efficiency)
    recompute_fraction: float  # share of the compute FLOPs that is recomputation
    half_efficiency_tokens: int
    seq_len: int
    per_step_parts: tuple[float, float, float]  # communication, offload, optimizer (for the report)
    per_micro_parts: tuple[float, float]  # communication, offload

    def step_cost(self, micro_batch: int, grad_accum: int) -> StepCost:
        tokens = micro_batch * self.seq_len
        # efficiency = max * t / (t + half)  =>  time = flops * t / (peak * max) * (t + half) / t
        busy = grad_accum * self.seconds_per_token_compute * (tokens + self.half_efficiency_tokens)
        communication = self.per_step_parts[0] + grad_accum * self.per_micro_parts[0]
        offload = self.per_step_parts[1] + grad_accum * self.per_micro_parts[1]
        return StepCost(
            compute_s=busy * (1 - self.recompute_fraction),
            recompute_s=busy * self.recompute_fraction,
            communication_s=communication,
            offload_s=offload,
            optimizer_s=self.per_step_parts[2],
            tokens=tokens * grad_accum,
        )

    def seconds_per_token(self, micro_batch: int, grad_accum: int) -> float:
        """`step_cost(...).gpu_seconds_per_token` without building the object (the planner's hot loop)."""
        tokens = micro_batch * self.seq_len
        busy = grad_accum * self.seconds_per_token_compute * (tokens + self.half_efficiency_tokens)
        return (busy + self.per_step_s + grad_accum * self.per_micro_s) / (tokens * grad_accum)


def step_cost_model(flops: ModelFlops, training, assumptions: Assumptions) -> StepCostModel:
    """The cost model of `training` (a TrainingSpec; micro_batch and grad_accum are ignored)."""
    n = training.gpus
    psi, psi_trainable = flops.params, flops.trainable_params
    sizes = state_bytes(training.precision, training.optimizer)
    element = sizes.param  # parameters and gradients travel at the model's width (sizes.grad is the same)
    ring = (n - 1) / n
    link = assumptions.intra_node_bytes_per_s if n <= training.node_gpus else assumptions.inter_node_bytes_per_s

    # ZeRO paper section 7; per rank, ring collectives.
    reduce_bytes = ring * psi_trainable * element  # gradients: the trained parameters'
    gathered = psi if flops.gathered_params is None else flops.gathered_params
    gather_bytes = ring * gathered * element  # every parameter gathered for compute (stage 3, FSDP2)
    updated_bytes = ring * psi_trainable * element  # the parameters the step updated, shared after it (stages 1-2)
    stage = training.zero_stage
    if stage == 0:
        comm_step, comm_micro = 2 * reduce_bytes, 0.0  # all-reduce at the accumulation boundary
    elif stage == 1 and training.engine == Engine.TORCH:
        # DDP all-reduces the whole gradient, then ZeroRedundancyOptimizer broadcasts each updated
        # shard from its owner (torch/distributed/optim/zero_redundancy_optimizer.py, _sync_params).
        comm_step, comm_micro = 2 * reduce_bytes + updated_bytes, 0.0
    elif stage == 1:
        comm_step, comm_micro = reduce_bytes + updated_bytes, 0.0
    elif stage == 2 and training.engine == Engine.FSDP2:
        # fully_shard(reshard_after_forward=False) still reshards after backward, so every forward
        # all-gathers again, and every backward reduce-scatters.
        comm_step, comm_micro = 0.0, gather_bytes + reduce_bytes
    elif stage == 2:
        comm_step, comm_micro = updated_bytes, reduce_bytes
    else:
        comm_step, comm_micro = 0.0, 2 * gather_bytes + reduce_bytes

    partition = psi / n if stage >= 1 else psi
    trainable_partition = psi_trainable / n if stage >= 1 else psi_trainable
    node_share = training.node_gpus  # GPUs of a node share its CPU memory and NVMe bandwidth
    offload_step = offload_micro = 0.0
    optimizer_bytes = _optimizer_bytes_per_param(sizes) * trainable_partition
    if training.offload_optimizer != Offload.NONE:
        grads_out = trainable_partition * element / assumptions.pcie_bytes_per_s
        offload_step += trainable_partition * element / assumptions.pcie_bytes_per_s  # updated 16-bit params come back
        if stage >= 2:
            offload_micro += grads_out
        else:
            offload_step += grads_out
        optimizer_s = optimizer_bytes / (assumptions.cpu_memory_bytes_per_s / node_share)
        if training.offload_optimizer == Offload.NVME:
            swapped = (_updated_weight_bytes(sizes) + sizes.optimizer_states) * trainable_partition
            offload_step += 2 * swapped / (assumptions.nvme_bytes_per_s / node_share)  # read and write back
    else:
        optimizer_s = optimizer_bytes / assumptions.hbm_bytes_per_s
    if training.offload_params != Offload.NONE:
        fetch = 2 * partition * element  # the partition comes to the GPU in forward and again in backward
        offload_micro += fetch / assumptions.pcie_bytes_per_s
        if training.offload_params == Offload.NVME:
            offload_micro += fetch / (assumptions.nvme_bytes_per_s / node_share)

    seq = training.seq_len
    forward_backward = flops.dense_flops_per_token + flops.attention_flops_per_token_per_seq * seq
    if training.checkpointing == Checkpointing.FULL:
        # one more forward: 2 FLOPs per parameter and the attention's forward third
        recompute = flops.dense_forward_flops_per_token + flops.attention_flops_per_token_per_seq * seq / 3
    elif training.checkpointing == Checkpointing.SELECTIVE:
        recompute = flops.attention_flops_per_token_per_seq * seq / 3  # the attention core's forward
    else:
        recompute = 0.0
    rate = assumptions.gpu_flops_per_s * assumptions.max_efficiency
    total = forward_backward + recompute
    return StepCostModel(
        per_step_s=comm_step / link + offload_step + optimizer_s,
        per_micro_s=comm_micro / link + offload_micro,
        seconds_per_token_compute=total / rate,
        recompute_fraction=recompute / total,
        half_efficiency_tokens=assumptions.half_efficiency_tokens,
        seq_len=seq,
        per_step_parts=(comm_step / link, offload_step, optimizer_s),
        per_micro_parts=(comm_micro / link, offload_micro),
    )


DEFAULT_SPEEDS_GPU = "h100-80gb"
"""The preset whose speeds are assumed when only a GPU memory size is given."""

_RATES_AS_TYPED = {
    "gpu_tflops": ("gpu_flops_per_s", 1e12),
    "intra_node_gbps": ("intra_node_bytes_per_s", _GB),
    "inter_node_gbps": ("inter_node_bytes_per_s", _GB),
    "pcie_gbps": ("pcie_bytes_per_s", _GB),
    "cpu_memory_gbps": ("cpu_memory_bytes_per_s", _GB),
    "nvme_gbps": ("nvme_bytes_per_s", _GB),
}
"""Rates in the units users type (TFLOP/s, GB/s) -> the Assumptions field and its scale."""


def assumptions_for(gpu, **overrides) -> Assumptions:
    """Assumptions from a `GpuPreset`'s datasheet figures (DEFAULT_SPEEDS_GPU's, said in `source`,
    when `gpu` is None), with `overrides` on top: Assumptions fields, or the rates of
    `_RATES_AS_TYPED` in TFLOP/s and GB/s; None means not given."""
    if gpu is None:
        from zeroplan.importers.gpus import get_gpu

        gpu = get_gpu(DEFAULT_SPEEDS_GPU)
        source = f"no --gpu given: speeds of {gpu.label} assumed ({gpu.source})"
    else:
        source = f"{gpu.label}: {gpu.source}"
    values = {
        "gpu_flops_per_s": gpu.bf16_flops_per_s,
        "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "intra_node_bytes_per_s": gpu.gpu_link_one_way_bytes_per_s,
        "pcie_bytes_per_s": gpu.pcie_one_way_bytes_per_s,
        "source": source,
    }
    for name, value in overrides.items():
        if value is None:
            continue
        if name in _RATES_AS_TYPED:
            name, scale = _RATES_AS_TYPED[name]
            value = value * scale
        values[name] = value
    return Assumptions.model_validate(values)
