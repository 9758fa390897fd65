"""Context parallelism on CPU, for measuring only: torch's own ring attention with the CPU flash kernel.

Why. torch 2.13's context parallelism (torch/distributed/tensor/experimental/_context_parallel/
_attention.py) wraps q, k, v as DTensors sharded on the sequence and lets the DTensor dispatcher hand
the SDPA op to `_templated_ring_attention` (and its backward to `_templated_ring_attention_backward`).
It maps only the CUDA kernels (`_sdpa_handler`: flash, efficient, cuDNN). On CPU, SDPA dispatches to
`aten._scaled_dot_product_flash_attention_for_cpu`, which has neither a handler nor a sharding rule:
  NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
  have a sharding strategy registered.
(forcing the math kernel instead fails with "mixed torch.Tensor and DTensor": the math path builds
its causal mask as a plain tensor).

What this changes, and nothing else:
- a CP sharding rule for the CPU op and its backward, the rule torch registers for the flash op
  (`_sharding_rules.py` `_scaled_dot_product_flash_attention_cp_strategy`: every tensor Shard(2));
- a DTensor custom op handler for the two CPU ops, doing what `_sdpa_handler` does (unwrap,
  propagate, call the ring, wrap) with the ring templated over the CPU op: the CPU op's signature
  (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, logsumexp) is passed through
  unchanged, and its backward's (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal) too;
- the ring's own tensors are counted: the accounting's dispatch mode (measure/accounting.py) sees
  only the ops called on DTensors, not the local ops a DTensor handler runs; on a GPU the caching
  allocator sees both. The handler re-enters the active accounting around the ring.
The ring (chunking, load-balanced halves, the fp32 out/logsumexp merger, the fp32 gradient
accumulators, the all-gather or all-to-all rotaters) is torch's, unchanged. Differences from the CUDA
path are listed in docs/measure.md, "Context parallelism on CPU".
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, Shard

aten = torch.ops.aten
SEQ_DIM = 2  # q, k, v are (batch, heads, sequence, head dim); torch's ring hardcodes the same
CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _forward_strategy(op_schema):
    """out, logsumexp | q, k, v: all on the sequence, as torch's flash CP strategy."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_strategy(op_schema):
    """grad q, k, v | grad_out, q, k, v, out, logsumexp: all on the sequence, as torch's flash CP backward strategy."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise NotImplementedError("context parallelism takes is_causal, not an attention mask")
    return _templated_ring_attention(mesh.get_group(), SEQ_DIM, CPU_FORWARD, query=query, key=key, value=value,
                                     is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

    if attn_mask is not None:
        raise NotImplementedError("context parallelism takes is_causal, not an attention mask")
    return _templated_ring_attention_backward(mesh.get_group(), SEQ_DIM, CPU_BACKWARD, grad_out=grad_out,
                                              grad_out_name="grad_out", query=query, key=key, value=value, out=out,
                                              logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
                                              scale=scale)


_RINGS = {CPU_FORWARD: _ring_forward, CPU_BACKWARD: _ring_backward}


@contextlib.contextmanager
def _counted():
    """The active accounting's mode pushed back for the ring's local ops (torch pops a dispatch mode while
    it handles an op, so the DTensor handler below it runs unseen)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    from zeroplan.measure.accounting import active_accounting

    accounting = active_accounting()
    if accounting is None or any(mode is accounting for mode in _get_current_dispatch_mode_stack()):
        yield
        return
    _push_mode(accounting)
    try:
        yield
    finally:
        _pop_mode()


def _ring_handler(op_call, args, kwargs):
    """torch's `_sdpa_handler` for the CPU ops."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise NotImplementedError(f"{op_call}: context parallelism needs q, k and v sharded on the sequence")
    with _counted():
        local_results = _RINGS[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local_results, output_sharding.output_spec)


def enable_cpu_ring_attention(cp_mesh, rotate_method: str = "allgather") -> None:
    """Turn on torch's SDPA context parallelism over `cp_mesh` (the legacy monkey-patch of
    F.scaled_dot_product_attention that wraps q, k, v as Shard(2) DTensors: the same DTensors
    torchtitan 0.3.0's `apply_cp_to_forward` makes), then add the CPU kernel's rule and handler.
    `rotate_method` as torch's `set_rotate_method` (torchtitan 0.3.0 leaves torch's default, allgather)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.set_rotate_method(rotate_method)
    _attention._cp_options.enable_load_balance = True  # the head-tail split (`shard_batch`)
    _attention._dispatch_mode = _attention._DispatchMode.MONKEY_PATCH
    _attention._enable_context_parallel_dispatcher_impl(seq_dim=SEQ_DIM, mesh=cp_mesh)
    register_op_strategy(CPU_FORWARD, schema_info=RuntimeSchemaInfo(3))(_forward_strategy)
    register_op_strategy(CPU_BACKWARD)(_backward_strategy)
    DTensor._op_dispatcher._custom_op_handlers = {**DTensor._op_dispatcher._custom_op_handlers,
                                                  CPU_FORWARD: _ring_handler, CPU_BACKWARD: _ring_handler}


def shard_batch(cp_mesh, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's head-tail shard of each (batch, sequence) tensor: torchtitan 0.3.0 `cp_shard` with its
    default load balancer "headtail" (`_HeadTailLoadBalancer`: chunks r and 2 cp - 1 - r for rank r)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    balancer = _HeadTailLoadBalancer(tensors[0].shape[1], cp_mesh.size(), cp_mesh.device_type)
    shards = _attention._context_parallel_shard(cp_mesh, tensors, [1] * len(tensors), load_balancer=balancer)
    _attention._dispatch_mode = _attention._DispatchMode.MONKEY_PATCH  # `_context_parallel_shard` resets it; the patch stays
    return shards


def cp_batch(cp_mesh, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's token ids, next-token labels and positions (torchtitan 0.3.0 `prepare_context_parallel_input`:
    the dataloader's labels are already the next tokens, so they are shifted before the sequence is cut)."""
    import torch.nn.functional as F

    next_tokens = F.pad(labels, (0, 1), value=-100)[:, 1:]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, seq), as torchtitan's
    ids, targets, local_positions = shard_batch(cp_mesh, [input_ids, next_tokens, positions])
    return ids, targets, local_positions
