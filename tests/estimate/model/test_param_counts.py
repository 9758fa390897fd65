"""Parameter counts: the catalogue against published totals, and against transformers' own models.

Published totals come from the Hugging Face Hub (safetensors metadata of the checkpoints) or the
model card, as cited in each `model_specs/<name>.toml`. Where transformers is installed, each
`tests/data/hf_configs/<name>.json` (a model's config.json) is built on the meta device (no
memory, no weights) and its parameters are counted tensor by tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zeroplan.estimate.model.layout import param_layout
from zeroplan.importers.catalog import list_models, resolve_model
from zeroplan.importers.hf_config import SUPPORTED_MODEL_TYPES, spec_from_hf_config
from tests.paths import DATA

# Exact totals as published (Hugging Face Hub safetensors metadata; GPT-2: transformers'
# GPT2LMHeadModel.num_parameters(), the head tied to the token embedding).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    # The dense families of issue 13 (Hub safetensors totals, model_specs/<name>.toml cites each config.json)
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    "gemma-3-1b": 999_885_952,
    "olmo-2-7b": 7_298_617_344,
    "olmo-2-13b": 13_716_198_400,
    "phi-4": 14_659_507_200,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.3-70b": 70_553_706_496,
}

# Qwen3 model cards (tied embeddings; the checkpoints also store lm_head, so the Hub's totals count
# the embedding twice): "Number of Parameters" and "(Non-Embedding)", in billions as printed.
QWEN3_MODEL_CARDS = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6)}

# Gemma 3 4B/12B/27B are image-text checkpoints: the Hub's safetensors total is the language model
# (the catalogue entry) plus the SigLIP vision tower and projector of its config.json.
GEMMA3_IMAGE_TEXT_TOTALS = {"gemma-3-4b": 4_300_079_472, "gemma-3-12b": 12_187_325_040, "gemma-3-27b": 27_432_406_640}

HF_CONFIGS = sorted((DATA / "hf_configs").glob("*.json"))


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("name, total", PUBLISHED.items())
def test_published_totals(name, total):
    spec = resolve_model(name)
    assert spec.published_params == total
    assert param_layout(spec).total_params == total


@pytest.mark.parametrize(
    "spec", [s for s in list_models() if s.kind == "transformer" and s.published_params], ids=lambda s: s.name
)
def test_every_published_catalogue_total_is_met(spec):
    assert param_layout(spec).total_params == spec.published_params


def test_pythia_1b_non_embedding_params_match_model_card():
    # EleutherAI/pythia-1b model card: 805,736,448 non-embedding parameters (embed_in and the
    # untied embed_out excluded).
    spec = resolve_model("pythia-1b")
    embeddings = 2 * spec.vocab_size * spec.hidden_size
    assert param_layout(spec).total_params - embeddings == 805_736_448


def test_mixtral_active_params_per_token():
    # Mistral AI's Mixtral announcement: 46.7B total, 12.9B used per token (2 of 8 experts).
    spec = resolve_model("mixtral-8x7b")
    layout = param_layout(spec)
    expert = 3 * spec.hidden_size * spec.intermediate_size
    active = layout.total_params - spec.num_layers * (spec.num_experts - spec.experts_per_token) * expert
    assert round(active / 1e9, 1) == 12.9


@pytest.mark.parametrize("name, card", QWEN3_MODEL_CARDS.items())
def test_qwen3_tied_totals_match_model_cards(name, card):
    spec = resolve_model(name)
    total = param_layout(spec).total_params
    embedding = spec.vocab_size * spec.hidden_size
    assert (round(total / 1e9, 1), round((total - embedding) / 1e9, len(str(card[1]).split(".")[1]))) == card


@pytest.mark.parametrize("name, total", GEMMA3_IMAGE_TEXT_TOTALS.items())
def test_gemma3_language_model_plus_vision_tower_is_the_published_total(name, total):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    spec = resolve_model(name)
    text = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size, "sliding_window": spec.sliding_window}
    vision = _read(DATA / "hf_configs" / "gemma-3-4b.json")["vision_config"]  # the same in all three
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256)
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == total
    language = sum(p.numel() for n, p in model.named_parameters() if ".language_model." in n or n.startswith("lm_head"))
    assert language == param_layout(spec).total_params


def test_hf_configs_cover_every_supported_model_type():
    assert {_read(path)["model_type"] for path in HF_CONFIGS} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_config_json_and_catalogue_agree(path):
    from_config = spec_from_hf_config(_read(path), path.stem)
    from_catalogue = resolve_model(path.stem)
    ignore = {"name", "source", "published_params", "notes"}  # notes: what the config.json holds beyond the catalogue (a vision tower)
    assert from_config.model_dump(exclude=ignore) == from_catalogue.model_dump(exclude=ignore)


def _decoder_layers(model, num_layers: int):
    """The ModuleList of transformer blocks, whatever the family calls it (h, layers)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise LookupError("no ModuleList of the model's depth")



