"""A short PyTorch FSDP2 snippet (torch.distributed.fsdp.fully_shard) that applies a zeroplan plan.

ZeRO stage 2 is `reshard_after_forward=False` (parameters stay gathered from forward to backward, only
gradients and optimizer states are sharded), stage 3 is `True` (torch/distributed/fsdp/_fully_shard/
_fully_shard.py, fully_shard docstring). Text generation only: no torch import here.
"""

from __future__ import annotations

from zeroplan.errors import SpecError
from zeroplan.importers.lora_options import fsdp2_peft_lines
from zeroplan.spec.program import FSDP2Units, fsdp2_reduces_in_param_dtype
from zeroplan.spec.training import Device, Offload, Optimizer, Precision, TrainingSpec

_PARAM_DTYPE = {  # MixedPrecisionPolicy: compute in param_dtype, reduce gradients in fp32
    Precision.FP32: "MixedPrecisionPolicy()",
    Precision.BF16: "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
    Precision.FP16: "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)",
    Precision.PURE_BF16: "MixedPrecisionPolicy()  # the model itself is bf16: no casts, no fp32 copy",
}
# accelerate's policy for the Trainer (spec/program.py fsdp2_reduces_in_param_dtype): gradients reduced in param_dtype
_PARAM_DTYPE_REDUCED = {
    Precision.BF16: "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)",
    Precision.FP16: "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)",
}
_OPTIMIZER = {
    Optimizer.ADAMW: "torch.optim.AdamW(model.parameters(), lr=lr)",
    Optimizer.ADAM: "torch.optim.Adam(model.parameters(), lr=lr)",
    # zeroplan's "sgd" keeps one momentum buffer, which torch.optim.SGD allocates only with momentum > 0.
    Optimizer.SGD: "torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)",
}  # bitsandbytes' optimizers cannot step FSDP2's DTensor shards: TrainingSpec refuses them with fsdp2


def write_fsdp2_snippet(training: TrainingSpec) -> str:
    """Python source defining `apply_plan(model, blocks, lr)` -> (model, optimizer) for this plan; under
    `fsdp2.units` split `apply_plan(model, blocks, embeddings, head, lr)`, the wrapping the estimate
    assumed (`training.fsdp2_wrapping`, as measure/engines/fsdp2_engine.py applies it)."""
    if training.zero_stage not in (2, 3):
        raise SpecError(f"zero_stage {training.zero_stage} has no FSDP2 form: fully_shard covers stages 2 and 3")
    if Offload.NVME in (training.offload_optimizer, training.offload_params):
        raise SpecError("FSDP2 offloads to cpu only (CPUOffloadPolicy); nvme needs DeepSpeed")
    reshard = training.zero_stage == 3
    wrapping = training.fsdp2_wrapping
    split = wrapping.units == FSDP2Units.SPLIT
    offload = Offload.CPU in (training.offload_optimizer, training.offload_params)
    # CPUOffloadPolicy pins host memory, which fails on a machine without an accelerator (NOTES.md);
    # pin on a GPU run only. It moves sharded parameters, gradients and the optimizer step together.
    pin = training.device == Device.CUDA
    policies = "mp_policy=mp_policy, offload_policy=offload_policy"
    lines = [
        f"# zeroplan plan: FSDP2, ZeRO stage {training.zero_stage}, {training.precision.value}, "
        f"{training.optimizer.value}, offload {'cpu' if offload else 'none'}, "
        f"micro batch {training.micro_batch} x {training.grad_accum} accumulation x {training.gpus} GPUs",
        *fsdp2_peft_lines(training),  # importers/lora_options.py
        "import torch",
    ]
    lines += [
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard",
        "",
        "",
    ]
    if split:
        lines += [
            "def apply_plan(model, blocks, embeddings, head, lr=1e-4):",
            '    """Shard each block, the embeddings (list of modules) and the head ([final norm, output',
            "    projection]) as units of their own (accelerate's fsdp2_prepare_model), then the root;",
            '    call after init_process_group, before training."""',
        ]
    else:
        lines += [
            "def apply_plan(model, blocks, lr=1e-4):",
            '    """Shard each block, then the root; call after init_process_group, before training."""',
        ]
    if training.precision == Precision.PURE_BF16:
        lines.append("    model = model.to(torch.bfloat16)")
    mp_policy = _PARAM_DTYPE[training.precision]
    if training.precision in _PARAM_DTYPE_REDUCED and fsdp2_reduces_in_param_dtype(training.program.recipe):
        mp_policy = _PARAM_DTYPE_REDUCED[training.precision]
    lines += [
        f"    mp_policy = {mp_policy}",
        f"    offload_policy = {f'CPUOffloadPolicy(pin_memory={pin})' if offload else 'OffloadPolicy()'}",
    ]
    if wrapping.reshard_last_block == reshard:
        lines += ["    for block in blocks:", f"        fully_shard(block, reshard_after_forward={reshard}, {policies})"]
    else:
        lines += [
            "    for block in blocks[:-1]:",
            f"        fully_shard(block, reshard_after_forward={reshard}, {policies})",
            f"    fully_shard(blocks[-1], reshard_after_forward={wrapping.reshard_last_block}, {policies})",
        ]
    if split:
        lines += [
            "    tied = any(p is q for m in head for p in m.parameters() for e in embeddings for q in e.parameters())",
            "    if tied:  # one unit holds the shared matrix",
            f"        fully_shard(embeddings + head, reshard_after_forward={wrapping.reshard_head}, {policies})",
            "    else:",
            f"        fully_shard(embeddings, reshard_after_forward={reshard}, {policies})",
            f"        fully_shard(head, reshard_after_forward={wrapping.reshard_head}, {policies})",
            f"    fully_shard(model, {policies})  # holds no parameters",
        ]
    else:
        lines.append(f"    fully_shard(model, reshard_after_forward={wrapping.reshard_root}, {policies})")
    lines += [
        f"    optimizer = {_OPTIMIZER[training.optimizer]}" if training.lora is None else
        f"    optimizer = {_OPTIMIZER[training.optimizer].replace('model.parameters()', '[p for p in model.parameters() if p.requires_grad]')}",
        *(["    # fp16: scale the loss (torch.amp.GradScaler) so that small gradients do not underflow"]
          if training.precision == Precision.FP16 else []),
        "    return model, optimizer",
        "",
    ]
    return "\n".join(lines)
