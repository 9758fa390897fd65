"""The accuracy grid as data: one `Row` per configuration that `zeroplan validate` estimates and
measures (a covering design, not a cross product; docs/accuracy.md, "Grid"), how rows are
selected, and the specs each row runs. Nothing here runs or measures anything."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroplan.errors import SpecError
from zeroplan.measure.grid_ep import ep_rows

# DeepSpeed "small buckets": buckets far below the default 5e8 elements, so that the buckets are
# exercised rather than one buffer larger than the model; persistence 0 makes stage 3 shard every
# tensor of the tiny models (the default 1e5 keeps them all whole). deepspeed/runtime/zero/config.py.
SMALL_BUCKETS = {
    "reduce_bucket_size": 100_000,
    "allgather_bucket_size": 100_000,
    "stage3_prefetch_bucket_size": 100_000,
    "stage3_param_persistence_threshold": 0,
}


@dataclass(frozen=True)
class LoraRow:
    """The PEFT part of a row (TrainingSpec.lora and .quant, zeroplan/spec/lora.py)."""

    rank: int = 8
    targets: tuple[str, ...] | str = "all-linear"
    dora: bool = False
    modules_to_save: tuple[str, ...] = ()
    dropout: float = 0.0
    base_precision: str | None = None  # bf16, fp16, fp32, int8, nf4, fp4; None: the model's own
    double_quant: bool = False
    compute_dtype: str | None = None  # bitsandbytes compute dtype; None: the spec's default
    quant_storage: str | None = None  # dtype the packed 4-bit weights are stored in; None: uint8
    upcast: bool = False  # prepare_model_for_kbit_training: the non-quantized layers cast to fp32

    @property
    def id(self) -> str:
        kbit = self.base_precision in ("int8", "nf4", "fp4", "torchao-nf4")
        targets = self.targets if isinstance(self.targets, str) else "+".join(self.targets)
        parts = [f"{'qlora' if kbit else 'lora'}-r{self.rank}", targets]
        parts += ["dora"] if self.dora else []
        parts += [f"save-{'+'.join(self.modules_to_save)}"] if self.modules_to_save else []
        parts += [f"drop{self.dropout:g}"] if self.dropout else []
        parts += [self.base_precision] if self.base_precision else []
        parts += ["dq"] if self.double_quant else []
        parts += [f"compute-{self.compute_dtype}"] if self.compute_dtype else []
        parts += [f"store-{self.quant_storage}"] if self.quant_storage else []
        parts += ["upcast"] if self.upcast else []
        return "-".join(parts)

    def training_fields(self) -> dict[str, Any]:
        targets = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        fields: dict[str, Any] = {"lora": {"rank": self.rank, "targets": targets, "dora": self.dora,
                                           "modules_to_save": list(self.modules_to_save), "dropout": self.dropout}}
        if self.base_precision is not None:
            quant: dict[str, Any] = {"base_precision": self.base_precision, "double_quant": self.double_quant}
            for knob in ("compute_dtype", "quant_storage"):
                if getattr(self, knob) is not None:
                    quant[knob] = getattr(self, knob)
            if self.upcast:
                quant["upcast_non_quantized"] = True
            fields["quant"] = quant
        return fields


@dataclass(frozen=True)
class Row:
    """One configuration of the grid: a catalogue model, an engine set-up and a workload."""

    model: str
    engine: str  # torch, fsdp2, deepspeed
    stage: int
    precision: str = "fp32"
    offload: bool = False  # fsdp2: CPUOffloadPolicy; deepspeed: offload_optimizer cpu
    checkpointing: str = "none"
    attention: str = "fused"  # fused (SDPA) or eager
    micro_batch: int = 2
    seq_len: int = 128
    world: int = 2
    simulate: bool = False  # the fake backend: one process standing for `world` ranks
    small_buckets: bool = False  # deepspeed: SMALL_BUCKETS instead of DeepSpeed's defaults
    sub_group_size: int | None = None  # deepspeed stage 3: elements per optimizer sub-group (None: DeepSpeed's 1e9)
    quick: bool = False  # part of the CI slice (`--quick`, tests/measure/test_accuracy_slice.py)
    recipe: str = "plain"  # the program measured: zeroplan's own loop unless a row names another
    optimizer_impl: str | None = None  # torch optimizer kernel: fused, foreach, for-loop (None: the recipe's)
    ddp: bool | None = None  # engine torch on one rank: False runs the bare module (None: the recipe's)
    optimizer_in_backward: bool = False  # per-parameter optimizers stepped in the gradient hooks
    client_optimizer: bool = False  # deepspeed: a client torch optimizer instead of the JSON's
    grad_accum: int = 1
    grad_sync: str | None = None  # last or every (spec/program.py GradSync); None: the recipe's
    model_init: str | None = None  # host, device, meta or zero-init; None: the recipe's (device for deepspeed)
    dropout: float | None = None  # --dropout P on every dropout layer; None: the model config's rates
    loss: str | None = None  # standard, chunked or fused-linear; None: the recipe's
    checkpoint_every: int | None = None  # with checkpointing full: blocks N, 2N, ... only
    fsdp2_units: str | None = None  # fsdp2: root or split (spec/program.py FSDP2Units); None: the recipe's
    reshard_last_block: bool | None = None  # fsdp2 at stage 3: False keeps the last block gathered
    activation_offload: str | None = None  # none or cpu (torchtune's OffloadActivations); None: the recipe's
    mesh: tuple[tuple[str, Any], ...] = ()  # spec/mesh.py MeshSpec fields beyond data parallelism, e.g. (("tp", 2),)
    lora: LoraRow | None = None  # PEFT adapters and a quantized base (ids "lora-..." / "qlora-...")
    compile: tuple[str, ...] = ()  # torch.compile components: model (each block), loss (measure/compiled.py)
    float8: tuple[tuple[str, Any], ...] = ()  # spec/training.py Float8Knobs fields, e.g. (("recipe", "rowwise"),); GPU rows
    optimizer: str = "adamw"  # adamw, sgd, or bitsandbytes' adam8bit / adam32bit
    paged: bool = False  # bitsandbytes' paged optimizer (falls back to ordinary states on CPU)
    fsdp1: tuple[tuple[str, Any], ...] = ()  # spec/fsdp1.py FSDP1Knobs beyond the recipe's, e.g. (("use_orig_params", True),)

    @property
    def id(self) -> str:
        setup = f"{self.engine}-{self.stage}" + ("+offload" if self.offload else "") + ("+smallbkt" if self.small_buckets else "")
        setup += f"+subgroup{self.sub_group_size}" if self.sub_group_size is not None else ""
        ckpt = "ckpt" if self.checkpointing == "full" else "nockpt" if self.checkpointing == "none" else self.checkpointing
        if self.checkpoint_every:
            ckpt += f"-every{self.checkpoint_every}"
        world = f"fake{self.world}" if self.simulate else f"w{self.world}"
        parts = (self.model, setup, self.precision, ckpt, f"{self.micro_batch}x{self.seq_len}", world)
        program = (("eager",) if self.attention == "eager" else ()) + ((self.optimizer_impl,) if self.optimizer_impl else ()) \
            + (("noddp",) if self.ddp is False else ()) + (("optinbwd",) if self.optimizer_in_backward else ()) \
            + (("client",) if self.client_optimizer else ()) \
            + ((f"ga{self.grad_accum}" + (f"-{self.grad_sync}" if self.grad_sync else ""),) if self.grad_accum > 1 else ()) \
            + ((f"init-{self.model_init}",) if self.model_init else ()) \
            + ((f"drop{self.dropout:g}",) if self.dropout is not None else ()) \
            + ((f"{self.loss}-loss",) if self.loss else ()) \
            + ((f"units-{self.fsdp2_units}",) if self.fsdp2_units else ()) \
            + (("keeplast",) if self.reshard_last_block is False else ()) \
            + ((f"actoffload-{self.activation_offload}",) if self.activation_offload else ()) \
            + ((f"compile-{'+'.join(self.compile)}",) if self.compile else ()) \
            + (("float8-" + "-".join(str(v) if not isinstance(v, bool) else k for k, v in self.float8 if v),)
               if self.float8 else ()) \
            + (((f"paged-" if self.paged else "") + self.optimizer,) if self.optimizer != "adamw" else ()) \
            + tuple(_fsdp1_part(knob, value) for knob, value in self.fsdp1)
        row_id = "/".join(parts + program + ((self.recipe,) if self.recipe != "plain" else ()))
        row_id = mesh_row_id(self.mesh, row_id, "mesh-ds" if self.engine == "deepspeed" else "mesh") if self.mesh else row_id
        trainer = "trainer-" if self.recipe == "hf-trainer" else ""  # the Trainer's adapter rows apart from the loop's
        return f"{trainer}{self.lora.id}/{row_id}" if self.lora is not None else row_id

    @property
    def needs_cpu_adam(self) -> bool:
        """DeepSpeed optimizer offload runs DeepSpeedCPUAdam, a JIT build (~1 min, 2 GB) the first time."""
        return self.engine == "deepspeed" and self.offload

    def training_fields(self, backend: str = "gloo") -> dict[str, Any]:
        """The TrainingSpec fields of this row (device cuda for an nccl run, else cpu)."""
        fields: dict[str, Any] = {
            "engine": self.engine, "zero_stage": self.stage, "gpus": self.world, "precision": self.precision,
            "micro_batch": self.micro_batch, "seq_len": self.seq_len, "checkpointing": self.checkpointing,
            "attention": self.attention, "device": "cuda" if backend == "nccl" and not self.simulate else "cpu",
            "recipe": self.recipe, "grad_accum": self.grad_accum,
        }
        if self.grad_sync:
            fields["grad_sync"] = self.grad_sync
        if self.dropout is not None:
            fields["dropout"] = self.dropout
        if self.loss:
            fields["loss"] = self.loss
        if self.checkpoint_every:
            fields["checkpoint_every"] = self.checkpoint_every
        if self.offload:
            fields["offload_optimizer"] = "cpu"
            if self.engine in ("fsdp2", "fsdp1") and self.stage == 3:
                fields["offload_params"] = "cpu"  # CPUOffloadPolicy / CPUOffload move parameters with the optimizer
        fsdp2 = {"units": self.fsdp2_units, "reshard_last_block": self.reshard_last_block}
        if any(value is not None for value in fsdp2.values()):
            fields["fsdp2"] = {knob: value for knob, value in fsdp2.items() if value is not None}
        if self.small_buckets:
            fields["deepspeed"] = dict(SMALL_BUCKETS)
        if self.client_optimizer:
            fields["deepspeed"] = {**fields.get("deepspeed", {}), "client_optimizer": True}
        if self.sub_group_size is not None:
            fields["deepspeed"] = {**fields.get("deepspeed", {}), "sub_group_size": self.sub_group_size}
        for knob in ("optimizer_impl", "ddp", "grad_sync", "model_init", "activation_offload"):
            if getattr(self, knob) is not None:
                fields[knob] = getattr(self, knob)
        if self.optimizer_in_backward:
            fields["optimizer_in_backward"] = True
        if self.compile:
            fields["compile"] = list(self.compile)
        if self.float8:
            fields["float8"] = dict(self.float8)
        if self.optimizer != "adamw":
            fields["optimizer"] = self.optimizer
        if self.paged:
            fields["paged_optimizer"] = True
        if self.mesh:
            fields["mesh"] = dict(self.mesh)
        if self.fsdp1:
            fields["fsdp1"] = dict(self.fsdp1)
            if fields["fsdp1"].get("hybrid"):  # HYBRID_SHARD: two "nodes" of half the ranks each
                fields["gpus_per_node"] = self.world // 2
        if self.model_init is None and self.engine == "deepspeed" and self.recipe == "plain":
            fields["model_init"] = "device"  # the plain loop builds whole, then deepspeed.initialize partitions (no zero.Init)
        if self.lora is not None:
            fields |= self.lora.training_fields()
        return fields


def _grid() -> tuple[Row, ...]:
    """The covering design (docs/accuracy.md, "Grid"): every engine set-up on both tiny models,
    with precision x checkpointing x batch covered pairwise over the main set-ups; llama-100m on
    one row per main set-up; FSDP2 on llama-1b at 8 and 64 simulated ranks."""
    # The L4 orthogonal array over (precision, checkpointing, micro-batch x seq): any two of the
    # three factors take all four level pairs over its four runs.
    l4 = (("fp32", "none", (2, 128)), ("fp32", "full", (4, 256)), ("bf16", "none", (4, 256)), ("bf16", "full", (2, 128)))
    tiny = ("tiny-llama", "tiny-gpt2")
    main = [  # (engine, stage, extra fields): all four L4 runs
        ("torch", 0, {}), ("torch", 1, {}), ("fsdp2", 2, {}), ("fsdp2", 3, {}),
        ("deepspeed", 1, {}), ("deepspeed", 2, {}), ("deepspeed", 3, {}),
    ]
    variants = [  # two L4 runs each (fp32 without, bf16 with checkpointing)
        ("fsdp2", 2, {"offload": True}), ("fsdp2", 3, {"offload": True}),
        ("deepspeed", 1, {"small_buckets": True}), ("deepspeed", 2, {"small_buckets": True}),
        ("deepspeed", 3, {"small_buckets": True}),
        ("deepspeed", 2, {"offload": True, "small_buckets": True}), ("deepspeed", 3, {"offload": True, "small_buckets": True}),
    ]
    # The CI slice: the first (fp32, no checkpointing, 2x128) run of these set-ups.
    quick = {("torch", 0, ()), ("torch", 1, ()), ("fsdp2", 2, ()), ("fsdp2", 3, ()), ("deepspeed", 2, ("small_buckets",))}
    rows: list[Row] = []
    for k, (engine, stage, extra) in enumerate(main + variants):
        runs = l4 if k < len(main) else (l4[0], l4[3])
        for j, (precision, ckpt, (mb, seq)) in enumerate(runs):
            # alternate the models so each sees both levels of every factor across set-ups
            model = tiny[(k + (j in (1, 2))) % 2] if len(runs) == 4 else tiny[(j + k) % 2]
            is_quick = j == 0 and (engine, stage, tuple(sorted(extra))) in quick
            rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, micro_batch=mb, seq_len=seq,
                            quick=is_quick, **extra))
    # about 100M parameters: one row per main set-up, short sequences (each step is ~1e11 FLOP on CPU)
    for engine, stage, precision, ckpt in (
        ("torch", 0, "fp32", "none"), ("torch", 1, "bf16", "none"), ("fsdp2", 2, "bf16", "full"),
        ("fsdp2", 3, "fp32", "none"), ("deepspeed", 2, "bf16", "none"), ("deepspeed", 3, "fp32", "full"),
    ):
        rows.append(Row("llama-100m", engine, stage, precision, checkpointing=ckpt))
    # simulated worlds (fake backend, FSDP2 only): llama-1b at 8 and 64 ranks; one tiny row for CI
    for stage, world, precision, ckpt in (
        (2, 8, "bf16", "none"), (3, 8, "bf16", "none"), (3, 8, "fp32", "full"),
        (2, 64, "bf16", "full"), (3, 64, "bf16", "none"), (3, 64, "fp32", "none"),
    ):
        rows.append(Row("llama-1b", "fsdp2", stage, precision, checkpointing=ckpt, world=world, simulate=True))
    rows.append(Row("tiny-llama", "fsdp2", 3, "fp32", world=8, simulate=True, quick=True))
    # Selective checkpointing (the attention core recomputed) and eager attention, on both tiny
    # models: fused and eager, with and without autocast (the torch engine's bf16), GQA (tiny-llama)
    # and fused q/k/v (tiny-gpt2).
    for model, engine, stage, precision, ckpt, attention, (mb, seq) in (
        ("tiny-llama", "torch", 0, "bf16", "selective", "eager", (2, 128)),
        ("tiny-llama", "torch", 0, "bf16", "selective", "fused", (2, 128)),
        ("tiny-llama", "fsdp2", 2, "bf16", "selective", "fused", (4, 256)),
        ("tiny-llama", "deepspeed", 2, "bf16", "selective", "eager", (2, 128)),
        ("tiny-gpt2", "fsdp2", 3, "fp32", "selective", "eager", (4, 256)),
        ("tiny-gpt2", "torch", 1, "fp32", "none", "eager", (4, 256)),
        # long sequences, where eager attention's backward (s x s gradients) is the block's peak
        ("tiny-llama", "fsdp2", 3, "fp32", "none", "eager", (1, 1024)),
        ("tiny-llama", "fsdp2", 2, "bf16", "selective", "eager", (1, 1024)),
        ("tiny-llama", "fsdp2", 3, "fp32", "full", "eager", (1, 1024)),
        ("tiny-llama", "torch", 1, "bf16", "none", "eager", (1, 1024)),
        ("tiny-gpt2", "torch", 0, "bf16", "selective", "eager", (4, 256)),
    ):
        quick = (model, engine, ckpt, seq) == ("tiny-llama", "fsdp2", "selective", 1024)  # the CI slice's eager row
        rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, attention=attention, micro_batch=mb, seq_len=seq,
                        quick=quick))
    rows.append(Row("tiny-llama", "deepspeed", 3, "fp32", checkpointing="selective", attention="eager", micro_batch=1,
                    seq_len=1024, small_buckets=True))
    # Stage 3's step one optimizer sub-group at a time (stage3.py `_create_fp16_sub_groups`): a sub_group_size
    # that cuts each rank's 250,176-element partition into four, where the first step's peak is the step
    rows.append(Row("tiny-llama", "deepspeed", 3, "bf16", checkpointing="full", small_buckets=True, sub_group_size=50_000))
    # The torch optimizer's kernel (for-loop is the plain loop's on CPU, in every row above), one rank
    # without DDP, the optimizer in backward, and DeepSpeed stepping a client torch optimizer.
    for model, engine, stage, precision, extra in (
        ("tiny-llama", "torch", 0, "fp32", {"optimizer_impl": "foreach"}),
        ("tiny-gpt2", "torch", 1, "bf16", {"optimizer_impl": "fused"}),
        ("tiny-gpt2", "fsdp2", 2, "fp32", {"optimizer_impl": "foreach"}),
        ("tiny-llama", "fsdp2", 3, "bf16", {"optimizer_impl": "fused"}),
        ("tiny-llama", "torch", 0, "fp32", {"world": 1, "ddp": False}),
        ("tiny-gpt2", "torch", 0, "bf16", {"world": 1, "ddp": False, "optimizer_impl": "foreach"}),
        ("tiny-llama", "torch", 0, "fp32", {"world": 1, "ddp": False, "optimizer_in_backward": True}),
        ("tiny-gpt2", "torch", 0, "fp32", {"world": 1, "ddp": False, "optimizer_in_backward": True,
                                           "optimizer_impl": "foreach"}),
        ("tiny-llama", "deepspeed", 2, "fp32", {"client_optimizer": True, "optimizer_impl": "for-loop", "small_buckets": True}),
        ("tiny-gpt2", "deepspeed", 1, "bf16", {"client_optimizer": True, "optimizer_impl": "foreach", "small_buckets": True}),
        ("tiny-llama", "deepspeed", 3, "fp32", {"client_optimizer": True, "optimizer_impl": "fused", "small_buckets": True}),
        ("tiny-gpt2", "deepspeed", 0, "bf16", {"client_optimizer": True, "optimizer_impl": "foreach"}),
    ):
        rows.append(Row(model, engine, stage, precision, **extra))
    # transformers.Trainer itself (measure/programs/hf_trainer.py): DDP, DeepSpeed with the Hugging Face
    # docs' "auto" buckets, FSDP2 through accelerate; fp32 without and bf16 with checkpointing, and
    # accumulation (DDP and FSDP2 skip the sync of non-final micro-batches, DeepSpeed reduces every one).
    for engine, stage in (("torch", 0), ("deepspeed", 2), ("deepspeed", 3), ("fsdp2", 3)):
        rows.append(Row("tiny-llama", engine, stage, "fp32", recipe="hf-trainer"))
        rows.append(Row("tiny-llama", engine, stage, "bf16", checkpointing="full", recipe="hf-trainer"))
    # DeepSpeed stage 0 with bf16: the FP16_UnfusedOptimizer wrapper in bf16 mode over the Trainer's AdamW
    rows.append(Row("tiny-llama", "deepspeed", 0, "bf16", checkpointing="full", recipe="hf-trainer"))
    for engine, stage in (("torch", 0), ("deepspeed", 2), ("fsdp2", 2)):
        rows.append(Row("tiny-llama", engine, stage, "fp32", grad_accum=2, recipe="hf-trainer"))
    # Gradient accumulation (2 micro-batches), reduced on the last one only (DDP no_sync, FSDP2
    # set_requires_gradient_sync(False)) or on every one (torchtitan, torchtune, DeepSpeed).
    for model, engine, stage, precision in (("tiny-llama", "torch", 0, "fp32"), ("tiny-gpt2", "torch", 1, "bf16"),
                                            ("tiny-llama", "fsdp2", 2, "bf16"), ("tiny-gpt2", "fsdp2", 3, "fp32")):
        for sync in ("last", "every"):
            quick = (engine, stage, sync) == ("fsdp2", 2, "every")  # the CI slice's accumulation row
            rows.append(Row(model, engine, stage, precision, grad_accum=2, grad_sync=sync, quick=quick))
    # Where the weights are when the engine takes them. On a CPU run the host is the device's memory,
    # so host rows check that case; zero-init builds inside deepspeed.zero.Init.
    for model, engine, stage, precision, init, extra in (
        ("tiny-llama", "torch", 0, "bf16", "host", {}), ("tiny-gpt2", "torch", 1, "fp32", "meta", {}),
        ("tiny-llama", "fsdp2", 2, "fp32", "host", {}), ("tiny-gpt2", "fsdp2", 3, "bf16", "device", {}),
        ("tiny-llama", "deepspeed", 2, "bf16", "host", {"small_buckets": True}),
        ("tiny-gpt2", "deepspeed", 3, "fp32", "host", {"small_buckets": True}),
        ("tiny-llama", "deepspeed", 3, "bf16", "zero-init", {"small_buckets": True}),
        ("tiny-gpt2", "deepspeed", 3, "fp32", "zero-init", {"offload": True, "small_buckets": True}),
    ):
        quick = (engine, init, precision) == ("deepspeed", "zero-init", "bf16")  # the CI slice's zero.Init row
        rows.append(Row(model, engine, stage, precision, model_init=init, quick=quick, **extra))
    # Dropout at GPT-2's 0.1 (embedding, attention, residual masks): fused attention (on CPU, SDPA's
    # math path keeps the attention matrices) and eager, with and without checkpointing, autocast's bf16.
    for engine, stage, precision, ckpt, attention, (mb, seq), quick in (
        ("torch", 0, "fp32", "none", "fused", (2, 128), True),
        ("torch", 0, "fp32", "full", "eager", (2, 128), False),
        ("torch", 1, "bf16", "selective", "fused", (4, 256), False),
        ("fsdp2", 2, "fp32", "none", "eager", (4, 256), False),
        ("fsdp2", 3, "fp32", "full", "fused", (4, 256), True),
        ("fsdp2", 2, "bf16", "none", "fused", (2, 128), False),
    ):
        rows.append(Row("tiny-gpt2", engine, stage, precision, checkpointing=ckpt, attention=attention, micro_batch=mb,
                        seq_len=seq, dropout=0.1, quick=quick))
    rows.append(Row("tiny-gpt2", "deepspeed", 2, "fp32", attention="eager", small_buckets=True, dropout=0.1))
    # The training program's loss and checkpointing knobs (issue 11) on tiny-llama, fsdp2 and torch,
    # fp32 and bf16 (autocast for torch): torchtune's chunked loss, a fused linear + loss, torchtitan's
    # per-op checkpointing and its every-Nth-block full checkpointing (N = 2 of 2 blocks: the last).
    for engine, stage, precision, knobs in (
        ("fsdp2", 3, "bf16", {"loss": "chunked"}), ("torch", 0, "fp32", {"loss": "chunked"}),
        ("fsdp2", 3, "fp32", {"loss": "fused-linear"}), ("torch", 0, "bf16", {"loss": "fused-linear"}),
        ("fsdp2", 3, "fp32", {"checkpointing": "op"}), ("fsdp2", 2, "bf16", {"checkpointing": "op"}),
        ("torch", 0, "fp32", {"checkpointing": "op"}), ("torch", 0, "bf16", {"checkpointing": "op"}),
        ("fsdp2", 3, "fp32", {"checkpointing": "full", "checkpoint_every": 2}),
        ("torch", 0, "bf16", {"checkpointing": "full", "checkpoint_every": 2}),
    ):
        rows.append(Row("tiny-llama", engine, stage, precision, **knobs))
    # torchtitan and torchtune reproduced in zeroplan's loop (measure/programs/reproduction.py), each
    # with its recipe's defaults: torchtitan 0.3.0's llama3 configs (FSDP2, meta init, per-op
    # checkpointing, ChunkedLossWrapper); torchtune 0.6.1's full_finetune_single_device (one rank
    # without DDP, pure bf16, optimizer in backward, CEWithChunkedOutputLoss).
    rows.append(Row("tiny-llama", "fsdp2", 3, "bf16", checkpointing="op", recipe="torchtitan", fsdp2_units="root"))
    rows.append(Row("tiny-llama", "torch", 0, "pure-bf16", world=1, recipe="torchtune"))
    # bitsandbytes' optimizers (issue 23; estimate/engines/bnb_optim.py): 8-bit and 32-bit AdamW, paged or not (on
    # CPU bitsandbytes pages nothing and steps with its CPU kernels), in the loop, in torchtune's single-device
    # program (paged 8-bit stepped in backward, as llama3_1/8B_full_single_device) and under the Trainer, whose
    # 8-bit optimizers keep the embeddings' states at 32 bits
    for model, engine, stage, precision, extra in (
        ("tiny-llama", "torch", 0, "fp32", {"optimizer": "adam8bit"}),
        ("tiny-gpt2", "torch", 0, "bf16", {"optimizer": "adam8bit", "paged": True, "world": 1, "ddp": False}),
        ("tiny-llama", "torch", 1, "fp32", {"optimizer": "adam32bit", "paged": True}),
        ("tiny-llama", "torch", 0, "pure-bf16", {"optimizer": "adam8bit", "paged": True, "world": 1, "recipe": "torchtune"}),
        ("tiny-llama", "torch", 0, "fp32", {"optimizer": "adam8bit", "recipe": "hf-trainer"}),
        ("tiny-gpt2", "torch", 0, "bf16", {"optimizer": "adam8bit", "paged": True, "checkpointing": "full",
                                          "recipe": "hf-trainer"}),
    ):
        rows.append(Row(model, engine, stage, precision, **extra))
    # FSDP2 units outside the blocks (issue 11): accelerate's and torchtitan's split (untied: embeddings,
    # [norm, head]; tied GPT-2: one [embeddings, norm, head] unit), and torchtitan's 2024 last block kept.
    rows.append(Row("tiny-llama", "fsdp2", 3, "fp32", fsdp2_units="split"))
    rows.append(Row("tiny-gpt2", "fsdp2", 3, "bf16", fsdp2_units="split", reshard_last_block=False))
    # activation offloading (torchtune's OffloadActivations): one rank without checkpointing, and
    # FSDP2 with full checkpointing as torchtune's recipes pair them
    rows.append(Row("tiny-llama", "torch", 0, "bf16", world=1, micro_batch=4, seq_len=256, activation_offload="cpu"))
    rows.append(Row("tiny-llama", "fsdp2", 3, "bf16", checkpointing="full", micro_batch=4, seq_len=256,
                    activation_offload="cpu"))
    # Mixture of experts and latent attention (issue 13): Qwen3-MoE, DeepSeek-V3 (one dense layer, then
    # sparse ones), GPT-OSS (eager only: transformers 5.23.0 has no SDPA path for its sinks).
    for model, attention in (("qwen3moe-tiny", "fused"), ("dsv3-tiny", "fused"), ("gptoss-tiny", "eager")):
        for engine, stage, precision, ckpt in (("fsdp2", 3, "fp32", "none"), ("fsdp2", 2, "bf16", "full"),
                                               ("deepspeed", 3, "bf16", "none")):
            rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, attention=attention,
                            small_buckets=engine == "deepspeed"))  # buffers the size of the model, not of 5e8 elements
    rows.extend(_issue23_rows())
    rows.extend(mesh_rows())
    rows.extend(deepspeed_mesh_rows())
    rows.extend(ep_rows(Row))  # expert parallelism (measure/engines/mesh_moe.py)
    rows += _dense_family_rows()
    rows.extend(_lora_rows())
    rows.extend(fsdp1_rows())
    # the Trainer's FSDP2 at micro-batch 1 x 64 tokens (issue 23): the peak in FSDP's buffers, where gloo's late
    # release of a reduce-scatter's clone made ranks and steps differ (measure/collective_scratch.py)
    for model in ("tiny-gpt2", "tiny-llama"):
        rows.append(Row(model, "fsdp2", 3, "fp32", micro_batch=1, seq_len=64, recipe="hf-trainer"))
    return tuple(rows)


def _issue23_rows() -> list[Row]:
    """The programs of issue 23 measured with the real libraries on CPU:
    - torch.compile (inductor's CPU backend) of each block and of the loss, on one rank without DDP (measure/
      compiled.py; counted from the allocator's records, which miss frees on gloo's threads: one rank has none),
      fp32 and under autocast;
    - the CPU misses it lists: DeepSpeed stage 0 in bf16 with full checkpointing (a block's recomputation with the
      gradients so far beats the loss's backward), ZeRO-2 in bf16 under the Trainer, DeepSeek-V3's latent
      attention under eager attention."""
    one = {"world": 1, "ddp": False}
    return [
        Row("tiny-llama", "torch", 0, "fp32", compile=("model",), **one),
        Row("tiny-llama", "torch", 0, "fp32", compile=("model", "loss"), **one),
        Row("tiny-llama", "torch", 0, "bf16", compile=("model",), **one),
        Row("tiny-llama", "torch", 0, "bf16", compile=("model", "loss"), **one),
        Row("tiny-gpt2", "deepspeed", 0, "bf16", checkpointing="full", micro_batch=4, seq_len=256),
        Row("tiny-llama", "deepspeed", 2, "bf16", recipe="hf-trainer"),
        Row("dsv3-tiny", "fsdp2", 3, "fp32", attention="eager"),
        Row("dsv3-tiny", "torch", 0, "bf16", attention="eager"),
    ]


def fsdp1_rows() -> list[Row]:
    """FSDP1 (issue 23, measure/engines/fsdp1_engine.py): every sharding strategy on both tiny models in zeroplan's
    loop, fp32 and bf16 (reduce fp32), use_orig_params, HYBRID_SHARD over two "nodes" of 4 ranks, the backward and
    forward prefetch knobs, accumulation under no_sync, LoRA sharing its block's unit (use_orig_params); the Trainer
    through accelerate (reduce in bf16, use_orig_params true, no prefetch), with PEFT's wrapping of a LoRA model.
    sync_module_states is off where the Trainer runs on CPU (accelerate's plugin needs a GPU for it)."""
    orig, hybrid = (("use_orig_params", True),), (("hybrid", True),)
    nosync = (("sync_module_states", False),)
    rows = [  # each strategy: every pair of precision, checkpointing and batch, on both models (as the L4 of _grid)
        Row("tiny-llama", "fsdp1", 3, "fp32"),
        Row("tiny-gpt2", "fsdp1", 3, "bf16", checkpointing="full"),
        Row("tiny-gpt2", "fsdp1", 3, "fp32", checkpointing="full", micro_batch=4, seq_len=256),
        Row("tiny-llama", "fsdp1", 3, "bf16", micro_batch=4, seq_len=256),
        Row("tiny-llama", "fsdp1", 2, "fp32"),
        Row("tiny-gpt2", "fsdp1", 2, "bf16", micro_batch=4, seq_len=256),
        Row("tiny-gpt2", "fsdp1", 2, "fp32", checkpointing="full", micro_batch=4, seq_len=256),
        Row("tiny-llama", "fsdp1", 2, "bf16", checkpointing="full"),
        Row("tiny-llama", "fsdp1", 0, "fp32"),
        Row("tiny-gpt2", "fsdp1", 0, "bf16"),
        Row("tiny-gpt2", "fsdp1", 0, "fp32", checkpointing="full", micro_batch=4, seq_len=256),
        Row("tiny-llama", "fsdp1", 0, "bf16", checkpointing="full"),
        Row("tiny-llama", "fsdp1", 0, "bf16", micro_batch=4, seq_len=256),
        Row("tiny-llama", "fsdp1", 3, "bf16", fsdp1=orig),
        Row("tiny-gpt2", "fsdp1", 3, "fp32", fsdp1=orig),
        Row("tiny-llama", "fsdp1", 3, "fp32", world=4, fsdp1=hybrid),
        Row("tiny-llama", "fsdp1", 2, "bf16", world=4, fsdp1=hybrid),
        Row("tiny-llama", "fsdp1", 3, "fp32", fsdp1=(("backward_prefetch", "backward-post"),)),
        Row("tiny-llama", "fsdp1", 3, "bf16", fsdp1=(("backward_prefetch", "none"), ("forward_prefetch", True))),
        Row("tiny-llama", "fsdp1", 3, "fp32", grad_accum=2),
        Row("tiny-llama", "fsdp1", 2, "bf16", grad_accum=2),
        Row("tiny-llama", "fsdp1", 3, "fp32", lora=LoraRow(8), fsdp1=orig),
        Row("tiny-llama", "fsdp1", 3, "bf16", checkpointing="full", lora=LoraRow(8, ("q_proj", "v_proj")), fsdp1=orig),
        Row("tiny-llama", "fsdp1", 3, "fp32", recipe="hf-trainer", fsdp1=nosync),
        Row("tiny-llama", "fsdp1", 3, "bf16", checkpointing="full", recipe="hf-trainer", fsdp1=nosync),
        Row("tiny-llama", "fsdp1", 2, "fp32", grad_accum=2, recipe="hf-trainer", fsdp1=nosync),
        Row("tiny-llama", "fsdp1", 0, "bf16", recipe="hf-trainer", fsdp1=nosync),
        Row("tiny-llama", "fsdp1", 3, "bf16", recipe="hf-trainer",
            fsdp1=(("use_orig_params", False), ("backward_prefetch", "backward-pre"), *nosync)),
        Row("tiny-llama", "fsdp1", 3, "bf16", lora=LoraRow(8), recipe="hf-trainer", fsdp1=nosync),
    ]
    return rows


def _fsdp1_part(knob: str, value: Any) -> str:
    """A row id's part for an FSDP1 knob: "orig" / "noorig", "hybrid", "bwd-post", "fwdprefetch", "nosync"."""
    names = {"use_orig_params": ("orig", "noorig"), "hybrid": ("hybrid", "nohybrid"), "forward_prefetch": ("fwdprefetch", ""),
             "sync_module_states": ("sync", "nosync"), "limit_all_gathers": ("", "nolimit"),
             "cpu_ram_efficient_loading": ("ramefficient", "")}
    if knob == "backward_prefetch":
        return f"bwd-{value.removeprefix('backward-')}"
    return names[knob][0 if value else 1]


def mesh_row_id(mesh: tuple[tuple[str, Any], ...], row_id: str, prefix: str = "mesh") -> str:
    """"mesh-" and the mesh's degrees before the row's id: mesh-tp2-sp/tiny-llama/fsdp2-3/..."""
    knobs = dict(mesh)
    degrees = "-".join(f"{name}{knobs[name]}" for name in ("cp", "tp", "pp", "ep", "dp_replicate") if knobs.get(name, 1) > 1)
    extras = ([knobs["pp_schedule"]] if "pp_schedule" in knobs else []) \
        + ([f"v{knobs['pp_virtual_stages']}"] if knobs.get("pp_virtual_stages", 1) > 1 else []) \
        + (["nosp"] if knobs.get("sequence_parallel") is False else []) \
        + (["nolossparallel"] if knobs.get("loss_parallel") is False else [])
    return "-".join([prefix, degrees, *extras]) + "/" + row_id


_TINY_LLAMA_4L = "tests/data/tiny-llama-4l.toml"  # spec files of the tests: relative to the checkout (row_files)
_TINY_LLAMA_16K = "tests/data/tiny-llama-16k.toml"
CHECKOUT = Path(__file__).resolve().parents[2]
"""The zeroplan checkout this code runs from (an installed copy has no tests/ beside it)."""


def row_files(row: Row) -> tuple[Path, ...]:
    """The files a row reads: its model's spec file when it names one (a path, not a catalogue name),
    in the checkout whatever the working directory."""
    return (CHECKOUT / row.model,) if "/" in row.model else ()


def missing_files(rows: Sequence[Row]) -> dict[Path, list[str]]:
    """The files `rows` read that are not there, each with the ids of the rows that read it."""
    missing: dict[Path, list[str]] = {}
    for row in rows:
        for path in row_files(row):
            if not path.is_file():
                missing.setdefault(path, []).append(row.id)
    return missing


_TINY_LLAMA_16K_KV4 = "tests/data/tiny-llama-16k-kv4.toml"


def mesh_rows() -> list[Row]:
    """Tensor, sequence and pipeline parallelism with FSDP2 (issue 14, measure/engines/mesh.py): torchtitan's
    loop with its standard loss, tiny-llama (2 KV heads: tp 2 at most), real gloo ranks and one
    simulated world. Context parallelism runs torch's ring attention with the CPU kernel added
    (measure/cp_cpu.py; docs/measure.md, "Context parallelism on CPU")."""
    titan = {"recipe": "torchtitan", "loss": "standard"}
    return [
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("tp", 2), ("sequence_parallel", False), ("loss_parallel", False)), **titan),
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("tp", 2),), **titan),
        Row("tiny-llama", "fsdp2", 3, "bf16", mesh=(("tp", 2),), world=4, **titan),
        Row("tiny-llama", "fsdp2", 2, "fp32", mesh=(("tp", 2),), world=4, **titan),
        Row("tiny-llama", "fsdp2", 3, "fp32", checkpointing="full", mesh=(("tp", 2),), world=4, **titan),  # tp under full checkpointing
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "gpipe")), grad_accum=4, **titan),
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "1f1b")), grad_accum=4, **titan),
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "1f1b")), grad_accum=4, world=4, **titan),
        Row("tiny-llama", "fsdp2", 3, "fp32", mesh=(("tp", 2),), world=64, simulate=True, **titan),
        # looped schedules need layers >= pp x virtual stages: tiny-llama with 4 layers, a spec file of the tests
        Row(_TINY_LLAMA_4L, "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "interleaved-1f1b"), ("pp_virtual_stages", 2)),
            grad_accum=4, **titan),
        Row(_TINY_LLAMA_4L, "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "zero-bubble"), ("pp_virtual_stages", 2)),
            grad_accum=4, **titan),
        Row(_TINY_LLAMA_4L, "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "interleaved-1f1b"), ("pp_virtual_stages", 2)),
            grad_accum=4, world=4, **titan),
        *_context_parallel_rows(titan),
        # zero bubble with FSDP2 sharding: I after a resharding forward keeps nothing for W (estimate/parallel/pipeline_fsdp.py)
        Row(_TINY_LLAMA_4L, "fsdp2", 3, "fp32", mesh=(("pp", 2), ("pp_schedule", "zero-bubble"), ("pp_virtual_stages", 2)),
            grad_accum=4, world=4, **titan),
        # a 16k vocabulary: the rowwise embedding's gradient arrives whole on each TP rank (estimate/parallel/tp_embedding.py)
        Row(_TINY_LLAMA_16K, "fsdp2", 3, "fp32", mesh=(("tp", 2),), **titan),
        # every other block checkpointed under sequence parallelism: two kinds of block, each cut by SP as it keeps
        Row(_TINY_LLAMA_4L, "fsdp2", 3, "fp32", checkpointing="full", checkpoint_every=2, mesh=(("tp", 2),), **titan),
        *_loss_parallel_rows(titan),
    ]


