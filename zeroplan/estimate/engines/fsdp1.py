"""PyTorch FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`, torch 2.13), wrapped as accelerate wraps a
model (`TRANSFORMER_BASED_WRAP`): one FlatParameter per transformer block and one for the root (embeddings,
final norm, output head); with LoRA and use_orig_params false, PEFT's `fsdp_auto_wrap_policy` also makes every
adapter Linear a unit of its own. The derivation, moment by moment, is docs/engines/fsdp1.md.

Read from torch/distributed/fsdp/ (torch 2.13):
- `_flat_param.py` FlatParamHandle `_init_flat_param_and_metadata` / `flatten_tensors`: a unit's parameters
  are concatenated into one flat tensor; with use_orig_params each parameter starts on a 16-byte boundary
  (`_get_aligned_numel`) and the whole is padded to a multiple of the world size; without, neither (the last
  shard is padded when it is cut: `_get_shard`). `shard`: each rank keeps ceil(F/N) elements.
- `init_flat_param_attributes`: `_full_param_padded` (N x shard, in the compute dtype) is the all-gather
  destination; under mixed precision `_mp_shard` is the low-precision shard, allocated for the all-gather
  (`_use_low_precision_shard`) and freed after it (`post_unshard`).
- `_runtime_utils.py` `_post_forward_reshard`: FULL_SHARD / HYBRID_SHARD free a unit's unsharded parameter
  after its forward, except the root's; SHARD_GRAD_OP keeps it until the unit's post-backward.
  `_pre_backward_hook` unshards a unit and prefetches the next one (BackwardPrefetch.BACKWARD_PRE);
  `_post_backward_reshard` frees it and prefetches there under BACKWARD_POST.
- The unit's gradient: the views' gradients (autograd, held by the flat parameter's SplitWithSizesBackward
  until the unit's backward ends) are concatenated into one flat gradient (`flat_param.grad`), which
  `_post_backward_hook` casts to the reduce dtype, `_reduce_grad` pads to N x shard (`F.pad`, a copy, unless
  the flat parameter is padded already), reduce-scatters into a new shard, and `_cast_grad_to_param_dtype`
  casts to the parameter dtype: `_saved_grad_shard`, the sharded `.grad` from `_finalize_params` on.
  NO_SHARD all-reduces the whole gradient in place (`_reduce_grad_no_shard`).
- `no_sync()` (grad_sync last): the post-backward keeps the unsharded flat gradient and reduces nothing; under
  SHARD_GRAD_OP the unsharded parameters stay too (`_should_free_in_backward`).
- CPUOffload(offload_params=True): `_local_shard` and `_cpu_grad` pinned on the host, the optimizer steps
  there; each unshard first copies the shard to the device (`flat_param_to`, `_use_low_precision_shard`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from zeroplan.estimate.activations.transformer import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import (EngineEstimate, Point, Setup, ceil_div, early_gradients, largest_point,
                                              phase, step_temporary_bytes)
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import named, register
from zeroplan.spec.fsdp1 import BackwardPrefetch, adapters_wrapped_apart, fsdp1_reduces_in_param_dtype, sharding_strategy
from zeroplan.spec.program import GradSync, ModelInit, OptimizerImpl, Recipe
from zeroplan.spec.training import Device, Offload, Optimizer, Precision

_FSDP = "torch/distributed/fsdp/"
register({
    "sharded flat parameters": f"{_FSDP}_flat_param.py FlatParamHandle.shard (flat_param._local_shard)",
    "unsharded flat parameters": f"{_FSDP}_flat_param.py init_flat_param_attributes (_full_param_padded, the "
                                 "all-gather destination)",
    "low-precision shard": f"{_FSDP}_flat_param.py _use_low_precision_shard (_mp_shard)",
    "gradients of the flat parameter's views": "torch/csrc/autograd (held by the FlatParameter's "
                                               "SplitWithSizesBackward until the unit's backward ends: docs/engines/"
                                               "fsdp1.md, Backward)",
    "unsharded flat gradient": f"{_FSDP}_runtime_utils.py _post_backward_hook (flat_param.grad, cast to the reduce "
                               "dtype there)",
    "reduce-scatter input and output": f"{_FSDP}_runtime_utils.py _reduce_grad, _get_reduce_scatter_tensors",
    "sharded flat gradients": f"{_FSDP}_runtime_utils.py _accumulate_sharded_grad (_saved_grad_shard)",
    "flat parameters before sharding": f"{_FSDP}_flat_param.py flatten_tensors (torch.cat of a unit's parameters: "
                                       "docs/engines/fsdp1.md, Set-up)",
    "sync_module_states broadcast bucket": f"{_FSDP}_init_utils.py _sync_module_params_and_buffers "
                                           "(_broadcast_coalesced, 250 MB buckets)",
    "flat shard copied to the device (CPU offload)": f"{_FSDP}_flat_param.py pre_unshard (flat_param_to / _mp_shard)",
    "offloaded flat shards, gradients and states": f"{_FSDP}_flat_param.py init_flat_param_attributes (pinned "
                                              "_local_shard and _cpu_grad; the optimizer steps on the host)",
})

SYNC_BUCKET_BYTES = 250 * 1024 * 1024  # fully_sharded_data_parallel.py PARAM_BROADCAST_BUCKET_SIZE (int(250 * 1024 * 1024))
ALIGNMENT_BYTES = 16  # _flat_param.py _get_aligned_numel: "This alignment constraint comes from TorchInductor"


class Unit(NamedTuple):
    """One FlatParameter on one rank, in elements."""

    flat: int  # the flat parameter's elements, alignment padding included (F)
    shard: int  # this rank's padded shard (S); N x S is the padded unsharded flat parameter
    trains: bool  # the FlatParameter requires grad (any of its tensors trains)
    local_trainable: int  # trainable elements of the largest rank's shard (the optimizer's, with use_orig_params)
    # per rank, the tensors the optimizer steps, in order: the flat shard, or with use_orig_params each trained
    # parameter's local slice (`_use_sharded_views`); one entry for all ranks without use_orig_params
    stepped: tuple[tuple[int, ...], ...]
    params: int  # elements before flattening (the set-up's whole unit)
    padded_copy: bool  # _get_reduce_scatter_tensors pads the gradient with a copy (F is not a multiple of N)


def _unit(numels: list[tuple[int, bool]], n: int, align: int, use_orig: bool) -> Unit:
    """The FlatParameter of tensors `numels` ((elements, trains) in registration order) over `n` ranks, aligned
    to `align` elements when use_orig_params (FlatParamHandle._init_flat_param_and_metadata)."""
    offsets, total = [], 0
    for numel, trains in numels:
        if align and total % align:
            total += align - total % align  # a padding tensor before the parameter
        offsets.append((total, numel, trains))
        total += numel
    if align and total % n:
        total += n - total % n  # world-size divisibility padding
    shard = ceil_div(total, n)
    trains = any(t for _, t in numels)
    # each rank's trainable elements and largest piece (use_orig_params: the optimizer sees each parameter's
    # local slice, _use_sharded_views); without use_orig_params the optimizer steps the whole flat shard
    if use_orig:
        stepped = tuple(tuple(max(0, min((r + 1) * shard, o + k) - max(r * shard, o)) for o, k, t in offsets if t)
                        for r in range(n))
    else:
        stepped = (((shard,) if trains else ()),)
    return Unit(total, shard, trains, max(sum(pieces) for pieces in stepped), stepped, sum(k for k, _ in numels),
                total % n != 0)


def for_loop_temporary_elements(stepped: list[int]) -> int:
    """The for-loop Adam step's peak temporaries over tensors stepped in this order (torch/optim/adam.py
    `_single_tensor_adam`): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds the sqrt and the
    quotient of tensor i while the previous iteration's `denom` (tensor i-1) is alive until the assignment."""
    return max((2 * size + (stepped[i - 1] if i else 0) for i, size in enumerate(stepped)), default=0)


