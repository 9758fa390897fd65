"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), one unit per transformer block, and outside
them either the root (embeddings, final norm, output head: zeroplan's measure loop, torchtune) or,
under `fsdp2.units` split, the embeddings alone and [final norm, head] as one unit not resharded
after forward, the root empty (accelerate `fsdp2_prepare_model`, torchtitan `apply_fsdp`).

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
  gradients are reduced and kept in fp32. accelerate's policy (the Trainer's) reduces in bf16:
  `_reduce_element_bytes`.
Under units root the root's unsharded gradients (the output head's first) are alive from the start
of backward until the root's post-backward at the very end; under split the head's unit reduces
them in its own post-backward, before the blocks' backward.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.activations.transformer import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FLOAT8_BYTES, FP32_BYTES, HALF_BYTES, optimizer_state_bytes
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
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import named, register, relabel
from zeroplan.spec.program import FSDP2Units, GradSync, ModelInit, Recipe, fsdp2_reduces_in_param_dtype
from zeroplan.spec.training import Device, Offload, Precision

_FSDP = "torch/distributed/fsdp/_fully_shard/"
register({
    "sharded parameters": f"{_FSDP}_fsdp_param.py FSDPParam._sharded_param_data",
    "unsharded parameters": f"{_FSDP}_fsdp_collectives.py foreach_all_gather_copy_out",
    "unsharded float8 weights": "torchao/float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor fsdp_pre_all_gather, "
                                "fsdp_post_all_gather (docs/engines/programs.md, float8)",
    "sharded gradients": f"{_FSDP}_fsdp_collectives.py foreach_reduce (the reduce-scatter output)",
    "unsharded gradients": "torch/csrc/autograd (the gradients of unsharded parameters, before their post-backward)",
    "accumulated unsharded gradients": f"{_FSDP}_fsdp_param.py to_accumulated_grad_if_needed",
    "shards copied to the device (CPU offload)": f"{_FSDP}_fsdp_param.py CPUOffloadPolicy (each all-gather copies the shards in)",
    "parameters before sharding": f"{_FSDP}_fully_shard.py _move_states_to_device (docs/engines/fsdp2.md, Set-up)",
    "offloaded shards, gradients and states": f"{_FSDP}_fsdp_api.py CPUOffloadPolicy",
})
register({  # one flat buffer per unit and collective (estimate/terms.py PIECES)
    "all-gather output": f"{_FSDP}_fsdp_collectives.py foreach_all_gather; _fsdp_param_group.py wait_for_unshard",
    "reduce-scatter input": f"{_FSDP}_fsdp_collectives.py foreach_reduce (reduce_scatter_input)",
}, pieces="whole")


def _output(gathered: int) -> int:
    """A unit's flat all-gather output, the size of its unsharded parameters (`_sizes` names those)."""
    return relabel("all-gather output", gathered)


