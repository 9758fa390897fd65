"""The device mesh: tensor, context, pipeline and expert parallelism around ZeRO/FSDP (issue 14).

`TrainingSpec.gpus` is the whole world; the mesh says how it is cut. Data-parallel sharding takes
what the other dimensions leave: dp_shard = gpus / (tp * cp * pp * dp_replicate), as torchtitan's
`data_parallel_shard_degree = -1` (torchtitan/distributed/parallel_dims.py `ParallelDims._validate`).
Expert parallelism borrows its ranks from the dense region instead of adding a dimension: in
torchtitan 0.3.0 `efsdp = dp_shard * cp * tp // ep` (parallel_dims.py `build_mesh`, and
config/configs.py `expert_parallel_degree`: "EP borrows ranks from FSDP and TP"), so ep divides
dp_shard * cp * tp. Derivations and engine support: docs/engines/mesh.md.
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from enum import Enum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.errors import SpecError
from zeroplan.spec.limits import MAX_GPUS

if TYPE_CHECKING:  # spec.training imports this module
    from zeroplan.spec.model import ModelSpec
    from zeroplan.spec.training import TrainingSpec

_STRICT = ConfigDict(extra="forbid", frozen=True)


class PPSchedule(str, Enum):
    """Pipeline schedule (torch/distributed/pipelining/schedules.py), which fixes the micro-batches in flight."""

    GPIPE = "gpipe"  # ScheduleGPipe: every micro-batch's forward before any backward
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: stage i warms up with pp - i forwards (torchtitan's default "1F1B")
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B: several (virtual) stages per rank
    ZERO_BUBBLE = "zero-bubble"  # ScheduleInterleavedZeroBubble: backward split into input and weight parts

    @property
    def looped(self) -> bool:
        """Runs several stages per rank (PipelineScheduleMulti)."""
        return self in (PPSchedule.INTERLEAVED_1F1B, PPSchedule.ZERO_BUBBLE)


# torchtitan's names for the schedules (parallelism.pipeline_parallel_schedule), both ways
TORCHTITAN_SCHEDULES = {PPSchedule.GPIPE: "GPipe", PPSchedule.ONE_F_ONE_B: "1F1B",
                        PPSchedule.INTERLEAVED_1F1B: "Interleaved1F1B",
                        PPSchedule.ZERO_BUBBLE: "InterleavedZeroBubble"}


class MeshSpec(BaseModel):
    """How the GPUs are cut beyond data parallelism; all ones is plain ZeRO/FSDP over every GPU."""

    model_config = _STRICT

    tp: int = Field(1, ge=1, le=MAX_GPUS, description="Tensor-parallel degree: linears sharded colwise/rowwise as torchtitan's plans.")
    cp: int = Field(1, ge=1, le=MAX_GPUS, description="Context-parallel degree: the sequence split over ranks (ring attention; "
                    "DeepSpeed: Ulysses sequence parallelism).")
    pp: int = Field(1, ge=1, le=MAX_GPUS, description="Pipeline-parallel degree: ranks holding consecutive stages of the layers.")
    pp_schedule: PPSchedule = Field(PPSchedule.ONE_F_ONE_B, description="Pipeline schedule: gpipe, 1f1b, "
                                    "interleaved-1f1b or zero-bubble (torchtitan's default: 1f1b).")
    pp_virtual_stages: int = Field(1, ge=1, le=MAX_GPUS, description="Pipeline stages per rank (looped schedules: 2 or more).")
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="Expert-parallel degree (MoE): experts split over ranks borrowed from "
                    "data-parallel sharding, context and tensor parallelism.")
    dp_replicate: int = Field(1, ge=1, le=MAX_GPUS, description="Data-parallel replicas (HSDP): each replica shards over the rest.")
    sequence_parallel: bool = Field(True, description="Under TP, shard the norms and their activations over the "
                                    "sequence (torchtitan enable_sequence_parallel).")
    loss_parallel: bool = Field(True, description="Under TP, keep the logits sharded over the vocabulary into the "
                                "loss (torchtitan's default; disable_loss_parallel turns it off).")
    async_tp: bool = Field(False, description="Under TP, micro-pipeline the all-gather and reduce-scatter with the "
                           "matmuls through symmetric memory (torchtitan enable_async_tensor_parallel; needs compile).")
    moe_imbalance: float = Field(1.0, ge=1.0, description="Under EP, the token-expert pairs the busiest expert-parallel "
                                 "rank receives over the mean (1: balanced routing; at most ep).")

    @property
    def is_trivial(self) -> bool:
        """No dimension beyond data-parallel sharding: today's single-rank estimate holds."""
        return (self.tp, self.cp, self.pp, self.ep, self.dp_replicate) == (1, 1, 1, 1, 1)

    @property
    def model_ranks(self) -> int:
        """Ranks that together hold one copy of the model and one batch slice: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks times their virtual stages."""
        return self.pp * self.pp_virtual_stages

    def dp_shard(self, gpus: int) -> int:
        """Data-parallel sharding degree: what the other dimensions leave of `gpus`."""
        return gpus // (self.model_ranks * self.dp_replicate)

    def fsdp_degree(self, gpus: int) -> int:
        """Ranks that shard each dense parameter: dp_shard * cp (torchtitan's "fsdp" mesh: CP ranks hold the
        same weights and join their sharding)."""
        return self.dp_shard(gpus) * self.cp

    def expert_fsdp_degree(self, gpus: int) -> int:
        """Ranks that shard each expert parameter: efsdp = dp_shard * cp * tp / ep (parallel_dims.py `build_mesh`)."""
        return self.dp_shard(gpus) * self.cp * self.tp // self.ep

    def check_world(self, gpus: int, engine: str, zero_stage: int, recipe: str = "torchtitan") -> None:
        """The rules that need only the training spec: the degrees fill `gpus`, the engine runs them.
        Raises ValueError (TrainingSpec's validator turns it into one line naming the field)."""
        if self.async_tp and self.tp == 1:
            raise ValueError("mesh.async_tp: async tensor parallelism needs tp above 1")
        if self.is_trivial:
            return
        product = self.model_ranks * self.dp_replicate
        if gpus % product:
            raise ValueError(f"mesh: tp {self.tp} x cp {self.cp} x pp {self.pp} x dp_replicate {self.dp_replicate} "
                             f"= {product} does not divide gpus {gpus}")
        dense = self.dp_shard(gpus) * self.cp * self.tp
        if dense % self.ep:
            raise ValueError(f"mesh.ep: {self.ep} does not divide dp_shard x cp x tp = {dense}, the ranks expert "
                             "parallelism borrows (torchtitan parallel_dims.py)")
        if self.pp_schedule.looped and self.pp > 1 and self.pp_virtual_stages < 2:
            raise ValueError(f"mesh.pp_virtual_stages: schedule {self.pp_schedule.value} runs 2 or more stages per rank")
        if not self.pp_schedule.looped and self.pp_virtual_stages > 1:
            raise ValueError(f"mesh.pp_virtual_stages: schedule {self.pp_schedule.value} runs one stage per rank; "
                             "use interleaved-1f1b or zero-bubble")
        _check_engine(self, engine, zero_stage)
        _check_recipe(self, recipe)


