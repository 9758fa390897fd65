"""Per-GPU memory that is not a tensor: zero for a CPU run.

CUDA_CONTEXT_BYTES: the CUDA context with PyTorch's kernels, cuBLAS workspace and NCCL's
communicator buffers. With lazy module loading (CUDA_MODULE_LOADING=LAZY, PyTorch's default since
1.13) the context is commonly reported at 300-600 MiB by nvidia-smi minus
torch.cuda.memory_reserved(); NCCL adds NCCL_BUFFSIZE (4 MiB, nccl docs "Environment Variables")
per channel and peer. zeroplan takes 512 MiB for both together. It was NOT measured here (no GPU
is available to this project yet): `zeroplan measure` on a GPU reports reserved minus allocated
and the nvidia-smi figure, and docs/accuracy.md is where a measured value will replace this one.
Allocator rounding (the caching allocator rounds each block up to 512 bytes,
c10/cuda/CUDACachingAllocator.cpp kMinBlockSize) is below 0.1% for these tensor sizes and is not
added; fragmentation (reserved beyond allocated) is reported by measure, not guessed here.
"""

from zeroplan.estimate.terms import named, register
from zeroplan.spec.training import Device, TrainingSpec

CUDA_CONTEXT_BYTES = 512 * 2**20
register({"CUDA context and communication buffers": "estimate/overhead.py (a stated 512 MiB, not measured)"})


def overhead_bytes(training: TrainingSpec) -> int:
    return named("CUDA context and communication buffers", CUDA_CONTEXT_BYTES if training.device == Device.CUDA else 0)
