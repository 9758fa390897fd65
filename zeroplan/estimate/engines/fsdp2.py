"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), one unit per transformer block plus the
root (embeddings, final norm, output head), as zeroplan's measure mode wraps a model.

Read from torch/distributed/fsdp/_fully_shard/ (torch 2.13):
- `_fsdp_param.py` FSDPParam: each parameter is sharded on dim 0, padded to a multiple of the
  world size (`_sharded_param_data` holds ceil(rows/N) rows on every rank); the local shard seen
  by the optimizer is the unpadded chunk, largest on rank 0.
- `_fsdp_collectives.py` foreach_all_gather / foreach_all_gather_copy_out: a flat all-gather
  output of the unit's padded size in param_dtype, copied out into per-parameter unsharded
  tensors: both are alive while copying (2 x unit), then the flat buffer is freed.
- foreach_reduce: unsharded gradients (param_dtype) are copied into a reduce-scatter input of
  the unit's padded size in reduce_dtype, freed, and the reduce-scatter output (one shard) becomes
  the sharded .grad (views into it).
- `_fully_shard.py`: reshard_after_forward=True frees the unsharded parameters after each unit's
  forward and re-gathers them in backward (ZeRO-3); False keeps them until the unit's
  post-backward (ZeRO-2). An explicitly passed value applies to the root too; only `None` makes
  the root keep its parameters (`_fsdp_state.py` _lazy_init).
- CPUOffloadPolicy: sharded parameters, sharded gradients and the optimizer step live on the host;
  each all-gather first copies the unit's shards to the device.
- MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): shards stay fp32, gathers are bf16,
  gradients are reduced and kept in fp32.
The root's unsharded gradients (the output head's first) are alive from the start of backward
until the root's post-backward at the very end.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import (
    EngineEstimate,
    Point,
    Setup,
    ceil_div,
    early_gradients,
    largest_point,
    phase,
    step_temporary_bytes,
)
from zeroplan.estimate.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.spec.program import GradSync, ModelInit
from zeroplan.spec.training import Device, Offload, Precision


