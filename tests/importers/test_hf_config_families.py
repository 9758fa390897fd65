"""config.json import of the dense families of issue 13 (Qwen3, Gemma 2, Gemma 3, OLMo 2, Phi-4,
Llama 3.x): the fields each family's transformers 5.23.0 modeling file hard-codes, and the errors."""

from __future__ import annotations

import json
import re

import pytest

from zeroplan.errors import SpecError
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.hf_config import spec_from_hf_config
from tests.paths import DATA

CONFIGS = DATA / "hf_configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_qwen3_has_head_wide_qk_norms_and_its_own_head_dim():
    spec = spec_from_hf_config(_config("qwen3-8b"), "q")
    assert (spec.qk_norm, spec.norm_placement, spec.head_dim) == ("head", "pre", 128)
    assert spec.attention_softcap is None and spec.sliding_window is None


def test_gemma2_sandwich_norms_softcaps_and_alternating_windows():
    spec = spec_from_hf_config(_config("gemma-2-9b"), "g")
    assert (spec.norm_placement, spec.norm_unit_offset, spec.norm_weight_in_fp32, spec.embedding_scale) == (
        "sandwich", True, True, True)
    assert (spec.attention_softcap, spec.final_logit_softcap) == (50.0, 30.0)
    assert (spec.sliding_window, spec.sliding_window_pattern, spec.qk_norm) == (4096, 2, "none")


def test_gemma2_layer_types_give_the_pattern():
    # transformers 5 writes layer_types into config.json: every other layer full
    layer_types = ["sliding_attention", "full_attention"] * 21
    assert spec_from_hf_config(_config("gemma-2-9b") | {"layer_types": layer_types}, "g").sliding_window_pattern == 2
    with pytest.raises(SpecError, match=r"^config\.json of g: layer_types: only every Nth layer full"):
        spec_from_hf_config(_config("gemma-2-9b") | {"layer_types": ["full_attention"] + layer_types[1:]}, "g")


def test_gemma3_text_and_image_text_configs():
    one_b = spec_from_hf_config(_config("gemma-3-1b"), "g")
    assert (one_b.qk_norm, one_b.sliding_window, one_b.sliding_window_pattern) == ("head", 512, 6)
    assert one_b.attention_softcap is None and one_b.final_logit_softcap is None
    # the published 4B config.json nests the language model and leaves heads and vocabulary to defaults
    four_b = spec_from_hf_config(_config("gemma-3-4b"), "g")
    assert (four_b.hf_model_type, four_b.num_heads, four_b.kv_heads, four_b.vocab_size) == ("gemma3_text", 8, 4, 262_208)
    # the same language model as the catalogue's; the config.json's vision tower is said not to be counted
    assert four_b == resolve_model("gemma-3-4b").model_copy(update={"name": "g", "source": None, "published_params": None,
                                                                    "notes": four_b.notes})
    assert len(four_b.notes) == 1 and "vision tower (vision_config, SigLIP)" in four_b.notes[0]
    with pytest.raises(SpecError, match=r"^config\.json of g: no 'text_config', required for model_type 'gemma3'"):
        spec_from_hf_config({"model_type": "gemma3"}, "g")


def test_olmo2_post_norms_and_projection_wide_qk_norms():
    spec = spec_from_hf_config(_config("olmo-2-7b"), "o")
    assert (spec.norm_placement, spec.qk_norm, spec.norm_weight_in_fp32, spec.tie_word_embeddings) == (
        "post", "projection", True, False)


def test_phi4_is_a_phi3_config():
    spec = spec_from_hf_config(_config("phi-4"), "p")
    assert (spec.hf_model_type, spec.kv_heads, spec.max_position_embeddings) == ("phi3", 10, 16384)


def test_llama3_rope_scaling_changes_no_field():
    # rope_scaling (llama3) rescales the rotary frequencies: no parameter, no saved tensor.
    config = _config("llama-3.1-8b")
    assert spec_from_hf_config(config, "l") == spec_from_hf_config({**config, "rope_scaling": None}, "l")


@pytest.mark.parametrize("name, key", [("qwen3-8b", "num_attention_heads"), ("gemma-2-9b", "hidden_size"),
                                       ("olmo-2-7b", "intermediate_size"), ("gemma-3-1b", "num_hidden_layers")])
def test_missing_field_is_named(name, key):
    config = _config(name)
    del config[key]
    model_type = config["model_type"]
    with pytest.raises(SpecError, match=rf"^config\.json of m: no '{key}', required for model_type '{model_type}'$"):
        spec_from_hf_config(config, "m")


@pytest.mark.parametrize("model_type, nearest", [("qwen3_next", "qwen3_moe"), ("gemma3n", "gemma3"), ("olmo3", "olmo2")])
def test_unsupported_model_type_names_the_nearest(model_type, nearest):
    with pytest.raises(SpecError, match=rf"model_type '{model_type}' is not supported \(nearest supported: {nearest}\); "
                                        r"supported: deepseek_v3, gemma, .*qwen3, qwen3_moe$"):
        spec_from_hf_config({"model_type": model_type}, "m")


def test_sliding_window_pattern_needs_a_window():
    spec = resolve_model("qwen3-8b")
    with pytest.raises(ValueError, match="sliding_window_pattern 2 needs a sliding_window"):
        spec.model_validate(spec.model_dump() | {"sliding_window_pattern": 2})


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen3_next"}, r"model_type 'qwen3_next' is not supported \(nearest supported: qwen3_moe\); supported: "),
    ({"model_type": "olmo2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
     r"no 'intermediate_size', required for model_type 'olmo2'"),
])
def test_cli_bad_config_json_is_one_line_exit_2(tmp_path, config, message):
    from click.testing import CliRunner

    from zeroplan.cli import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["estimate", str(path), "--gpus", "8"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert re.search(message, lines[0])
