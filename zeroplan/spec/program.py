"""The training program around the engine: how the model is built, trained and checkpointed.

Two configurations with the same engine, stage and batch can differ by gigabytes because the
program differs: where the weights are when the engine takes them, which optimizer kernel steps,
whether gradients are reduced every micro-batch, how the loss is computed. Each of these is a knob
of `TrainingSpec` (None: not given), and a recipe (`--recipe`) says what the program people run
does by default. `resolve_program` turns the two into the concrete `Program` the estimator and
`measure` follow; an explicit knob always wins over the recipe.

The defaults of each recipe cite the file of the program that sets them (versions: transformers
5.23.0 with accelerate 1.15.0, torchtitan 0.3.0, torchtune 0.6.1).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Recipe(str, Enum):
    """The program that trains the model, whose defaults fill every knob left unset."""

    HF_TRAINER = "hf-trainer"  # transformers.Trainer, with accelerate (DDP, FSDP2) or DeepSpeed
    TORCHTITAN = "torchtitan"  # torchtitan's train.py: FSDP2, meta-device init, per-op checkpointing
    TORCHTUNE = "torchtune"  # torchtune's full_finetune_{single_device,distributed} recipes
    PLAIN = "plain"  # zeroplan measure's own loop (the assumptions of zeroplan's first version)


class ModelInit(str, Enum):
    """Where the weights are when the engine takes the model."""

    HOST = "host"  # loaded on the host, cast and moved by the engine (Trainer, accelerate, DeepSpeed)
    DEVICE = "device"  # built on the GPU in the training dtype
    META = "meta"  # built on the meta device, sharded, then each shard materialised (torchtitan)
    ZERO_INIT = "zero-init"  # built inside deepspeed.zero.Init: partitioned as it is built (ZeRO-3)


class GradSync(str, Enum):
    """Under gradient accumulation, when gradients are reduced."""

    LAST = "last"  # only on the last micro-batch (DDP no_sync, FSDP2 set_requires_gradient_sync(False))
    EVERY = "every"  # every micro-batch (DeepSpeed; torchtitan and torchtune's FSDP2)


class OptimizerImpl(str, Enum):
    """The kernel of a torch optimizer (torch/optim/adamw.py: fused, foreach or the for-loop)."""

    FUSED = "fused"
    FOREACH = "foreach"
    FOR_LOOP = "for-loop"


class Loss(str, Enum):
    """How the output projection and the cross-entropy are computed."""

    STANDARD = "standard"  # the whole logits tensor, upcast to fp32 for the loss
    CHUNKED = "chunked"  # torchtune CEWithChunkedOutputLoss / torchtitan's chunked loss: per-chunk fp32
    FUSED_LINEAR = "fused-linear"  # a fused linear + cross-entropy kernel: the logits never exist whole


class ActivationOffload(str, Enum):
    NONE = "none"
    CPU = "cpu"  # saved activations kept in host memory (torchtune OffloadActivations)


class FSDP2Units(str, Enum):
    """How `fully_shard` groups the modules outside the transformer blocks."""

    ROOT = "root"  # embeddings, final norm and head in the root's unit (zeroplan's loop, torchtune)
    # embeddings alone and [final norm, head] as one unit, the root empty; a tied model has one
    # [embeddings, final norm, head] unit (accelerate `fsdp2_prepare_model`, torchtitan `apply_fsdp`)
    SPLIT = "split"


class FSDP2Wrapping(NamedTuple):
    """The FSDP2 units of a program and which of them reshard after forward: every value resolved."""

    units: FSDP2Units
    reshard_root: bool  # the root unit (units root: embeddings, final norm, head)
    reshard_head: bool  # the [final norm, head] unit (units split)
    reshard_last_block: bool


def resolve_fsdp2_wrapping(recipe: Recipe, zero_stage: int, units: FSDP2Units | None, reshard_root: bool | None,
                           reshard_head: bool | None, reshard_last_block: bool | None) -> FSDP2Wrapping:
    """The recipe's FSDP2 wrapping, overridden by every value given (not None)."""
    reshard = zero_stage == 3
    if units is None and (reshard_root, reshard_head) != (None, None):
        # a setting given for the root's or the head's unit says which units the program has
        units = FSDP2Units.ROOT if reshard_root is not None else FSDP2Units.SPLIT
    if units is None:
        # accelerate 1.15.0 utils/fsdp_utils.py `fsdp2_prepare_model` carves out the embeddings and
        # [final norm, lm_head]; torchtitan 0.3.0 distributed/fsdp.py `apply_fsdp_to_decoder` does the
        # same; torchtune 0.6.1 training/_distributed.py `shard_model` shards each layer, then the root.
        units = FSDP2Units.SPLIT if recipe in (Recipe.HF_TRAINER, Recipe.TORCHTITAN) else FSDP2Units.ROOT
    return FSDP2Wrapping(
        units=units,
        # an explicit reshard_after_forward applies to the root too (torch `_fully_shard.py`)
        reshard_root=reshard if reshard_root is None else reshard_root,
        # accelerate: the tail gets reshard_after_forward=False; torchtitan: (policy == "always"), False
        reshard_head=False if reshard_head is None else reshard_head,
        # every block, the last included, in all four programs (torchtitan's Dec-2024 code kept the last)
        reshard_last_block=reshard if reshard_last_block is None else reshard_last_block,
    )