def _registration_order(tensors):
    """A block's tensors in `module.named_parameters()` order, the order FSDP1 flattens them in: PEFT's adapters
    (peft tuners/lora/layer.py: `base_layer`, then `lora_A`, `lora_B`) right after the weights of the layer they
    adapt; the layout lists them after the whole block."""
    def layer(name: str) -> str:
        return name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0]

    first = {}
    for index, t in enumerate(tensors):
        first.setdefault(layer(t.name), index)
    return sorted(tensors, key=lambda t: (first[layer(t.name)], ".lora_" in t.name))


@memo(maxsize=256)
def units(facts: ModelFacts, n: int, use_orig: bool, align: int, adapters_apart: bool) -> tuple[Unit, Unit, tuple[Unit, ...]]:
    """(root, largest block, adapter units of one block) of FSDP1 over `n` ranks: the root holds every tensor outside
    the blocks; under `adapters_apart` (PEFT's policy, use_orig_params false) each trained tensor of a block is a
    unit of its own and the block's unit holds its frozen tensors."""
    def numels(tensors, frozen_group: bool) -> list[tuple[int, bool]]:
        return [(t.numel, not (frozen_group or t.frozen)) for t in tensors]

    outside = [x for g in facts.groups if g.role != "block" for x in numels(g.tensors, g.frozen)]
    root = _unit(outside, n, align, use_orig)
    blocks, adapters = [], ()
    for g in facts.groups:
        if g.role != "block":
            continue
        tensors = numels(_registration_order(g.tensors), g.frozen)
        if adapters_apart:
            adapters = tuple(_unit([x], n, align, use_orig) for x in tensors if x[1])
            tensors = [x for x in tensors if not x[1]]
        blocks.append(_unit(tensors, n, align, use_orig))
    block = max(blocks, key=lambda u: u.flat, default=Unit(0, 0, False, 0, ((),), 0, False))
    return root, block, adapters


