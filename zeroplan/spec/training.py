"""Training specs: how a model is trained (ZeRO stage, world, offload, precision, batch) and the
knobs of the engine that runs it. Validated once here; everything downstream trusts them.
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from enum import Enum
from functools import lru_cache
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from zeroplan.errors import SpecError
from zeroplan.spec.limits import (MAX_CHUNKS, MAX_COUNT, MAX_GPUS, MAX_GRAD_ACCUM, MAX_LAYERS, MAX_MICRO_BATCH, MAX_SEQ_LEN,
                                  MAX_SMALL_COUNT)
from zeroplan.spec.gpu import GpuSpec
from zeroplan.spec.fsdp1 import FSDP1Knobs, FSDP1Wrapping, resolve_fsdp1_wrapping
from zeroplan.spec.lora import LoraSpec, QuantSpec, check_training_lora
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.validation import describe_validation_error

from zeroplan.spec.program import (
    KNOBS,
    ActivationOffload,
    FSDP2Units,
    FSDP2Wrapping,
    GradSync,
    Loss,
    ModelInit,
    OptimizerImpl,
    Program,
    Recipe,
    resolve_fsdp2_wrapping,
    resolve_program,
)

_STRICT = ConfigDict(extra="forbid", frozen=True)


class Engine(str, Enum):
    """Which ZeRO implementation is modelled (and, in measure, run)."""

    DEEPSPEED = "deepspeed"  # deepspeed.runtime.zero stage_1_and_2.py / stage3.py
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard
    FSDP1 = "fsdp1"  # torch.distributed.fsdp.FullyShardedDataParallel: a FlatParameter per wrapped unit
    TORCH = "torch"  # DDP (stage 0), DDP + ZeroRedundancyOptimizer (stage 1)
    PAPER = "paper"  # the ZeRO paper's idealised 2Ψ + 2Ψ + KΨ accounting, nothing else


# The ZeRO stages each engine runs: fsdp2's reshard_after_forward False/True are stages 2/3, fsdp1's
# NO_SHARD, SHARD_GRAD_OP and FULL_SHARD stages 0/2/3 (spec/fsdp1.py), torch's DDP and DDP +
# ZeroRedundancyOptimizer stages 0/1.
ENGINE_STAGES = {Engine.DEEPSPEED: (0, 1, 2, 3), Engine.FSDP2: (2, 3), Engine.FSDP1: (0, 2, 3), Engine.TORCH: (0, 1),
                 Engine.PAPER: (0, 1, 2, 3)}


class Precision(str, Enum):
    """Numeric format of parameters, gradients and the optimizer's master copy."""

    FP32 = "fp32"  # everything fp32
    FP16 = "fp16"  # mixed: 16-bit params/grads, fp32 master weights and states
    BF16 = "bf16"  # mixed, as fp16 with bfloat16
    PURE_BF16 = "pure-bf16"  # params, grads and optimizer states all bf16, no master copy


class Optimizer(str, Enum):
    """Optimizer, by the states it keeps per parameter."""

    ADAMW = "adamw"  # exp_avg and exp_avg_sq
    ADAM = "adam"  # same states as adamw
    SGD = "sgd"  # momentum buffer
    ADAM_8BIT = "adam8bit"  # bitsandbytes AdamW8bit: two uint8 states and their block-wise absmax
    ADAM_32BIT = "adam32bit"  # bitsandbytes AdamW (optim_bits 32): two fp32 states whatever the parameter dtype

    @property
    def is_bitsandbytes(self) -> bool:
        """One of bitsandbytes' optimizers (bitsandbytes/optim/optimizer.py Optimizer2State)."""
        return self in (Optimizer.ADAM_8BIT, Optimizer.ADAM_32BIT)


