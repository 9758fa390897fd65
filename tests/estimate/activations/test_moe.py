"""The saved activations of Qwen3-MoE, DeepSeek-V3 and GPT-OSS blocks against what transformers'
modules keep: one forward of each tiny model, every tensor autograd saves inside the decoder
blocks that is still held when the forward ends (storage by storage), summed over the blocks,
against the estimate's blocks (docs/engines/moe.md)."""

from __future__ import annotations

import gc
import weakref

import pytest

from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 128


class _Held:
    """What the pack hook returns: alive as long as the graph node that saved the tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


def _saved_in_blocks(name: str, dtype) -> tuple[int, int]:
    """(bytes of the distinct storages saved inside the blocks and still held after the forward,
    bytes of the rotary cos and sin among them, which the estimate counts outside the blocks)."""
    from zeroplan.measure.workload import hf_config_kwargs

    spec = resolve_model(name)
    model_type, kwargs = hf_config_kwargs(spec)
    attention = "eager" if spec.attention_sinks else "sdpa"
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs),
                                                        attn_implementation=attention, dtype=dtype)
    lm.train()
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    inside = [False]
    held: list[tuple[weakref.ref, torch.Tensor]] = []

    def pack(tensor):
        box = _Held(tensor)
        if inside[0] and tensor.untyped_storage().data_ptr() not in params:
            held.append((weakref.ref(box), tensor))
        return box

    for layer in lm.model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        loss = lm(input_ids=tokens, labels=tokens).loss
        gc.collect()
        storages = {}
        for ref, tensor in held:
            if ref() is not None:
                storages[tensor.untyped_storage().data_ptr()] = (tensor.untyped_storage().nbytes(), tuple(tensor.shape))
    del loss
    rotary = sum(size for size, shape in storages.values() if shape[:2] == (1, 1) or shape[:1] == (1,))
    return sum(size for size, _ in storages.values()), rotary


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "dsv3-tiny", "gptoss-tiny"])
@pytest.mark.parametrize("precision", ["fp32", "pure-bf16"])
def test_blocks_keep_what_the_estimate_says(name, precision):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    measured, rotary = _saved_in_blocks(name, dtype)
    spec = resolve_model(name)
    training = TrainingSpec(engine="torch", precision=precision, micro_batch=BATCH, seq_len=SEQ, device="cpu",
                            attention="eager" if spec.attention_sinks else "fused")
    estimated = activation_bytes(spec, training, dtype.itemsize).saved_per_block * spec.num_layers
    assert estimated == pytest.approx(measured - rotary, rel=0.003)