def _padded_shard(numel: int, rows: int, world: int) -> int:
    return ceil_div(rows, world) * (numel // rows)


def _shards(facts: ModelFacts, n: int) -> tuple[int, int, int, int, int, int, int]:
    """Per-rank padded elements: root unit, largest block, all, trainable, largest trainable
    tensor, one block's trainable, the root's trainable."""

    def shard_elems(group) -> int:
        return sum(_padded_shard(t.numel, t.rows, n) for t in group.tensors)

    # The root unit holds every non-block group (embeddings, final norm, output head).
    root = sum(shard_elems(g) for g in facts.groups if g.role != "block")
    block = max((shard_elems(g) for g in facts.groups if g.role == "block"), default=0)
    total = sum(shard_elems(g) * g.count for g in facts.groups)
    trainable = sum(shard_elems(g) * g.count for g in facts.groups if not g.frozen)
    largest = max((_padded_shard(t.numel, t.rows, n) for g in facts.groups if not g.frozen for t in g.tensors), default=0)
    block_trainable = max((shard_elems(g) for g in facts.groups if g.role == "block" and not g.frozen), default=0)
    root_trainable = sum(shard_elems(g) for g in facts.groups if g.role != "block" and not g.frozen)
    return root, block, total, trainable, largest, block_trainable, root_trainable


class _Sizes(NamedTuple):
    """Bytes per rank that do not depend on the activations (cached: the planner asks for the same
    configuration at many micro-batches)."""

    num_blocks: int
    offloaded: bool
    sharded_params: int
    sharded_grads: int
    states: int
    temporaries: int
    root_gathered: int
    block_gathered: int
    head_grads: int
    tied_grad: int
    first_grads: int
    root_grads: int
    block_grads: int
    block_shard_grads: int
    block_reduce_in: int
    root_reduce_in: int
    h2d_copy: int
    reshard: bool
    root_reshards: bool
    held_blocks: int
    held_grads: int
    accum_root: int
    accum_block: int
    kept_shards: int  # grad_sync every: the sharded gradients reduced by earlier micro-batches
    init_params: int  # the set-up's peak, by where the model was when fully_shard took it (`_init_params`)
    host_bytes: int  # per rank, offloaded to the host
    padding_note: str | None  # `_padding_note`


@memo(maxsize=4096)  # measured: a warm FSDP2 plan takes 14% longer without it
def _sizes(facts: ModelFacts, setup: Setup) -> _Sizes:
    n, precision, device, optimizer = setup.gpus, setup.precision, setup.device, setup.optimizer
    storage = HALF_BYTES if precision == Precision.PURE_BF16 else FP32_BYTES
    gathered = FP32_BYTES if precision == Precision.FP32 else HALF_BYTES
    reduce = storage  # reduce_dtype fp32 under mixed precision, the model dtype otherwise
    offloaded = setup.offload_optimizer == Offload.CPU
    on_device = not offloaded or device == Device.CPU  # a CPU run has one memory

    root_shard, block_shard, shard_total, trainable_shard, largest_local, block_train, root_train = _shards(facts, n)
    head_numel, tied_numel, first_numel = early_gradients(facts)
    num_blocks = sum(g.count for g in facts.groups if g.role == "block")

    sharded_params = shard_total * storage if on_device else 0
    # foreach_reduce: the reduce-scatter output (padded shard, reduce dtype, cast to the
    # parameter dtype) is the storage of the sharded .grad views.
    sharded_grads = trainable_shard * storage if on_device else 0
    block_shard_grads = block_train * storage if on_device else 0
    states = optimizer_state_bytes(trainable_shard, optimizer, storage) if on_device else 0
    temporaries = (step_temporary_bytes(largest_local, trainable_shard, storage, optimizer, setup.program.optimizer_impl)
                   if on_device else 0)
    root_gathered = root_shard * n * gathered  # the root's all-gather output, or its unsharded parameters
    block_gathered = block_shard * n * gathered
    # Autograd writes unsharded gradients in the unsharded parameters' dtype (param_dtype).
    head_grads = head_numel * gathered
    tied_grad = tied_numel * gathered
    first_grads = first_numel * gathered
    root_grads = root_train * n * gathered
    block_grads = block_train * n * gathered  # one block's unsharded gradients
    block_reduce_in = block_train * n * reduce  # foreach_reduce's reduce_scatter_input (reduce dtype)
    root_reduce_in = root_train * n * reduce
    h2d_copy = 0 if on_device else max(root_shard, block_shard) * storage

    reshard = setup.zero_stage == 3
    root_reshards = reshard if setup.reshard_root is None else setup.reshard_root
    # Blocks whose unsharded parameters are held while block `i` runs: itself under ZeRO-3; under
    # ZeRO-2 (reshard_after_forward=False) every block from the forward until its post-backward.
    held_blocks = 1 if reshard else num_blocks

    # Gradient accumulation (set_requires_gradient_sync(False) before the last micro-batch):
    # post_backward skips the reduce-scatter and keeps each unsharded gradient as
    # FSDPParam.unsharded_accumulated_grad in the reduce dtype (to_accumulated_grad_if_needed),
    # so the last micro-batch starts with the whole model's unsharded gradients; its
    # post-backwards reduce-scatter and free them block by block.
    holding = setup.accumulating and setup.program.grad_sync == GradSync.LAST
    accum_root = root_train * n * reduce if holding else 0
    accum_block = block_train * n * reduce if holding else 0
    # Reducing every micro-batch (torchtitan, torchtune): foreach_reduce adds each new reduce-scatter
    # output into the existing sharded .grad (`_fsdp_collectives.py`, to_accumulate_grad), so the last
    # micro-batch starts with every sharded gradient and adds none.
    kept_shards = sharded_grads if setup.accumulating and not holding else 0
    held_grads = accum_root + num_blocks * accum_block + kept_shards
    host_bytes = 0
    if offloaded:
        host_bytes = shard_total * storage + trainable_shard * reduce + optimizer_state_bytes(trainable_shard, optimizer, storage)
    return _Sizes(num_blocks, offloaded, sharded_params, sharded_grads, states, temporaries, root_gathered, block_gathered,
                  head_grads, tied_grad, first_grads, root_grads, block_grads, block_shard_grads, block_reduce_in,
                  root_reduce_in, h2d_copy, reshard, root_reshards, held_blocks, held_grads, accum_root, accum_block,
                  kept_shards, _init_params(facts, setup, storage, on_device, sharded_params, block_shard, root_shard),
                  host_bytes, _padding_note(facts, n, shard_total))


def _init_params(facts: ModelFacts, setup: Setup, storage: int, on_device: bool, sharded_params: int,
                 block_shard: int, root_shard: int) -> int:
    """Parameter bytes at the set-up's peak, by where the model is when `fully_shard` takes it.

    meta (torchtitan): only this rank's shards are ever allocated (`to_empty`). device: the whole
    model, built on the GPU, plus the first block's shards (`FSDPParam._init_sharded_param` copies
    them before the block's whole parameters are dropped); a CPU run builds on the host, the same
    memory. host (accelerate `fsdp2_prepare_model`): `_fully_shard.py` `_move_states_to_device`
    moves one unit at a time to the GPU and shards it there: the shards done, plus one unit whole.
    """
    init = setup.program.model_init
    shard = storage if on_device else 0  # offloaded shards go to the host (CPUOffloadPolicy)
    if init == ModelInit.META:
        return sharded_params
    block_whole = max((g.params for g in facts.groups if g.role == "block"), default=0) * storage
    root_whole = sum(g.params for g in facts.groups if g.role != "block") * storage
    num_blocks = sum(g.count for g in facts.groups if g.role == "block")
    if init == ModelInit.DEVICE or setup.device == Device.CPU:
        whole = block_whole * num_blocks + root_whole
        # the last unit, the root: every block's shards, the root whole and its shards
        return max(whole + block_shard * shard, num_blocks * block_shard * shard + root_whole + root_shard * shard)
    return max((num_blocks - 1) * block_shard * shard + block_whole + block_shard * shard,
               num_blocks * block_shard * shard + root_whole + root_shard * shard)


def estimate_fsdp2(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    z = _sizes(facts, setup)
    # The forward and backward moments are the same in every step; only the states differ.
    forward = _forward(acts, z)
    backward = _backward(acts, z)
    phases: list[PhaseBytes] = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, z.states)):
        base = dict(params=z.sharded_params, optimizer_states=held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, params=z.init_params))
        phases.append(phase(step, Phase.FORWARD, **base, **forward))
        phases.append(phase(step, Phase.BACKWARD, **base, **backward))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, params=z.sharded_params, grads=z.sharded_grads,
                            optimizer_states=z.states, temporaries=z.temporaries))
    host = 0
    notes = []
    padding = z.padding_note
    if padding:
        notes.append(padding)
    if z.offloaded:
        host = z.host_bytes * setup.node_gpus
        if setup.offload_params != setup.offload_optimizer:  # one policy, fully_shard(offload_policy=...)
            notes.append("fsdp2: CPUOffloadPolicy keeps the parameter and gradient shards on the host with the optimizer "
                         "states, so offload_params follows offload_optimizer")
        if setup.device == Device.CPU:
            notes.append(f"CPU run: the {z.host_bytes:,} offloaded bytes per rank share the one memory; on GPUs they sit on the host")
    return EngineEstimate(tuple(phases), NodeBytes(cpu_bytes=host, pinned_bytes=0 if setup.device == Device.CPU else host), tuple(notes))


