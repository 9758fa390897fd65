"""The output projection and loss of a measured step, for each `Loss` (zeroplan/spec/program.py).

- standard: the Hugging Face model's own loss (loss_utils.ForCausalLMLoss: fp32 logits, whole),
  run by `workload.CausalLM` itself, not here;
- chunked: torchtune 0.6.1's flow: `TransformerDecoder.chunked_output` (modules/transformer.py)
  applies the output projection to each of `h.chunk(N, dim=1)` and returns the list of logits
  chunks, then `CEWithChunkedOutputLoss.forward` (modules/loss/ce_chunked_output_loss.py) runs
  `F.cross_entropy(chunk.float(), labels, reduction="sum")` chunk by chunk and divides by the
  number of labelled tokens;
- chunked under the torchtitan recipe: torchtitan 0.3.0's flow (components/loss.py
  `ChunkedLossWrapper.__call__`): every chunk's lm_head, fp32 cross-entropy and backward run at
  once, inside the forward, into an fp32 gradient accumulator of the hidden states, which the
  decoder's backward then starts from (`torchtitan_chunked_loss`);
- fused-linear: a stand-in, in plain torch, for a fused linear + cross-entropy kernel such as
  Liger's (ops/fused_linear_cross_entropy.py `LigerFusedLinearCrossEntropyFunction`): the same
  chunks, buffers and saved tensors, computed by torch ops instead of its Triton kernel
  (docs/measure.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1; the last position is ignored (ForCausalLMLoss pads and shifts;
    torchtune's recipes hstack the ignore index after labels[..., 1:])."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def chunked_logits(hidden: torch.Tensor, head: nn.Module, chunks: int) -> list[torch.Tensor]:
    """torchtune `TransformerDecoder.chunked_output`: every chunk's logits, all alive together."""
    return [head(chunk) for chunk in hidden.chunk(chunks, dim=1)]


def chunked_cross_entropy(logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """torchtune `CEWithChunkedOutputLoss.forward`: one chunk upcast to fp32 at a time."""
    total_elements = (labels != IGNORE_INDEX).sum()
    label_chunks = [chunk.reshape(-1) for chunk in labels.chunk(len(logits), dim=1)]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, label_chunks):
        logits_chunk = logits_chunk.reshape(-1, logits_chunk.size(-1))
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=IGNORE_INDEX, reduction="sum")
    return total_loss / total_elements


def torchtitan_chunked_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """torchtitan 0.3.0 `ChunkedLossWrapper.__call__` with its default `CrossEntropyLoss` over
    `hidden` (the model's output with `_skip_lm_head=True`). The hidden states are split on the
    sequence into `chunks` `.contiguous()` copies, each `detach().requires_grad_()`, all made up
    front; a `GradAccumulator` buffer is `zeros_like(hidden, dtype=float32)`; per chunk
    `head(chunk)`, `cross_entropy(logits.flatten(0, 1).float(), reduction="sum")` divided by the
    token count, and `chunk_loss.backward()` at once, its input gradient copied into the buffer
    and dropped. Returns the summed loss, whose backward hands the accumulated gradient (cast to
    the hidden states' dtype) to the decoder (`_DecoderOutputGradientBackProp`). With `head` an
    FSDP2 unit of its own, its resharding and gradient sync are held off until the last chunk,
    as torchtitan does; measure's FSDP2 runner keeps the head in the root unit, where no FSDP hook
    runs inside the forward (docs/measure.md)."""
    from torch.distributed.fsdp import FSDPModule

    seq_len = hidden.shape[1]
    if seq_len % chunks:  # torchtitan: torch._check(seq_len % num_chunks == 0)
        raise ValueError(f"ChunkedLossWrapper sequence length must be divisible by num_chunks ({seq_len} by {chunks})")
    width = seq_len // chunks
    hidden_chunks = [c.contiguous().detach().requires_grad_(hidden.requires_grad)
                     for c in torch.split(hidden, [width] * chunks, dim=1)]
    label_chunks = [c.contiguous() for c in torch.split(labels, [width] * chunks, dim=1)]
    # the trainer divides by the global count of labelled tokens; one micro-batch's here (same memory)
    valid_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
    accumulated = torch.zeros_like(hidden, dtype=torch.float32) if hidden.requires_grad else None
    fsdp = isinstance(head, FSDPModule)
    if fsdp:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    total_loss = hidden.new_zeros((), dtype=torch.float32)
    for index, (hidden_chunk, label_chunk) in enumerate(zip(hidden_chunks, label_chunks)):
        if fsdp and index == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(hidden_chunk)
        chunk_loss = F.cross_entropy(logits.flatten(0, 1).float(), label_chunk.flatten(0, 1),
                                     reduction="sum", ignore_index=IGNORE_INDEX) / valid_tokens
        total_loss = total_loss + chunk_loss.detach()
        if accumulated is not None:
            chunk_loss.backward()
            accumulated[:, index * width:(index + 1) * width] = hidden_chunk.grad.to(torch.float32)  # GradAccumulator.add
            hidden_chunk.grad = None
        del logits, chunk_loss
    if fsdp:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    if accumulated is None:
        return total_loss
    return _DecoderOutputGradient.apply(hidden, accumulated.to(hidden.dtype), total_loss)


