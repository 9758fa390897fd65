"""The model catalogue and MODEL resolution: names, spec files, config.json, and their errors."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from zeroplan.estimate.model.layout import param_layout
from zeroplan.importers.catalog import list_models, params_model, resolve_model
from zeroplan.errors import SpecError, UnknownModelError
from zeroplan.spec.model import ParamCountSpec, TransformerSpec
from tests.paths import REPO

SYNTHETIC = {"tiny-llama", "tiny-gpt2", "llama-100m", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "olmo2-tiny", "phi4-tiny",
             "qwen3moe-tiny", "dsv3-tiny", "gptoss-tiny"}

TINY_TOML = """\
name = "tiny"
vocab_size = 512
hidden_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 352
max_position_embeddings = 256
position_embedding = "rotary"
norm = "rmsnorm"
mlp = "gated"
tie_word_embeddings = false
"""


def test_catalogue_holds_the_promised_models():
    names = [spec.name for spec in list_models()]
    assert names == sorted(names) and len(names) == len(set(names))
    assert {
        "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b",
        "llama-3-8b", "llama-3-70b", "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2-7b",
        "gemma-7b", "phi-3-mini", "pythia-1b", "tiny-llama", "tiny-gpt2", "llama-100m", "llama-1b",
    } <= set(names)


@pytest.mark.parametrize("spec", list_models(), ids=lambda s: s.name)
def test_real_models_cite_their_config_json(spec):
    if spec.name in SYNTHETIC:
        assert spec.source is None and spec.published_params is None
    else:
        assert re.fullmatch(r"https://huggingface\.co/[\w.-]+/[\w.-]+/blob/main/config\.json", spec.source)
        assert spec.hf_model_type is not None


def test_tiny_models_have_the_agreed_shapes():
    llama = resolve_model("tiny-llama")
    assert (llama.vocab_size, llama.hidden_size, llama.num_layers, llama.num_heads, llama.kv_heads) == (512, 128, 2, 4, 2)
    assert (llama.intermediate_size, llama.tie_word_embeddings, llama.mlp) == (352, False, "gated")
    gpt2 = resolve_model("tiny-gpt2")
    assert (gpt2.vocab_size, gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads) == (512, 128, 2, 4)
    assert (gpt2.max_position_embeddings, gpt2.tie_word_embeddings, gpt2.position_embedding) == (256, True, "learned")


def test_measurement_models_have_their_sizes():
    assert 80e6 < param_layout(resolve_model("llama-100m")).total_params < 150e6
    assert 0.9e9 < param_layout(resolve_model("llama-1b")).total_params < 1.5e9


def test_unknown_name_suggests_close_names():
    with pytest.raises(UnknownModelError, match=r"unknown model 'lama-2-7b'; did you mean llama-2-7b.*zeroplan models"):
        resolve_model("lama-2-7b")
    with pytest.raises(UnknownModelError, match=r"^unknown model 'bert-base' \(run `zeroplan models`"):
        resolve_model("bert-base")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(UnknownModelError, match=r"model file '.*nope\.toml' does not exist"):
        resolve_model(str(tmp_path / "nope.toml"))


def test_toml_and_json_spec_files(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    from_toml = resolve_model(str(tmp_path / "tiny.toml"))
    assert isinstance(from_toml, TransformerSpec) and from_toml.kv_heads == 2
    (tmp_path / "tiny.json").write_text(json.dumps(tomllib.loads(TINY_TOML)))
    assert resolve_model(str(tmp_path / "tiny.json")) == from_toml
    # Same shapes as the catalogue's tiny-llama.
    assert param_layout(from_toml) == param_layout(resolve_model("tiny-llama"))


def test_params_spec_file(tmp_path):
    (tmp_path / "seven.toml").write_text('name = "seven"\nparams = 7_500_000_000\n')
    spec = resolve_model(str(tmp_path / "seven.toml"))
    assert isinstance(spec, ParamCountSpec) and spec.params == 7_500_000_000


def test_config_json_and_its_folder(tmp_path):
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    (folder / "config.json").write_text((REPO / "tests/data/hf_configs/llama-2-7b.json").read_text())
    spec = resolve_model(str(folder / "config.json"))
    assert spec.name == "Llama-2-7b-hf" and spec.hf_model_type == "llama"
    assert param_layout(spec).total_params == 6_738_415_616
    assert resolve_model(str(folder)) == spec


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bad_toml_names_file_and_line(in_tmp):
    (in_tmp / "bad.toml").write_text('name = "x"\nhidden_size = = 3\n')
    with pytest.raises(SpecError, match=r"^bad\.toml: invalid TOML: .*\(at line 2, column \d+\)$"):
        resolve_model("bad.toml")


def test_bad_json_names_file_and_line(in_tmp):
    (in_tmp / "bad.json").write_text('{"name": "x",\n "hidden_size": }\n')
    with pytest.raises(SpecError, match=r"^bad\.json: invalid JSON: .*\(at line 2, column \d+\)$"):
        resolve_model("bad.json")


def test_one_validation_error_is_one_line(in_tmp):
    (in_tmp / "tiny.toml").write_text(TINY_TOML.replace("num_kv_heads = 2", "num_kv_heads = 3"))
    with pytest.raises(SpecError, match=r"^tiny\.toml: num_kv_heads 3 does not divide num_heads 4$"):
        resolve_model("tiny.toml")
    (in_tmp / "tiny.toml").write_text(TINY_TOML.replace("num_kv_heads = 2", "num_kv_heads = 0"))
    with pytest.raises(SpecError, match=r"^tiny\.toml: num_kv_heads: Input should be greater than or equal to 1 \(got 0\)$"):
        resolve_model("tiny.toml")


def test_several_validation_errors_are_counted(in_tmp):
    text = TINY_TOML.replace("hidden_size", "hiden_size").replace('norm = "rmsnorm"', 'norm = "batchnorm"')
    (in_tmp / "x.toml").write_text(text)
    with pytest.raises(SpecError) as info:
        resolve_model("x.toml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("3 errors in x.toml: ")
    assert "hidden_size: Field required" in message
    assert "norm: Input should be 'layernorm' or 'rmsnorm'" in message
    assert "hiden_size: unknown key (did you mean hidden_size?)" in message


def test_other_files_are_refused(in_tmp):
    (in_tmp / "model.yaml").write_text("name: x\n")
    with pytest.raises(SpecError, match=r"^model\.yaml: a \.yaml file is a trainer's config .*; give it with --config"):
        resolve_model("model.yaml")
    (in_tmp / "model.txt").write_text("name: x\n")
    with pytest.raises(SpecError, match=r"^model\.txt: a model file must end in \.toml or \.json$"):
        resolve_model("model.txt")
    (in_tmp / "list.json").write_text("[1, 2]")
    with pytest.raises(SpecError, match=r"^list\.json: expected a table of spec fields, got list$"):
        resolve_model("list.json")


def test_unsupported_config_json_is_named(in_tmp):
    (in_tmp / "config.json").write_text('{"model_type": "bert", "hidden_size": 768}')
    with pytest.raises(SpecError, match=r"^config\.json: model_type 'bert' is not supported; supported: deepseek_v3, gemma, "):
        resolve_model("config.json")


def test_params_model():
    spec = params_model(7_000_000_000, largest_layer=200_000_000, trainable=1_000_000)
    assert (spec.params, spec.largest_layer_params, spec.trainable_params) == (7_000_000_000, 200_000_000, 1_000_000)
    assert params_model(10).largest_layer_params is None
    with pytest.raises(SpecError, match=r"largest_layer_params 20 exceeds params 10"):
        params_model(10, largest_layer=20)
    with pytest.raises(SpecError, match=r"params: Input should be greater than or equal to 1"):
        params_model(0)


def test_wheel_lists_every_package():
    # pyproject lists packages by hand (model_specs/ is mapped into zeroplan.model_specs), so a
    # new subpackage left off the list would be missing from an installed zeroplan.
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(Path(folder).relative_to(REPO).parts)
        for folder, _, files in os.walk(REPO / "zeroplan")
        if "__pycache__" not in folder and any(f.endswith(".py") for f in files)
    }
    assert listed == on_disk | {"zeroplan.model_specs"}
