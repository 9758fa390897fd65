"""Hugging Face config.json import: each family's keys and defaults, and the errors."""

from __future__ import annotations

import sys

import pytest

from zeroplan.estimate.model.layout import param_layout
from zeroplan.errors import SpecError
from zeroplan.importers.hf_config import SUPPORTED_MODEL_TYPES, spec_from_hf_config

# Configs that leave out every key with a default, so the defaults decide the shapes. The head
# counts fit each family's default num_key_value_heads (Mistral/Mixtral 8, Gemma 16, Qwen2 32).
MINIMAL = {
    "llama": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
    "mistral": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 16},
    "mixtral": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 16},
    "qwen2": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 32},
    "gemma": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 16},
    "phi3": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
    "gpt2": {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4},
    "gpt_neox": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
    # Qwen3 32 key/value heads, Gemma 2/3 4, OLMo 2 as many as heads; gemma3 nests its language model.
    "qwen3": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 32},
    "gemma2": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8},
    "gemma3_text": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8},
    "gemma3": {"text_config": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}},
    "olmo2": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
    # Qwen3-MoE: 4 kv heads by default; DeepSeek-V3: wide enough for its default MLA ranks (q 1536,
    # kv 512) and its 3 dense first layers; GPT-OSS: 8 kv heads of 64 by default.
    "qwen3_moe": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8},
    "deepseek_v3": {"vocab_size": 64, "hidden_size": 2048, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 16},
    "gpt_oss": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8},
}


def _spec(model_type: str, **overrides):
    return spec_from_hf_config({"model_type": model_type, **MINIMAL[model_type], **overrides}, "m")


def test_minimal_configs_cover_every_supported_type():
    assert set(MINIMAL) == set(SUPPORTED_MODEL_TYPES)


def test_gpt2_keys_and_defaults():
    spec = _spec("gpt2")
    assert (spec.hidden_size, spec.num_layers, spec.num_heads) == (32, 2, 4)
    assert spec.intermediate_size == 4 * 32  # n_inner None -> 4 * n_embd
    assert spec.max_position_embeddings == 1024  # n_positions
    assert spec.tie_word_embeddings and spec.position_embedding == "learned" and spec.norm == "layernorm"
    assert spec.attention_bias and spec.attention_out_bias and spec.mlp_bias
    assert _spec("gpt2", n_inner=100, n_positions=64).intermediate_size == 100
    # GPT2Config.attribute_map: the generic names stand for n_embd etc.
    aliased = spec_from_hf_config(
        {"model_type": "gpt2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}, "m"
    )
    assert aliased == spec


def test_gpt_neox_biases_and_untied_head():
    spec = _spec("gpt_neox")
    assert not spec.tie_word_embeddings and spec.position_embedding == "rotary" and spec.norm == "layernorm"
    assert spec.attention_bias and spec.attention_out_bias and spec.mlp_bias and spec.mlp == "gelu"
    no_bias = _spec("gpt_neox", attention_bias=False)
    assert not no_bias.attention_bias and not no_bias.attention_out_bias and no_bias.mlp_bias


def test_llama_family_defaults():
    llama = _spec("llama")
    assert llama.kv_heads == 4 and not llama.tie_word_embeddings and llama.max_position_embeddings == 2048
    assert not (llama.attention_bias or llama.attention_out_bias or llama.mlp_bias)
    biased = _spec("llama", attention_bias=True, mlp_bias=True)
    assert biased.attention_bias and biased.attention_out_bias and biased.mlp_bias
    assert _spec("llama", num_key_value_heads=None).kv_heads == 4  # null means "as many as heads"
    assert _spec("mistral").kv_heads == 8 and _spec("mistral").max_position_embeddings == 4096 * 32
    mixtral = _spec("mixtral")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.kv_heads) == (8, 2, 8)
    fewer = _spec("mixtral", num_local_experts=4, num_experts_per_tok=1)
    assert (fewer.num_experts, fewer.experts_per_token) == (4, 1)


def test_qwen2_has_qkv_bias_only():
    spec = _spec("qwen2")
    assert spec.attention_bias and not spec.attention_out_bias and not spec.mlp_bias
    assert spec.kv_heads == 32 and spec.max_position_embeddings == 32768


def test_gemma_head_dim_and_tying():
    spec = _spec("gemma")
    assert spec.head_dim == 256 and spec.kv_heads == 16 and spec.tie_word_embeddings
    assert spec.max_position_embeddings == 8192
    assert _spec("gemma", head_dim=8).dim_per_head == 8


def test_phi3_counts_as_separate_projections():
    spec = _spec("phi3")
    assert spec.mlp == "gated" and spec.kv_heads == 4 and not spec.tie_word_embeddings
    assert not (spec.attention_bias or spec.attention_out_bias or spec.mlp_bias)


def test_name_source_and_model_type_are_recorded():
    spec = spec_from_hf_config({"model_type": "llama", **MINIMAL["llama"]}, "mine", source="cfg/config.json")
    assert (spec.name, spec.source, spec.hf_model_type) == ("mine", "cfg/config.json", "llama")


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(
        SpecError,
        match=r"^x/config\.json: model_type 'bert' is not supported; supported: deepseek_v3, gemma, gemma2, gemma3, "
              r"gemma3_text, gpt2, gpt_neox, gpt_oss, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe$",
    ):
        spec_from_hf_config({"model_type": "bert", "hidden_size": 8}, "m", source="x/config.json")
    with pytest.raises(SpecError, match=r"model_type None is not supported"):
        spec_from_hf_config({"hidden_size": 8}, "m")


