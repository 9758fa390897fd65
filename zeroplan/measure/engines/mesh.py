"""Measure on a device mesh: tensor, sequence and pipeline parallelism composed with FSDP2.

When `training.mesh` is not all ones, `engines.build_runner` hands the model to `build_mesh_runner`
here instead of an engine module. The model is zeroplan's reference model (measure/reference_model.py),
built on the meta device, as torchtitan builds its models before parallelising them; the reference
model is the one whose modules this file can name one by one (the Hugging Face Llama computes its
own causal mask and rotary positions from the whole sequence, which sequence parallelism shards).

What a rank does, in torchtitan's order (torchtitan/models/llama3/infra/parallelize.py
`parallelize_llama`, torchtitan/distributed/pipeline_parallel.py `pipeline_llm`):
- the mesh is `init_device_mesh` over ("pp", "dp_replicate", "dp_shard", "cp", "tp") (torchtitan
  ParallelDims.build_mesh), dp_shard = world / (pp * dp_replicate * cp * tp);
- pipeline: the rank keeps the blocks of its stage(s) (torchtitan's split; stage 0 the embeddings, the
  last stage the final norm and the head), each stage a `PipelineStage`, driven by the schedule;
- tensor parallelism (`apply_tp`): embeddings rowwise, q/k/v and gate/up colwise, o and down
  rowwise, the head colwise; with sequence parallelism the norms are `SequenceParallel` and the
  blocks' inputs are all-gathered (`PrepareModuleInput`); with loss parallelism the head's output
  stays sharded over the vocabulary and the loss runs under `loss_parallel()`;
- FSDP2 (`apply_fsdp`): `fully_shard` on every block, then on the stage's root, over
  ("dp_replicate", "dp_shard") (HSDP when dp_replicate > 1), reshard_after_forward as the ZeRO
  stage says (fsdp2_engine.py);
- then the shards are materialised (`to_empty`, `init_materialized`) and AdamW created;
- context parallelism: torch's ring attention with the CPU kernel added (measure/cp_cpu.py), FSDP2 over
  dp_shard x cp, each rank's head-tail shard of the batch (torchtitan `prepare_context_parallel_input`).
What this does not run (expert parallelism, ...) is refused before the workers start (measure/mesh_rules.py).

Pipeline runs: the worker calls `forward` grad_accum times per step; the micro-batches are the
schedule's (n_microbatches = grad_accum), so `forward` keeps the first ones and runs the whole
schedule (forwards and backwards interleaved) at the last, which is then that step's "forward"
phase; `backward` does nothing. A non-pipeline run follows the worker's phases as FSDP2 does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeroplan.errors import MeasureError
from zeroplan.measure.engines.common import RunContext, TorchOptimizerSteps, gradients, make_optimizer, module_buffers, optimizer_state_tensors
from zeroplan.measure.mesh_rules import MESH_DIMS
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import Precision, TrainingSpec



@dataclass(frozen=True)
class MeshShape:
    """One run's mesh (spec/mesh.py MeshSpec) with dp_shard resolved from the world size."""

    spec: MeshSpec
    dp_shard: int

    def __getattr__(self, name: str):  # tp, pp, pp_schedule, sequence_parallel, ...: the spec's
        return getattr(self.spec, name)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.dp_shard if name == "dp_shard" else getattr(self.spec, name) for name in MESH_DIMS)

    @property
    def dp(self) -> int:
        return self.spec.dp_replicate * self.dp_shard


def mesh_shape(training: TrainingSpec, world_size: int) -> MeshShape | None:
    """The mesh of `training` on `world_size` ranks; None when every degree is one (a plain run)."""
    if training.mesh.is_trivial:
        return None
    return MeshShape(training.mesh, training.mesh.dp_shard(world_size))


def build_device_mesh(shape: MeshShape, ctx: RunContext):
    """The 5-dimensional mesh; under the fake backend built from real tensors (DeviceMesh reads
    its rank layout back with .tolist(), which a fake tensor cannot give)."""
    from torch.distributed.device_mesh import init_device_mesh

    with _real_tensors(ctx):
        return init_device_mesh(ctx.device.type, shape.sizes, mesh_dim_names=MESH_DIMS)


