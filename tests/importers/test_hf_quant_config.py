"""Quantized checkpoints (issue 23): a config.json's quantization_config read as the frozen base's storage, GPTQ's
packed storage against published checkpoint sizes, the methods read but not modelled, and Gemma 3's vision tower."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.estimate.adapters.lora import base_tensors
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.hf_config import vision_tower_params
from zeroplan.importers.hf_quant_config import quant_from_checkpoint
from zeroplan.spec.lora import QuantSpec
from zeroplan.spec.training import TrainingSpec
from tests import paths

DATA = paths.DATA / "hf_configs"
LLAMA = json.loads((DATA / "llama-3-8b.json").read_text()) if (DATA / "llama-3-8b.json").exists() else None


@pytest.mark.parametrize("group_size, published_gb", [(128, 7.26), (32, 8.00), (64, 7.51)])
def test_gptq_storage_is_the_published_checkpoint_size(group_size, published_gb):
    """TheBloke/Llama-2-13B-GPTQ's "Provided files" table (4 bits, file sizes in GB; copied in the model card of
    huggingface.co/tridungduong16/Llama-2-13B-GPTQ-Orca): qweight, qzeros, scales and g_idx of every block linear,
    the embeddings, norms and head in fp16."""
    quant = QuantSpec(base_precision="gptq", compute_dtype="fp16", group_size=group_size)
    stored = sum(t.stored_bytes * t.count for t in base_tensors(resolve_model("llama-2-13b"), quant))
    assert abs(stored / (published_gb * 1e9) - 1) < 0.002


def _config(tmp_path, quantization: dict, **more) -> str:
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512,
              "torch_dtype": "bfloat16", "quantization_config": quantization} | more
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _estimate(*args: str):
    return CliRunner().invoke(cli, ["estimate", *args, "--engine", "torch", "--format", "json"])


BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
       "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}


def test_a_bitsandbytes_checkpoint_is_a_qlora_base(tmp_path):
    result = _estimate(_config(tmp_path, BNB), "--lora-rank", "8")
    assert result.exit_code == 0, result.output
    quant = json.loads(result.output)["config"]["quant"]
    assert (quant["base_precision"], quant["double_quant"], quant["compute_dtype"]) == ("nf4", True, "bf16")
    # an option given wins over the checkpoint
    result = _estimate(_config(tmp_path, BNB), "--lora-rank", "8", "--base-precision", "bf16")
    assert json.loads(result.output)["config"]["quant"]["base_precision"] == "bf16"


def test_a_quantized_checkpoint_without_adapters_is_one_line(tmp_path):
    path = _config(tmp_path, BNB)
    result = _estimate(path)
    assert result.exit_code == 2
    assert result.output.strip() == (f"Error: {path}: quantization_config (nf4): a quantized checkpoint trains through "
                                      "adapters only: add --lora-rank R, or --base-precision bf16 to estimate it dequantized")


def test_gptq_and_awq_checkpoints(tmp_path):
    for method in ("gptq", "awq"):
        result = _estimate(_config(tmp_path, {"quant_method": method, "bits": 4, "group_size": 64},
                                   torch_dtype="float16"), "--lora-rank", "8")
        assert result.exit_code == 0, result.output
        quant = json.loads(result.output)["config"]["quant"]
        assert (quant["base_precision"], quant["bits"], quant["group_size"], quant["compute_dtype"]) == (method, 4, 64, "fp16")
    result = CliRunner().invoke(cli, ["estimate", _config(tmp_path, {"quant_method": "gptq", "bits": 4}), "--lora-rank",
                                      "8", "--engine", "fsdp2", "--zero", "3", "--gpus", "2"])
    assert result.exit_code == 2 and "its packed weights are module buffers" in result.output


@pytest.mark.parametrize("quantization, line", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
     "quantization_config (fp8, e4m3 blocks [128, 128]) is read but not modelled as FP8Linear: transformers "
     "dequantizes it to bf16"),
    ({"quant_method": "torchao", "quant_type": {}}, "quantization_config (torchao) is read but not modelled"),
])
def test_methods_read_but_not_modelled_say_so(tmp_path, quantization, line):
    config = {"torch_dtype": "bfloat16", "quantization_config": quantization}
    assert quant_from_checkpoint(config) == {"base_precision": "bf16"}
    result = _estimate(_config(tmp_path, quantization), "--lora-rank", "8")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any(note.startswith(line) for note in notes), notes
    assert json.loads(result.output)["config"]["quant"]["base_precision"] == "bf16"


def test_a_bad_quantization_config_is_one_line():
    with pytest.raises(SpecError, match=r"quantization_config.bnb_4bit_quant_type: 'int2' is not nf4 or fp4"):
        quant_from_checkpoint({"quantization_config": BNB | {"bnb_4bit_quant_type": "int2"}})


def test_quant_knobs_belong_to_their_method():
    with pytest.raises(ValueError, match="bits and group_size describe a GPTQ or AWQ checkpoint"):
        QuantSpec(base_precision="nf4", bits=8)
    with pytest.raises(ValueError, match="prepare_model_for_kbit_training casts nothing on a GPTQ model"):
        TrainingSpec(engine="torch", lora={"rank": 8, "targets": ["all-linear"]},
                     quant={"base_precision": "gptq", "upcast_non_quantized": True})


@pytest.mark.parametrize("use_head", [False, True])
def test_gemma3_vision_tower_count_is_transformers(use_head):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    config = json.loads((DATA / "gemma-3-4b.json").read_text())
    config["vision_config"] = dict(config["vision_config"], vision_use_head=use_head)
    hf = Gemma3Config(vision_config=config["vision_config"], text_config=config["text_config"])
    with torch.device("meta"):
        built = [SiglipVisionModel(hf.vision_config), Gemma3MultiModalProjector(hf)]
    assert vision_tower_params(config) == sum(p.numel() for module in built for p in module.parameters())


def test_gemma3_with_a_vision_tower_says_what_is_left_out():
    notes = resolve_model(str(DATA / "gemma-3-4b.json")).notes
    assert any("vision tower (vision_config, SigLIP) and the multimodal projector, 419,816,304 parameters" in note
               for note in notes), notes
