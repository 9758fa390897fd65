"""modules_to_save copies under the torch engine (issue 12): PEFT's `ModulesToSaveWrapper`
(peft/utils/other.py) deep-copies the module, so the copy trains in the base's dtype, where the
torch engine's profile counts every trainable tensor in its own fp32 (docs/engines/lora.md
"Adapter dtype"). Apart from estimate/adapters/lora.py because it reads the torch engine's partition."""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.dtypes import optimizer_state_bytes
from zeroplan.estimate.engines.common import step_temporary_bytes
from zeroplan.estimate.engines.torch_ddp import largest_local_shard
from zeroplan.estimate.engines.rules import param_element_bytes
from zeroplan.estimate.adapters.lora import is_saved_copy
from zeroplan.estimate.result import Phase
from zeroplan.estimate.terms import named, register

register({f"modules_to_save copies in the base's dtype ({part})": "peft utils/other.py ModulesToSaveWrapper (a deep copy "
          "in the base's dtype, counted against the torch engine's element size: estimate/adapters/saved_copies.py)"
          for part in ("parameters", "DDP buckets", "gradients", "optimizer states", "step temporaries")})


class SavedCopyBytes(NamedTuple):
    """Bytes of the modules_to_save copies in their own dtype (`saved_copy_element`) minus the torch
    engine's count of them in its dtype, by category."""

    params: int
    buckets: int  # DDP's reducer buckets hold each gradient in its parameter's dtype (reducer.cpp, one bucket per dtype)
    all_grads: int  # every .grad present (the step, accumulation)
    head_grads: int  # the head's copy: its .grad is the first of backward
    states: int  # the largest rank's share (ZeroRedundancyOptimizer partitions by elements)
    step_temporaries: int


def saved_copy_bytes(facts, training, setup, element: int) -> SavedCopyBytes:
    """The corrections `SavedCopyBytes` names, for copies of `element` bytes against the engine's."""
    engine_element = param_element_bytes("torch", training.precision.value, 0)
    copies = [t.numel * g.count for g in facts.groups for t in g.trainable_tensors if is_saved_copy(t)]
    head = sum(t.numel for g in facts.groups if g.role == "final" for t in g.trainable_tensors if is_saved_copy(t))
    local = list(largest_local_shard(facts, setup.gpus if setup.zero_stage == 1 else 1))
    local_copies = [numel for numel in copies if numel in local]
    narrower = element - engine_element
    optimizer, impl = setup.optimizer, setup.program.optimizer_impl
    # the step's temporaries are in each tensor's dtype: a copy counts as numel x element / engine_element
    scaled = list(local)
    for numel in local_copies:
        scaled[scaled.index(numel)] = numel * element // engine_element
    temporaries = (step_temporary_bytes(max(scaled, default=0), sum(scaled), engine_element, optimizer, impl)
                   - step_temporary_bytes(max(local, default=0), sum(local), engine_element, optimizer, impl))
    states = sum(optimizer_state_bytes(numel, optimizer, element) - optimizer_state_bytes(numel, optimizer, engine_element)
                 for numel in local_copies)
    def copy(name: str, value: int) -> int:
        return named(f"modules_to_save copies in the base's dtype ({name})", value)

    return SavedCopyBytes(copy("parameters", sum(copies) * narrower),
                          copy("DDP buckets", sum(copies) * narrower if setup.program.ddp else 0),
                          copy("gradients", sum(copies) * narrower), copy("gradients", head * narrower),
                          copy("optimizer states", states), copy("step temporaries", temporaries))


def with_saved_copies(categories, phase, copy: SavedCopyBytes, full_grads: int):
    """`categories` of one torch-engine phase with the modules_to_save copies in their own dtype: the
    gradients present are all of them (`full_grads`), the head's once backward has begun, or none."""
    grads = categories.grads
    grads += copy.all_grads if grads >= full_grads else (copy.head_grads if grads and phase == Phase.BACKWARD else 0)
    states = categories.optimizer_states + (copy.states if categories.optimizer_states else 0)
    temporaries = categories.temporaries + (copy.step_temporaries if phase == Phase.OPTIMIZER_STEP else 0)
    return categories._replace(params=categories.params + copy.params, buffers=categories.buffers + copy.buckets,
                               grads=grads, optimizer_states=states, temporaries=temporaries)