# The mesh dimensions each program runs beside data parallelism: the Trainer through accelerate's
# ParallelismConfig (accelerate 1.15.0 parallelism_config.py: dp_replicate, dp_shard, tp, cp; no
# pipeline or expert degree), torchtune's distributed recipes a tensor-parallel dim only
# (full_finetune_distributed.py `tensor_parallel_dim`), torchtitan all of them (parallel_dims.py).
_RECIPE_DIMENSIONS = {"hf-trainer": ("tp", "cp", "dp_replicate"), "torchtune": ("tp", "dp_replicate")}


def _check_recipe(mesh: MeshSpec, recipe: str) -> None:
    allowed = _RECIPE_DIMENSIONS.get(recipe)
    if allowed is None:
        return
    for name in ("tp", "cp", "pp", "ep", "dp_replicate"):
        if getattr(mesh, name) > 1 and name not in allowed:
            raise ValueError(f"mesh.{name}: recipe {recipe} does not run it (it runs {', '.join(allowed)}); "
                             "recipe torchtitan runs every mesh dimension")


def _check_engine(mesh: MeshSpec, engine: str, zero_stage: int) -> None:
    """Which engine runs which dimension: FSDP2 all (torchtitan); DeepSpeed AutoTP with ZeRO 0-2 and Ulysses
    (deepspeed/runtime/tensor_parallel, deepspeed/sequence/layer.py); torch DDP and the paper none."""
    used = [name for name in ("tp", "cp", "pp", "ep", "dp_replicate") if getattr(mesh, name) > 1]
    if engine == "fsdp2" or not used:
        return
    if engine == "deepspeed":
        for name in used:
            if name in ("pp", "ep", "dp_replicate"):
                raise ValueError(f"mesh.{name}: engine deepspeed does not run it with ZeRO here "
                                 "(AutoTP and Ulysses only); engine fsdp2 (torchtitan) does")
        if mesh.tp > 1 and zero_stage == 3:
            raise ValueError("mesh.tp: DeepSpeed AutoTP training runs with ZeRO stages 0-2, not 3; "
                             "engine fsdp2 runs tp with zero_stage 3")
        return
    raise ValueError(f"mesh.{used[0]}: engine {engine} is data-parallel only; engine fsdp2 runs every mesh "
                     "dimension (deepspeed: tp with ZeRO 0-2 and cp as Ulysses)")