def _real_tensors(ctx: RunContext):
    if not ctx.is_fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@contextlib.contextmanager
def _fake_mesh_concatenation(ctx: RunContext):
    """FSDP2 over a TP-sharded parameter joins the dp and tp meshes (_fsdp_param.py
    `_init_sharding_spec_tp` -> `DeviceMesh._concatenate`), which under FakeTensorMode fails
    ("Please convert all Tensors to FakeTensors first"): run that one call on real tensors."""
    if not ctx.is_fake:
        yield
        return
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes):
        with _real_tensors(ctx):
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


# --- the pieces of the reference model ---------------------------------------------------------

class StageModule(nn.Module):
    """A contiguous slice of the reference model: the embeddings if first, blocks, the final norm
    and the head if last (torchtitan pipeline_parallel.py `pipeline_module_split` keeps the same
    pieces). `forward` takes token ids (first stage) or hidden states and returns hidden states
    or, on the last stage, the logits."""

    def __init__(self, lm: nn.Module, first: int, stop: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self.embed_tokens = lm.embed_tokens if is_first else None
        self.embed_positions = lm.embed_positions if is_first else None
        self.layers = nn.ModuleList(list(lm.layers)[first:stop])
        self.final_norm = lm.final_norm if is_last else None
        self.lm_head = lm.lm_head if is_last else None
        self.rotary = lm.embed_positions is None
        if self.rotary:
            self.register_buffer("inv_freq", lm.inv_freq, persistent=False)
        self.dim_per_head = lm.dim_per_head
        self.seq_len = 0  # the whole sequence's length, set by PipelineRunner for the stages after the first

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed_tokens is not None:
            T = x.shape[1]  # token ids (B, T): the whole sequence, before sequence parallelism shards it
            ids = x
            x = self.embed_tokens(ids)
            if self.embed_positions is not None:
                x = x + self.embed_positions(torch.arange(T, device=ids.device))
        else:
            T = self.seq_len  # hidden states may be sharded over the sequence: the runner says how long it is
        rope = self._rope(T, x.dtype, positions) if self.rotary else None
        for block in self.layers:
            x = block(x, rope)
        if self.lm_head is not None:
            return self.lm_head(self.final_norm(x))
        return x

    def _rope(self, seq: int, dtype: torch.dtype, positions: torch.Tensor | None = None):
        # under context parallelism the rank's tokens are not 0..seq-1: the runner gives their positions (1, seq)
        positions = torch.arange(seq, device=self.inv_freq.device) if positions is None else positions[0]
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, d), as ReferenceCausalLM._rope
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @torch.no_grad()
    def init_materialized(self) -> None:
        for param in self.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param  # a DTensor's shard
            local.normal_(0.0, 0.02)
        if self.rotary:
            d = self.dim_per_head
            self.inv_freq.copy_(1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.inv_freq.device) / d)))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool = True) -> torch.Tensor:
    """ReferenceCausalLM's loss: fp32 logits, labels shifted left and padded with the ignored index
    (`shift=False`: already shifted, as context parallelism shards them: measure/cp_cpu.py `cp_batch`)."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:] if shift else labels
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(0, 1), ignore_index=-100)


def reference_lm(model: nn.Module) -> nn.Module:
    if getattr(model, "hf", True):
        raise MeasureError("implementation: a mesh is measured with zeroplan's reference model; use implementation "
                           "reference (the worker picks it for mesh runs)")
    return model.lm


def stage_ids(shape: MeshShape, pp_rank: int) -> list[int]:
    """The stages a pipeline rank holds: one, or `pp_virtual_stages` looping ones (rank, rank + pp, ...),
    as torchtitan's `generate_llm_fqn_per_model_part` with its "loop" style."""
    return [pp_rank + v * shape.pp for v in range(shape.pp_virtual_stages)]