class _DecoderOutputGradient(torch.autograd.Function):
    """torchtitan `_DecoderOutputGradientBackProp`: the loss's backward returns the accumulated
    gradient as the hidden states' gradient, whatever the incoming gradient (torchtitan scales by
    the global token count in forward instead)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, accumulated: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(accumulated)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (accumulated,) = ctx.saved_tensors
        return accumulated, None, None


def fused_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk: next_power_of_2(ceil(BT / ceil(V / H))), at most BT, so a chunk's logits
    are about the size of the hidden states."""
    inc_factor = -(-vocab // hidden)
    wanted = -(-tokens // inc_factor)
    return min(1 << (wanted - 1).bit_length(), tokens)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear + cross-entropy (reduction mean), in torch ops: the gradients are
    computed in forward, chunk by chunk, and backward returns them.

    Allocates what the kernel's host code does: grad_input = zeros_like(input), grad_weight =
    zeros_like(weight), an fp32 loss per token, and per chunk its logits, turned into their own
    gradient in place (the Triton kernel does that in one pass; here in-place torch ops), and that
    gradient times the weight. grad_weight is accumulated in place (addmm_, as the kernel's CUDA
    path); a weight in another dtype than the logits (fp32 under autocast) gets casts of the chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]  # x: (tokens, hidden), weight: (vocab, hidden), labels: (tokens,)
        chunk = fused_chunk_tokens(tokens, x.shape[1], weight.shape[0])
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=x.device)
        valid = labels != IGNORE_INDEX
        count = max(int(valid.sum()), 1)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            x_chunk, keep = x[start:end], valid[start:end]
            target = labels[start:end].clamp(min=0).unsqueeze(1)
            logits = x_chunk @ weight.t()  # (chunk, vocab)
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            total = logits.sum(dim=-1, keepdim=True)
            picked = logits.gather(1, target)
            loss_1d[start:end] = torch.where(keep, (total.log() - picked.log()).squeeze(1).float(), 0.0)
            logits.div_(total)  # softmax; its gradient: minus one at the target, over the labelled count
            logits.scatter_add_(1, target, torch.full_like(picked, -1.0))
            logits.mul_(keep.unsqueeze(1).to(logits.dtype) / count)
            grad_input[start:end] = logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(logits.t().to(grad_weight.dtype), x_chunk.to(grad_weight.dtype))
            del logits, total, picked
        ctx.save_for_backward(grad_input, grad_weight)
        return loss_1d.sum() / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, grad_weight = ctx.saved_tensors
        if not torch.equal(grad_output, torch.ones_like(grad_output)):  # Liger scales them in place
            grad_input.mul_(grad_output)
            if grad_weight is not None:
                grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None


def fused_linear_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """The loss of `head` over `hidden` without the logits: called through the head module, so
    that hooks gathering its weight (DeepSpeed ZeRO-3) run around it."""
    return _call_through(head, lambda x, y: FusedLinearCrossEntropy.apply(x, head.weight, y),
                         hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


def _call_through(module: nn.Module, function: Callable, *args):
    forward = module.forward
    module.forward = function
    try:
        return module(*args)
    finally:
        module.forward = forward