def _loss_parallel_rows(titan: dict) -> list[Row]:
    """A 16k vocabulary, where loss_parallel()'s handlers dominate the peak (estimate/parallel/mesh.py
    `_loss_parallel_changes`): tp 2 and 4, bf16 logits under FSDP2's mixed precision (tp 2 x dp 2), bf16 asked
    of TP alone (torchtitan then trains in fp32: maybe_enable_amp), and the same vocabulary without loss
    parallelism (the logits all-gathered, aten's log_softmax and nll_loss)."""
    return [
        Row(_TINY_LLAMA_16K, "fsdp2", 3, "bf16", mesh=(("tp", 2),), world=4, **titan),
        Row(_TINY_LLAMA_16K_KV4, "fsdp2", 3, "fp32", mesh=(("tp", 4),), world=4, **titan),
        Row(_TINY_LLAMA_16K, "fsdp2", 3, "bf16", mesh=(("tp", 2),), **titan),
        Row(_TINY_LLAMA_16K, "fsdp2", 3, "fp32", mesh=(("tp", 2), ("loss_parallel", False)), **titan),
    ]


def deepspeed_mesh_rows() -> list[Row]:
    """DeepSpeed AutoTP (ZeRO 1-2) and Ulysses (issue 14, measure/engines/deepspeed_mesh.py) on the Hugging Face
    tiny-llama in zeroplan's loop, with small buckets so that the buckets are not one 5e8-element buffer."""
    tp2, ulysses2 = (("tp", 2),), (("cp", 2),)
    return [
        Row("tiny-llama", "deepspeed", 1, "fp32", mesh=tp2, small_buckets=True),
        Row("tiny-llama", "deepspeed", 2, "fp32", mesh=tp2, small_buckets=True),
        Row("tiny-llama", "deepspeed", 1, "fp32", mesh=tp2, world=4, small_buckets=True),
        Row("tiny-llama", "deepspeed", 1, "fp32", mesh=ulysses2, small_buckets=True),
    ]


