"""Adapter parameter counts (issue 12) against PEFT's definition and published figures.

Where peft is installed, each model of tests/data/hf_configs is built on the meta device with
transformers, wrapped with peft's get_peft_model, and `get_nb_trainable_parameters` must equal
zeroplan's count for every target set."""

from __future__ import annotations

import json

import pytest

from zeroplan.errors import SpecError
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.adapters.lora import adapter_params, lora_layout, quantized_weight_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.hf_config import spec_from_hf_config
from zeroplan.spec.lora import LoraSpec, QuantSpec
from tests.paths import DATA

HF_CONFIGS = sorted((DATA / "hf_configs").glob("*.json"))

# the attention projections each family's PEFT default targets (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
ATTENTION_TARGETS = {"gpt2": ("c_attn",), "gpt_neox": ("query_key_value",), "phi3": ("qkv_proj",),
                     # no PEFT default; DeepseekV3Attention has no v_proj: its low-rank projections (MLA)
                     "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")}


def _attention(model_type: str) -> tuple[str, ...]:
    return ATTENTION_TARGETS.get(model_type, ("q_proj", "v_proj"))


def _head(model_type: str) -> str:
    return "lm_head"  # transformers 5 names GPT-NeoX's head lm_head too


def test_llama_2_7b_rank_8_q_v_is_peft_printed_count():
    # PEFT's README: "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622"
    spec = resolve_model("llama-2-7b")
    lora = LoraSpec(rank=8, targets=("q_proj", "v_proj"))
    assert adapter_params(spec, lora) == 4_194_304
    assert param_layout(spec).total_params + 4_194_304 == 6_742_609_920


def test_all_linear_is_every_linear_but_the_head():
    # Llama-3-8B, r=16: per block q(4096->4096), k, v(4096->1024), o, gate, up(4096->14336), down
    spec = resolve_model("llama-3-8b")
    per_block = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 2 + (14336 + 4096))
    assert adapter_params(spec, LoraSpec(rank=16, targets=("all-linear",))) == 32 * per_block == 41_943_040


def test_dora_adds_a_magnitude_per_output_and_a_saved_head_is_a_copy():
    spec = resolve_model("llama-2-7b")
    lora = LoraSpec(rank=8, targets=("q_proj", "v_proj"), dora=True, modules_to_save=("lm_head",))
    assert adapter_params(spec, lora) == 4_194_304 + 32 * 2 * 4096 + 32_000 * 4096


@pytest.mark.parametrize("targets, message", [
    (("qkv",), r"lora.targets: 'qkv' names no module of llama-3-8b; its modules: q_proj, k_proj"),
])
def test_a_target_naming_no_module_lists_the_modules(targets, message):
    with pytest.raises(SpecError, match=message):
        lora_layout(resolve_model("llama-3-8b"), LoraSpec(rank=8, targets=targets))


def test_a_rank_above_a_target_dimension_is_refused():
    with pytest.raises(SpecError, match=r"lora.rank: 200 exceeds the dimensions of attn.c_attn \(128 -> 384\)"):
        lora_layout(resolve_model("tiny-gpt2"), LoraSpec(rank=200, targets=("c_attn",)))


def test_nf4_storage_follows_bitsandbytes():
    # 4096 x 4096: 8 MiB packed, 262,144 blocks of 64 -> fp32 absmax, and the state's own 16-value fp32
    # code; double quant: uint8 absmax, 1,024 fp32 second-level absmax, the fp32 offset and the nested
    # state's own 256-value fp32 dynamic map (functional.py quantize_4bit, quantize_blockwise)
    n = 4096 * 4096
    assert quantized_weight_bytes(n, 4096, QuantSpec(base_precision="nf4")) == n // 2 + 4 * (n // 64) + 4 * 16
    assert quantized_weight_bytes(n, 4096, QuantSpec(base_precision="nf4", double_quant=True)) == (
        n // 2 + n // 64 + 4 * (n // 64 // 256) + 4 + 4 * 16 + 4 * 256)
    # Int8Params: int8 weight, SCB fp32 per output row
    assert quantized_weight_bytes(n, 4096, QuantSpec(base_precision="int8")) == n + 4 * 4096


def _peft_count(config: dict, targets, dora: bool = False, modules_to_save=None) -> tuple[int, int]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if "text_config" in config:  # a multimodal config (gemma3): zeroplan models the language model, as Gemma3ForCausalLM builds it
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", "gemma3_text")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
        wrapped = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=targets if targets != ("all-linear",) else "all-linear", use_dora=dora,
            modules_to_save=modules_to_save))
    return wrapped.get_nb_trainable_parameters()


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_adapter_counts_equal_peft(path):
    config = json.loads(path.read_text())
    spec = spec_from_hf_config(config, path.stem)
    model_type = config["model_type"]
    cases = [(("all-linear",), False, None), (_attention(model_type), True, [_head(model_type)])]
    for targets, dora, saved in cases:
        trainable, total = _peft_count(config, list(targets) if targets != ("all-linear",) else targets, dora, saved)
        lora = LoraSpec(rank=4, targets=targets, dora=dora, modules_to_save=tuple(saved or ()))
        assert adapter_params(spec, lora) == trainable, (targets, dora, saved)