@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_transformers_meta_model_has_the_same_parameters(path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = _read(path)
    spec = spec_from_hf_config(config, path.stem)
    layout = param_layout(spec)
    if config["model_type"] == "gemma3":  # an image-text config: its language model, as Gemma3ForCausalLM
        config = config["text_config"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))

    assert sum(p.numel() for p in model.parameters()) == layout.total_params  # tied weights once

    # Per module group, the units ZeRO-3 and FSDP2 gather: embeddings, one block, the rest.
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    assert embeddings == layout.embedding_params
    # Every block, run by run in forward order (DeepSeek-V3's dense first layers, then its sparse ones).
    blocks = iter(_decoder_layers(model, spec.num_layers))
    for tensors, count in layout.runs:
        for block in [next(blocks) for _ in range(count)]:
            # Tensor by tensor, with dim 0 (what FSDP2 pads and shards): fused projections included
            # (GPT-2 c_attn, GPT-NeoX query_key_value, Phi-3 qkv_proj/gate_up_proj, 3-D experts).
            # ... in registration order, which DeepSpeed flattens and partitions by.
            assert [(p.numel(), p.shape[0]) for p in block.parameters()] == [(t.numel, t.rows) for t in tensors]


@pytest.mark.parametrize("name", ["qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "olmo2-tiny", "phi4-tiny"])
def test_tiny_family_models_as_measure_builds_them(name):
    # The config `zeroplan measure` builds each tiny family model from (measure/workload.py), on the
    # meta device: the same tensors, block by block, in registration order.
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from zeroplan.measure.workload import hf_config_kwargs

    spec = resolve_model(name)
    model_type, kwargs = hf_config_kwargs(spec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs))
    layout = param_layout(spec)
    assert sum(p.numel() for p in model.parameters()) == layout.total_params
    block = _decoder_layers(model, spec.num_layers)[0]
    assert [(p.numel(), p.shape[0]) for p in block.parameters()] == [(t.numel, t.rows) for t in layout.block]


def _active_params(spec) -> int:
    """Parameters a token runs through (the step-time model counts these, zeroplan/plan/work.py): all but the
    routed experts it is not sent to; the input embedding, a lookup the step-time model gives no FLOPs, is added back."""
    from zeroplan.plan.work import model_shape
    from zeroplan.spec.training import TrainingSpec

    shape = model_shape(spec, TrainingSpec())
    lookup = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    return round(shape.layers * shape.layer_params + shape.head_params + lookup)


# Totals and activated parameters as published: Qwen3 model cards (30.5B total, 3.3B activated,
# 29.9B non-embedding; 235B, 22B, 234B), DeepSeek-V3 Technical Report section 4.2 (671B, 37B; R1's
# model card the same), gpt-oss model card table 1 (116.83B, 5.13B; 20.91B, 3.61B: active counts
# there leave out the embedding). Qwen's and DeepSeek's activated figures are cut, not rounded
# (3.35B is "3.3B", 37.55B is "37B"); the others are rounded.
@pytest.mark.parametrize("name, digits, total, active, non_embedding", [
    ("qwen3-30b-a3b", 1, 30.5, 3.3, 29.9),
    ("qwen3-235b-a22b", 0, 235, 22, 234),
    ("deepseek-v3", 0, 671, 37, None),
    ("deepseek-r1", 0, 671, 37, None),
    ("gpt-oss-120b", 2, 116.83, 5.13, None),
    ("gpt-oss-20b", 2, 20.91, 3.61, None),
])
def test_moe_totals_and_active_params_as_published(name, digits, total, active, non_embedding):
    spec = resolve_model(name)
    layout = param_layout(spec)
    assert round(layout.total_params / 1e9, digits) == total
    embedding = spec.vocab_size * spec.hidden_size
    if spec.hf_model_type == "gpt_oss":
        assert round((_active_params(spec) - embedding) / 1e9, digits) == active
    else:
        assert math.floor(_active_params(spec) / 10 ** (9 - digits)) == round(active * 10 ** digits)
    if non_embedding is not None:
        assert round((layout.total_params - 2 * embedding) / 1e9, digits) == non_embedding


def test_deepseek_v3_with_its_mtp_layer_is_the_hubs_685b():
    # DeepSeek-V3's model card: 671B main model weights plus 14B of multi-token-prediction weights,
    # 685B on the Hub, where layer 61 (the MTP module) also stores its own copies of the embedding
    # and the output head: one sparse layer, enorm, hnorm, eh_proj, the shared head's norm.
    spec = resolve_model("deepseek-v3")
    with_mtp = spec.model_copy(update={"moe": spec.moe.model_copy(update={"mtp_layers": 1})})
    copies = 2 * spec.vocab_size * spec.hidden_size
    # 684.49B: the rest of the Hub's 684.53B is the FP8 checkpoint's block scales (one fp32 per 128 x 128).
    assert abs((param_layout(with_mtp).total_params + copies) / 685e9 - 1) < 0.001