def _padding_note(facts: ModelFacts, n: int, padded: int) -> str | None:
    """A warning when dim-0 padding (`_padded_shard`) makes the shards much larger than an even
    split: tensors with fewer rows than ranks, e.g. Mixtral's expert tensors (8 experts on dim 0)
    on 64 ranks, where each rank holds 1/8 of every expert tensor and gathers 8x its size."""
    even = ceil_div(facts.total_params, n)
    if padded <= 1.25 * even:
        return None
    rows = min((t.rows for g in facts.groups for t in g.tensors), default=0)
    return (f"FSDP2 shards each tensor on dim 0, padded to a multiple of {n} ranks: with tensors of as few as {rows} rows "
            f"each rank holds {padded / even:.1f}x an even share ({padded:,} elements instead of {even:,}), and gathers "
            f"as much more; shard those tensors on another dim (fully_shard's shard_placement_fn) or use fewer ranks per "
            f"FSDP group")


def _forward(acts: ActivationBytes | None, z: _Sizes) -> Point:
    """The largest moment of the forward pass: while block i copies out, the previous unit's
    all-gather output is still held (`FSDPParamGroup.wait_for_unshard`); the moments are in
    docs/engines/fsdp2.md ("Forward")."""
    num_blocks, reshard, held_grads, h2d_copy = z.num_blocks, z.reshard, z.held_grads, z.h2d_copy
    root_gathered, block_gathered = z.root_gathered, z.block_gathered
    earlier = 0 if reshard else max(num_blocks - 1, 0)  # unsharded blocks before the last
    acts_before_last = acts.embedding + max(num_blocks - 1, 0) * acts.saved_per_block if acts else 0
    points = [
        dict(buffers=2 * root_gathered + h2d_copy, grads=held_grads, activations=acts.embedding if acts else 0),
        dict(buffers=2 * root_gathered + 2 * block_gathered + h2d_copy, grads=held_grads,
             activations=acts.embedding if acts else 0),
    ]
    if num_blocks > 1:
        points.append(dict(buffers=root_gathered + (earlier + 3) * block_gathered + h2d_copy, grads=held_grads,
                           activations=acts_before_last))
    if acts is not None:
        held_at_end = num_blocks if not reshard else 1
        points += [
            dict(buffers=root_gathered + (held_at_end + 1) * block_gathered, grads=held_grads,
                 activations=acts.blocks_end_peak),
            dict(buffers=root_gathered + (held_at_end - (1 if reshard else 0) + 1) * block_gathered,
                 grads=held_grads, activations=acts.forward_peak),
        ]
    return largest_point(*points)