def _context_parallel_rows(titan: dict) -> list[Row]:
    """cp 2 alone (FSDP2 over the 2 cp ranks, torchtitan's "fsdp" = dp_shard x cp), cp 2 x dp 2 and cp 2 x tp 2 on
    4 ranks, each without and with checkpointing (full: the ring runs again in backward)."""
    rows = []
    for precision, world, extra in (("fp32", 2, ()), ("bf16", 4, ()), ("fp32", 4, (("tp", 2),))):
        for ckpt in ("none", "full"):
            rows.append(Row("tiny-llama", "fsdp2", 3, precision, checkpointing=ckpt, world=world,
                            mesh=(("cp", 2), *extra), **titan))
    return rows


def _dense_family_rows() -> list[Row]:
    """The dense families of issue 13 through their transformers classes: each family's block terms
    (q/k norms, sandwich and post norms, soft-capping under eager, sliding windows under SDPA) in
    fp32, in 16-bit under FSDP2 and DeepSpeed, under autocast, and with checkpointing."""
    return [
        Row("qwen3-tiny", "torch", 1, "fp32"),
        Row("qwen3-tiny", "fsdp2", 3, "bf16", checkpointing="selective"),
        Row("qwen3-tiny", "deepspeed", 2, "bf16", attention="eager"),
        Row("gemma2-tiny", "torch", 1, "fp32", attention="eager"),  # SDPA cannot soft-cap: eager only on CPU
        Row("gemma2-tiny", "fsdp2", 3, "bf16", attention="eager"),
        Row("gemma2-tiny", "torch", 0, "bf16", attention="eager", checkpointing="full"),
        Row("gemma3-tiny", "torch", 1, "fp32"),
        Row("gemma3-tiny", "torch", 1, "fp32", attention="eager"),
        Row("gemma3-tiny", "fsdp2", 3, "bf16"),
        Row("olmo2-tiny", "torch", 1, "fp32"),
        Row("olmo2-tiny", "torch", 0, "bf16", micro_batch=4, seq_len=256),
        Row("olmo2-tiny", "deepspeed", 2, "bf16", attention="eager", checkpointing="full"),
        Row("phi4-tiny", "torch", 1, "fp32"),
    ]


