"""LoRA and QLoRA on the command line (issue 12): estimate, compare and plan take the same options;
bad input is one line naming the option, exit status 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli

QLORA = ["--lora-rank", "16", "--lora-targets", "all-linear", "--base-precision", "nf4"]


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_done_when_command_answers_with_categories_and_fit():
    result = _run("estimate", "llama-3-8b", *QLORA, "--gpus", "1", "--gpu-memory", "rtx4090-24gb")
    assert result.exit_code == 0, result.output
    assert "Fits in 24.00 GiB per GPU" in result.output
    assert "41,943,040 trainable" in result.output


def test_json_shows_base_and_adapter_bytes_of_the_params():
    result = _run("estimate", "llama-3-8b", *QLORA, "--engine", "torch", "--format", "json")
    data = json.loads(result.output)
    parts = data["param_parts"]
    assert parts["base"] + parts["adapter"] == data["per_gpu"]["params"]
    # the torch engine keeps PEFT's fp32 adapters: 41,943,040 x 4 bytes
    assert parts["adapter"] == 41_943_040 * 4
    assert data["model"]["trainable_params"] == 41_943_040
    assert data["config"]["lora"]["rank"] == 16 and data["config"]["quant"]["base_precision"] == "nf4"


def test_a_quantized_base_takes_less_than_a_bf16_one():
    def peak(*extra: str) -> int:
        result = _run("estimate", "llama-3-8b", "--lora-rank", "16", "--engine", "torch", "--format", "json", *extra)
        return json.loads(result.output)["per_gpu"]["params"]

    assert peak("--base-precision", "nf4") < peak("--base-precision", "int8") < peak("--base-precision", "bf16")


def test_adapter_config_file(tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}))
    result = _run("estimate", "llama-2-7b", "--lora", str(path), "--format", "json")
    assert json.loads(result.output)["model"]["trainable_params"] == 4_194_304


def test_compare_and_plan_take_the_options():
    result = _run("compare", "llama-3-8b", *QLORA, "--gpus", "1", "--zero", "0", "--gpu-memory", "24GiB")
    assert result.exit_code == 0, result.output
    result = _run("plan", "llama-3-8b", "--lora-rank", "64", "--lora-targets", "all-linear", "--gpu", "rtx4090-24gb",
                  "--gpus", "1")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, message", [
    (["llama-3-8b", "--lora-rank", "0"], "Error: Invalid value for '--lora-rank': 0 is not in the range 1<=x<=65536."),
    (["llama-3-8b", "--lora-rank", "8", "--lora-targets", "qkv"],
     "Error: --lora-targets: 'qkv' names no module of llama-3-8b; its modules: q_proj, k_proj, v_proj, o_proj, "
     "gate_proj, up_proj, down_proj, lm_head, embed_tokens"),
    (["tiny-gpt2", "--lora-rank", "500", "--lora-targets", "c_attn"],
     "Error: --lora-rank: 500 exceeds the dimensions of attn.c_attn (128 -> 384)"),
    (["llama-3-8b", "--lora-dropout", "0.1"], "Error: --lora-dropout: LoRA options need --lora-rank R or --lora"),
    (["--params", "7B", "--base-precision", "nf4"], "Error: --base-precision: a model known by its parameter count"),
    (["--params", "7B", "--lora-rank", "8"], "Error: --lora-rank: a model known by its parameter count"),
    (["llama-3-8b", "--double-quant"], "Error: --double-quant: needs --base-precision"),
    (["llama-3-8b", "--lora-rank", "8", "--base-precision", "nf4", "--engine", "deepspeed", "--zero", "3", "--gpus", "2"],
     "Error: quant.quant_storage uint8: engine deepspeed at zero_stage 3"),
    (["llama-3-8b", "--lora-rank", "8", "--base-precision", "int8", "--engine", "deepspeed", "--zero", "3", "--gpus", "2"],
     "Error: quant.base_precision int8: Int8Params cannot be sharded"),
    (["llama-3-8b", "--base-precision", "nf4"], "Error: quant.base_precision nf4: a quantized base cannot train"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    result = _run("estimate", *args)
    assert result.exit_code == 2
    assert result.output.startswith(message), result.output
    assert result.output.count("\n") == 1


def test_bad_adapter_config_is_one_line(tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"r": 8, "target_modules": ["q_proj"], "peft_version": "2.0.0"}))
    result = _run("estimate", "llama-3-8b", "--lora", str(path))
    assert result.exit_code == 2
    assert result.output == f"Error: {path}: peft_version: unknown version '2.0.0' (this reader knows peft 0.x)\n"


TORCHTUNE_QLORA = """# tune run lora_finetune_single_device --config llama3_2/1B_qlora_single_device
model:
  _component_: torchtune.models.llama3_2.qlora_llama3_2_1b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 64
  lora_alpha: 128
  lora_dropout: 0.0