class Program(NamedTuple):
    """The concrete program a configuration runs: every knob resolved."""

    recipe: Recipe
    model_init: ModelInit
    grad_sync: GradSync
    ddp: bool  # a single rank still wrapped in DistributedDataParallel
    optimizer_impl: OptimizerImpl
    optimizer_in_backward: bool
    loss: Loss
    loss_chunks: int
    activation_offload: ActivationOffload


# Knob names of TrainingSpec, each None when not given.
KNOBS = ("model_init", "grad_sync", "ddp", "optimizer_impl", "optimizer_in_backward", "loss", "loss_chunks",
         "activation_offload")


def recipe_defaults(recipe: Recipe, engine: str, zero_stage: int, gpus: int, device: str) -> dict[str, object]:
    """What `recipe` runs when the user says nothing, for this engine, stage, world and device."""
    if recipe == Recipe.HF_TRAINER:
        return {
            # trainer.py `_wrap_model` / accelerate's prepare: weights loaded on the host, moved by the
            # engine; under ZeRO-3 from_pretrained builds inside deepspeed.zero.Init (integrations/deepspeed.py
            # `is_deepspeed_zero3_enabled`).
            "model_init": ModelInit.ZERO_INIT if engine == "deepspeed" and zero_stage == 3 else ModelInit.HOST,
            # accelerate `Accelerator.accumulate` skips the sync on non-final micro-batches (no_sync);
            # DeepSpeed reduces every micro-batch (engine.py `allreduce_gradients` per backward).
            "grad_sync": GradSync.EVERY if engine == "deepspeed" else GradSync.LAST,
            # accelerate wraps in DDP only when the world has more than one process (`prepare_model`).
            "ddp": engine == "torch" and gpus > 1,
            # training_args.py: optim defaults to OptimizerNames.ADAMW_TORCH_FUSED, AdamW(fused=True).
            "optimizer_impl": OptimizerImpl.FUSED,
            "optimizer_in_backward": False,
            # loss_utils.py `ForCausalLMLoss`: logits.float() then cross_entropy over the whole tensor.
            "loss": Loss.STANDARD,
            "loss_chunks": 1,
            "activation_offload": ActivationOffload.NONE,
        }
    if recipe == Recipe.TORCHTITAN:
        return {
            # train.py: the model is built under torch.device("meta"), parallelised, then `to_empty` +
            # `init_weights` materialise each rank's shard.
            "model_init": ModelInit.META,
            # train.py `forward_backward_step`: no set_requires_gradient_sync(False) between micro-batches.
            "grad_sync": GradSync.EVERY,
            # parallelize.py applies FSDP2, or replicate (DDP) over pure data parallelism; one GPU runs the bare module.
            "ddp": engine == "torch" and gpus > 1,
            # components/optimizer.py: AdamW with implementation "fused" by default.
            "optimizer_impl": OptimizerImpl.FUSED,
            "optimizer_in_backward": False,
            # models/llama3 config_registry: the loss is computed over 8 chunks of the output.
            "loss": Loss.CHUNKED,
            "loss_chunks": 8,
            "activation_offload": ActivationOffload.NONE,
        }
    if recipe == Recipe.TORCHTUNE:
        single = gpus == 1
        return {
            # full_finetune_single_device.py `_setup_model`: built on the device in the training dtype;
            # full_finetune_distributed.py: built on meta, sharded, then loaded shard by shard.
            "model_init": ModelInit.DEVICE if single else ModelInit.META,
            # full_finetune_distributed.py: gradients are reduced on every backward.
            "grad_sync": GradSync.EVERY,
            # the single-device recipe trains the bare module; the distributed one shards with FSDP2
            "ddp": engine == "torch" and gpus > 1,
            # recipes' default optimizers are torch (or bitsandbytes) AdamW built without foreach/fused:
            # on CUDA torch picks foreach (torch/optim/optimizer.py `_default_to_fused_or_foreach`).
            "optimizer_impl": OptimizerImpl.FOREACH,
            # recipes/configs/*_full_single_device.yaml: optimizer_in_bwd: True.
            "optimizer_in_backward": single,
            # every full-finetune YAML: loss: torchtune.modules.loss.CEWithChunkedOutputLoss (8 chunks).
            "loss": Loss.CHUNKED,
            "loss_chunks": 8,
            "activation_offload": ActivationOffload.NONE,
        }
    return {  # PLAIN: zeroplan measure's workload.py loop
        # FSDP2 shards a meta-device model (measure/engines/fsdp2_engine.py); ZeRO-3 builds under
        # deepspeed.zero.Init (zeroplan's first version assumed it); the rest build on the device.
        "model_init": ModelInit.META if engine == "fsdp2" else (
            ModelInit.ZERO_INIT if engine == "deepspeed" and zero_stage == 3 else ModelInit.DEVICE),
        "grad_sync": GradSync.EVERY if engine == "deepspeed" else GradSync.LAST,
        "ddp": engine == "torch",
        # torch's AdamW left to choose (optimizer.py `_default_to_fused_or_foreach`): the for-loop on CPU
        # tensors, foreach on CUDA; DeepSpeed's config optimizer on CUDA is FusedAdam (ops/adam/fused_adam.py).
        "optimizer_impl": OptimizerImpl.FOR_LOOP if device == "cpu" else (
            OptimizerImpl.FUSED if engine == "deepspeed" else OptimizerImpl.FOREACH),
        "optimizer_in_backward": False,
        "loss": Loss.STANDARD,
        "loss_chunks": 1,
        "activation_offload": ActivationOffload.NONE,
    }