def check_mesh(model: "ModelSpec", training: "TrainingSpec") -> None:
    """The rules that need the model: heads, layers, experts and the sequence divide as the mesh cuts them.
    Raises SpecError, one line naming the field."""
    mesh = training.mesh
    if mesh.is_trivial:
        return
    adapted = getattr(training, "lora", None) is not None or getattr(training, "quant", None) is not None
    cut = [name for name in ("tp", "cp", "pp", "ep") if getattr(mesh, name) > 1]
    if adapted and cut:
        # HSDP composes: FSDP2 over (dp_replicate, dp_shard) shards a PEFT model as it shards any other
        raise SpecError(f"mesh.{cut[0]}: LoRA adapters and quantized bases are modelled with dp_replicate (HSDP) only; "
                        f"no program zeroplan measures runs PEFT under {cut[0]} (torchtitan has no adapters; "
                        "transformers' tp_plan with PEFT is not modelled yet): set tp, cp, pp and ep to 1")
    if getattr(model, "kind", None) != "transformer":
        raise SpecError("mesh: a model given by parameter count cannot be cut by tp/cp/pp/ep; give its config")
    deepspeed = training.engine.value == "deepspeed"
    if mesh.tp > 1:
        for field, heads in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads)):
            if heads % mesh.tp:
                raise SpecError(f"mesh.tp: {mesh.tp} does not divide the model's {field} {heads}")
    seq = training.seq_len
    if mesh.cp > 1 and deepspeed:
        # Ulysses (deepspeed/sequence/layer.py) swaps the sequence split for a head split in attention
        for field, heads in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads)):
            if heads % (mesh.cp * mesh.tp):
                raise SpecError(f"mesh.cp: Ulysses splits heads over cp x tp = {mesh.cp * mesh.tp}, which does not "
                                f"divide the model's {field} {heads}")
        if seq % mesh.cp:
            raise SpecError(f"mesh.cp: {mesh.cp} does not divide seq_len {seq}")
    elif mesh.cp > 1 and seq % (2 * mesh.cp):
        # the head-tail load balancer cuts the sequence in 2 x cp chunks (torch context_parallel, _HeadTailLoadBalancer)
        raise SpecError(f"mesh.cp: load-balanced context parallelism cuts seq_len {seq} into 2 x cp = "
                        f"{2 * mesh.cp} chunks; it does not divide")
    if mesh.tp > 1 and mesh.sequence_parallel and (seq // mesh.cp) % mesh.tp:
        raise SpecError(f"mesh.tp: sequence parallelism shards the {seq // mesh.cp} tokens of each rank over tp "
                        f"{mesh.tp}; it does not divide (or set sequence_parallel false)")
    if model.num_layers < mesh.stages:
        raise SpecError(f"mesh.pp: {model.num_layers} layers cannot fill pp {mesh.pp} x pp_virtual_stages "
                        f"{mesh.pp_virtual_stages} = {mesh.stages} stages")
    if mesh.pp > 1 and mesh.pp_schedule == PPSchedule.ONE_F_ONE_B and training.grad_accum < mesh.pp:
        # Schedule1F1B.__init__: "Number of microbatches must be greater than or equal to the number of stages"
        raise SpecError(f"mesh.pp: schedule 1f1b needs at least pp {mesh.pp} micro-batches; grad_accum is "
                        f"{training.grad_accum}")
    if mesh.ep > 1:
        experts = routed_experts(model)
        if experts == 1:
            raise SpecError("mesh.ep: the model has no experts (num_experts 1); expert parallelism needs a MoE model")
        if experts % mesh.ep:
            raise SpecError(f"mesh.ep: {mesh.ep} does not divide the model's num_experts {experts}")
    if mesh.moe_imbalance > max(mesh.ep, 1):
        raise SpecError(f"mesh.moe_imbalance: {mesh.moe_imbalance:g} exceeds ep {mesh.ep}, the factor of every token "
                        "routed to one expert-parallel rank")


def routed_experts(model: "ModelSpec") -> int:
    """Routed experts per sparse layer: the MoE spec's (Qwen3-MoE, DeepSeek-V3, GPT-OSS) or Mixtral's num_experts."""
    moe = getattr(model, "moe", None)
    return moe.num_experts if moe is not None else getattr(model, "num_experts", 1)