def _lora_rows() -> list[Row]:
    """LoRA (issue 12) on every engine and stage, fp32 without and bf16 with checkpointing, ranks 8
    and 64, all linear layers or the attention projections only, DoRA and modules_to_save; QLoRA
    (bitsandbytes nf4/fp4/int8 bases) where bitsandbytes runs on this CPU (docs/measure.md, "LoRA
    and QLoRA")."""
    attention_only = {"tiny-llama": ("q_proj", "v_proj"), "tiny-gpt2": ("c_attn",)}
    rows = []
    for model, engine, stage, precision, ckpt, rank, all_linear, extra in (
        ("tiny-llama", "torch", 0, "fp32", "none", 8, True, {}),
        ("tiny-gpt2", "torch", 0, "bf16", "full", 64, False, {}),
        ("tiny-llama", "torch", 0, "bf16", "full", 8, False, {"world": 1, "ddp": False}),
        ("tiny-gpt2", "torch", 1, "fp32", "none", 8, True, {}),
        ("tiny-llama", "torch", 1, "bf16", "full", 64, True, {}),
        ("tiny-llama", "fsdp2", 2, "fp32", "none", 64, False, {}),
        ("tiny-gpt2", "fsdp2", 2, "bf16", "full", 8, True, {}),
        ("tiny-llama", "fsdp2", 3, "bf16", "full", 8, True, {}),
        ("tiny-gpt2", "fsdp2", 3, "fp32", "none", 64, True, {}),
        ("tiny-llama", "fsdp2", 3, "bf16", "none", 8, True, {"world": 8, "simulate": True}),
        ("tiny-llama", "deepspeed", 1, "fp32", "none", 8, True, {}),
        ("tiny-gpt2", "deepspeed", 1, "bf16", "full", 64, False, {}),
        ("tiny-gpt2", "deepspeed", 2, "fp32", "none", 8, True, {"small_buckets": True}),
        ("tiny-llama", "deepspeed", 2, "bf16", "full", 64, True, {}),
        # not small buckets: ZeRO-3 with persistence 0 breaks its prefetch trace on a PEFT model (docs/measure.md)
        ("tiny-llama", "deepspeed", 3, "fp32", "none", 8, False, {}),
        ("tiny-gpt2", "deepspeed", 3, "bf16", "full", 8, True, {}),
    ):
        targets = "all-linear" if all_linear else attention_only[model]
        rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, lora=LoraRow(rank, targets), **extra))
    for model, engine, stage, precision, ckpt, lora, extra in (  # DoRA, modules_to_save, adapter dropout
        ("tiny-llama", "torch", 0, "fp32", "none", LoraRow(8, dora=True), {}),
        ("tiny-gpt2", "fsdp2", 3, "bf16", "full", LoraRow(8, dora=True), {}),
        ("tiny-llama", "deepspeed", 2, "fp32", "none", LoraRow(8, dora=True), {}),
        ("tiny-llama", "torch", 0, "fp32", "none", LoraRow(8, modules_to_save=("lm_head",)), {}),
        ("tiny-llama", "fsdp2", 2, "bf16", "none", LoraRow(8, modules_to_save=("lm_head",)), {}),
        ("tiny-llama", "torch", 0, "fp32", "none", LoraRow(8, dropout=0.1), {"world": 1, "ddp": False}),
    ):
        rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, lora=lora, **extra))
    for model, engine, stage, precision, ckpt, lora, extra in QLORA_ROWS:
        rows.append(Row(model, engine, stage, precision, checkpointing=ckpt, lora=lora, **extra))
    for engine, stage, precision, ckpt, lora in TRAINER_LORA_ROWS:
        rows.append(Row("tiny-llama", engine, stage, precision, checkpointing=ckpt, lora=lora, recipe="hf-trainer"))
    # the QLoRA paper's recipe under the Trainer: paged 8-bit AdamW over the adapters (optim paged_adamw_8bit)
    rows.append(Row("tiny-llama", "torch", 0, "bf16", checkpointing="full", recipe="hf-trainer", optimizer="adam8bit",
                    paged=True, lora=LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16", upcast=True)))
    # adapted experts: peft's ParamWrapper merges each expert stack in every forward (estimate/adapters/experts.py)
    rows.append(Row("qwen3moe-tiny", "torch", 0, "fp32", checkpointing="none", lora=LoraRow(4), world=1, ddp=False))
    # HSDP: fully_shard over a 2-D (dp_replicate, dp_shard) mesh shards the PEFT model as it shards any other
    hsdp = (("dp_replicate", 2),)
    rows.append(Row("tiny-llama", "fsdp2", 3, "fp32", lora=LoraRow(8, "all-linear"), mesh=hsdp, world=4))
    rows.append(Row("tiny-llama", "fsdp2", 2, "bf16", checkpointing="full", lora=LoraRow(8), mesh=hsdp, world=4))
    rows.append(Row("tiny-llama", "fsdp2", 3, "bf16", lora=LoraRow(8, base_precision="nf4", quant_storage="bf16"), mesh=hsdp,
                    world=4, model_init="host"))
    return rows


QLORA_ROWS: tuple = (  # bitsandbytes bases: one rank as the QLoRA scripts run it, and DDP
    ("tiny-llama", "torch", 0, "bf16", "full", LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16"),
     {"world": 1, "ddp": False}),
    ("tiny-llama", "torch", 0, "fp32", "none", LoraRow(8, base_precision="nf4", compute_dtype="fp32"), {"world": 1, "ddp": False}),
    # an fp32 compute dtype under bf16 autocast (issue 23's CPU miss): Linear4bit returns its input's dtype, fp32
    ("tiny-llama", "torch", 0, "bf16", "none", LoraRow(8, base_precision="nf4", compute_dtype="fp32"), {"world": 1, "ddp": False}),
    ("tiny-llama", "torch", 0, "bf16", "full", LoraRow(8, base_precision="nf4", compute_dtype="fp32"),
     {"world": 1, "ddp": False, "micro_batch": 4, "seq_len": 256}),
    ("tiny-gpt2", "torch", 0, "bf16", "none", LoraRow(8, base_precision="fp4", double_quant=True, compute_dtype="bf16"), {}),
    ("tiny-llama", "torch", 0, "fp32", "full", LoraRow(8, base_precision="int8"), {}),
    ("tiny-llama", "torch", 1, "bf16", "none", LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16",
                                                       dora=True), {}),
    ("tiny-llama", "torch", 0, "bf16", "none", LoraRow(8, base_precision="bf16"), {"world": 1, "ddp": False}),
    # sharded 4-bit bases (FSDP-QLoRA, ZeRO-3 + bitsandbytes): packed weights stored as bf16, built on the host
    ("tiny-llama", "fsdp2", 3, "bf16", "none", LoraRow(8, base_precision="nf4", quant_storage="bf16"), {"model_init": "host"}),
    ("tiny-gpt2", "fsdp2", 2, "bf16", "full", LoraRow(8, base_precision="nf4", double_quant=True, quant_storage="bf16"),
     {"model_init": "host"}),
    ("tiny-llama", "deepspeed", 2, "fp32", "none", LoraRow(8, base_precision="nf4", compute_dtype="fp32"), {}),
    ("tiny-llama", "deepspeed", 3, "bf16", "none", LoraRow(8, base_precision="nf4", quant_storage="bf16"), {}),
    # torchao's NF4Tensor (torchtune's QLoRA base, issue 23): one rank, and FSDP2 sharding its data and scalers
    ("tests/data/tiny-llama-nf4.toml", "torch", 0, "bf16", "none", LoraRow(8, base_precision="torchao-nf4"),
     {"world": 1, "ddp": False}),
    ("tests/data/tiny-llama-nf4.toml", "fsdp2", 3, "bf16", "none", LoraRow(8, base_precision="torchao-nf4"),
     {"model_init": "host"}),
    ("tests/data/tiny-llama-nf4.toml", "fsdp2", 2, "bf16", "full", LoraRow(8, base_precision="torchao-nf4"),
     {"model_init": "host"}),
)


TRAINER_LORA_ROWS: tuple = (  # transformers.Trainer given get_peft_model's PeftModel (ids "trainer-lora-...")
    ("torch", 0, "bf16", "full", LoraRow(8)),
    ("deepspeed", 2, "bf16", "none", LoraRow(8)),
    ("deepspeed", 3, "bf16", "full", LoraRow(8)),
    ("deepspeed", 3, "bf16", "none", LoraRow(8)),
    ("fsdp2", 3, "bf16", "none", LoraRow(8)),
    ("torch", 0, "bf16", "none", LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16")),
    # QLoRA as PEFT's and TRL's scripts prepare it (issue 23): prepare_model_for_kbit_training's fp32 embeddings,
    # norms and head, with and without gradient checkpointing; one rank and DDP; with a paged 8-bit optimizer
    ("torch", 0, "bf16", "full", LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16", upcast=True)),
    ("torch", 0, "bf16", "none", LoraRow(8, base_precision="nf4", compute_dtype="bf16", upcast=True)),
    ("torch", 0, "fp32", "full", LoraRow(8, base_precision="nf4", compute_dtype="fp32", upcast=True)),
)


GRID: tuple[Row, ...] = _grid()


def select_rows(
    rows: Sequence[Row], patterns: str | None = None, *, quick: bool = False, skip_deepspeed_offload: bool = False
) -> list[Row]:
    """The rows matching any of the comma-separated `patterns` (a glob on the row id, or a plain
    substring when it has no `*?[`), only the CI slice with `quick`, without the rows that need
    DeepSpeed's cpu_adam build with `skip_deepspeed_offload`."""
    wanted = [p.strip() for p in (patterns or "").split(",") if p.strip()]

    def matches(row: Row) -> bool:
        if not wanted:
            return True
        return any(fnmatch.fnmatchcase(row.id, p) if any(c in p for c in "*?[") else p in row.id for p in wanted)

    chosen = [r for r in rows if matches(r) and (r.quick or not quick) and not (skip_deepspeed_offload and r.needs_cpu_adam)]
    if not chosen:
        raise SpecError(f"rows: no row of the grid matches {patterns!r}" + (" in the --quick slice" if quick else ""))
    return chosen


def row_specs(row: Row, backend: str = "gloo"):
    """(ModelSpec, TrainingSpec) of a row."""
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.spec.training import TrainingSpec

    files = row_files(row)
    model, fields = resolve_model(str(files[0]) if files else row.model), row.training_fields(backend)
    if row.recipe == "hf-trainer" and row.engine == "deepspeed" and not row.small_buckets:
        from zeroplan.importers.deepspeed_json import trainer_filled_buckets

        # the Hugging Face docs' DeepSpeed JSONs say "auto" for these: the Trainer fills them from the model;
        # the JSON the run gives the Trainer has no optimizer section (programs/hf_trainer.py
        # trainer_deepspeed_config), so the Trainer's AdamW is DeepSpeed's client optimizer
        fields["deepspeed"] = {**fields.get("deepspeed", {}), **trainer_filled_buckets(model.hidden_size, row.stage),
                               "client_optimizer": True}
    return model, TrainingSpec(**fields)


def run_backend(row: Row, backend: str) -> str:
    """The backend a row runs on: fake for simulated rows, else the run's (gloo or nccl)."""
    return "fake" if row.simulate else backend


def row_implementation(row: Row) -> str:
    """The model code a row runs: transformers' where installed, simulated rows too (their fake
    tensors run the model as a real run does: zeroplan/measure/fake_hf.py)."""
    return "auto"

