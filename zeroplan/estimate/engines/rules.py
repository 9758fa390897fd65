"""What each engine does with the parameters it is given, as rules other parts read (the adapters'
storage, the mesh) without importing an engine's profile: the engines' own files derive them and cite
their sources; this module states them once.

- torch (DDP, ZeroRedundancyOptimizer), FSDP2 and FSDP1 keep fp32 parameters and compute under autocast or a
  mixed-precision policy, pure bf16 casts the model (engines/torch_ddp.py, engines/fsdp2.py, engines/fsdp1.py);
- DeepSpeed casts the whole module to its 16-bit dtype unless the run is fp32 (runtime/engine.py
  `_configure_distributed_model`: `module.half()` / `bfloat16()`; engines/deepspeed.py);
- the paper engine counts what the ZeRO paper does (engines/paper.py): the precision's parameter bytes.
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES


def param_element_bytes(engine: str, precision: str, paper_param_bytes: int) -> int:
    """The element size the engine's profile gives every parameter it holds (`paper_param_bytes`: the paper
    engine's, the precision's `StateBytes.param`)."""
    if engine in ("torch", "fsdp2", "fsdp1"):
        return HALF_BYTES if precision == "pure-bf16" else FP32_BYTES
    if engine == "deepspeed":
        return FP32_BYTES if precision == "fp32" else HALF_BYTES
    return paper_param_bytes
