"""torchtune 0.6.1's activation offloading (training/_activation_offloading.py `OffloadActivations`),
run on CPU so that `zeroplan measure --activation-offload cpu` measures the same program.

The policy, as torchtune's source has it (use_streams=True, max_fwd_stash_size=5,
min_offload_size=1024, the defaults of `get_act_offloading_ctx_manager`):
- pack: a saved tensor of at least 1024 bytes (element_size x nelement) that is not an
  nn.Parameter or nn.Buffer is copied to a host tensor; the original stays in the forward stash
  until a later offloaded pack finds its id at least 5 below its own (ids count every pack).
  A parameter's transpose (what mm saves of nn.Linear's weight) is no Parameter: it is copied too.
- unpack: a tensor still in the forward stash is returned as it is; any other comes back as a new
  device tensor, kept in the backward stash until the hook of the next autograd node that brings
  one back has run (or the end of backward); the whole forward stash is dropped at the first such hook.
- the output head runs under a no-op hook pair (NoOpManager), so what it saves stays put; the
  context covers the model's forward only (the loss is outside).
On a CPU-only machine there are no streams: their events order copies and free nothing, so they
are left out. The host copies are made outside the live-tensor accounting (`accounting.uncounted`)
and counted here instead (`host_bytes`, `peak_host_bytes`): on a GPU machine they sit in pinned
host memory, not on the device (docs/measure.md, "Activation offloading").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from zeroplan.measure.accounting import uncounted

MAX_FWD_STASH_SIZE = 5  # torchtune OffloadActivations(max_fwd_stash_size=5)
MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)


class OffloadActivations(saved_tensors_hooks):
    """Enter around the model's forward; the backward then brings the offloaded tensors back."""

    def __init__(self) -> None:
        self._tracker: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor, offloaded)
        self._fwd_stash: dict[int, torch.Tensor] = {}
        self._bwd_stash: dict[int, torch.Tensor] = {}
        self._next_id = 0
        self._first_backward_call = True
        self._node = None
        self.host_bytes = 0  # host copies alive now
        self.peak_host_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        self._first_backward_call = True
        self._next_id += 1
        tensor_id = self._next_id
        nbytes = activation.element_size() * activation.nelement()
        if nbytes < MIN_OFFLOAD_BYTES or isinstance(activation, (nn.Parameter, nn.Buffer)):
            self._tracker[tensor_id] = (activation, False)
            return tensor_id
        for old in [k for k in self._fwd_stash if k <= tensor_id - MAX_FWD_STASH_SIZE]:
            del self._fwd_stash[old]
        with uncounted():  # pinned host memory on a GPU machine
            host = torch.empty_like(activation, device="cpu")
            host.copy_(activation)
        self._add_host(nbytes)
        self._tracker[tensor_id] = (host, True)
        self._fwd_stash[tensor_id] = activation
        return tensor_id

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        if self._first_backward_call:
            self._first_backward_call = False
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_stash.clear)
        tensor, offloaded = self._tracker.pop(tensor_id)
        if not offloaded:
            return tensor
        self._add_host(-(tensor.element_size() * tensor.nelement()))
        node = torch._C._current_autograd_node()
        previous = []
        if node is not self._node:  # a new node: the last node's tensors go after it has run
            self._node = node
            previous = list(self._bwd_stash)
        if tensor_id in self._fwd_stash:
            device_tensor = self._fwd_stash[tensor_id]
        else:
            device_tensor = tensor.to(self._device_of(tensor), copy=True)  # .to("cuda") in torchtune
            self._bwd_stash[tensor_id] = device_tensor

        def after_node(outputs, inputs):
            self._fwd_stash.clear()
            for old in previous:
                self._bwd_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(after_node)
        return device_tensor

    def _add_host(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    @staticmethod
    def _device_of(tensor: torch.Tensor) -> torch.device:
        return tensor.device  # a CPU run: the device is the host


class NoOpManager(saved_tensors_hooks):
    """torchtune's NoOpManager: saved tensors stay as they are (entered around the output head)."""

    def __init__(self) -> None:
        super().__init__(lambda tensor: tensor, lambda tensor: tensor)


def offloading_for(head: nn.Module) -> OffloadActivations:
    """The offloading context of a model whose output head is `head`, which it leaves alone
    (torchtune `get_act_offloading_ctx_manager`: NoOpManager entered in the head's forward hooks)."""
    noop = NoOpManager()
    head.register_forward_pre_hook(lambda *args: noop.__enter__())
    head.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)
    return OffloadActivations()
