"""Recipe hf-trainer: `transformers.Trainer` itself trains the model, on the world the worker joined.

The worker calls `run_trainer` instead of its own loop when `training.recipe` is hf-trainer. The
Trainer owns the loop, so the phases of the accounting are switched from its hooks (trainer.py
`_run_epoch`, transformers 5.23.0):
- `model` (the Hugging Face model, random weights; under `deepspeed.zero.Init` when the program's
  model init is zero-init), `trainer` (TrainingArguments, Trainer(...)), `engine` (train() up to
  `on_train_begin`: accelerate's prepare, `deepspeed.initialize` or `fully_shard`, the optimizer):
  step 0, the estimate's init;
- `forward`: from the end of the previous step (`on_step_end`; `on_train_begin` for step 1) or the
  previous micro-batch's backward to `accelerator.backward`: the batch fetch (`get_batch_samples`
  takes every micro-batch of the step at once), `training_step`, the model and its loss;
- `backward`: `accelerator.backward`, patched on the instance (the Trainer's one call of it);
- `optimizer_step`: from `_clip_grad_norm` / `_get_grad_norm` (the first calls after the last
  backward of a step), or with DeepSpeed from `DeepSpeedEngine.step` at the accumulation boundary
  (accelerate's `DeepSpeedEngineWrapper.backward` steps inside backward), to `on_step_end`.
What each engine holds is named by the plain loop's classifiers (`ddp_tensors`, `fsdp2_tensors`,
`deepspeed_tensors`), so a Trainer run and a plain run count the same tensors the same way.

How the spec maps to TrainingArguments, and what cannot run on CPU: docs/measure.md, "Recipe
hf-trainer". Versions: transformers 5.23.0, accelerate 1.15.0, deepspeed 0.19.8.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

from zeroplan.errors import MeasureError
from zeroplan.measure.engines.common import (RunContext, count_bitsandbytes_updates, module_buffers,
                                             optimizer_class_and_kwargs)
from zeroplan.measure.fsdp1_rules import refuse_unmeasurable_fsdp1
from zeroplan.measure.processes import run_folder
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.program import ModelInit, OptimizerImpl
from zeroplan.spec.training import Checkpointing, Engine, Offload, Optimizer, Precision, TrainingSpec

FSDP_CPU_NOTE = (
    "accelerate patched to shard on CPU: AcceleratorState.__init__ honours the FSDP plugin on MULTI_CPU as on GPUs "
    "(without it accelerate silently wraps the model in DDP)"
)


def run_trainer(spec: TransformerSpec, training: TrainingSpec, ctx: RunContext, *, steps: int, probe,
                fault=None, on_phase=None) -> dict:
    """Train `steps` steps of `spec` under `training` with transformers.Trainer on this rank; return
    the worker's `ok` object (RankResult JSON, implementation, notes). `fault(rank)` runs at the
    first forward, as in the plain loop; `on_phase(step, phase)` as each phase opens (PhaseRecorder)."""
    from zeroplan.measure.accounting import TensorAccounting
    from zeroplan.measure.allocator_replay import replay_summary
    from zeroplan.measure.result import RankResult
    from zeroplan.measure.phases import PhaseRecorder

    check_supported(training, ctx)
    engine, notes = training.engine, []
    if engine == Engine.DEEPSPEED:
        from zeroplan.measure.engines.deepspeed_engine import import_deepspeed, prepare_environment

        prepare_environment(ctx)  # before deepspeed is imported (by us or by transformers)
        import_deepspeed()
    if engine in (Engine.FSDP2, Engine.FSDP1) and not ctx.is_cuda:
        let_accelerate_shard_on_cpu()
        notes.append(FSDP_CPU_NOTE)
    output_dir = str(run_folder("trainer"))  # named for this worker: removed by the next run if it is killed
    held: dict[str, Any] = {}
    step_times: list[float] = []
    fits, oom_message = True, None
    try:
        with TensorAccounting(device_type="cuda" if ctx.is_cuda else None) as accounting:  # as the worker's
            accounting.set_classifier(lambda: _tensors_by_category(held, engine))
            recorder = PhaseRecorder(accounting, probe, on_phase)
            marks = _Marks(recorder, held, training, ctx, steps, step_times, notes, fault)
            try:
                zero_init = training.program.model_init == ModelInit.ZERO_INIT
                if zero_init:
                    # transformers builds under deepspeed.zero.Init once TrainingArguments(deepspeed=...) exists
                    # (modeling_utils.py _from_config, is_deepspeed_zero3_enabled): arguments first.
                    recorder.switch(0, "trainer", default_category="temporaries")
                    args = _arguments(spec, training, ctx, steps, output_dir)
                recorder.switch(0, "model", default_category="temporaries")
                model, model_name = _build_model(spec, training)
                held["model"] = model
                recorder.switch(0, "trainer", default_category="temporaries")
                if not zero_init:
                    args = _arguments(spec, training, ctx, steps, output_dir)
                trainer = _PhasedTrainer(
                    model=_as_users_pass_it(model), args=args, train_dataset=RandomTokens(spec, training, steps * ctx.world_size),
                    callbacks=[_MarksCallback(marks)], optimizer_cls_and_kwargs=_optimizer_cls_and_kwargs(training, args),
                )
                trainer.marks = marks
                held["trainer"] = trainer
                marks.patch_backward(trainer)
                recorder.switch(0, "engine", default_category="temporaries", born_as="buffers")
                trainer.train()
                recorder.close()
            except torch.OutOfMemoryError as error:
                recorder.close()
                fits, oom_message = False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            classifications = accounting.classifications
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    replayed = replay_summary(accounting.events, truncated=accounting.events_truncated, environ=os.environ)
    result = RankResult(ctx.rank, list(recorder.phases.values()), step_times, fits, oom_message, classifications, replayed)
    implementation = implementation_name(model_name, deepspeed=engine == Engine.DEEPSPEED)
    return {"ok": True, "result": result.to_json_dict(), "implementation": implementation, "notes": notes}


def implementation_name(model_name: str, *, deepspeed: bool) -> str:
    """Which program ran, with its versions, and which model code: e.g.
    "transformers.Trainer-5.23.0+accelerate-1.15.0+deepspeed-0.19.8:LlamaForCausalLM/sdpa"."""
    import accelerate
    import transformers

    versions = [f"transformers.Trainer-{transformers.__version__}", f"accelerate-{accelerate.__version__}"]
    if deepspeed:
        import deepspeed as ds

        versions.append(f"deepspeed-{ds.__version__}")
    return "+".join(versions) + ":" + model_name.partition(":")[2]


# -- what the Trainer can run, and the spec as its arguments --------------------------------------

def check_supported(training: TrainingSpec, ctx: RunContext) -> None:
    """Raise MeasureError for a spec the Trainer cannot run here, naming the field."""
    if ctx.is_fake:
        raise MeasureError("recipe: hf-trainer runs the real Trainer, which cannot run under --simulate; use --recipe plain")
    engine, stage = training.engine, training.zero_stage
    if engine == Engine.TORCH and stage == 1:
        raise MeasureError("zero_stage: the Trainer has no ZeroRedundancyOptimizer; measure ZeRO-1 with --engine deepspeed --zero 1")
    if engine == Engine.FSDP2 and Offload.CPU in (training.offload_optimizer, training.offload_params) and not ctx.is_cuda:
        raise MeasureError("offload: accelerate's FSDP2 offload pins host memory, which fails without a GPU; "
                           "measure it with --recipe plain")
    refuse_unmeasurable_fsdp1(training, on_gpu=ctx.is_cuda)  # measure/fsdp1_rules.py
    if training.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL) or training.checkpoint_every is not None:
        raise MeasureError(f"checkpointing: the Trainer checkpoints every decoder layer whole (gradient_checkpointing); "
                           f"{training.checkpointing.value} is not one of its choices: use none or full")
    if training.precision == Precision.FP16 and not ctx.is_cuda:
        raise MeasureError("precision: fp16 needs a GPU with the Trainer (autocast fp16 and DeepSpeed fp16 are GPU-only); use bf16")
    if training.precision == Precision.PURE_BF16 and engine == Engine.DEEPSPEED:
        raise MeasureError("precision: pure-bf16 has no Trainer + DeepSpeed equivalent measured here; use bf16 or fp32")
    if training.optimizer == Optimizer.ADAM_32BIT and not training.paged_optimizer:
        raise MeasureError("optimizer: adam32bit unpaged has no TrainingArguments.optim name (paged_adamw_32bit is "
                           "paged); add --paged-optimizer")
    program = training.program
    if program.optimizer_in_backward:
        raise MeasureError("optimizer_in_backward: the Trainer steps after backward; use --recipe plain")
    if program.model_init == ModelInit.META:
        raise MeasureError("model_init: the Trainer is given a built model, not a meta one; use host")
    if program.ddp != (engine == Engine.TORCH and training.gpus > 1):
        raise MeasureError(f"ddp: accelerate wraps a model in DDP exactly when engine torch runs more than one process; "
                           f"leave out --ddp")
    if engine == Engine.DEEPSPEED and program.grad_sync.value != "every":
        raise MeasureError("grad_sync: the Trainer lets DeepSpeed reduce every micro-batch; leave out --grad-sync")
    if engine != Engine.DEEPSPEED and program.grad_sync.value != "last" and training.grad_accum > 1:
        raise MeasureError("grad_sync: the Trainer skips the reduction of non-final micro-batches (accelerate no_sync); "
                           "leave out --grad-sync")
    if program.loss.value != "standard" or program.activation_offload.value != "none":
        raise MeasureError("loss / activation_offload: the Trainer computes the model's own loss and keeps activations "
                           "on the device; leave them at their defaults")
    wrapping = training.fsdp2_wrapping
    # accelerate `fsdp2_prepare_model`: embeddings and [final norm, head] units, the tail kept after forward
    if engine == Engine.FSDP2 and (wrapping.units.value != "split" or wrapping.reshard_head
                                   or wrapping.reshard_last_block != (stage == 3)):
        raise MeasureError("fsdp2: accelerate wraps the embeddings and [final norm, head] as units of their own, keeps "
                           "the head's after forward and reshards every block alike; leave out the fsdp2 wrapping knobs")


def _trainer_optim(training: TrainingSpec) -> str:
    """TrainingArguments.optim for the spec (importers/trainer_optim.py reads these names)."""
    if training.optimizer == Optimizer.ADAM_8BIT:
        return "paged_adamw_8bit" if training.paged_optimizer else "adamw_bnb_8bit"
    if training.optimizer == Optimizer.ADAM_32BIT:
        return "paged_adamw_32bit"
    return "adamw_torch_fused" if training.program.optimizer_impl == OptimizerImpl.FUSED else "adamw_torch"


def _fsdp1_config(spec: TransformerSpec, training: TrainingSpec) -> dict[str, Any]:
    """TrainingArguments.fsdp_config for FSDP1 (transformers 5.23.0 training_args.py `_process_fsdp_args` reads each)."""
    from zeroplan.spec.fsdp1 import sharding_strategy

    wrapping = training.fsdp1_wrapping
    strategy = sharding_strategy(training.zero_stage, wrapping.hybrid).lstrip("_").lower()
    prefetch = {"backward-pre": "BACKWARD_PRE", "backward-post": "BACKWARD_POST", "none": "NO_PREFETCH"}
    return {"version": 1, "reshard_after_forward": strategy, "transformer_layer_cls_to_wrap": [_block_class_name(spec, training)],
            "use_orig_params": wrapping.use_orig_params, "sync_module_states": wrapping.sync_module_states,
            "cpu_ram_efficient_loading": wrapping.cpu_ram_efficient_loading,
            "backward_prefetch": prefetch[wrapping.backward_prefetch.value], "forward_prefetch": wrapping.forward_prefetch,
            "limit_all_gathers": wrapping.limit_all_gathers}


def _arguments(spec: TransformerSpec, training: TrainingSpec, ctx: RunContext, steps: int, output_dir: str):
    """TrainingArguments for the spec, then the distributed set-up the model build needs."""
    from transformers import TrainingArguments

    program = training.program
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=training.micro_batch,
        gradient_accumulation_steps=training.grad_accum, bf16=training.precision == Precision.BF16,
        fp16=training.precision == Precision.FP16, activation_checkpointing=training.checkpointing == Checkpointing.FULL,
        report_to="none", save_strategy="no", disable_tqdm=True, ddp_backend=ctx.backend, seed=1234 + ctx.rank,
        optim=_trainer_optim(training),
    )
    if not ctx.is_cuda:
        # The GPU recipe (use_cpu False) finds no backend on a CPU machine and runs one process
        # (accelerate state.py PartialState._prepare_backend): docs/measure.md.
        kwargs.update(use_cpu=True, dataloader_pin_memory=False)
    if training.engine == Engine.DEEPSPEED:
        # the user's JSON as given ("auto" included: the Trainer fills it), else the spec's
        user = ctx.engine_config
        kwargs["deepspeed"] = json.loads(json.dumps(user)) if user is not None else trainer_deepspeed_config(
            training, spec.hidden_size, cpu=not ctx.is_cuda)
    if training.engine == Engine.FSDP2:
        kwargs.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": training.zero_stage == 3,
                                              "transformer_layer_cls_to_wrap": [_block_class_name(spec, training)]})
    if training.engine == Engine.FSDP1:
        kwargs.update(fsdp=True, fsdp_config=_fsdp1_config(spec, training))
        # accelerate 1.15.0's FSDP1 plugin takes FSDP_SHARDING_STRATEGY (FULL_SHARD when unset) before the
        # reshard_after_forward the Trainer passes (utils/dataclasses.py __post_init__): set it, as `accelerate
        # launch --fsdp_sharding_strategy` does, so that the strategy asked for is the one that runs
        os.environ["FSDP_SHARDING_STRATEGY"] = kwargs["fsdp_config"]["reshard_after_forward"].upper()
    args = TrainingArguments(**kwargs)
    args.device  # noqa: B018 - accelerate's PartialState joins the process group the worker made
    if training.engine == Engine.DEEPSPEED:
        import deepspeed

        # zero.Init and DeepSpeedConfig read deepspeed.comm's world size; with use_cpu accelerate never
        # calls deepspeed.init_distributed (state.py PartialState.__init__), which reuses the group.
        deepspeed.init_distributed(ctx.backend)
    return args


def trainer_deepspeed_config(training: TrainingSpec, hidden_size: int, *, cpu: bool = True) -> dict:
    """The DeepSpeed JSON of `training` as a Trainer user writes it (the Hugging Face docs' configs):
    zeroplan's writer for the ZeRO section, "auto" wherever the Trainer fills a value from its
    arguments or from the model (integrations/deepspeed.py HfTrainerDeepSpeedConfig). With
    `deepspeed.client_optimizer` no `optimizer` section, so that the Trainer's own torch optimizer is
    DeepSpeed's client optimizer (deepspeed_optim_sched); without it DeepSpeed's own AdamW, as the
    estimate of that spec models it (torch's AdamW on a `cpu` run: engine.py `torch_adam`)."""
    from zeroplan.importers.deepspeed_json import trainer_filled_buckets, write_deepspeed_config

    config = write_deepspeed_config(training)
    if training.deepspeed.client_optimizer:
        del config["optimizer"]
    else:
        params = config["optimizer"].setdefault("params", {})
        params.update(lr="auto", weight_decay="auto")  # trainer_config_process fills them
        if cpu and training.offload_optimizer == Offload.NONE and training.optimizer != Optimizer.SGD:
            params["torch_adam"] = True  # no JIT build of FusedAdam on CPU (measure/engines/deepspeed_engine.py)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config[key] = "auto"
    config["fp16"]["enabled"] = config["bf16"]["enabled"] = "auto"
    config.update(gradient_clipping="auto", steps_per_print=1 << 30, wall_clock_breakdown=False)
    zero = config["zero_optimization"]
    for key, filled in trainer_filled_buckets(hidden_size, training.zero_stage).items():
        if zero[key] == filled:
            zero[key] = "auto"  # the Trainer writes the same number: let it (trainer_config_finalize)
    return config


def _optimizer_cls_and_kwargs(training: TrainingSpec, args) -> tuple[type, dict] | None:
    """None for the Trainer's default fused AdamW (optim adamw_torch_fused, trainer_optimizer.py
    `_get_adamw_torch`); otherwise the class and kwargs the Trainer is given, with the kernel of
    `optimizer_impl` (torch/optim/adamw.py foreach / fused flags)."""
    impl = training.program.optimizer_impl
    if training.optimizer.is_bitsandbytes:
        count_bitsandbytes_updates()  # what its CPU updates allocate (engines/common.py)
        return None  # the Trainer builds it from args.optim (`_get_bitsandbytes_optimizer`)
    if training.optimizer == Optimizer.ADAMW and impl == OptimizerImpl.FUSED:
        return None
    cls, kwargs = optimizer_class_and_kwargs(training)
    kwargs = dict(kwargs, lr=args.learning_rate)
    if training.optimizer != Optimizer.SGD or impl != OptimizerImpl.FOR_LOOP:
        kwargs.update(fused=impl == OptimizerImpl.FUSED, foreach=impl == OptimizerImpl.FOREACH)
    return cls, kwargs


def _build_model(spec: TransformerSpec, training: TrainingSpec):
    from zeroplan.measure.workload import build_hf_model

    torch.manual_seed(1234)
    return build_hf_model(spec, training)


def _block_class_name(spec: TransformerSpec, training: TrainingSpec) -> str:
    """The decoder layer class accelerate shards one by one (fsdp_config transformer_layer_cls_to_wrap)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeroplan.measure.workload import hf_config_kwargs

    model_type, kwargs = hf_config_kwargs(spec)
    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type, **kwargs))]
    return model_class._no_split_modules[0]


class RandomTokens(torch.utils.data.Dataset):
    """micro_batch x grad_accum x steps sequences per rank of random ids, labels = ids (the model shifts)."""

    def __init__(self, spec: TransformerSpec, training: TrainingSpec, steps_times_world: int):
        self.vocab_size, self.seq_len = spec.vocab_size, training.seq_len
        self.length = training.micro_batch * training.grad_accum * steps_times_world

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


# -- phases ---------------------------------------------------------------------------------------

class _Marks:
    """Switches the accounting's phases from the Trainer's hooks (see the module docstring)."""

    def __init__(self, recorder, held, training, ctx, steps, step_times, notes, fault):
        self.recorder, self.held, self.training, self.ctx = recorder, held, training, ctx
        self.steps, self.step_times, self.notes, self.fault = steps, step_times, notes, fault
        self.step, self.started = 0, 0.0

    def _switch(self, name: str, default_category: str, born_as: str | None = None) -> None:
        self.recorder.switch(self.step, name, default_category=default_category, born_as=born_as)

    def start_step(self, step: int) -> None:
        self.step, self.started = step, time.perf_counter()
        self._switch("forward", "activations")

    def forward(self, model) -> None:
        if self.recorder.open != (self.step, "forward"):  # the first micro-batch continues the batch fetch
            self._switch("forward", "activations")
        if self.fault is not None:
            self.fault(self.ctx.rank)
        if isinstance(model, DistributedDataParallel):
            from zeroplan.measure.engines.torch_engine import rebuild_ddp_buckets

            rebuild_ddp_buckets(model)

    def backward(self) -> None:
        # what backward allocates and no classifier names is a temporary (the worker's rule)
        self._switch("backward", "activations", born_as="temporaries")

    def optimizer_step(self) -> None:
        if self.recorder.open != (self.step, "optimizer_step"):
            self._switch("optimizer_step", "temporaries")

    def end_step(self, global_step: int) -> None:
        self.step_times.append(time.perf_counter() - self.started)
        if global_step < self.steps:
            self.start_step(global_step + 1)
        else:
            self.recorder.close()  # what follows is the Trainer's end of training, not a step

    def patch_backward(self, trainer) -> None:
        backward = trainer.accelerator.backward

        def marked_backward(loss, **kwargs):
            self.backward()
            return backward(loss, **kwargs)

        trainer.accelerator.backward = marked_backward  # trainer.py training_step: its one call of backward

    def engine_ready(self, trainer) -> None:
        """At on_train_begin: check that the engine asked for is the one that runs, note what the
        run resolved, and mark DeepSpeed's step, which runs inside backward."""
        wrapped, accelerator = trainer.model_wrapped, trainer.accelerator
        ran = _engine_that_ran(wrapped, trainer.model, str(accelerator.distributed_type))
        wanted = self.training.engine.value if self.ctx.world_size > 1 or self.training.engine != Engine.TORCH else "none"
        if ran != wanted:
            raise MeasureError(f"engine: asked for {wanted}, but the Trainer ran {ran} "
                               f"(accelerate distributed_type {accelerator.distributed_type})")
        self.held["engine_ready"] = True
        optimizer = trainer.optimizer
        while getattr(optimizer, "optimizer", None) is not None:  # accelerate's and DeepSpeed's wrappers
            optimizer = optimizer.optimizer
        flags = {k: v for k, v in getattr(optimizer, "defaults", {}).items() if k in ("fused", "foreach") and v is not None}
        self.notes.append(f"Trainer resolved: {type(wrapped).__name__} over {type(trainer.model).__name__}, "
                          f"optimizer {type(optimizer).__name__}{flags}, mixed precision {accelerator.mixed_precision}, "
                          f"parameters {next(trainer.model.parameters()).dtype}")
        if isinstance(wrapped, DistributedDataParallel):
            self.notes.append(f"DDP find_unused_parameters={wrapped.find_unused_parameters} "
                              f"gradient_as_bucket_view={wrapped.gradient_as_bucket_view}")
        if ran == "deepspeed":
            filled = accelerator.state.deepspeed_plugin.deepspeed_config
            _check_filled(filled, self.training)
            self.notes.append(f"DeepSpeed zero_optimization as the Trainer filled it: {json.dumps(filled['zero_optimization'])}")
            step = wrapped.step

            def marked_step(*args, **kwargs):
                if wrapped.is_gradient_accumulation_boundary():
                    self.optimizer_step()
                return step(*args, **kwargs)

            wrapped.step = marked_step
        self.start_step(1)


def _engine_that_ran(wrapped, model, distributed_type: str) -> str:
    if type(wrapped).__name__ == "DeepSpeedEngine":
        return "deepspeed"
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(wrapped, FullyShardedDataParallel):
        return "fsdp1"
    if isinstance(model, FSDPModule):
        return "fsdp2"
    if isinstance(wrapped, DistributedDataParallel):
        return "torch"
    return "none"


def _check_filled(filled: dict, training: TrainingSpec) -> None:
    """The buckets DeepSpeed got are those the estimate models (the Trainer filled every "auto")."""
    zero = filled["zero_optimization"]
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if key in zero and int(zero[key]) != getattr(training.deepspeed, key):
            raise MeasureError(f"deepspeed.{key}: the Trainer filled {zero[key]}, the spec says {getattr(training.deepspeed, key)}")


def _as_users_pass_it(model):
    """The PeftModel that `get_peft_model` returned, for a model with adapters (what a LoRA script
    gives the Trainer: programs/peft_model.py `apply_peft` keeps it); else the model itself."""
    return getattr(model, "zeroplan_peft_model", [model])[0]


def _tensors_by_category(held: dict, engine: Engine) -> dict[str, list[torch.Tensor]]:
    """The classifier: the engine's own once it wraps the model, the bare model before; with
    adapters apart and quantization states as parameters (programs/peft_model.py)."""
    categories = _engine_tensors_by_category(held, engine)
    if categories and hasattr(held["model"], "zeroplan_peft_model"):
        from zeroplan.measure.programs.peft_model import with_peft_categories

        return with_peft_categories(categories, held["model"])
    return categories


def _engine_tensors_by_category(held: dict, engine: Engine) -> dict[str, list[torch.Tensor]]:
    model, trainer = held.get("model"), held.get("trainer")
    if model is None:
        return {}
    if trainer is not None and held.get("engine_ready"):
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if engine == Engine.DEEPSPEED:
            from zeroplan.measure.engines.deepspeed_engine import deepspeed_tensors

            return deepspeed_tensors(trainer.model_wrapped, trainer.model_wrapped.module)
        if engine == Engine.FSDP2:
            from zeroplan.measure.engines.fsdp2_engine import fsdp2_tensors

            return fsdp2_tensors(trainer.model, optimizer)
        if engine == Engine.FSDP1:
            from zeroplan.measure.engines.fsdp1_engine import fsdp1_tensors

            return fsdp1_tensors(trainer.model_wrapped, optimizer)
        from zeroplan.measure.engines.torch_engine import ddp_tensors

        return ddp_tensors(trainer.model, optimizer)
    params = list(model.parameters())
    params += [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]  # zero.Init partitions
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "buffers": module_buffers(model)}


class _PhasedTrainer(Trainer):
    """The Trainer, with the phase switches that no callback gives (see the module docstring)."""

    marks: _Marks

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.marks.forward(model)
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        self.marks.optimizer_step()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        self.marks.optimizer_step()
        return super()._get_grad_norm(model, grad_norm)


class _MarksCallback(TrainerCallback):
    def __init__(self, marks: _Marks):
        self.marks = marks

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks.engine_ready(self.marks.held["trainer"])

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.end_step(state.global_step)


# -- FSDP2 on CPU ---------------------------------------------------------------------------------

def let_accelerate_shard_on_cpu() -> None:
    """Make accelerate honour the FSDP plugin on CPU ranks, as it does on GPUs.

    accelerate 1.15.0 state.py AcceleratorState.__init__ turns `distributed_type` into FSDP only in
    the branch for GPU-like types (MULTI_GPU, MULTI_XPU, ...); MULTI_CPU, what TrainingArguments
    (use_cpu=True) gives on gloo, is not among them, so the plugin is dropped and
    Accelerator.prepare_model wraps the model in DDP, silently. This runs the three statements of
    that branch for MULTI_CPU after the original __init__, and gives FSDP1 the CPU device without an index, and
    nothing else; from there on it is accelerate's own FSDP path (fsdp_utils.py fsdp2_prepare_model, or
    FullyShardedDataParallel in Accelerator.prepare_model)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "zeroplan_cpu_fsdp", False):
        return

    def __init__(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None, fsdp_plugin=None,
                 *args, **kwargs):
        initialized = AcceleratorState._shared_state != {} and getattr(self, "initialized", False)
        original(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        wants_fsdp = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if not initialized and wants_fsdp and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no" and fsdp_plugin is not None:
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type
            # FSDP1 takes accelerate's device as device_id and compares it with torch.device("cpu")
            # (_init_utils.py _get_compute_device): the CPU device without an index, as a GPU rank's has its own
            # (AcceleratorState keeps a copy of PartialState's attributes: both are set)
            if getattr(self, "device", None) is not None and self.device.type == "cpu":
                self.device = PartialState._shared_state["device"] = torch.device("cpu")

    __init__.zeroplan_cpu_fsdp = True
    AcceleratorState.__init__ = __init__