class _Sizes(NamedTuple):
    """Bytes per rank that do not depend on the activations."""

    num_blocks: int
    sharded_params: int
    sharded_grads: int  # every trained unit's _saved_grad_shard, in the parameters' dtype
    block_shard_grad: int
    root_shard_grad: int
    states: int
    temporaries: int
    root_unsharded: int  # the root's unsharded flat parameter (NO_SHARD: its low-precision copy, or 0)
    block_unsharded: int
    unshard_extra: int  # what an unshard holds beside its destination: the low-precision shard, an offloaded copy
    root_views: int  # gradients of the root's views held by autograd: the head's from its backward on
    tied_grad: int
    first_grads: int  # a block's output projection's gradient, alive at the block's backward peak
    block_views: int  # all of a block's view gradients at the end of its backward
    block_flat_grad: int  # the block's flat gradient (compute dtype)
    root_flat_grad: int
    block_reduce: int  # the post-backward's buffers beyond the flat gradient: cast, padded copy, output shard
    root_reduce: int
    adapter_reduce: int  # adapter units (PEFT's policy): their views, flat gradients and reduction, all blocks
    adapter_unsharded: int  # one block's adapter units unsharded
    reshard: bool  # FULL_SHARD / HYBRID_SHARD free after forward; NO_SHARD frees its low-precision copy there too
    sharded: bool  # not NO_SHARD
    prefetch: BackwardPrefetch
    forward_prefetch: bool
    accum_unsharded: int  # grad_sync last: every unit's unsharded flat gradient, kept across micro-batches
    accum_block: int
    kept_shards: int  # grad_sync every: sharded gradients from earlier micro-batches
    keep_params: bool  # SHARD_GRAD_OP under no_sync: unsharded parameters kept across micro-batches
    init_params: int
    host_bytes: int
    offloaded: bool


def _reduce_bytes(unit: Unit, n: int, gathered: int, reduce: int, storage: int, sharded: bool) -> int:
    """What a unit's post-backward allocates beside its flat gradient (`_post_backward_hook`, `_reduce_grad`): the
    cast to the reduce dtype, the padded copy, the reduce-scatter output, and its cast to the parameters' dtype."""
    if not unit.trains:
        return 0
    cast = unit.flat * reduce if reduce != gathered else 0
    if not sharded:  # NO_SHARD: all-reduced in place, then cast to the parameters' dtype (a new tensor)
        return cast + (unit.flat * storage if storage != reduce else 0)
    padded = unit.shard * n * reduce if unit.padded_copy else 0
    output = unit.shard * reduce + (unit.shard * storage if storage != reduce else 0)
    return cast + padded + output


def _all_trained(facts: ModelFacts) -> ModelFacts:
    """`facts` with every block tensor trained: what autograd computes for a FlatParameter that requires grad."""
    groups = tuple(g._replace(frozen=False, tensors=tuple(t._replace(frozen=False) for t in g.tensors))
                   if g.role == "block" else g for g in facts.groups)
    return replace(facts, groups=groups)