class Offload(str, Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Checkpointing(str, Enum):
    """Activation checkpointing (recomputation), Korthikanti et al. 2022 sections 4-5."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute attention's core only
    OP = "op"  # torchtitan's per-op policy: save matmul outputs (every other one) and attention, recompute the rest
    FULL = "full"  # keep each block's input only, recompute the block in backward


class Attention(str, Enum):
    EAGER = "eager"  # materialises the a x s x s score and probability matrices
    FUSED = "fused"  # flash / memory-efficient SDPA: keeps output and log-sum-exp only


class Device(str, Enum):
    CUDA = "cuda"
    CPU = "cpu"  # a CPU run: no CUDA context, exact allocations, host and device are one memory


FreezeGroup = Literal["embeddings", "blocks", "final"]
FREEZE_GROUPS: tuple[FreezeGroup, ...] = get_args(FreezeGroup)
"""The module groups `freeze` names; together they are every parameter of the model."""


class DeepSpeedKnobs(BaseModel):
    """`zero_optimization` settings of DeepSpeed that change memory, with DeepSpeed's defaults
    (deepspeed/runtime/zero/config.py)."""

    model_config = _STRICT

    reduce_bucket_size: int = Field(500_000_000, ge=1, le=MAX_COUNT, description="Elements per gradient reduce bucket.")
    allgather_bucket_size: int = Field(500_000_000, ge=1, le=MAX_COUNT, description="Elements per all-gather bucket (stages 1-2).")
    overlap_comm: bool | None = Field(
        None, description="Overlap reduction with backward; None = DeepSpeed's default (False for 1-2, True for 3)."
    )
    contiguous_gradients: bool = Field(True, description="Copy gradients into one contiguous buffer as produced.")
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0, le=MAX_COUNT, description="Elements prefetched ahead (stage 3).")
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0, le=MAX_COUNT, description="Gathered elements kept live (stage 3).")
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0, le=MAX_COUNT, description="Reuse distance for keeping params (stage 3).")
    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, le=MAX_COUNT, description="Tensors smaller than this stay whole on every rank (stage 3)."
    )
    sub_group_size: int = Field(
        1_000_000_000, ge=0, le=MAX_COUNT, description="Elements per optimizer sub-group (stage 3): the step, and NVMe swapping, "
        "work one sub-group at a time."
    )
    client_optimizer: bool = Field(
        False, description="A client torch optimizer steps the fp32 partition (the DeepSpeed JSON has no optimizer "
        "section: the Hugging Face Trainer passes its own AdamW); false: DeepSpeed's config optimizer (FusedAdam).")
    offload_pin_memory: bool = Field(True, description="Pin the CPU buffers of offloaded states.")
    offload_buffer_count: int = Field(5, ge=1, le=MAX_SMALL_COUNT, description="offload_param.buffer_count (NVMe swap buffers).")
    offload_buffer_size: int = Field(100_000_000, ge=1, le=MAX_COUNT, description="offload_param.buffer_size in elements.")
    offload_max_in_cpu: int = Field(1_000_000_000, ge=0, le=MAX_COUNT, description="offload_param.max_in_cpu elements.")


class Float8Knobs(BaseModel):
    """torchao float8 training of the blocks' linears (torchao/float8/float8_linear.py Float8Linear, config.py
    Float8LinearConfig; torchtitan's float8 converter), as torchtitan's [float8] (2025) or
    [quantize.linear.float8] (v0.2.2) section sets it. The output head is left in high precision, as
    torchtitan's configs filter it (filter_fqns ["output"]). Derivation: docs/engines/programs.md."""

    model_config = _STRICT

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "tensorwise", description="Scaling recipe (Float8LinearRecipeName): tensorwise (one scale per tensor, the "
        "default config), rowwise or rowwise_with_gw_hp (axiswise scales).")
    fsdp_all_gather: bool = Field(False, description="enable_fsdp_float8_all_gather: FSDP2 all-gathers the linears' "
                                  "weights in float8 (tensorwise only).")
    precompute_scale: bool = Field(False, description="precompute_float8_dynamic_scale_for_fsdp: the weights' scales "
                                   "computed once per step for all of them (with fsdp_all_gather).")
    saved: Literal["high-precision", "float8"] = Field(
        "high-precision", description="What each Float8Linear saves for backward: its high-precision input and weight "
        "(torchao since 2025-01-13, 12396c64) or their float8 casts (torchao of 2024, tensorwise).")

    @model_validator(mode="after")
    def _check(self) -> "Float8Knobs":
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            # torchao config.py Float8LinearConfig.__post_init__
            raise ValueError(f"float8.fsdp_all_gather: torchao all-gathers in float8 with tensorwise scaling only, "
                             f"not recipe {self.recipe}")
        if self.precompute_scale and not self.fsdp_all_gather:
            raise ValueError("float8.precompute_scale applies to float8 all-gather: set fsdp_all_gather true")
        if self.saved == "float8" and self.recipe != "tensorwise":
            raise ValueError("float8.saved float8: torchao of 2024 saved float8 casts on its tensorwise path only")
        return self