def resolve_program(recipe: Recipe, engine: str, zero_stage: int, gpus: int, device: str,
                    explicit: dict[str, object]) -> Program:
    """The recipe's defaults, overridden by every knob given explicitly (not None)."""
    values = recipe_defaults(recipe, engine, zero_stage, gpus, device)
    values.update({name: value for name, value in explicit.items() if value is not None})
    if explicit.get("loss") not in (None, Loss.CHUNKED) and explicit.get("loss_chunks") is None:
        values["loss_chunks"] = 1  # a loss chosen by hand that is not chunked has one chunk
    if explicit.get("loss") == Loss.CHUNKED and explicit.get("loss_chunks") is None and values["loss_chunks"] == 1:
        values["loss_chunks"] = 8  # torchtune CEWithChunkedOutputLoss(num_output_chunks=8)
    return Program(recipe=recipe, **values)


def fsdp2_reduces_in_param_dtype(recipe: Recipe) -> bool:
    """Whether the recipe's FSDP2 reduces gradients in the gathered (param) dtype rather than fp32.

    accelerate 1.15.0 (the Trainer) builds `MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)`
    (utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision); zeroplan's loop and
    torchtitan's default (mixed_precision_reduce "float32") reduce in fp32.
    """
    return recipe == Recipe.HF_TRAINER