def _for_loop_elements(root: Unit, block: Unit, adapters: tuple[Unit, ...], num_blocks: int) -> int:
    """`for_loop_temporary_elements` on the rank where it is largest, in the optimizer's order (model.parameters():
    the root's, then each block's, its adapters' units after it); two blocks stand for all (the pairs repeat)."""
    order = [root] + [block, *adapters] * min(num_blocks, 2)
    ranks = max(len(u.stepped) for u in order)
    return max(for_loop_temporary_elements([size for u in order for size in u.stepped[min(r, len(u.stepped) - 1)]])
               for r in range(ranks))


@memo(maxsize=4096)
def _sizes(facts: ModelFacts, setup: Setup) -> _Sizes:
    wrapping = setup.fsdp1
    sharded = setup.zero_stage != 0
    n = (setup.node_gpus if wrapping.hybrid else setup.gpus) if sharded else 1
    storage = HALF_BYTES if setup.precision == Precision.PURE_BF16 else FP32_BYTES
    gathered = FP32_BYTES if setup.precision == Precision.FP32 else HALF_BYTES
    reduce = gathered if fsdp1_reduces_in_param_dtype(setup.program.recipe) else storage
    mixed = gathered != storage
    offloaded = setup.offload_optimizer == Offload.CPU
    on_device = not offloaded or setup.device == Device.CPU
    use_orig = wrapping.use_orig_params
    align = ALIGNMENT_BYTES // gathered if use_orig else 0
    adapters_apart = (adapters_wrapped_apart(setup.program.recipe, use_orig)
                      and any(t.frozen for g in facts.groups for t in g.tensors))
    root, block, adapters = units(facts, n, use_orig, align, adapters_apart)
    num_blocks = sum(g.count for g in facts.groups if g.role == "block")
    every = [root] + [block] * num_blocks + list(adapters) * num_blocks  # blocks alike: the largest stands for all

    sharded_params = named("sharded flat parameters", sum(u.shard for u in every) * storage if on_device else 0)
    trained = [u for u in every if u.trains]
    sharded_grads = named("sharded flat gradients", sum(u.shard for u in trained) * storage if on_device else 0)
    block_shard_grad = named("sharded flat gradients", (block.shard if block.trains else 0) * storage
                             + sum(u.shard for u in adapters) * storage if on_device else 0)
    root_shard_grad = named("sharded flat gradients", (root.shard if root.trains else 0) * storage if on_device else 0)
    local = sum(u.local_trainable for u in trained)
    states = named("optimizer states", optimizer_state_bytes(local, setup.optimizer, storage) if on_device else 0)
    impl = setup.program.optimizer_impl
    temporaries = named("optimizer step temporaries", (
        _for_loop_elements(root, block, adapters, num_blocks) * storage
        if impl == OptimizerImpl.FOR_LOOP and setup.optimizer != Optimizer.SGD
        else step_temporary_bytes(max((max(p, default=0) for u in trained for p in u.stepped), default=0), local, storage,
                                  setup.optimizer, impl)) if on_device else 0)

    def unsharded(unit: Unit) -> int:
        if sharded:
            return named("unsharded flat parameters", unit.shard * n * gathered)
        return named("low-precision shard", unit.flat * gathered if mixed else 0)  # NO_SHARD's _mp_shard

    # pre_unshard: under mixed precision the low-precision shard lives through the all-gather; offloaded, the
    # shard copied to the device (`flat_param_to`) or, mixed, its fp32 copy beside the low-precision one
    largest_shard = max(root.shard, block.shard)
    unshard_extra = named("low-precision shard", largest_shard * gathered if mixed and sharded else 0)
    if not on_device:
        unshard_extra += named("flat shard copied to the device (CPU offload)", largest_shard * storage)

    head, tied, first = early_gradients(facts)
    if use_orig and block.trains:
        # every view of a trained FlatParameter requires grad: the output projection's frozen weight gets its
        # gradient first too (_use_unsharded_views), as in a block that trains whole
        first = early_gradients(_all_trained(facts))[2]
    views_of = lambda unit, elements: named("gradients of the flat parameter's views", elements * gathered)  # noqa: E731
    # every view of a trained FlatParameter requires grad, frozen tensors' included under use_orig_params
    # (_use_unsharded_views makes them views of the flat parameter): the whole unit's gradients are computed
    block_view_elements = block.params if block.trains else 0
    root_head = head if root.trains else 0
    root_views = views_of(root, root_head)
    first_grads = views_of(block, first if block.trains else 0)
    block_views = views_of(block, block_view_elements)
    flat = lambda unit: named("unsharded flat gradient", unit.flat * gathered if unit.trains else 0)  # noqa: E731

    def reduce_of(unit: Unit) -> int:
        return named("reduce-scatter input and output", _reduce_bytes(unit, n, gathered, reduce, storage, sharded))

    adapter_reduce = sum((views_of(u, u.params) + flat(u) + reduce_of(u) for u in adapters), 0)
    adapter_unsharded = sum((unsharded(u) for u in adapters), 0)

    program = setup.program
    holding = setup.accumulating and program.grad_sync == GradSync.LAST
    accum_block = named("unsharded flat gradient", (block.flat if block.trains else 0) * gathered if holding else 0)
    accum_unsharded = named("unsharded flat gradient", sum(u.flat for u in trained) * gathered if holding else 0)
    kept_shards = sharded_grads if setup.accumulating and not holding else 0
    host_bytes = 0
    if offloaded:  # _local_shard and _cpu_grad pinned, the optimizer's states beside them
        host_bytes = named("offloaded flat shards, gradients and states", sum(u.shard for u in every) * storage
                           + sum(u.shard for u in trained) * storage + optimizer_state_bytes(local, setup.optimizer, storage))
    return _Sizes(
        num_blocks, sharded_params, sharded_grads, block_shard_grad, root_shard_grad, states, temporaries,
        root_unsharded=unsharded(root), block_unsharded=unsharded(block), unshard_extra=unshard_extra,
        root_views=root_views, tied_grad=named("tied head gradient pending in autograd", tied * gathered if root.trains else 0),
        first_grads=first_grads, block_views=block_views, block_flat_grad=flat(block), root_flat_grad=flat(root),
        block_reduce=reduce_of(block), root_reduce=reduce_of(root), adapter_reduce=adapter_reduce,
        adapter_unsharded=adapter_unsharded, reshard=setup.zero_stage != 2, sharded=sharded,
        prefetch=wrapping.backward_prefetch, forward_prefetch=wrapping.forward_prefetch,
        accum_unsharded=accum_unsharded, accum_block=accum_block, kept_shards=kept_shards,
        keep_params=holding and setup.zero_stage == 2,
        init_params=_init_params(facts, setup, root, block, every, storage, on_device, sharded_params, n),
        host_bytes=host_bytes, offloaded=offloaded,
    )