def _padded_shard(numel: int, rows: int, world: int) -> int:
    return ceil_div(rows, world) * (numel // rows)


class _Units(NamedTuple):
    """Per-rank padded shard elements of the units (`_padded_shard`), whole and trainable."""

    lead: int  # the unit gathered first: the root (units root), the embeddings, or a tied [embeddings, norm, head]
    tail: int  # the [final norm, head] unit of units split (untied); 0 when the lead holds the head
    block: int  # the largest block
    total: int
    trainable: int
    largest: int  # the largest trainable tensor
    lead_trainable: int
    tail_trainable: int
    block_trainable: int
    lead_params: int  # unsharded parameter elements, for the set-up
    tail_params: int
    block_unsharded: int  # the largest block's elements once gathered: block x n, unless its experts shard apart
    block_trainable_unsharded: int
    block_experts_unsharded: int  # of those, the experts' when they are a unit of their own (EP), else 0
    block_experts_trainable_unsharded: int
    block_linear_unsharded: int = 0  # of `block_unsharded`, the linears' weights (float8 all-gather gathers them in 1 byte)


def _units(facts: ModelFacts, n: int, split: bool, expert_n: int = 0) -> _Units:
    from zeroplan.estimate.parallel.experts import is_expert, shard_degree  # expert tensors under EP shard over efsdp ranks

    def shard_elems(group) -> int:
        return sum(_padded_shard(t.numel, t.rows, shard_degree(t, n, expert_n)) for t in group.tensors)

    def trained_elems(group) -> int:
        return sum(_padded_shard(t.numel, t.rows, shard_degree(t, n, expert_n)) for t in group.trainable_tensors)

    def gathered_elems(tensors) -> int:  # what the unit's all-gathers return: each tensor's padded shard x its ranks
        return sum(_padded_shard(t.numel, t.rows, shard_degree(t, n, expert_n)) * shard_degree(t, n, expert_n)
                   for t in tensors)

    # Units root: the root holds every non-block group. Units split puts the final norm and head in a
    # unit of their own, unless the head is tied to the embeddings (one [embeddings, norm, head] unit:
    # accelerate `fsdp2_prepare_model`, torchtitan `apply_fsdp_to_decoder`).
    tied = early_gradients(facts)[1] > 0
    in_tail = (lambda g: g.role == "final") if split and not tied else (lambda g: False)
    lead = [g for g in facts.groups if g.role != "block" and not in_tail(g)]
    tail = [g for g in facts.groups if in_tail(g)]
    blocks = [g for g in facts.groups if g.role == "block"]
    return _Units(
        lead=sum(shard_elems(g) for g in lead),
        tail=sum(shard_elems(g) for g in tail),
        block=max((shard_elems(g) for g in blocks), default=0),
        total=sum(shard_elems(g) * g.count for g in facts.groups),
        trainable=sum(trained_elems(g) * g.count for g in facts.groups),
        largest=max((_padded_shard(t.numel, t.rows, n) for g in facts.groups for t in g.trainable_tensors), default=0),
        lead_trainable=sum(trained_elems(g) for g in lead),
        tail_trainable=sum(trained_elems(g) for g in tail),
        block_trainable=max((trained_elems(g) for g in blocks if not g.frozen), default=0),
        lead_params=sum(g.params for g in lead),
        tail_params=sum(g.params for g in tail),
        block_unsharded=max((gathered_elems(g.tensors) for g in blocks), default=0),
        block_trainable_unsharded=max((gathered_elems(g.trainable_tensors) for g in blocks if not g.frozen), default=0),
        block_experts_unsharded=max((gathered_elems([t for t in g.tensors if expert_n and is_expert(t)]) for g in blocks),
                                    default=0),
        block_experts_trainable_unsharded=max((gathered_elems([t for t in g.trainable_tensors if expert_n and is_expert(t)])
                                               for g in blocks if not g.frozen), default=0),
        block_linear_unsharded=max((gathered_elems([t for t in g.tensors if _is_linear_weight(t.name) and not is_expert(t)])
                                    for g in blocks), default=0),
    )


def _is_linear_weight(name: str) -> bool:
    """A block's nn.Linear weight (what torchtitan's float8 converter swaps for Float8Linear), not a norm's."""
    return name.endswith(".weight") and "norm" not in name


class _Sizes(NamedTuple):
    """Bytes per rank that do not depend on the activations (cached: the planner asks for the same
    configuration at many micro-batches)."""

    num_blocks: int
    offloaded: bool
    sharded_params: int
    sharded_grads: int
    states: int
    temporaries: int
    lead_gathered: int  # the lead unit's all-gather output, or its unsharded parameters
    tail_gathered: int
    block_gathered: int
    block_prefetched: int  # what backward prefetches of the next block: its experts are a later unit (EP)
    block_experts_grads: int  # EP: the experts' unsharded gradients, reduced in their own post-backward
    block_experts_reduce_in: int  # EP: the experts' reduce-scatter input, held until the block's post-backward
    head_grads: int
    tied_grad: int
    first_grads: int
    lead_grads: int
    tail_shard_grads: int  # units split: the head's sharded gradients, from its post-backward on
    block_grads: int
    block_shard_grads: int
    block_reduce_in: int
    lead_reduce_in: int
    tail_reduce_in: int
    h2d_copy: int
    reshard: bool
    split: bool  # the head is in a unit of its own, reduced before the blocks' backward
    lead_kept: bool  # the lead's parameters stay unsharded from its forward to its post-backward
    lead_regathered: bool  # the lead is gathered again at the start of backward
    tail_reshards: bool
    last_reshards: bool
    held_after_blocks: int  # blocks whose unsharded parameters are held when the blocks' forward ends
    held_blocks: int
    held_grads: int
    accum_lead: int
    accum_tail: int
    accum_block: int
    kept_shards: int  # grad_sync every: the sharded gradients reduced by earlier micro-batches
    init_params: int  # the set-up's peak, by where the model was when fully_shard took it (`_init_params`)
    host_bytes: int  # per rank, offloaded to the host
    padding_note: str | None  # `_padding_note`


@memo(maxsize=4096)  # measured: a warm FSDP2 plan takes 14% longer without it
def _sizes(facts: ModelFacts, setup: Setup) -> _Sizes:
    n, precision, device, optimizer, wrapping = setup.gpus, setup.precision, setup.device, setup.optimizer, setup.fsdp2
    storage = HALF_BYTES if precision == Precision.PURE_BF16 else FP32_BYTES
    gathered = FP32_BYTES if precision == Precision.FP32 else HALF_BYTES
    reduce = _reduce_element_bytes(setup.program.recipe, storage, gathered)
    offloaded = setup.offload_optimizer == Offload.CPU
    on_device = not offloaded or device == Device.CPU  # a CPU run has one memory

    u = _units(facts, n, wrapping.units == FSDP2Units.SPLIT, setup.expert_gpus)
    split = u.tail > 0
    head_numel, tied_numel, first_numel = early_gradients(facts)
    num_blocks = sum(g.count for g in facts.groups if g.role == "block")

    sharded_params = named("sharded parameters", u.total * storage if on_device else 0)
    # foreach_reduce: the reduce-scatter output (padded shard, reduce dtype, cast to the
    # parameter dtype) is the storage of the sharded .grad views.
    sharded_grads = named("sharded gradients", u.trainable * storage if on_device else 0)
    block_shard_grads = named("sharded gradients", u.block_trainable * storage if on_device else 0)
    tail_shard_grads = named("sharded gradients", u.tail_trainable * storage if on_device else 0)
    states = named("optimizer states", optimizer_state_bytes(u.trainable, optimizer, storage) if on_device else 0)
    temporaries = named("optimizer step temporaries", step_temporary_bytes(
        u.largest, u.trainable, storage, optimizer, setup.program.optimizer_impl) if on_device else 0)
    h2d_copy = named("shards copied to the device (CPU offload)", 0 if on_device else max(u.lead, u.tail, u.block) * storage)

    reshard = setup.zero_stage == 3
    # The lead keeps its parameters through forward and backward when it is the root (its
    # post-forward comes after the loss) or a tied [embeddings, norm, head] unit not resharded;
    # the embeddings alone reshard as the blocks do (accelerate passes them the blocks' setting).
    lead_reshards = wrapping.reshard_head if wrapping.units == FSDP2Units.SPLIT else wrapping.reshard_root
    lead_kept = not reshard if split else True
    lead_regathered = not split and lead_reshards and reshard
    held_after_blocks = num_blocks if not reshard else (0 if wrapping.reshard_last_block else min(num_blocks, 1))
    # Blocks whose unsharded parameters are held while block `i` runs: itself under ZeRO-3; under
    # ZeRO-2 (reshard_after_forward=False) every block from the forward until its post-backward.
    held_blocks = 1 if reshard else num_blocks

    # Gradient accumulation (set_requires_gradient_sync(False) before the last micro-batch):
    # post_backward skips the reduce-scatter and keeps each unsharded gradient as
    # FSDPParam.unsharded_accumulated_grad in the reduce dtype (to_accumulated_grad_if_needed),
    # so the last micro-batch starts with the whole model's unsharded gradients; its
    # post-backwards reduce-scatter and free them unit by unit.
    holding = setup.accumulating and setup.program.grad_sync == GradSync.LAST
    accum_lead = named("accumulated unsharded gradients", u.lead_trainable * n * reduce if holding else 0)
    accum_tail = named("accumulated unsharded gradients", u.tail_trainable * n * reduce if holding else 0)
    accum_block = named("accumulated unsharded gradients", u.block_trainable_unsharded * reduce if holding else 0)
    # Reducing every micro-batch (torchtitan, torchtune): foreach_reduce adds each new reduce-scatter
    # output into the existing sharded .grad (`_fsdp_collectives.py`, to_accumulate_grad), so the last
    # micro-batch starts with every sharded gradient and adds none.
    kept_shards = sharded_grads if setup.accumulating and not holding else 0
    held_grads = accum_lead + accum_tail + num_blocks * accum_block + kept_shards
    host_bytes = 0
    if offloaded:
        # foreach_reduce casts the reduced shard to the parameters' dtype before it goes to the host
        host_bytes = named("offloaded shards, gradients and states", u.total * storage + u.trainable * storage
                           + optimizer_state_bytes(u.trainable, optimizer, storage))
    # Float8 all-gather (torchao fsdp_utils.py WeightWithDynamicFloat8CastTensor: fsdp_pre_all_gather casts each
    # linear weight's shard to float8, fsdp_post_all_gather wraps the gathered bytes): those weights are gathered,
    # and held unsharded, in 1 byte; the norms in the param dtype (docs/engines/programs.md, float8).
    float8 = u.block_linear_unsharded if setup.float8_all_gather else 0
    float8_weights = named("unsharded float8 weights", float8 * FLOAT8_BYTES)
    block_gathered = named("unsharded parameters", (u.block_unsharded - float8) * gathered) + float8_weights
    block_prefetched = (named("unsharded parameters", (u.block_unsharded - u.block_experts_unsharded - float8) * gathered)
                        + float8_weights)
    # Autograd writes unsharded gradients in the unsharded parameters' dtype (param_dtype);
    # foreach_reduce's reduce_scatter_input is in the reduce dtype.
    return _Sizes(
        num_blocks, offloaded, sharded_params, sharded_grads, states, temporaries,
        lead_gathered=named("unsharded parameters", u.lead * n * gathered),
        tail_gathered=named("unsharded parameters", u.tail * n * gathered),
        block_gathered=block_gathered,
        block_prefetched=block_prefetched,
        block_experts_grads=named("unsharded gradients", u.block_experts_trainable_unsharded * gathered),
        block_experts_reduce_in=named("reduce-scatter input", u.block_experts_trainable_unsharded * reduce),
        head_grads=named("unsharded gradients", head_numel * gathered),
        tied_grad=named("tied head gradient pending in autograd", tied_numel * gathered),
        first_grads=named("unsharded gradients", first_numel * gathered),
        lead_grads=named("unsharded gradients", u.lead_trainable * n * gathered), tail_shard_grads=tail_shard_grads,
        block_grads=named("unsharded gradients", u.block_trainable_unsharded * gathered), block_shard_grads=block_shard_grads,
        block_reduce_in=named("reduce-scatter input", u.block_trainable_unsharded * reduce),
        lead_reduce_in=named("reduce-scatter input", u.lead_trainable * n * reduce),
        tail_reduce_in=named("reduce-scatter input", u.tail_trainable * n * reduce), h2d_copy=h2d_copy, reshard=reshard, split=split,
        lead_kept=lead_kept, lead_regathered=lead_regathered, tail_reshards=split and wrapping.reshard_head,
        last_reshards=reshard and wrapping.reshard_last_block, held_after_blocks=held_after_blocks,
        held_blocks=held_blocks, held_grads=held_grads, accum_lead=accum_lead, accum_tail=accum_tail,
        accum_block=accum_block, kept_shards=kept_shards,
        init_params=_init_params(facts, setup, u, storage, on_device, sharded_params),
        host_bytes=host_bytes, padding_note=None if setup.expert_gpus else _padding_note(facts, n, u.total))


def _reduce_element_bytes(recipe: Recipe, storage: int, gathered: int) -> int:
    """Bytes per element of the gradients FSDP2 reduce-scatters (and accumulates unsharded).

    Under accelerate's policy (`fsdp2_reduces_in_param_dtype`) torch `_fsdp_param.py`
    init_dtype_attrs clamps a reduce_dtype equal to param_dtype to None, so foreach_reduce reduces
    in the gradients' dtype, the gathered one; the other programs in the shards' dtype.
    """
    return gathered if fsdp2_reduces_in_param_dtype(recipe) else storage


def _init_params(facts: ModelFacts, setup: Setup, u: _Units, storage: int, on_device: bool, sharded_params: int) -> int:
    """Parameter bytes at the set-up's peak, by where the model is when `fully_shard` takes it.

    meta (torchtitan): only this rank's shards are ever allocated (`to_empty`). device: the whole
    model, built on the GPU, plus the first block's shards (`FSDPParam._init_sharded_param` copies
    them before the block's whole parameters are dropped); a CPU run builds on the host, the same
    memory. host (accelerate `fsdp2_prepare_model`): `_fully_shard.py` `_move_states_to_device`
    moves one unit at a time to the GPU and shards it there: the shards done, plus one unit whole.
    The blocks are sharded first, then the units outside them (accelerate: embeddings, then the tail).
    """
    init = setup.program.model_init
    shard = storage if on_device else 0  # offloaded shards go to the host (CPUOffloadPolicy)
    if init == ModelInit.META:
        return sharded_params
    block_whole = named("parameters before sharding", max((g.params for g in facts.groups if g.role == "block"), default=0)
                        * storage)
    num_blocks = sum(g.count for g in facts.groups if g.role == "block")
    outside = ([(named("parameters before sharding", u.lead_params * storage), named("sharded parameters", u.lead * shard))]
               + ([(named("parameters before sharding", u.tail_params * storage), named("sharded parameters", u.tail * shard))]
                  if u.tail else []))
    block_shard = named("sharded parameters", u.block * shard)
    blocks_done = num_blocks * block_shard
    whole_model = block_whole * num_blocks + sum(whole for whole, _ in outside)
    built = init == ModelInit.DEVICE or setup.device == Device.CPU
    moments = [whole_model + block_shard if built else
               (num_blocks - 1) * block_shard + block_whole + block_shard]
    for k, (whole, unit_shard) in enumerate(outside):
        done = blocks_done + sum(s for _, s in outside[:k])
        # built: the units not yet sharded are still whole; host: only the unit being moved is
        wholes = sum(w for w, _ in outside[k:]) if built else whole
        moments.append(done + wholes + unit_shard)
    return max(moments)


def estimate_fsdp2(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    z = _sizes(facts, setup)
    # The forward and backward moments are the same in every step; only the states differ.
    forward = _forward(acts, z)
    backward, backward_end = _backward(acts, z)
    phases: list[PhaseBytes] = []
    passing: list[PhaseBytes] = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, z.states)):
        base = dict(params=z.sharded_params, optimizer_states=held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, params=z.init_params))
        phases.append(phase(step, Phase.FORWARD, **base, **forward))
        phases.append(phase(step, Phase.BACKWARD, **base, **backward))
        passing += [phase(step, Phase.BACKWARD, **base, **end) for end in backward_end]
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
    return EngineEstimate(tuple(phases), NodeBytes(cpu_bytes=host, pinned_bytes=0 if setup.device == Device.CPU else host), tuple(notes),
                          tuple(passing))


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
    """The largest moment of the forward pass: while a unit copies out, the previous unit's
    all-gather output is still held (`FSDPParamGroup.wait_for_unshard`); the moments are in
    docs/engines/fsdp2.md ("Forward")."""
    num_blocks, reshard, held_grads, h2d_copy = z.num_blocks, z.reshard, z.held_grads, z.h2d_copy
    lead, tail, block_gathered = z.lead_gathered, z.tail_gathered, z.block_gathered
    kept = lead if z.lead_kept else 0  # the lead's unsharded parameters while the blocks run
    after = z.held_after_blocks
    earlier = 0 if reshard else max(num_blocks - 1, 0)  # unsharded blocks before the last
    acts_before_last = acts.embedding + max(num_blocks - 1, 0) * acts.saved_per_block if acts else 0
    points = [
        dict(buffers=_output(lead) + lead + h2d_copy, grads=held_grads, activations=acts.embedding if acts else 0),
        dict(buffers=_output(lead) + kept + _output(block_gathered) + block_gathered + h2d_copy, grads=held_grads,
             activations=acts.embedding if acts else 0),
    ]
    if num_blocks > 1:  # the previous block's output, this one's and its copy-out, and under ZeRO-2 the earlier ones
        points.append(dict(buffers=kept + (earlier + 1) * block_gathered + 2 * _output(block_gathered) + h2d_copy,
                           grads=held_grads, activations=acts_before_last))
    if acts is not None:
        held_at_end = num_blocks if not reshard else 1
        points.append(dict(buffers=kept + held_at_end * block_gathered + _output(block_gathered), grads=held_grads,
                           activations=acts.blocks_end_peak))
        # Units split: the [final norm, head] unit copies out next to the last block's all-gather
        # output; its own is then held until the root's post-forward, after the loss.
        last_gather = _output(block_gathered)
        if tail:
            points.append(dict(buffers=kept + after * block_gathered + _output(block_gathered) + _output(tail) + tail
                               + h2d_copy, grads=held_grads, activations=acts.blocks_saved))
            last_gather = _output(tail) + tail
        points.append(dict(buffers=kept + after * block_gathered + last_gather, grads=held_grads,
                           activations=acts.forward_peak))
    return largest_point(*points)