@pytest.mark.parametrize("model_type, key", [("llama", "intermediate_size"), ("gpt2", "n_embd"), ("gpt_neox", "vocab_size")])
def test_missing_required_key_is_named(model_type, key):
    config = {"model_type": model_type, **MINIMAL[model_type]}
    del config[key]
    with pytest.raises(SpecError, match=rf"^config\.json of m: no '{key}', required for model_type '{model_type}'$"):
        spec_from_hf_config(config, "m")


def test_bad_values_name_the_config_key():
    # the key the file has (issue 21: it said num_heads, the spec's name, for num_attention_heads)
    with pytest.raises(SpecError, match=r"^c\.json: num_attention_heads: Input should be greater than or equal to 1 \(got 0\)$"):
        spec_from_hf_config({"model_type": "llama", **MINIMAL["llama"], "num_attention_heads": 0}, "m", source="c.json")
    with pytest.raises(SpecError, match=r"^c\.json: num_kv_heads 3 does not divide num_heads 4$"):
        spec_from_hf_config({"model_type": "llama", **MINIMAL["llama"], "num_key_value_heads": 3}, "m", source="c.json")
    with pytest.raises(SpecError, match=r"add_cross_attention"):
        _spec("gpt2", add_cross_attention=True)


def test_code_references_are_not_followed():
    config = {
        "model_type": "llama",
        **MINIMAL["llama"],
        "auto_map": {"AutoModelForCausalLM": "zeroplan_test_remote_code.Model"},
        "trust_remote_code": True,
    }
    spec_from_hf_config(config, "m")
    assert not any(name.startswith("zeroplan_test_remote_code") for name in sys.modules)


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_defaults_agree_with_transformers(model_type):
    # Build each minimal config with transformers itself: its defaults fill the same gaps.
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    token_ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}  # within the tiny vocabulary
    config = transformers.AutoConfig.for_model(model_type, **MINIMAL[model_type], **token_ids)
    if model_type == "gemma3":  # an image-text model: zeroplan reads its language model
        config = transformers.AutoConfig.for_model("gemma3_text", **MINIMAL[model_type]["text_config"], **token_ids)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == param_layout(_spec(model_type)).total_params


def test_dropout_rates_and_their_defaults():
    # GPT2Config: embd_pdrop, attn_pdrop, resid_pdrop 0.1; the others' config classes 0.0.
    assert _spec("gpt2").dropout_rates() == (0.1, 0.1, 0.1)
    assert _spec("gpt2", embd_pdrop=0.0, attn_pdrop=0.2, resid_pdrop=0.3).dropout_rates() == (0.0, 0.2, 0.3)
    # GPTNeoXConfig.hidden_dropout drives the embedding and both residual dropouts
    assert _spec("gpt_neox", attention_dropout=0.1, hidden_dropout=0.2).dropout_rates() == (0.2, 0.1, 0.2)
    assert _spec("phi3", resid_pdrop=0.1, embd_pdrop=0.3).dropout_rates() == (0.0, 0.0, 0.1)
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "gemma"):
        assert _spec(model_type).dropout_rates() == (0.0, 0.0, 0.0)
        assert _spec(model_type, attention_dropout=0.1).dropout_rates() == (0.0, 0.1, 0.0)


def test_dropout_override_reaches_the_layers_a_family_has():
    assert _spec("llama").dropout_rates(0.1) == (0.0, 0.1, 0.0)
    assert _spec("phi3").dropout_rates(0.2) == (0.0, 0.2, 0.2)
    assert _spec("gpt2").dropout_rates(0.0) == (0.0, 0.0, 0.0)


def test_dropout_on_a_layer_the_family_lacks_is_named():
    spec = _spec("llama")
    with pytest.raises(ValueError, match="residual_dropout: llama models have no residual dropout layer"):
        spec.model_validate(spec.model_dump() | {"residual_dropout": 0.1})
    neox = _spec("gpt_neox")
    with pytest.raises(ValueError, match="differ, but GPT-NeoX sets both from one hidden_dropout"):
        neox.model_validate(neox.model_dump() | {"embedding_dropout": 0.1})


def test_moe_families_defaults():
    # configuration_<type>.py defaults (transformers 5.23.0) for every key the minimal configs leave out.
    qwen = _spec("qwen3_moe")
    assert (qwen.kv_heads, qwen.max_position_embeddings, qwen.tie_word_embeddings) == (4, 32768, False)
    assert (qwen.moe.num_experts, qwen.moe.experts_per_token, qwen.moe.expert_intermediate_size) == (128, 8, 768)
    assert qwen.moe.dense_layers == () and qwen.moe.router == "softmax-topk"
    deepseek = _spec("deepseek_v3")
    assert (deepseek.kv_heads, deepseek.head_dim, deepseek.max_position_embeddings) == (16, 64, 4096)
    assert (deepseek.moe.num_experts, deepseek.moe.experts_per_token, deepseek.moe.expert_intermediate_size,
            deepseek.moe.shared_expert_intermediate_size, deepseek.moe.dense_layers) == (256, 8, 2048, 2048, (0, 1, 2))
    assert deepseek.mla.model_dump() == {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                         "qk_nope_head_dim": 128, "v_head_dim": 128}
    assert _spec("deepseek_v3", q_lora_rank=None).mla.q_lora_rank is None  # DeepSeek-V2-Lite style: one q_proj
    oss = _spec("gpt_oss")
    assert (oss.kv_heads, oss.head_dim, oss.attention_bias, oss.attention_out_bias, oss.attention_sinks) == (8, 64, True, True, True)
    assert (oss.moe.num_experts, oss.moe.experts_per_token, oss.moe.expert_intermediate_size) == (128, 4, 48)
    assert oss.moe.router_bias and oss.moe.expert_bias