def _init_params(facts: ModelFacts, setup: Setup, root: Unit, block: Unit, every: list[Unit], storage: int,
                 on_device: bool, sharded_params: int, n: int) -> int:
    """Parameter bytes at the set-up's peak (docs/engines/fsdp1.md, Set-up). FSDP1 wraps bottom-up (the blocks, then
    the root): for each unit it moves the unit's parameters to the device (`_move_module_to_device`), broadcasts
    them from rank 0 under sync_module_states (`_sync_module_params_and_buffers`: one bucket of at most 250 MB),
    concatenates them into the flat parameter (`flatten_tensors`: the unit twice), drops the originals, and cuts
    this rank's shard (`_get_shard`: a clone, padded) before freeing the whole."""
    shard_bytes = storage if on_device else 0
    whole_model = sum(u.params for u in every) * storage
    wrapping = setup.fsdp1
    # built whole where the units are wrapped: on the GPU, or on a CPU run's one memory; cpu_ram_efficient_loading
    # builds rank 0's model on the host and the others' on meta (each unit materialised by param_init_fn)
    built = ((setup.program.model_init == ModelInit.DEVICE and not wrapping.cpu_ram_efficient_loading)
             or setup.device == Device.CPU)
    moments = []
    done = 0
    for unit in [block] * sum(g.count for g in facts.groups if g.role == "block") + [root]:
        whole = named("flat parameters before sharding", unit.params * storage)
        bucket = named("sync_module_states broadcast bucket", min(whole, SYNC_BUCKET_BYTES)
                       if wrapping.sync_module_states and n > 1 else 0)
        before = whole_model - done if built else whole  # the units not wrapped yet are whole where they were built
        flat = named("flat parameters before sharding", unit.flat * storage)
        # _get_shard clones the rank's chunk and, on the ranks whose chunk is short, pads it into a new tensor; the
        # originals and the whole flat parameter are freed after the shard is cut
        shard = named("sharded flat parameters", unit.shard * shard_bytes * (2 if unit.flat % n else 1))
        moments.append(done + before + bucket)
        moments.append(done + before + flat + shard)
        done += named("sharded flat parameters", unit.shard * shard_bytes)
        whole_model -= unit.params * storage
    return max(moments, default=sharded_params)


