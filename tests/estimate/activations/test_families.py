"""Activations of the dense families' blocks (issue 13) against what transformers' modules save.

Each tiny family model (model_specs/<family>-tiny.toml) is built through transformers on one
process, as `zeroplan measure` builds it, and every tensor autograd saves during its forward is
recorded (one count per storage, parameters left out): the blocks' bytes must equal the estimate's
`num_blocks x saved_per_block` plus the rotary tables it counts outside the blocks. The families'
terms must vanish for every model that leaves the family fields at their defaults.
"""

from __future__ import annotations


import pytest

import zeroplan.estimate.activations.families as families
from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.importers.catalog import list_models, resolve_model
from zeroplan.measure.grid import Row, row_specs
from tests.paths import DATA

CASES = [
    ("qwen3-tiny", "fused"), ("qwen3-tiny", "eager"),
    ("gemma2-tiny", "eager"),  # Gemma2PreTrainedModel._supports_sdpa is False: SDPA cannot soft-cap
    ("gemma3-tiny", "fused"), ("gemma3-tiny", "eager"),
    ("olmo2-tiny", "fused"), ("olmo2-tiny", "eager"),
    ("phi4-tiny", "fused"), ("phi4-tiny", "eager"),
    (str(DATA / "phi3-mha-tiny.toml"), "fused"),  # phi-3-mini's attention: no GQA
    (str(DATA / "phi3-mha-tiny.toml"), "eager"),
]


def _saved_by_blocks(name: str, attention: str, precision: str, seq_len: int) -> tuple[int, int]:
    """(bytes the blocks' forward saves, bytes of the estimate for them) for a micro-batch of 2."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.measure.workload import hf_config_kwargs

    engine = "torch" if precision == "fp32" else "deepspeed"  # deepspeed bf16: the model itself in bf16
    model, training = row_specs(Row(name, engine, 2 if engine == "deepspeed" else 1, precision, attention=attention,
                                    seq_len=seq_len))
    model_type, kwargs = hf_config_kwargs(model)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    lm = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **kwargs),
        attn_implementation="sdpa" if attention == "fused" else "eager", dtype=dtype)
    lm.train()
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    seen: set[int] = set()
    inside = [False]
    total = [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return tensor

    blocks = lm.model.layers
    blocks[0].register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    blocks[-1].register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, model.vocab_size, (2, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm(input_ids=ids, use_cache=False)
    acts = activation_bytes(model, training, dtype.itemsize)
    rotary = 2 * seq_len * model.dim_per_head * families.rotary_element_bytes(model, dtype.itemsize) * families.rotary_tables(model)
    return total[0], acts.num_blocks * acts.saved_per_block + rotary


@pytest.mark.parametrize("name, attention", CASES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_saved_tensors_equal_what_transformers_saves(name, attention, precision):
    measured, estimated = _saved_by_blocks(name, attention, precision, seq_len=128)
    assert estimated == measured


@pytest.mark.parametrize("name", ["gemma3-tiny"])
def test_below_the_window_sdpa_gets_no_mask(name):
    # seq_len 32 < sliding_window 64: masking_utils skips the mask, SDPA keeps k and v at kv width
    measured, estimated = _saved_by_blocks(name, "fused", "fp32", seq_len=32)
    assert estimated == measured


def test_family_terms_vanish_for_every_model_without_them():
    plain = [s for s in list_models() if s.kind == "transformer" and s.qk_norm == "none" and s.norm_placement == "pre"
             and not (s.norm_unit_offset or s.attention_softcap or s.final_logit_softcap or s.sliding_window)]
    assert {"llama-2-7b", "gpt2", "mixtral-8x7b", "phi-3-mini", "gemma-7b"} <= {s.name for s in plain}
    for spec in plain:
        assert families.qk_norm_saved_per_token(spec, 2) == families.output_norm_saved_per_token(spec, 2) == 0
        assert families.softcap_scores_per_token(spec, True, 4096, 2) == families.final_softcap_per_token(spec, 2) == 0
        assert families.sliding_saved_per_token(spec, "fused", 4096, 2) == families.offset_weights_bytes(spec) == 0
        assert families.rotary_tables(spec) == 1


def test_gemma_logits_and_softcap_against_their_definitions():
    # Gemma 2's 256k vocabulary: tanh of the final soft-capping keeps vocab x tokens in bf16, beside
    # log_softmax's fp32 output (vocab x tokens x 4), which is what dwarfs a block.
    spec = resolve_model("gemma-2-9b")
    model, training = row_specs(Row("gemma-2-9b", "deepspeed", 3, "bf16", attention="eager", micro_batch=1, seq_len=4096))
    acts = activation_bytes(model, training, 2)
    tokens = 4096
    assert acts.loss_saved == tokens * spec.vocab_size * (4 + 2)
    assert acts.logits == tokens * spec.vocab_size * 2
    assert acts.saved_per_block < acts.loss_saved


def test_measure_refuses_sdpa_for_soft_capped_attention_before_any_worker():
    pytest.importorskip("torch")
    from zeroplan.errors import MeasureError
    from zeroplan.measure.launcher import run_measurement

    model, training = row_specs(Row("gemma2-tiny", "torch", 1, "fp32", attention="fused"))
    with pytest.raises(MeasureError, match=r"^attention: SDPA cannot soft-cap attention logits \(transformers refuses "
                                           r"it for gemma2\); measure --attention eager$"):
        run_measurement(model, training, nproc=2)