class FSDP2Knobs(BaseModel):
    """fully_shard settings that change memory (torch/distributed/fsdp/_fully_shard/_fully_shard.py)."""

    model_config = _STRICT

    reshard_root_after_forward: bool | None = Field(
        None, description="reshard_after_forward of the root module (units root); None = same as the blocks."
    )
    units: FSDP2Units | None = Field(
        None, description="Units outside the blocks: root (embeddings, final norm and head in the root) or split "
        "(embeddings alone, [final norm, head] together, as accelerate and torchtitan). [default: the recipe's]")
    reshard_head_after_forward: bool | None = Field(
        None, description="reshard_after_forward of the [final norm, head] unit (units split); None = False, "
        "as accelerate and torchtitan.")
    reshard_last_block: bool | None = Field(
        None, description="reshard_after_forward of the last block (zero_stage 3); None = as the other blocks "
        "(torchtitan's 2024 benchmarks kept it: false).")


# The planner reads the program and wrapping of thousands of specs that share a few: each distinct
# input is resolved once (pure functions of hashable values, returning immutable records).
_fsdp2_wrapping_of = lru_cache(maxsize=256)(resolve_fsdp2_wrapping)


@lru_cache(maxsize=256)
def _program_of(recipe: Recipe, engine: Engine, zero_stage: int, gpus: int, device: Device,
                knobs: tuple[object, ...]) -> Program:
    return resolve_program(recipe, engine.value, zero_stage, gpus, device.value, dict(zip(KNOBS, knobs)))


def clear_caches() -> None:
    """Forget the resolved programs and wrappings (estimate.clear_caches: a process's first plan)."""
    _fsdp2_wrapping_of.cache_clear()
    _program_of.cache_clear()