def estimate_fsdp1(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    z = _sizes(facts, setup)
    forward, backward = _forward(acts, z), _backward(acts, z)
    phases: list[PhaseBytes] = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, z.states)):
        base = dict(params=z.sharded_params, optimizer_states=held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, params=z.init_params))
        phases.append(phase(step, Phase.FORWARD, **_plus(base, forward)))
        phases.append(phase(step, Phase.BACKWARD, **_plus(base, backward)))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, params=z.sharded_params, grads=z.sharded_grads,
                            optimizer_states=z.states, temporaries=z.temporaries))
    notes = []
    host = 0
    if z.offloaded:
        host = z.host_bytes * setup.node_gpus
        if setup.device == Device.CPU:
            notes.append(f"CPU run: the {z.host_bytes:,} offloaded bytes per rank share the one memory; on GPUs they "
                         "sit on the host (pinned)")
    if setup.program.recipe == Recipe.HF_TRAINER and (setup.zero_stage != 3 or setup.fsdp1.hybrid):
        notes.append(f"fsdp1 {sharding_strategy(setup.zero_stage, setup.fsdp1.hybrid)} under the Trainer: accelerate 1.15's "
                     "FSDP1 plugin reads FSDP_SHARDING_STRATEGY (FULL_SHARD when unset) before fsdp_config's "
                     "reshard_after_forward; launch with --fsdp_sharding_strategy (or set the variable) for this strategy "
                     "to run")
    if not setup.fsdp1.limit_all_gathers and setup.device == Device.CUDA and z.sharded:
        notes.append("fsdp1 limit_all_gathers false: the CPU thread may issue all-gathers ahead of the GPU, whose "
                     "freed unsharded parameters wait for the compute stream (record_stream); reserved memory can grow "
                     "beyond the allocated peak estimated here (docs/engines/fsdp1.md, limit_all_gathers)")
    return EngineEstimate(tuple(phases), NodeBytes(cpu_bytes=host, pinned_bytes=0 if setup.device == Device.CPU else host),
                          tuple(notes))


def _plus(base: dict, point: Point) -> dict:
    merged = dict(base)
    for key, value in point.items():
        merged[key] = merged.get(key, 0) + value
    return merged


def _forward(acts: ActivationBytes | None, z: _Sizes) -> Point:
    """The largest moment of the forward (docs/engines/fsdp1.md, Forward): the root is unsharded first and kept
    (`_post_forward_reshard` never frees the root's); each block is all-gathered in its pre-forward (its low-precision
    shard beside the destination), and under FULL_SHARD freed in its post-forward; under SHARD_GRAD_OP every block
    stays unsharded; forward_prefetch all-gathers the next block while one runs."""
    n = z.num_blocks
    root, block, extra = z.root_unsharded, z.block_unsharded + z.adapter_unsharded, z.unshard_extra
    held = z.accum_unsharded + z.kept_shards
    grads = dict(grads=held)
    keep = z.keep_params  # no_sync under SHARD_GRAD_OP: every unit stays unsharded from the first micro-batch
    ahead = block if z.forward_prefetch and n > 1 else 0
    embedding = acts.embedding if acts else 0
    points = [dict(buffers=root + extra + (n * block if keep else 0), activations=embedding, **grads)]
    kept_blocks = lambda i: n * block if keep else (i if not z.reshard else 0) * block  # noqa: E731 - blocks 0..i-1
    if n:
        points.append(dict(buffers=root + kept_blocks(0) + block + extra, activations=embedding, **grads))
        points.append(dict(buffers=root + kept_blocks(n - 1) + block + ahead + (extra if not keep else 0),
                           activations=(acts.blocks_end_peak if acts else 0), **grads))
    if acts is not None:
        after = n * block if (keep or not z.reshard) else 0
        points.append(dict(buffers=root + after, activations=acts.forward_peak, **grads))
    return largest_point(*points)


