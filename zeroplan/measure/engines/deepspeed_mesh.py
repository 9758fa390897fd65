"""DeepSpeed on a mesh (issue 14): AutoTP training (`tensor_parallel.autotp_size`, ZeRO 0-2) and
Ulysses sequence parallelism (`sequence_parallel_size`), on the Hugging Face model, in zeroplan's loop.

AutoTP (deepspeed/runtime/engine.py `_apply_autotp_partitioning`) shards the linears the model's
Hugging Face tp_plan names (Llama: q/k/v and gate/up colwise, o and down rowwise, lm_head colwise with
its output gathered) inside `deepspeed.initialize`; the embedding and the norms stay whole. Its
first forward checks that every rank of a TP group was fed the same batch (engine.py
`check_dataloader_inputs_same_across_ranks`: "Data inconsistency within the TP group"), so the
runner broadcasts the batch from the group's first rank, in place.

Ulysses (deepspeed/runtime/sequence_parallel/ulysses_sp.py `UlyssesSPAttentionHF.register_with_transformers`,
DeepSpeed's documented path for Hugging Face models) swaps the attention for an all-to-all around the
core SDPA. Each rank of a sequence-parallel group runs its slice of one sequence, with its position ids
and its slice of the labels shifted once over the whole sequence (`UlyssesSPDataLoaderAdapter`:
`shift_labels`). ZeRO partitions over the sequence-data-parallel group (engine.py `seq_data_parallel_group`).

What is refused, before any worker starts (`refuse_unmeasurable`), and what runs: docs/measure.md,
"DeepSpeed AutoTP and Ulysses"; the estimate's terms: docs/engines/deepspeed.md, "AutoTP and Ulysses".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.errors import MeasureError
from zeroplan.importers.deepspeed_mesh import batch_ranks, mesh_section
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

if TYPE_CHECKING:
    import torch

    from zeroplan.measure.engines.common import RunContext


def is_deepspeed_mesh(training: TrainingSpec) -> bool:
    """A DeepSpeed run with tp or cp above one: this module runs it, not measure/engines/mesh.py."""
    return training.engine.value == "deepspeed" and not training.mesh.is_trivial


def refuse_unmeasurable(model: TransformerSpec, training: TrainingSpec) -> None:
    """Raise MeasureError for a DeepSpeed mesh this module does not run (spec/mesh.py already refuses
    pp, ep, dp_replicate and tp with ZeRO-3 for DeepSpeed)."""
    mesh = training.mesh
    if mesh.tp > 1 and mesh.cp > 1:
        raise MeasureError("mesh: DeepSpeed AutoTP and Ulysses together are not measured; measure tp or cp alone")
    if training.recipe.value != "plain":
        raise MeasureError(f"recipe: a DeepSpeed mesh is measured in zeroplan's loop (plain), not {training.recipe.value}")
    if training.program.loss.value != "standard":
        raise MeasureError(f"loss: {training.program.loss.value} is not measured on a DeepSpeed mesh; use --loss standard")
    if training.program.model_init.value not in ("device", "host"):
        raise MeasureError("model_init: AutoTP and Ulysses need the whole model built before deepspeed.initialize "
                           "(device or host)")
    if training.program.activation_offload.value != "none":
        raise MeasureError("activation_offload: activation offload is not measured on a DeepSpeed mesh")
    if training.checkpointing.value != "none":
        raise MeasureError("checkpointing: checkpointing is not measured on a DeepSpeed mesh; use --checkpointing none")
    if mesh.cp > 1 and training.attention.value != "fused":
        # ulysses_sp.py register_with_transformers: "eager attn_implementation isn't currently supported"
        raise MeasureError("attention: Ulysses needs SDPA (eager keeps a 4-D mask); use --attention fused")
    if model.position_embedding != "rotary":
        raise MeasureError("model: a DeepSpeed mesh is measured on Llama-family models (rotary positions)")


class DeepSpeedMeshRunner:
    """`deepspeed.initialize` over the Hugging Face module with AutoTP or Ulysses switched on."""

    def __init__(self, model: torch.nn.Module, training: TrainingSpec, ctx: RunContext):
        import zeroplan.measure.engines.deepspeed_engine as deepspeed_engine

        if ctx.is_fake:
            raise MeasureError("engine deepspeed cannot run under --simulate (it needs real tensors); use --engine fsdp2")
        deepspeed_engine.prepare_environment(ctx)
        deepspeed = deepspeed_engine.import_deepspeed()
        config = deepspeed_engine.deepspeed_config(training, ctx) if ctx.engine_config is None \
            else deepspeed_engine.user_config(ctx.engine_config, training, ctx.world_size)
        config.update(mesh_section(training))
        config["train_batch_size"] = training.micro_batch * training.grad_accum * ctx.world_size // batch_ranks(training)
        mesh = training.mesh
        self.model = model  # the workload's CausalLM; DeepSpeed wraps the Hugging Face module inside it
        self.training = training
        self.grad_accum = int(config["gradient_accumulation_steps"])
        self._micro = 0
        mpu = None
        if mesh.cp > 1:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            deepspeed.init_distributed(dist_backend="nccl" if ctx.is_cuda else "gloo")
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model.lm, core_attn_implementation="sdpa", sequence_parallel_size=mesh.cp,
                micro_batch_size=training.micro_batch, seq_length=training.seq_len, seq_length_is_variable=False)
        trainable = [p for p in model.lm.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model.lm, model_parameters=trainable, config=config, mpu=mpu)
        self._group, self._source = self._batch_group(mpu)

    def _batch_group(self, mpu):
        """The process group whose ranks must draw one batch, and its first rank (global)."""
        import torch.distributed as dist
        from deepspeed.utils import groups

        group = mpu.get_sequence_parallel_group() if mpu is not None else groups.get_tensor_model_parallel_group()
        return group, dist.get_global_rank(group, 0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        dist.broadcast(input_ids, src=self._source, group=self._group)  # one batch per group, in place
        cp = self.training.mesh.cp
        if cp == 1:
            return self.engine(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        # UlyssesSPDataLoaderAdapter: labels shifted over the whole sequence (-100 past its end), then sliced
        shift = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
        local = input_ids.shape[1] // cp
        start = dist.get_rank(self._group) * local
        piece = slice(start, start + local)
        positions = torch.arange(start, start + local, device=input_ids.device).unsqueeze(0)
        return self.engine(input_ids=input_ids[:, piece], position_ids=positions, labels=input_ids[:, piece],
                           shift_labels=shift[:, piece].contiguous(), use_cache=False).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself (engine.backward)
        self._micro += 1
        if self._micro < self.grad_accum:
            self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter

    def step(self) -> None:
        self.engine.step()
        self._micro = 0

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        from zeroplan.measure.engines.deepspeed_engine import deepspeed_tensors

        return deepspeed_tensors(self.engine, self.model)


def build_runner(model: torch.nn.Module, training: TrainingSpec, ctx: RunContext) -> DeepSpeedMeshRunner:
    return DeepSpeedMeshRunner(model, training, ctx)
