"""torchao's NF4Tensor (torchtune's QLoRA base, issue 23) against the library on CPU: what it stores, what FSDP2
shards of it, and what its dequantization and its conversion allocate. The grid rows `*torchao-nf4*` check whole
runs on one rank and under FSDP2 (docs/accuracy.md)."""

from __future__ import annotations

import weakref

import pytest

from zeroplan.estimate.adapters.lora import (nf4_conversion_bytes, nf4_dequantize_bytes, nf4_inner_bytes,
                                             nf4_whole_bytes, quantized_weight_bytes)
from zeroplan.spec.lora import QuantSpec

QUANT = QuantSpec(base_precision="torchao-nf4", compute_dtype="bf16")


def _nf4():
    pytest.importorskip("torchao")
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def _peak(run, existing) -> int:
    """Peak bytes of the tensors `run()` allocates beyond the `existing` ones (a dispatch mode; each storage released
    when it is freed; an op returning a view of an existing tensor allocates nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live = {"now": 0, "peak": 0}
    seen = {t.untyped_storage().data_ptr() for t in existing}

    def freed(pointer: int, size: int) -> None:
        live["now"] -= size
        seen.discard(pointer)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    storage = t.untyped_storage()
                    seen.add(storage.data_ptr())
                    live["now"] += storage.nbytes()
                    live["peak"] = max(live["peak"], live["now"])
                    weakref.finalize(storage, freed, storage.data_ptr(), storage.nbytes())
            return out

    with Count():
        kept = run()  # noqa: F841 - alive until the count ends, as the caller keeps it
    return live["peak"]


@pytest.mark.parametrize("shape", [(256, 512), (512, 128)])
def test_storage_is_what_to_nf4_keeps(shape):
    nf4 = _nf4()
    import torch

    weight = torch.randn(*shape, dtype=torch.bfloat16)
    tensor = nf4.to_nf4(weight)
    inner = sum(getattr(tensor, name).nbytes for name in ("quantized_data", "quantized_scalers", "quantization_factor"))
    whole = tensor.scaler_mean.nbytes + tensor.nf4.nbytes
    assert (inner, whole) == (nf4_inner_bytes(weight.numel(), QUANT), nf4_whole_bytes(QUANT))
    assert quantized_weight_bytes(weight.numel(), shape[0], QUANT) == inner + whole


def test_dequantization_peak_is_get_original_weight():
    nf4 = _nf4()
    import torch

    tensor = nf4.to_nf4(torch.randn(256, 512, dtype=torch.bfloat16))
    inner = [getattr(tensor, name) for name in ("quantized_data", "quantized_scalers", "quantization_factor",
                                                 "scaler_mean", "nf4")]
    measured = _peak(lambda: tensor.get_original_weight(), inner)
    # the derivation's int64 indices, halves and stack; the dequantized scalers (numel / 64) are the rest
    assert nf4_dequantize_bytes(256 * 512, QUANT) <= measured <= nf4_dequantize_bytes(256 * 512, QUANT) * 1.01


def test_conversion_peak_is_to_nf4():
    nf4 = _nf4()
    import torch

    weight = torch.randn(256, 512, dtype=torch.bfloat16)
    measured = _peak(lambda: nf4.to_nf4(weight), [weight])
    # the derivation's two 16-wide comparisons and the scaled blocks and indices; the scalers are under 1%
    assert nf4_conversion_bytes(256 * 512, QUANT) <= measured <= nf4_conversion_bytes(256 * 512, QUANT) * 1.01