def _backward(acts: ActivationBytes | None, z: _Sizes) -> tuple[Point, tuple[Point, ...]]:
    """The largest moment of the backward pass: its start, the loss's backward, the head's,
    blocks j in {0, 1, L-2, L-1} (the terms are linear in j between the ends), the end; what each
    holds is in docs/engines/fsdp2.md ("Backward"). With it, the moments of the lead's post-backward
    that come after it, in program order (for the allocator replay: EngineEstimate.passing)."""
    num_blocks, reshard, held_blocks, held_grads, h2d_copy = z.num_blocks, z.reshard, z.held_blocks, z.held_grads, z.h2d_copy
    lead, tail, block_gathered, tied_grad, head_grads = z.lead_gathered, z.tail_gathered, z.block_gathered, z.tied_grad, z.head_grads
    block_grads, block_shard_grads, block_reduce_in = z.block_grads, z.block_shard_grads, z.block_reduce_in
    accum_lead, accum_block = z.accum_lead, z.accum_block
    lead_kept = lead if z.lead_kept else 0
    after = z.held_after_blocks

    def shards_done(j: int) -> int:
        """Sharded gradients present while block j (from the last) runs its backward."""
        return z.kept_shards or j * block_shard_grads

    # What the head leaves for the blocks' backward: under units root its unsharded gradients
    # (reduced with the root's at the end); under split its sharded ones (reduced in its post-backward).
    head_left = (0 if z.kept_shards else z.tail_shard_grads) if z.split else head_grads
    points = []
    acts_start = acts.forward_end if acts else 0
    if z.lead_regathered:
        points.append(dict(buffers=_output(lead) + lead + h2d_copy, grads=held_grads, activations=acts_start))
    # The last block's all-gather output once prefetched (by the root's pre-backward under units
    # root, by the head's under split), unless it kept its parameters.
    last_prefetch = _output(z.block_prefetched) if z.last_reshards else 0
    if acts is not None:
        # Saved tensors are activations; what backward allocates (the logits' gradients, the
        # recomputed block, gradients in flight, a tied head's pending gradient) is temporaries.
        if z.split:
            loss_buffers = lead_kept + after * block_gathered + (0 if z.tail_reshards else tail) + h2d_copy
            head_buffers = lead_kept + after * block_gathered + last_prefetch + tail + h2d_copy
        else:
            loss_buffers = head_buffers = lead + after * block_gathered + last_prefetch + h2d_copy
        points.append(dict(buffers=loss_buffers, grads=held_grads, activations=acts.forward_end,
                           temporaries=acts.logits_grad))
        if z.tail_reshards:  # the head's pre-backward gathers it again
            points.append(dict(buffers=loss_buffers + _output(tail) + tail, grads=held_grads, activations=acts.head_backward_saved,
                               temporaries=acts.logits_grad))
        # lm_head's backward: the logits' gradient, the head weight's unsharded gradient (a tied
        # one still pending in autograd), the gradient of the final norm's output.
        points.append(dict(buffers=head_buffers, grads=held_grads + head_grads, activations=acts.head_backward_saved,
                           temporaries=acts.head_backward_temporary + tied_grad))
        if z.split:
            # The head's post-backward: its gradients copied into the reduce-scatter input (kept
            # until the last block's post-backward), the head resharded.
            points.append(dict(buffers=head_buffers - tail + z.tail_reduce_in,
                               grads=held_grads + (0 if z.accum_tail else head_grads), activations=acts.blocks_saved,
                               temporaries=acts.block_input_grad))
    visits = acts.backward_blocks() if acts else [j for j in sorted({0, 1, num_blocks - 2, num_blocks - 1}) if 0 <= j < num_blocks]
    accum_left = accum_lead + (0 if z.split else z.accum_tail)
    for j in visits:
        blocks_held = 1 if reshard else num_blocks - j
        # FSDP2 prefetches the next unit in reverse post-forward order: the previous block, whose experts
        # (EP: a unit of their own, post-forward before their block) come after it
        prefetch = _output(z.block_prefetched) if reshard and j < num_blocks - 1 else 0
        if z.split and reshard and j == num_blocks - 1:
            prefetch = _output(lead)  # block 0's pre-backward prefetches the embeddings
        # EP: the experts reduce before the rest of their block (a unit of their own), so at the MLP's backward
        # the previous block's dense part's reduce-scatter input is held, at the block's end its experts' is
        experts_grads, experts_reduce_in = z.block_experts_grads, z.block_experts_reduce_in
        dense_reduce_in = block_reduce_in - experts_reduce_in
        held_reduce_in = dense_reduce_in if j else (z.tail_reduce_in if z.split else 0)
        buffers = lead_kept + blocks_held * block_gathered + prefetch + held_reduce_in + h2d_copy
        experts_resharded = (block_gathered - z.block_prefetched) if reshard else 0  # the experts' unsharded parameters
        end_buffers = buffers - held_reduce_in + experts_reduce_in - experts_resharded if experts_grads else buffers
        points.append(dict(
            buffers=buffers,
            grads=accum_left + (num_blocks - j) * accum_block + head_left + z.first_grads + shards_done(j),
            activations=acts.block_backward_saved(num_blocks - j) if acts else 0,
            temporaries=(acts.block_backward_temporary_at(num_blocks - j) if acts else 0) + tied_grad,
        ))
        # The end of the block's backward, before its post-backward: every unsharded gradient of
        # the block, its saved tensors gone, the gradient of its input in flight.
        end_acts = acts.blocks_left_saved(num_blocks - j - 1) if acts else 0
        in_flight = (acts.block_input_grad if acts else 0) + tied_grad
        points.append(dict(
            buffers=end_buffers,
            grads=accum_left + (num_blocks - j) * accum_block + head_left + block_grads - experts_grads + shards_done(j),
            activations=end_acts,
            temporaries=in_flight,
        ))
        # Its post_backward: the gradients move from .grad into a list, the block reshards, the
        # previous reduce-scatter input is dropped, and foreach_reduce allocates this block's
        # (in the reduce dtype: twice the gradients' bytes under bf16 mixed precision) and copies
        # them in before freeing them.
        points.append(dict(
            buffers=lead_kept + (blocks_held - 1) * block_gathered + prefetch + dense_reduce_in + h2d_copy
            + (experts_resharded if experts_grads else 0),
            grads=accum_left + (num_blocks - j - 1) * accum_block + head_left + shards_done(j),
            activations=end_acts,
            # the list holds the accumulated gradients when accumulating (the fresh ones were added in)
            temporaries=in_flight + (accum_block or block_grads - experts_grads),
        ))
    blocks_done = (z.kept_shards or num_blocks * block_shard_grads) + (head_left if z.split else 0)
    last_reduce_in = block_reduce_in if num_blocks else (z.tail_reduce_in if z.split else 0)
    if z.split and reshard:
        # The embeddings' pre-backward copies out their prefetched all-gather output.
        points.append(dict(buffers=_output(lead) + lead + last_reduce_in, grads=accum_left + blocks_done,
                           temporaries=(acts.block_input_grad if acts else 0)))
    # The embedding's backward, the last before the lead's post-backward: its weight gradient
    # (aten embedding_dense_backward). A tied weight's two gradients meet in autograd's input
    # buffer, which adds them out of place (torch/csrc/autograd/input_buffer.cpp accumulate):
    # the head's pending gradient, the embedding's and their sum are alive together, none a
    # .grad yet.
    points.append(dict(buffers=lead + last_reduce_in,
                       grads=accum_left + z.lead_grads - tied_grad + blocks_done,
                       temporaries=3 * tied_grad))
    # foreach_reduce copies the lead's unsharded gradients into its reduce-scatter input and
    # frees them (`unsharded_grads.clear()`) before allocating the reduce-scatter output.
    reduced = dict(buffers=z.lead_reduce_in, grads=accum_left + blocks_done + z.lead_grads)
    points.append(reduced)
    # Then the reduce-scatter into the lead's shard (smaller). gloo's copy of the whole input
    # is not modelled (NCCL makes none): docs/engines/fsdp2.md ("What is not modelled").
    peak = largest_point(*points)
    if peak is reduced:
        return peak, ()
    # The lead's post-backward, after backward's peak: the replay needs its request (the whole lead's gradients in
    # the reduce dtype, one tensor) even where it is not the peak. Before it the lead reshards and the last block's
    # reduce-scatter input is dropped (_fsdp_param_group.py FSDPParamGroup.post_backward: `reshard`, then
    # `reduce_scatter_states` popped down to reduce_scatter_max_input_buffers, 1), so foreach_reduce
    # (_fsdp_collectives.py) asks for a new block of the lead's size.
    resharded = dict(grads=reduced["grads"])
    return peak, (resharded, reduced)