def split_stages(lm: nn.Module, shape: MeshShape, pp_rank: int) -> list[StageModule]:
    """The rank's stages, blocks split as torchtitan splits them (zeroplan.estimate.parallel.mesh.stage_layers:
    the embedding and the head count as a layer each, distributed/pipeline_parallel.py)."""
    from zeroplan.estimate.parallel.mesh import stage_layers

    counts = stage_layers(len(lm.layers), shape.stages)
    starts = [sum(counts[:s]) for s in range(shape.stages + 1)]
    return [StageModule(lm, starts[s], starts[s + 1], is_first=s == 0, is_last=s == shape.stages - 1)
            for s in stage_ids(shape, pp_rank)]


# --- tensor parallelism ------------------------------------------------------------------------

def apply_tp(module: nn.Module, tp_mesh, shape: MeshShape) -> None:
    """torchtitan's `apply_tp` for Llama on the reference model's names; the attention modules
    are told their local head counts (torchtitan before it viewed with -1:
    `attn_layer.n_heads = attn_layer.n_heads // tp_mesh.size()`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = shape.sequence_parallel
    between = Shard(1) if sp else Replicate()  # the layout of the residual stream between blocks
    outer = {}
    if getattr(module, "embed_tokens", None) is not None:
        outer["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if getattr(module, "lm_head", None) is not None:
        if sp:
            outer["final_norm"] = SequenceParallel()
        outer["lm_head"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if shape.loss_parallel else Replicate(),
            use_local_output=not shape.loss_parallel,
        )
    if getattr(module, "embed_positions", None) is not None:
        raise MeasureError("model: tensor parallelism is measured on Llama-family models (rotary positions)")
    if outer:
        parallelize_module(module, tp_mesh, outer)
    for block in module.layers:
        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if block.mlp.gated:
            plan["mlp.gate_proj"] = ColwiseParallel()
        if sp:
            plan |= {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
        attn = block.attn
        if attn.heads % tp_mesh.size() or attn.kv_heads % tp_mesh.size():
            raise MeasureError(f"training.mesh.tp: {tp_mesh.size()} does not divide {attn.heads} heads and {attn.kv_heads} KV heads")
        attn.heads //= tp_mesh.size()
        attn.kv_heads //= tp_mesh.size()


# --- FSDP2 over the data-parallel dimensions ---------------------------------------------------

def apply_fsdp(module: StageModule, dp_mesh, training: TrainingSpec) -> None:
    """torchtitan `apply_fsdp`: every block; under units split the embeddings and [final norm,
    head] as units of their own (fsdp2_engine.py does the same without a mesh); then the stage's
    root. reshard_after_forward as the ZeRO stage and `training.fsdp2_wrapping` say."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeroplan.spec.program import FSDP2Units

    dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(training.precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    reshard = training.zero_stage == 3
    wrapping = training.fsdp2_wrapping
    blocks = list(module.layers)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=wrapping.reshard_last_block if last else reshard)
    if wrapping.units == FSDP2Units.SPLIT:
        if module.embed_tokens is not None:
            fully_shard(module.embed_tokens, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        if module.lm_head is not None:
            fully_shard([module.final_norm, module.lm_head], mesh=dp_mesh, mp_policy=mp_policy,
                        reshard_after_forward=wrapping.reshard_head)
    fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=wrapping.reshard_root)


def _uses_fsdp(shape: MeshShape, training: TrainingSpec) -> bool:
    # torchtitan parallel_dims.py `fsdp_enabled`: dp_shard > 1 or cp > 1
    return training.engine.value == "fsdp2" and (shape.dp_shard > 1 or shape.cp > 1)


def _dp_mesh(mesh, shape: MeshShape):
    """FSDP2's mesh: torchtitan's "fsdp" dimension, dp_shard and cp flattened into one (CP ranks shard the
    parameters too: parallel_dims.py `build_mesh`), with dp_replicate outside it for HSDP."""
    shard = "dp_shard"
    if shape.cp > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    return mesh["dp_replicate", shard] if shape.dp_replicate > 1 else mesh[shard]


# --- the runners -------------------------------------------------------------------------------

def loss_context(shape: MeshShape):
    """`loss_parallel()` under TP with loss parallelism (torchtitan's default), else nothing."""
    if shape.tp > 1 and shape.loss_parallel:
        return counted_loss_parallel()
    return contextlib.nullcontext()


