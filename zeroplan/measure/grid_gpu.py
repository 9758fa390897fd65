"""Small grids for the first machine with GPUs (`zeroplan validate --backend nccl --grid gpu-1`, `gpu-8` or
`gpu-1-quant`): what the allocated, reserved and device figures are checked on.

Each is sized to finish in under ten minutes: real catalogue models with random weights (no
download), bf16 mixed precision, 3 steps, a row being about a minute (process start, NCCL set-up,
the model built on the device). gpu-1 wants one GPU of at least 40 GB (an A100 or H100); gpu-8 eight
of them on one node. Each rank records max_memory_allocated and _reserved, memory_stats()'s retries,
inactive split bytes and OOMs, and NVML's used memory (measure/context.py CudaProbe), and replays its
own allocation stream through the allocator model (measure/allocator_replay.py): the replay beside
the real allocator checks the model, the measured figures beside the estimate check the estimate.
DeepSpeed rows are left out: building its CUDA ops (FusedAdam) takes minutes on a fresh machine.
"""

from __future__ import annotations

from zeroplan.measure.grid import LoraRow, Row

_ONE = dict(world=1, precision="bf16", recipe="plain")
_EIGHT = dict(world=8, precision="bf16", recipe="plain")

# FSDP1's CPU offload (issue 23) cannot run on a CPU-only machine (CPUOffload pins host memory): derived from the
# source (docs/engines/fsdp1.md, "CPU offload") and checked here, on one GPU: the flat shards, their gradients and the
# optimizer on the host, the unsharded units and activations on the device; then the FSDP-QLoRA recipe of Answer.AI
# and PEFT scaled to one 1B model: a 4-bit base stored as bf16, offloaded, PEFT's wrapping (use_orig_params false).
FSDP1_GPU_1: tuple[Row, ...] = (
    Row("llama-3.2-1b", "fsdp1", 3, micro_batch=2, seq_len=2048, checkpointing="full", offload=True, **_ONE),
    Row("llama-3.2-1b", "fsdp1", 3, micro_batch=2, seq_len=1024, checkpointing="full", offload=True, model_init="host",
        lora=LoraRow(8, base_precision="nf4", double_quant=True, compute_dtype="bf16", quant_storage="bf16"),
        fsdp1=(("use_orig_params", False),), **_ONE),
)

GPU_1: tuple[Row, ...] = FSDP1_GPU_1 + (
    Row("llama-100m", "torch", 0, micro_batch=8, seq_len=1024, **_ONE),
    Row("llama-100m", "torch", 0, micro_batch=8, seq_len=1024, checkpointing="full", **_ONE),
    Row("gpt2-medium", "torch", 0, micro_batch=8, seq_len=1024, **_ONE),
    Row("pythia-1b", "torch", 0, micro_batch=4, seq_len=2048, checkpointing="full", **_ONE),
    Row("llama-3.2-1b", "torch", 0, micro_batch=2, seq_len=2048, checkpointing="full", **_ONE),
)

GPU_8: tuple[Row, ...] = (
    Row("llama-3.2-1b", "fsdp2", 3, micro_batch=2, seq_len=2048, **_EIGHT),
    Row("llama-3.2-1b", "fsdp2", 2, micro_batch=2, seq_len=2048, **_EIGHT),
    Row("llama-3.2-3b", "fsdp2", 3, micro_batch=1, seq_len=4096, checkpointing="full", **_EIGHT),
    Row("gpt2-large", "torch", 0, micro_batch=4, seq_len=1024, **_EIGHT),
    Row("llama-3.2-1b", "torch", 1, micro_batch=2, seq_len=2048, checkpointing="full", **_EIGHT),
)

# bitsandbytes on one GPU (issue 23; docs/engines/torch.md "bitsandbytes optimizers"): what CPU runs cannot check.
# The paged rows: max_memory_allocated must leave the paged states out (the estimate's peak) and NVML's used memory
# hold them while the GPU has room (the peak plus per_node.unified); the unpaged 8-bit row: the fused CUDA update
# allocates nothing (no step temporaries); the QLoRA row: the paper's recipe under the Trainer.
GPU_QUANT: tuple[Row, ...] = (
    Row("llama-3.2-1b", "torch", 0, "pure-bf16", world=1, recipe="torchtune", micro_batch=2, seq_len=2048,
        checkpointing="full", optimizer="adam8bit", paged=True),
    Row("llama-3.2-1b", "torch", 0, "bf16", world=1, ddp=False, micro_batch=2, seq_len=2048, checkpointing="full",
        optimizer="adam8bit"),
    Row("llama-3.2-1b", "torch", 0, "bf16", world=1, recipe="hf-trainer", micro_batch=2, seq_len=2048,
        checkpointing="full", optimizer="adam8bit", paged=True,
        lora=LoraRow(16, base_precision="nf4", double_quant=True, compute_dtype="bf16", upcast=True)),
)

GRIDS: dict[str, tuple[Row, ...]] = {"gpu-1": GPU_1, "gpu-8": GPU_8, "gpu-1-quant": GPU_QUANT}