save_adapter_weights_only: False
batch_size: 4
optimizer:
  _component_: torch.optim.AdamW
  fused: True
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
gradient_accumulation_steps: 8
dtype: bf16
enable_activation_checkpointing: True
"""


def test_torchtune_qlora_recipe(tmp_path):
    path = tmp_path / "1B_qlora_single_device.yaml"
    path.write_text(TORCHTUNE_QLORA)
    data = json.loads(_run("estimate", "--config", str(path), "--format", "json").output)
    # lora_llama3_2 (torchtune/models/llama3_2/_component_builders.py): q, v, output_proj and the MLP's
    # w1/w2/w3 of 16 layers at rank 64: 16 x 64 x ((2048+2048) x 2 + (2048+512) + 3 x (2048+8192))
    assert data["model"]["trainable_params"] == 16 * 64 * (4096 * 2 + 2560 + 3 * 10240) == 42_467_328
    # torchtune's QLoRA base is torchao's NF4Tensor (LoRALinear(quantize_base=True): to_nf4), not bitsandbytes
    assert data["config"]["quant"]["base_precision"] == "torchao-nf4"
    assert data["config"]["engine"] == "torch" and data["config"]["precision"] == "pure-bf16"


def test_torchtune_qlora_recipe_under_fsdp2_shards_the_nf4_scalers(tmp_path):
    """The distributed recipe: FSDP2 shards NF4Tensor's data, scalers and factors (torchao fsdp_pre_all_gather);
    bitsandbytes' QuantState would stay whole on every rank."""
    path = tmp_path / "8B_qlora.yaml"
    path.write_text(TORCHTUNE_QLORA.replace("lora_finetune_single_device", "lora_finetune_distributed")
                    .replace("llama3_2.qlora_llama3_2_1b", "llama3_1.qlora_llama3_1_8b"))
    torchao = json.loads(_run("estimate", "--config", str(path), "--gpus", "8", "--format", "json").output)
    assert torchao["config"]["engine"] == "fsdp2" and torchao["config"]["quant"]["base_precision"] == "torchao-nf4"
    bnb = json.loads(_run("estimate", "--config", str(path), "--gpus", "8", "--base-precision", "nf4", "--double-quant",
                          "--quant-storage", "bf16", "--format", "json").output)
    steady = [p for p in torchao["phases"] if p["step"] == "steady" and p["phase"] == "optimizer_step"][0]
    steady_bnb = [p for p in bnb["phases"] if p["step"] == "steady" and p["phase"] == "optimizer_step"][0]
    assert steady["params"] < steady_bnb["params"]


def test_torchtune_lora_builder_arguments_are_checked(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(TORCHTUNE_QLORA.replace("lora_rank: 64", "lora_rnak: 64"))
    result = _run("estimate", "--config", str(path))
    assert result.exit_code == 2
    assert result.output == f"Error: {path}: model.lora_rnak is not an argument of torchtune's LoRA model builders\n"
