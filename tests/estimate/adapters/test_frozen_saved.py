"""What a frozen base stops autograd from keeping, and what bitsandbytes' quantization state holds,
counted on the libraries themselves (saved-tensor hooks; the QuantState's tensors) against the
estimate's terms (estimate/adapters/lora.py `outside_blocks`, `adapter_activations`, `quant_state_bytes`)."""

from __future__ import annotations

import pytest

from zeroplan.estimate.adapters.lora import quant_state_bytes
from zeroplan.spec.lora import QuantSpec


def _saved_bytes(torch, fn, *args) -> int:
    """Bytes of the distinct storages autograd saves while `fn(*args)` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def test_a_frozen_rmsnorm_weight_keeps_no_normalized_tensor():
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    tokens, h = 64, 32
    norm = modeling.LlamaRMSNorm(h)
    x = torch.randn(tokens, h, requires_grad=True)
    trained = _saved_bytes(torch, norm, x)
    norm.weight.requires_grad_(False)
    frozen = _saved_bytes(torch, norm, x)
    # `self.weight * hidden_states.to(input_dtype)`: the normalized fp32 tensor is saved for the weight only
    assert trained - frozen == 4 * tokens * h


def test_a_norm_whose_input_needs_no_gradient_keeps_nothing():
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = modeling.LlamaRMSNorm(32).requires_grad_(False)
    # the first block's norm before the first adapter (frozen embeddings, no input-gradient hook)
    assert _saved_bytes(torch, norm, torch.randn(64, 32)) == 0


def test_a_frozen_head_keeps_no_input():
    torch = pytest.importorskip("torch")
    tokens, h, vocab = 64, 32, 100
    head = torch.nn.Linear(h, vocab, bias=False)
    x = torch.randn(tokens, h, requires_grad=True)
    trained = _saved_bytes(torch, head, x)
    head.weight.requires_grad_(False)
    # mm saves `self` for the weight's gradient and the weight for the input's: the input goes
    assert trained - _saved_bytes(torch, head, x) == 4 * tokens * h


def test_dropout_of_an_input_needing_no_gradient_keeps_no_noise():
    torch = pytest.importorskip("torch")
    dropout = torch.nn.Dropout(0.1).train()
    x = torch.randn(64, 32)
    assert _saved_bytes(torch, dropout, x) == 0
    # on CPU `_dropout_impl` keeps the noise tensor in the input's dtype (aten Dropout.cpp)
    assert _saved_bytes(torch, dropout, x.requires_grad_()) == 4 * 64 * 32


@pytest.mark.parametrize("double_quant", [False, True])
def test_quant_state_bytes_are_those_of_bitsandbytes_quant_state(double_quant):
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    out_features, in_features = 96, 128
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    _, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    tensors = [state.absmax, state.code]
    if double_quant:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    stored = sum(t.numel() * t.element_size() for t in tensors)
    quant = QuantSpec(base_precision="nf4", double_quant=double_quant)
    assert quant_state_bytes(weight.numel(), quant) == stored


def test_int8_row_scales_are_counted_after_the_first_forward():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from zeroplan.measure.programs.peft_model import quantization_state_tensors

    out_features, in_features = 48, 64
    layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(torch.randn(out_features, in_features), requires_grad=False,
                                     has_fp16_weights=False).to("cpu")
    layer(torch.randn(4, in_features))
    # init_8bit_state moved SCB from the weight to layer.state: one fp32 scale per output row still lives
    assert layer.weight.SCB is None
    assert sum(t.numel() * t.element_size() for t in quantization_state_tensors(layer)) == 4 * out_features