def _backward(acts: ActivationBytes | None, z: _Sizes) -> Point:
    """The largest moment of backward (docs/engines/fsdp1.md, Backward): the loss's and the head's backward with
    the root unsharded (and the last block prefetched under BACKWARD_PRE); for each block its backward's peak, the
    end of its backward (all its views' gradients and the flat gradient they are concatenated into), and its
    post-backward (resharded, the gradient cast, padded and reduce-scattered); the root's post-backward at the end."""
    n = z.num_blocks
    root, block = z.root_unsharded, z.block_unsharded + z.adapter_unsharded
    pre = z.prefetch == BackwardPrefetch.BACKWARD_PRE
    post = z.prefetch == BackwardPrefetch.BACKWARD_POST
    resharded = z.reshard  # units gathered again in backward (NO_SHARD: its low-precision copy)
    keep_all = not resharded  # SHARD_GRAD_OP: every block unsharded from its forward to its post-backward

    def blocks_held(j: int) -> int:
        """Unsharded blocks while block j (from the last) runs its backward."""
        if keep_all:
            return (n - j) * block
        return block + (block if pre and j < n - 1 else 0)

    def shards_done(j: int) -> int:
        return z.kept_shards or j * z.block_shard_grad

    held = z.accum_unsharded  # grad_sync last: the unsharded flat gradients of earlier micro-batches
    accum_done = lambda j: held - j * z.accum_block  # noqa: E731 - blocks reduced so far freed theirs
    points = []
    last_prefetched = block if (pre and resharded and n) else 0
    start_blocks = n * block if keep_all else last_prefetched
    if acts is not None:
        points.append(dict(buffers=root + start_blocks, grads=held + z.kept_shards, activations=acts.forward_end,
                           temporaries=acts.logits_grad))
        points.append(dict(buffers=root + start_blocks, grads=held + z.kept_shards, activations=acts.head_backward_saved,
                           temporaries=acts.head_backward_temporary + z.root_views + z.tied_grad))
    visits = acts.backward_blocks() if acts else [j for j in sorted({0, 1, n - 2, n - 1}) if 0 <= j < n]
    for j in visits:
        left = n - j
        buffers = root + blocks_held(j)
        in_flight = (acts.block_input_grad if acts else 0) + z.tied_grad + z.root_views
        points.append(dict(buffers=buffers, grads=accum_done(j) + shards_done(j),
                           activations=acts.block_backward_saved(left) if acts else 0,
                           temporaries=(acts.block_backward_temporary_at(left) if acts else 0) + z.first_grads
                           + z.tied_grad + z.root_views))
        end_acts = acts.blocks_left_saved(left - 1) if acts else 0
        # SplitWithSizesBackward: the views' gradients and the flat gradient they are concatenated into
        points.append(dict(buffers=buffers, grads=accum_done(j) + shards_done(j) + z.block_flat_grad,
                           activations=end_acts, temporaries=in_flight + z.block_views + z.adapter_reduce))
        # the post-backward: resharded (FULL_SHARD), the next block prefetched (BACKWARD_POST), the gradient cast,
        # padded and reduce-scattered while the autograd-computed one is still referenced
        after = root + (blocks_held(j) - block if resharded else blocks_held(j)) \
            + (block if post and resharded and j < n - 1 else 0)
        points.append(dict(buffers=after + z.block_reduce, grads=accum_done(j) + shards_done(j) + z.block_flat_grad,
                           activations=end_acts, temporaries=in_flight))
    done = z.kept_shards or n * z.block_shard_grad
    # the embedding's backward ends the root's: its views' gradients (the head's, the embedding's, a tied one's sum)
    # are concatenated into the root's flat gradient, then reduced
    root_grads = held - n * z.accum_block
    points.append(dict(buffers=root, grads=root_grads + done + z.root_flat_grad, temporaries=z.root_views + 3 * z.tied_grad))
    points.append(dict(buffers=z.root_reduce + (0 if resharded else root), grads=root_grads + done + z.root_flat_grad))
    return largest_point(*points)