def test_llama_3_8b_peft_default_targets_count():
    # PEFT's print_trainable_parameters for Meta-Llama-3-8B, LoraConfig(r=8) (q_proj, v_proj by default):
    # "trainable params: 3,407,872 || all params: 8,033,669,120"
    from zeroplan.spec.lora import PEFT_DEFAULT_TARGETS

    spec = resolve_model("llama-3-8b")
    lora = LoraSpec(rank=8, targets=PEFT_DEFAULT_TARGETS["llama"])
    assert adapter_params(spec, lora) == 3_407_872
    assert param_layout(spec).total_params + 3_407_872 == 8_033_669_120


def _mla_attention(rank: int) -> int:
    # DeepSeek-V3 (h 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64, v 128):
    # q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
    pairs = [(7168, 1536), (1536, 128 * 192), (7168, 512 + 64), (512, 128 * (128 + 128)), (128 * 128, 7168)]
    return rank * sum(i + o for i, o in pairs)


def test_deepseek_all_linear_adapts_attention_router_and_experts_not_the_dense_or_shared_mlps():
    # peft 0.21.2 _convert_peft_config_moe (deepseek_v3 converts as qwen2_moe): gate_proj/up_proj/down_proj
    # become the experts' parameters, so the 3 dense layers' MLP and the shared expert stay frozen
    spec = resolve_model("deepseek-v3")
    r, h, experts, inner = 4, 7168, 256, 2048
    sparse = r * (h + experts) + 2 * r * experts * (h + 2 * inner) + r * experts * (inner + h)
    assert adapter_params(spec, LoraSpec(rank=r, targets=("all-linear",))) == 61 * _mla_attention(r) + 58 * sparse


def test_gpt_oss_all_linear_adapts_attention_only():
    # GptOssTopKRouter and GptOssExperts are not nn.Linear and gpt_oss is not converted by peft
    spec = resolve_model("gpt-oss-20b")
    per_block = 4 * ((2880 + 64 * 64) + 2 * (2880 + 8 * 64) + (64 * 64 + 2880))
    assert adapter_params(spec, LoraSpec(rank=4, targets=("all-linear",))) == 24 * per_block


def test_half_of_a_fused_expert_pair_is_refused_as_peft_does():
    # peft: "Cannot convert PEFT target(s) gate_proj without also targeting up_proj because they are fused"
    with pytest.raises(SpecError, match=r"lora.targets: gate_proj cannot be adapted without up_proj"):
        lora_layout(resolve_model("qwen3-30b-a3b"), LoraSpec(rank=4, targets=("gate_proj",)))


def test_dora_on_the_router_is_refused():
    # peft tuners/lora/layer.py ParamWrapper: "lora.ParamWrapper does not work with use_dora=True"
    with pytest.raises(SpecError, match=r"lora.dora: peft has no DoRA for parameter targets"):
        lora_layout(resolve_model("deepseek-v3"), LoraSpec(rank=4, targets=("gate",), dora=True))


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "gpt-oss-20b", "llama-2-7b"])
def test_the_quantized_base_covers_every_block_kind(name):
    from zeroplan.estimate.adapters.lora import base_tensors

    spec = resolve_model(name)
    tensors = base_tensors(spec, QuantSpec(base_precision="nf4"))
    assert sum(t.numel * t.count for t in tensors) == param_layout(spec).total_params