class TrainingSpec(BaseModel):
    """One training configuration, as a user would choose it."""

    model_config = _STRICT

    engine: Engine = Field(Engine.DEEPSPEED, description="ZeRO implementation to model.")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters.")
    gpus: int = Field(1, ge=1, le=MAX_GPUS, description="Total data-parallel ranks (GPUs).")
    gpus_per_node: int | None = Field(None, ge=1, le=MAX_GPUS, description="GPUs per node; defaults to min(gpus, 8).")
    offload_optimizer: Offload = Field(Offload.NONE, description="Where optimizer states live: none (GPU), cpu, nvme.")
    offload_params: Offload = Field(Offload.NONE, description="Where parameters live between uses (stage 3 only).")
    precision: Precision = Field(Precision.BF16, description="fp32, fp16/bf16 mixed with fp32 master, or pure-bf16.")
    optimizer: Optimizer = Field(Optimizer.ADAMW, description="Optimizer, which fixes the states per parameter.")
    paged_optimizer: bool = Field(False, description="bitsandbytes' paged optimizer (PagedAdamW8bit, PagedAdamW32bit; "
                                  "TrainingArguments optim paged_adamw_*): the states of tensors of 100,000 elements or "
                                  "more live in CUDA unified memory, outside PyTorch's allocator.")
    micro_batch: int = Field(1, ge=1, le=MAX_MICRO_BATCH, description="Sequences per GPU per forward pass.")
    seq_len: int = Field(2048, ge=1, le=MAX_SEQ_LEN, description="Tokens per sequence.")
    grad_accum: int = Field(1, ge=1, le=MAX_GRAD_ACCUM, description="Micro-batches accumulated per optimizer step.")
    checkpointing: Checkpointing = Field(Checkpointing.NONE, description="Activation checkpointing mode.")
    attention: Attention = Field(Attention.FUSED, description="Attention kernel: eager or fused (flash/SDPA).")
    device: Device = Field(Device.CUDA, description="cuda (a GPU run) or cpu (a CPU run, as measured here).")
    freeze: tuple[FreezeGroup, ...] = Field(
        (), description="Module groups that do not train (no gradients, no optimizer states)."
    )
    recipe: Recipe = Field(Recipe.HF_TRAINER, description="The training program whose defaults fill the knobs left unset: "
                           "hf-trainer (transformers.Trainer with accelerate or DeepSpeed), torchtitan, torchtune, "
                           "or plain (zeroplan measure's own loop).")
    model_init: ModelInit | None = Field(None, description="Where the weights are when the engine takes the model: host "
                                         "(loaded, cast and moved by the engine), device (built on the GPU), meta "
                                         "(sharded, then materialised), zero-init (deepspeed.zero.Init). [default: the recipe's]")
    dropout: float | None = Field(None, ge=0, lt=1, description="Dropout probability of every dropout layer, over "
                                  "the model config's rates. [default: the model's]")
    grad_sync: GradSync | None = Field(None, description="Under accumulation, reduce gradients on the last micro-batch "
                                       "only (no_sync) or on every one. [default: the recipe's]")
    ddp: bool | None = Field(None, description="Wrap a single rank in DistributedDataParallel (engine torch). "
                             "[default: the recipe's; the Trainer and torchtune do not]")
    optimizer_impl: OptimizerImpl | None = Field(None, description="Kernel of a torch optimizer: fused, foreach or for-loop "
                                                 "(its step's temporaries differ). [default: the recipe's]")
    optimizer_in_backward: bool | None = Field(None, description="Step each parameter in its gradient hook and free "
                                               "the gradient at once (torchtune optimizer_in_bwd). [default: the recipe's]")
    loss: Loss | None = Field(None, description="Loss computation: standard (whole fp32 logits), chunked, or "
                              "fused-linear (logits never materialised). [default: the recipe's]")
    loss_chunks: int | None = Field(None, ge=1, le=MAX_CHUNKS, description="Chunks of a chunked loss. [default: the recipe's, 8]")
    activation_offload: ActivationOffload | None = Field(None, description="Keep saved activations in host memory "
                                                         "(cpu). [default: the recipe's]")
    checkpoint_every: int | None = Field(None, ge=1, le=MAX_LAYERS, description="With full checkpointing, checkpoint every Nth block "
                                         "only (torchtitan selective_ac_option = N). [default: every block]")
    deepspeed: DeepSpeedKnobs = Field(default_factory=DeepSpeedKnobs, description="DeepSpeed zero_optimization knobs.")
    fsdp2: FSDP2Knobs = Field(default_factory=FSDP2Knobs, description="FSDP2 knobs.")
    fsdp1: FSDP1Knobs = Field(default_factory=FSDP1Knobs, description="FSDP1 knobs (engine fsdp1).")
    lora: LoraSpec | None = Field(None, description="LoRA adapters (PEFT): the base is frozen, the adapters train.")
    quant: QuantSpec | None = Field(None, description="Storage of the frozen base (bf16 ... or bitsandbytes nf4).")
    gpu: GpuSpec | None = Field(None, description="The GPU the run uses (a preset: --gpu, --gpu-memory NAME); its "
                                "architecture sizes the CUDA context and NCCL's buffers. [default: none named: the stated "
                                "defaults of docs/engines/allocator.md]")
    compile: tuple[Literal["model", "loss"], ...] = Field(
        (), description="torch.compile of the transformer blocks, one graph each (model: torchtitan `apply_compile`) "
        "and of the loss function (loss), as torchtitan's [compile] components; none: eager.")
    float8: Float8Knobs | None = Field(None, description="torchao float8 training of the blocks' linears "
                                       "(torchtitan's float8 converter); none: high-precision matmuls.")
    mesh: MeshSpec = Field(default_factory=MeshSpec, description="Tensor, context, pipeline and expert parallelism "
                           "and HSDP replicas around the data-parallel sharding (all ones: data parallelism only).")

    @model_validator(mode="after")
    def _check_combination(self) -> "TrainingSpec":
        if set(self.freeze) == set(FREEZE_GROUPS):
            raise ValueError(f"freeze: every module group ({', '.join(FREEZE_GROUPS)}) is frozen, so nothing trains; "
                             "freeze fewer groups, or train LoRA adapters (lora)")
        if self.gpus % self.node_gpus:
            raise ValueError(f"gpus {self.gpus} is not divisible by gpus_per_node {self.node_gpus}")
        if self.offload_params != Offload.NONE and self.zero_stage != 3:
            raise ValueError(f"offload_params requires zero_stage 3 (got zero_stage {self.zero_stage})")
        if self.offload_optimizer != Offload.NONE and self.zero_stage == 0 and self.engine != Engine.PAPER:
            raise ValueError("offload_optimizer requires zero_stage 1 or higher (ZeRO-Offload partitions the states)")
        if self.engine == Engine.TORCH and self.zero_stage > 1:
            raise ValueError("engine torch covers zero_stage 0 (DDP) and 1 (ZeroRedundancyOptimizer); use fsdp2 or deepspeed for 2-3")
        if self.engine == Engine.TORCH and self.offload_optimizer != Offload.NONE:
            raise ValueError("engine torch has no offload; use deepspeed or fsdp2")
        if self.engine == Engine.DEEPSPEED and self.offload_optimizer == Offload.NVME and self.zero_stage < 3:
            # stage_1_and_2.py has no optimizer swapper: "nvme" there runs as CPU offload.
            raise ValueError("offload_optimizer nvme requires zero_stage 3 with deepspeed (stages 1-2 offload to cpu only)")
        if self.engine == Engine.FSDP2:
            if self.zero_stage in (0, 1):
                raise ValueError("engine fsdp2 covers zero_stage 2 (reshard_after_forward=False) and 3 (True)")
            if Offload.NVME in (self.offload_optimizer, self.offload_params):
                raise ValueError("engine fsdp2 offloads to cpu only (CPUOffloadPolicy); nvme needs deepspeed")
            if self.offload_params != Offload.NONE and self.offload_optimizer != self.offload_params:
                # CPUOffloadPolicy moves sharded parameters, gradients and the optimizer step together.
                raise ValueError("engine fsdp2 offloads parameters and optimizer together: set offload_optimizer cpu too")
        if self.engine == Engine.FSDP1:
            self._check_fsdp1_stage()
        self._check_program()
        self._check_compiled()
        self._check_bitsandbytes_optimizer()
        check_training_lora(self)  # spec/lora.py
        self.mesh.check_world(self.gpus, self.engine.value, self.zero_stage, self.recipe.value)
        return self

    def _check_program(self) -> None:
        """Knobs that do not apply to the engine or recipe (issue 11, bad input)."""
        if self.recipe in (Recipe.TORCHTITAN, Recipe.TORCHTUNE) and self.engine == Engine.DEEPSPEED:
            raise ValueError(f"recipe {self.recipe.value} runs FSDP2 (or one GPU with engine torch), not deepspeed")
        program = self.program
        if program.optimizer_in_backward:
            if self.engine == Engine.DEEPSPEED:
                raise ValueError("optimizer_in_backward: DeepSpeed steps its own optimizer; use engine torch or fsdp2")
            if self.grad_accum > 1:
                raise ValueError("optimizer_in_backward steps at every backward, so it cannot accumulate gradients (grad_accum 1)")
        if self.loss_chunks is not None and program.loss != Loss.CHUNKED:
            raise ValueError(f"loss_chunks applies to a chunked loss, not loss {program.loss.value}")
        if program.model_init == ModelInit.ZERO_INIT and not (self.engine == Engine.DEEPSPEED and self.zero_stage == 3):
            raise ValueError("model_init zero-init is deepspeed.zero.Init, which needs engine deepspeed at zero_stage 3")
        if self.optimizer_impl is not None and self.engine == Engine.DEEPSPEED and not self.deepspeed.client_optimizer:
            raise ValueError("optimizer_impl chooses a torch optimizer's kernel; DeepSpeed steps the optimizer of its JSON "
                             "(FusedAdam): give a DeepSpeed JSON without an optimizer section for a client torch optimizer")
        if self.ddp is False and self.engine == Engine.TORCH and self.gpus > 1:
            raise ValueError(f"ddp false runs one rank without DistributedDataParallel; with gpus {self.gpus} engine torch is DDP")
        if program.optimizer_in_backward and self.engine == Engine.FSDP2:
            raise ValueError("optimizer_in_backward under fsdp2 is not modelled (FSDP2 steps after each block's "
                             "reduce-scatter); use engine torch on one GPU, or --no-optimizer-in-backward")
        if program.optimizer_in_backward and self.engine == Engine.TORCH and program.ddp:
            raise ValueError("optimizer_in_backward with engine torch runs one rank without DDP (torchtune's single-device "
                             "recipe): use gpus 1 and no ddp, or engine fsdp2")
        if program.model_init == ModelInit.META and self.engine == Engine.DEEPSPEED:
            # engine.py `_configure_distributed_model` casts and moves the module's real parameters
            raise ValueError("model_init meta: DeepSpeed takes a materialised model; use host, device or zero-init (stage 3)")
        if program.grad_sync == GradSync.LAST and self.engine == Engine.DEEPSPEED:
            # engine.py `backward` -> `allreduce_gradients` reduces at every micro-batch; there is no no_sync
            raise ValueError("grad_sync last: DeepSpeed reduces gradients at every micro-batch (grad_sync every)")
        if program.activation_offload == ActivationOffload.CPU and self.engine == Engine.DEEPSPEED:
            # deepspeed 0.19.8 runtime/activation_checkpointing/checkpointing.py: cpu_checkpointing moves the
            # checkpointed blocks' inputs only, not every saved activation as torchtune's OffloadActivations
            raise ValueError("activation_offload cpu is torchtune's OffloadActivations (fsdp2 or torch); DeepSpeed offers "
                             "activation_checkpointing.cpu_checkpointing, which offloads checkpoint inputs only: not modelled")
        if self.ddp is not None and self.engine != Engine.TORCH:  # true or false: either way a knob that does not apply
            raise ValueError(f"ddp applies to engine torch; engine {self.engine.value} wraps the model itself (leave it unset)")
        if self.dropout is not None and self.engine == Engine.PAPER:
            raise ValueError("dropout: engine paper counts model states only (the ZeRO paper's 2Ψ + 2Ψ + KΨ), no "
                             "activations for dropout to change; leave it unset or use another engine")
        self._check_fsdp2()
        if self.checkpoint_every is not None and self.checkpointing != Checkpointing.FULL:
            raise ValueError("checkpoint_every chooses which blocks full checkpointing recomputes: set checkpointing full")

    def _check_compiled(self) -> None:
        """torch.compile, float8 and async TP (issue 23): the engines and devices that run them."""
        if len(set(self.compile)) != len(self.compile):
            raise ValueError(f"compile: {', '.join(self.compile)} names a component twice")
        if self.compile and self.engine not in (Engine.FSDP2, Engine.TORCH):
            raise ValueError(f"compile: torch.compile of the blocks and the loss is modelled for engines fsdp2 and torch "
                             f"(torchtitan), not {self.engine.value}")
        if self.float8 is not None:
            if self.device == Device.CPU:
                # torchao float8 matmuls run torch._scaled_mm, which needs an sm_89+ GPU
                raise ValueError("float8: torchao's float8 matmuls (torch._scaled_mm) do not run on CPU; use device cuda")
            if self.engine not in (Engine.FSDP2, Engine.TORCH):
                raise ValueError(f"float8: torchao float8 training is modelled for engines fsdp2 and torch, not "
                                 f"{self.engine.value}")
            if self.float8.fsdp_all_gather and self.engine != Engine.FSDP2:
                raise ValueError("float8.fsdp_all_gather: float8 all-gather is FSDP2's (fsdp_pre_all_gather); use engine fsdp2")
        if self.mesh.async_tp and "model" not in self.compile:
            # torchtitan v0.2.2 parallelize.py: "Async TP requires 'model' in --compile.components"
            raise ValueError("mesh.async_tp: async tensor parallelism is an inductor pass: set compile to include model")

    def _check_bitsandbytes_optimizer(self) -> None:
        """bitsandbytes' optimizers where they cannot step (issue 23, bad input)."""
        if self.paged_optimizer and not self.optimizer.is_bitsandbytes:
            raise ValueError(f"paged_optimizer: paging is bitsandbytes' (PagedAdamW8bit, PagedAdamW32bit); optimizer "
                             f"{self.optimizer.value} keeps its states in PyTorch's allocator: use adam8bit or adam32bit")
        if self.optimizer.is_bitsandbytes and self.engine == Engine.FSDP2:
            # bitsandbytes 0.50.2: torch.ops.bitsandbytes.optimizer_update_* have no DTensor sharding rule
            # ("does not have a sharding strategy registered"), so they cannot step fully_shard's DTensor shards
            raise ValueError(f"optimizer {self.optimizer.value}: bitsandbytes' update kernels cannot step FSDP2's "
                             "sharded (DTensor) parameters; use engine torch, or deepspeed with a client optimizer")
        if self.optimizer.is_bitsandbytes and self.optimizer_impl is not None:
            raise ValueError(f"optimizer_impl chooses a torch optimizer's kernel; bitsandbytes' {self.optimizer.value} "
                             "runs its own update (fused on CUDA): leave optimizer_impl unset")

    def _check_fsdp1_stage(self) -> None:
        """FSDP1's stages and offload (torch fsdp/api.py ShardingStrategy, CPUOffload)."""
        if self.zero_stage == 1:
            raise ValueError("engine fsdp1 covers zero_stage 0 (NO_SHARD), 2 (SHARD_GRAD_OP) and 3 (FULL_SHARD); "
                             "stage 1 has no FSDP1 strategy")
        if Offload.NVME in (self.offload_optimizer, self.offload_params):
            raise ValueError("engine fsdp1 offloads to cpu only (CPUOffload(offload_params=True)); nvme needs deepspeed")
        if self.offload_params != Offload.NONE and self.offload_optimizer != self.offload_params:
            # CPUOffload(offload_params=True) keeps the shards and their gradients on the host, where the optimizer steps
            raise ValueError("engine fsdp1 offloads parameters and optimizer together (CPUOffload(offload_params=True)): "
                             "set offload_optimizer cpu too")
        if self.fsdp1.hybrid and self.zero_stage == 0:
            raise ValueError("fsdp1.hybrid shards within a node (HYBRID_SHARD, _HYBRID_SHARD_ZERO2): use zero_stage 3 or "
                             "2, not NO_SHARD")
        if self.fsdp1.hybrid and self.nodes == 1:
            raise ValueError(f"fsdp1.hybrid replicates across nodes, but gpus {self.gpus} with gpus_per_node "
                             f"{self.node_gpus} is one node: set gpus_per_node to the ranks each shard spans")
        if self.recipe in (Recipe.TORCHTITAN, Recipe.TORCHTUNE):
            raise ValueError(f"recipe {self.recipe.value} runs FSDP2, not FSDP1: use engine fsdp2")
        program = self.program
        if program.optimizer_in_backward:
            raise ValueError("optimizer_in_backward under fsdp1 is not modelled (FSDP1's _register_post_backward_hook "
                             "steps per FlatParameter); use engine torch on one GPU, or --no-optimizer-in-backward")
        if program.model_init in (ModelInit.META, ModelInit.ZERO_INIT):
            raise ValueError(f"model_init {program.model_init.value}: FSDP1 takes a built model (host or device); a "
                             "meta-device build on ranks other than 0 is fsdp1.cpu_ram_efficient_loading")
        if not self.mesh.is_trivial:
            raise ValueError("engine fsdp1 runs data parallelism only here (tensor, context, pipeline and expert "
                             "parallelism are modelled with FSDP2): use engine fsdp2 with a mesh")

    @property
    def fsdp1_wrapping(self) -> FSDP1Wrapping:
        """FSDP1's settings: the explicit knobs over the recipe's defaults."""
        return resolve_fsdp1_wrapping(self.recipe, self.fsdp1)

    def _check_fsdp2(self) -> None:
        """FSDP2 wrapping knobs that do not apply; FSDP1 knobs outside engine fsdp1."""
        if self.engine != Engine.FSDP1 and self.fsdp1 != FSDP1Knobs():
            given = ", ".join(name for name, value in self.fsdp1 if value != FSDP1Knobs.model_fields[name].default)
            raise ValueError(f"fsdp1.{given.split(', ')[0]} applies to engine fsdp1, not {self.engine.value}")
        knobs = self.fsdp2
        if self.engine != Engine.FSDP2:
            if (knobs.units, knobs.reshard_head_after_forward, knobs.reshard_last_block) != (None, None, None):
                raise ValueError(f"fsdp2.units, reshard_head_after_forward and reshard_last_block apply to engine fsdp2, "
                                 f"not {self.engine.value}")
            return
        units = self.fsdp2_wrapping.units
        if units == FSDP2Units.SPLIT and knobs.reshard_root_after_forward is not None:
            raise ValueError("fsdp2.reshard_root_after_forward: under units split the root holds no parameters; "
                             "use reshard_head_after_forward")
        if units == FSDP2Units.ROOT and knobs.reshard_head_after_forward is not None:
            raise ValueError("fsdp2.reshard_head_after_forward applies to units split; under units root the head is "
                             "in the root (reshard_root_after_forward)")
        if knobs.reshard_last_block and self.zero_stage != 3:
            raise ValueError("fsdp2.reshard_last_block: at zero_stage 2 no block reshards after forward")

    @property
    def fsdp2_wrapping(self) -> FSDP2Wrapping:
        """The FSDP2 units and their resharding: the explicit knobs over the recipe's defaults."""
        knobs = self.fsdp2
        return _fsdp2_wrapping_of(self.recipe, self.zero_stage, knobs.units, knobs.reshard_root_after_forward,
                                  knobs.reshard_head_after_forward, knobs.reshard_last_block)

    @property
    def program(self) -> Program:
        """Every program knob resolved: the explicit ones over the recipe's defaults."""
        values = self.__dict__  # pydantic keeps the field values here
        return _program_of(self.recipe, self.engine, self.zero_stage, self.gpus, self.device,
                           tuple(map(values.__getitem__, KNOBS)))

    @property
    def node_gpus(self) -> int:
        return node_size(self.gpus, self.gpus_per_node)

    def varied(self, **changes: Any) -> "TrainingSpec":
        """This spec with `changes` (field: value), validated; a SpecError says why the combination
        is invalid. A world smaller than one node is that node (gpus_per_node follows gpus down)."""
        # pydantic keeps the field values in __dict__: a shallow copy, so the knob models are shared
        # (the estimator's caches find equal knobs by identity), and cheap (the planner varies often)
        values = {**self.__dict__, **changes}
        if self.gpus_per_node is not None and values["gpus"] < self.gpus_per_node and "gpus_per_node" not in changes:
            values["gpus_per_node"] = values["gpus"]
        try:
            return TrainingSpec.model_validate(values)
        except ValidationError as error:
            raise SpecError(describe_validation_error(error, schema=TrainingSpec)) from None

    @property
    def nodes(self) -> int:
        return self.gpus // self.node_gpus


def node_size(gpus: int, gpus_per_node: int | None = None) -> int:
    """GPUs per node: as given, else min(gpus, 8) (an 8-GPU server, or fewer GPUs on one)."""
    return gpus_per_node or min(gpus, 8)


def config_label(zero_stage: int, offload_optimizer: Offload = Offload.NONE, offload_params: Offload = Offload.NONE,
                 checkpointing: Checkpointing = Checkpointing.NONE) -> str:
    """The name of a configuration in every report: "ZeRO-3 + opt->cpu + params->cpu + ckpt full"."""
    parts = [f"ZeRO-{zero_stage}"]
    if offload_optimizer != Offload.NONE:
        parts.append(f"opt->{offload_optimizer.value}")
    if offload_params != Offload.NONE:
        parts.append(f"params->{offload_params.value}")
    if checkpointing != Checkpointing.NONE:
        parts.append(f"ckpt {checkpointing.value}")
    return " + ".join(parts)