@contextlib.contextmanager
def counted_loss_parallel():
    """`loss_parallel()` with its handlers counted by the accounting (accounting.py `counted_inside`):
    DTensor runs them with the accounting's mode off, and they allocate several logits-sized fp32
    shards beside the output it would see (torch/distributed/tensor/parallel/loss.py `_log_softmax`:
    `x - x_max` and its exp; `_nll_loss_and_log_softmax_backward`: zeros_like, exp, the sum and the
    product). The handlers are those loss_parallel() registers (`customized_loss_ops`), in
    DTensor's table of custom handlers, which loss_parallel() itself edits. Each handler first runs
    the op on fake tensors of the global shape to learn its output's metadata (`_propagate_tensor_meta`,
    under the run's own fake mode in a simulated run): that holds no memory and is not counted."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    from zeroplan.measure.accounting import counted_inside, uncounted

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagate = propagator._propagate_tensor_meta

    def propagate_uncounted(*args, **kwargs):
        with uncounted():
            return propagate(*args, **kwargs)

    with loss_parallel():
        handlers = DTensor._op_dispatcher._custom_op_handlers
        originals = {op: handlers[op] for op in customized_loss_ops}
        handlers.update({op: counted_inside(handler) for op, handler in originals.items()})
        propagator._propagate_tensor_meta = propagate_uncounted
        try:
            yield
        finally:
            del propagator._propagate_tensor_meta  # the class's method again
            handlers.update(originals)  # loss_parallel() then removes them as it registered them

def _parallelize(modules: list[nn.Module], mesh, shape: MeshShape, training: TrainingSpec, ctx: RunContext) -> None:
    dp_mesh = _dp_mesh(mesh, shape) if _uses_fsdp(shape, training) else None
    with _fake_mesh_concatenation(ctx):
        for module in modules:
            if shape.tp > 1:
                apply_tp(module, mesh["tp"], shape)
            if dp_mesh is not None:
                apply_fsdp(module, dp_mesh, training)
    for module in modules:
        if any(p.is_meta for p in module.parameters()):  # torchtitan: init on meta, shard, then materialise
            module.to_empty(device=ctx.device)
            module.init_materialized()


def _held_tensors(modules: list[nn.Module], optimizer, shape: MeshShape, training: TrainingSpec) -> dict[str, list]:
    if _uses_fsdp(shape, training):
        from zeroplan.measure.engines.fsdp2_engine import fsdp2_tensors

        held: dict[str, list] = {}
        for module in modules:
            for category, tensors in fsdp2_tensors(module, None).items():
                held.setdefault(category, []).extend(tensors)
        held["optimizer_states"] = optimizer_state_tensors(optimizer)
        return held
    params = [p for module in modules for p in module.parameters()]
    return {
        "params": params,
        "grads": gradients(params),
        "optimizer_states": optimizer_state_tensors(optimizer),
        "buffers": [b for module in modules for b in module_buffers(module)],
    }


def _param_groups(modules: list[nn.Module]) -> list[dict]:
    """DTensors and plain tensors in groups of their own: without sequence parallelism the norms stay
    plain tensors, and one fused/foreach AdamW step over both fails ("aten._fused_adamw_.default got
    mixed torch.Tensor and DTensor"); the optimizer steps each group on its own, the same bytes."""
    from torch.distributed.tensor import DTensor

    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


class TensorParallelRunner(TorchOptimizerSteps):
    """TP/SP (and FSDP2 over dp) without pipelining: the worker's forward/backward/step."""

    def __init__(self, model: nn.Module, training: TrainingSpec, ctx: RunContext, shape: MeshShape, mesh):
        lm = reference_lm(model)
        self.model, self.shape, self.training = model, shape, training
        self.grad_accum, self._micro = training.grad_accum, 0
        self.stage = StageModule(lm, 0, len(lm.layers), is_first=True, is_last=True)
        _parallelize([self.stage], mesh, shape, training, ctx)
        self.optimizer = make_optimizer(_param_groups([self.stage]), training)
        self.cp_mesh = mesh["cp"] if shape.cp > 1 else None
        if self.cp_mesh is not None:  # torch's ring attention, its CPU kernel added (measure/cp_cpu.py)
            from zeroplan.measure.cp_cpu import enable_cpu_ring_attention

            enable_cpu_ring_attention(self.cp_mesh)

    def _loss_context(self):
        return loss_context(self.shape)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if _uses_fsdp(self.shape, self.training):
            self.stage.set_requires_gradient_sync(self._syncs())
        if self.cp_mesh is not None:  # this rank's head-tail shard of the sequence, as torchtitan's trainer
            from zeroplan.measure.cp_cpu import cp_batch

            input_ids, labels, positions = cp_batch(self.cp_mesh, input_ids, labels)
            with self._loss_context():
                return causal_lm_loss(self.stage(input_ids, positions), labels, shift=False)
        with self._loss_context():
            return causal_lm_loss(self.stage(input_ids), labels)

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_context():  # loss_parallel must also cover the loss's backward (its docstring)
            super().backward(loss)

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return _held_tensors([self.stage], self.optimizer, self.shape, self.training)


_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


class PipelineRunner:
    """Pipeline stages (each with TP and FSDP2 as the mesh says) driven by a torch.distributed.pipelining schedule."""

    def __init__(self, model: nn.Module, training: TrainingSpec, ctx: RunContext, shape: MeshShape, mesh):
        from torch.distributed import pipelining

        lm = reference_lm(model)
        self.shape, self.training = shape, training
        pp_mesh = mesh["pp"]
        pp_rank = pp_mesh.get_local_rank()
        self.is_first, self.is_last = pp_rank == 0, pp_rank == shape.pp - 1
        self.stages = split_stages(lm, shape, pp_rank)
        _parallelize(self.stages, mesh, shape, training, ctx)
        group = pp_mesh.get_group()
        pipeline_stages = [
            pipelining.PipelineStage(module, stage_id, shape.stages, ctx.device, group=group)
            for module, stage_id in zip(self.stages, stage_ids(shape, pp_rank))
        ]
        if shape.pp_schedule.value not in _SCHEDULES:
            raise MeasureError(f"training.mesh.pp_schedule: {shape.pp_schedule.value} is not measured; use one of {', '.join(_SCHEDULES)}")
        schedule_class = getattr(pipelining, _SCHEDULES[shape.pp_schedule.value])
        single = shape.pp_virtual_stages == 1 and not shape.pp_schedule.looped
        self.schedule = schedule_class(pipeline_stages[0] if single else pipeline_stages,
                                       n_microbatches=training.grad_accum, loss_fn=self._loss)
        self.optimizer = make_optimizer(_param_groups(self.stages), training)
        self._inputs: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def _loss_context(self):
        return loss_context(self.shape)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # torchtitan rescale_accumulated_loss: each micro-batch's loss divided by their number
        return causal_lm_loss(logits, labels) / self.training.grad_accum

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._inputs.append(input_ids)
        self._labels.append(labels)
        if len(self._inputs) < self.training.grad_accum:
            return torch.zeros(())
        inputs, targets = torch.cat(self._inputs), torch.cat(self._labels)
        for stage in self.stages:
            stage.seq_len = inputs.shape[1]
        self._inputs, self._labels = [], []
        losses: list[torch.Tensor] = []
        with self._loss_context():  # torchtitan enters loss_parallel around the whole schedule step
            if self.is_first:
                self.schedule.step(inputs, target=targets if self.is_last else None, losses=losses)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
        del inputs, targets, losses
        return torch.zeros(())

    def backward(self, loss: torch.Tensor) -> None:
        """Nothing: the schedule ran every backward in `forward`."""

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return _held_tensors(self.stages, self.optimizer, self.shape, self.training)


def build_mesh_runner(model: nn.Module, training: TrainingSpec, ctx: RunContext, shape: MeshShape):
    mesh = build_device_mesh(shape, ctx)
    if shape.pp > 1:
        return PipelineRunner(model, training, ctx, shape, mesh)
    return TensorParallelRunner(model, training, ctx, shape, mesh)