def _backward(acts: ActivationBytes | None, z: _Sizes) -> Point:
    """The largest moment of the backward pass: its start, the loss's backward, blocks j in
    {0, 1, L-2, L-1} (the terms are linear in j between the ends), the end; what each holds is
    in docs/engines/fsdp2.md ("Backward")."""
    num_blocks, reshard, held_blocks, held_grads, h2d_copy = z.num_blocks, z.reshard, z.held_blocks, z.held_grads, z.h2d_copy
    root_gathered, block_gathered, tied_grad, head_grads = z.root_gathered, z.block_gathered, z.tied_grad, z.head_grads
    block_grads, block_shard_grads, block_reduce_in = z.block_grads, z.block_shard_grads, z.block_reduce_in
    accum_root, accum_block = z.accum_root, z.accum_block

    def shards_done(j: int) -> int:
        """Sharded gradients present while block j (from the last) runs its backward."""
        return z.kept_shards or j * block_shard_grads

    points = []
    acts_start = acts.forward_end if acts else 0
    if z.root_reshards and reshard:
        points.append(dict(buffers=2 * root_gathered + h2d_copy, grads=held_grads, activations=acts_start))
    if acts is not None:
        # Saved tensors are activations; what backward allocates (the logits' gradients, the
        # recomputed block, gradients in flight, a tied head's pending gradient) is temporaries.
        loss_buffers = root_gathered + block_gathered * (held_blocks if not reshard else 1) + h2d_copy
        points.append(dict(buffers=loss_buffers, grads=held_grads, activations=acts.forward_end,
                           temporaries=acts.logits_grad))
        # lm_head's backward: the logits' gradient, the head weight's unsharded gradient (a tied
        # one still pending in autograd), the gradient of the final norm's output.
        points.append(dict(buffers=loss_buffers, grads=held_grads + head_grads, activations=acts.head_backward_saved,
                           temporaries=acts.head_backward_temporary + tied_grad))
    visits = acts.backward_blocks() if acts else [j for j in sorted({0, 1, num_blocks - 2, num_blocks - 1}) if 0 <= j < num_blocks]
    for j in visits:
        blocks_held = 1 if reshard else num_blocks - j
        prefetch = block_gathered if reshard and j < num_blocks - 1 else 0
        buffers = root_gathered + blocks_held * block_gathered + prefetch + (block_reduce_in if j else 0) + h2d_copy
        points.append(dict(
            buffers=buffers,
            grads=accum_root + (num_blocks - j) * accum_block + head_grads + z.first_grads + shards_done(j),
            activations=acts.block_backward_saved(num_blocks - j) if acts else 0,
            temporaries=(acts.block_backward_temporary_at(num_blocks - j) if acts else 0) + tied_grad,
        ))
        # The end of the block's backward, before its post-backward: every unsharded gradient of
        # the block, its saved tensors gone, the gradient of its input in flight.
        end_acts = acts.blocks_left_saved(num_blocks - j - 1) if acts else 0
        in_flight = (acts.block_input_grad if acts else 0) + tied_grad
        points.append(dict(
            buffers=buffers,
            grads=accum_root + (num_blocks - j) * accum_block + head_grads + block_grads + shards_done(j),
            activations=end_acts,
            temporaries=in_flight,
        ))
        # Its post_backward: the gradients move from .grad into a list, the block reshards, the
        # previous reduce-scatter input is dropped, and foreach_reduce allocates this block's
        # (in the reduce dtype: twice the gradients' bytes under bf16 mixed precision) and copies
        # them in before freeing them.
        points.append(dict(
            buffers=root_gathered + (blocks_held - 1) * block_gathered + prefetch + block_reduce_in + h2d_copy,
            grads=accum_root + (num_blocks - j - 1) * accum_block + head_grads + shards_done(j),
            activations=end_acts,
            # the list holds the accumulated gradients when accumulating (the fresh ones were added in)
            temporaries=in_flight + (accum_block or block_grads),
        ))
    blocks_done = z.kept_shards or num_blocks * block_shard_grads
    # The embedding's backward, the last before the root's post-backward: its weight gradient
    # (aten embedding_dense_backward). A tied weight's two gradients meet in autograd's input
    # buffer, which adds them out of place (torch/csrc/autograd/input_buffer.cpp accumulate):
    # the head's pending gradient, the embedding's and their sum are alive together, none a
    # .grad yet.
    points.append(dict(buffers=root_gathered + (block_reduce_in if num_blocks else 0),
                       grads=accum_root + z.root_grads - tied_grad + blocks_done,
                       temporaries=3 * tied_grad))
    # foreach_reduce copies the root's unsharded gradients into its reduce-scatter input and
    # frees them (`unsharded_grads.clear()`) before allocating the reduce-scatter output.
    points.append(dict(buffers=z.root_reduce_in, grads=accum_root + blocks_done + z.root_grads))
    # Then the reduce-scatter into the root's shard (smaller). gloo's copy of the whole input
    # is not modelled (NCCL makes none): docs/engines/fsdp2.md ("What is not modelled").
    return largest_point(*points)
