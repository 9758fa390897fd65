"""Mixture of experts and latent attention (Qwen3-MoE, DeepSeek-V3, GPT-OSS): config.json import,
bad input as one line naming the field, blocks of two kinds grouped in forward order, and the
answers of `zeroplan estimate` for the big ones. Parameter counts against transformers' meta
models and the published totals are in tests/estimate/model/test_param_counts.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.estimate.model.facts import model_facts
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.hf_config import spec_from_hf_config
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA

CONFIGS = DATA / "hf_configs"


def _config(name: str, **changes) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text()) | changes


@pytest.mark.parametrize("name, changes, message", [
    ("deepseek-v3", {"num_experts_per_tok": 300}, "c.json: num_experts_per_tok 300 exceeds n_routed_experts 256"),
    ("qwen3-30b-a3b", {"num_experts_per_tok": 129}, "c.json: num_experts_per_tok 129 exceeds num_experts 128"),
    ("gpt-oss-20b", {"num_experts_per_tok": 33}, "c.json: num_experts_per_tok 33 exceeds num_local_experts 32"),
    ("deepseek-v3", {"first_k_dense_replace": 62}, "c.json: first_k_dense_replace 62 exceeds num_hidden_layers 61"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0, 48]},
     r"c.json: mlp_only_layers: layer 48 is not one of the 48 layers \(num_hidden_layers\)"),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 0}, "c.json: decoder_sparse_step 0 is not a positive layer step"),
    ("deepseek-v3", {"kv_lora_rank": 8192}, "c.json: mla.kv_lora_rank 8192 exceeds hidden_size 7168"),
    ("deepseek-v3", {"q_lora_rank": 7200}, "c.json: mla.q_lora_rank 7200 exceeds hidden_size 7168"),
    ("deepseek-v3", {"qk_rope_head_dim": 63}, "c.json: mla: qk_rope_head_dim 63 is odd"),
    ("deepseek-v3", {"num_attention_heads": 2, "num_key_value_heads": 2},
     r"c.json: mla.q_lora_rank 1536 exceeds the query width num_heads x \(qk_nope_head_dim \+ qk_rope_head_dim\) = 384"),
    ("deepseek-v3", {"moe_intermediate_size": None, "hidden_size": None}, "c.json: no 'hidden_size', required"),
])
def test_inconsistent_moe_and_mla_configs_are_one_line_naming_the_field(name, changes, message):
    with pytest.raises(SpecError, match=message) as caught:
        spec_from_hf_config(_config(name, **changes), "x", "c.json")
    assert "\n" not in str(caught.value)


def test_bad_config_is_one_line_and_exit_2_on_the_command_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("deepseek-v3", first_k_dense_replace=99)))
    result = CliRunner().invoke(cli, ["estimate", str(path), "--gpus", "8"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].endswith("first_k_dense_replace 99 exceeds num_hidden_layers 61")


def test_qwen3_moe_sparse_step_and_mlp_only_layers_pick_the_dense_layers():
    # Qwen3MoeDecoderLayer: sparse where idx not in mlp_only_layers and (idx + 1) % step == 0.
    spec = spec_from_hf_config(_config("qwen3-30b-a3b", num_hidden_layers=6, decoder_sparse_step=2,
                                       mlp_only_layers=[3]), "x")
    assert spec.moe.dense_layers == (0, 2, 3, 4)


def test_deepseek_mtp_layers_are_off_unless_set():
    # transformers skips the checkpoint's layer 61 (_keys_to_ignore_on_load_unexpected): not built.
    assert spec_from_hf_config(_config("deepseek-v3"), "x").moe.mtp_layers == 0


def test_heterogeneous_blocks_are_gathered_kind_by_kind_in_forward_order():
    # DeepSeek-V3: 3 dense blocks, then 58 sparse ones; ZeRO-3 and FSDP2 gather one block at a time.
    spec = resolve_model("deepseek-v3")
    facts = model_facts(spec, TrainingSpec(gpus=256, zero_stage=3))
    blocks = [g for g in facts.groups if g.role == "block"]
    assert [g.count for g in blocks] == [3, 58]
    dense_mlp = 3 * 7168 * 18432
    routed = 256 * 3 * 7168 * 2048
    assert blocks[1].params - blocks[0].params == routed + 256 * 7168 + 3 * 7168 * 2048 - dense_mlp
    assert facts.largest_group_params == blocks[1].params
    # the largest tensor: one layer's 256 experts' gate_up_proj, gathered whole by ZeRO-3
    assert facts.largest_tensor_numel == 256 * 2 * 2048 * 7168
    assert [g.role for g in facts.groups] == ["embedding", "block", "block", "final"]


@pytest.mark.parametrize("args", [
    ["deepseek-v3", "--gpus", "256", "--zero", "3"],
    ["deepseek-v3", "--gpus", "256", "--zero", "3", "--engine", "fsdp2"],
    ["gpt-oss-120b", "--gpus", "8", "--zero", "3"],
    ["qwen3-30b-a3b", "--gpus", "8", "--zero", "3", "--engine", "fsdp2"],
])
def test_the_big_moe_models_answer(args):
    result = CliRunner().invoke(cli, ["estimate", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["per_gpu"]["peak"] > 0


def _per_gpu(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["estimate", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["per_gpu"]


def test_fsdp2_pads_expert_tensors_on_dim_0_beyond_one_expert_per_rank():
    # FSDP2 shards dim 0 (the expert count) padded to the world size (_sharded_param_data): GPT-OSS-120B's
    # 128 experts on 256 ranks leave each rank a whole expert of each tensor, twice its even share.
    one_expert = 2880 * 5760 + 5760 + 2880 * 2880 + 2880  # gate_up_proj, its bias, down_proj, its bias
    fp32 = 4  # FSDP2 keeps fp32 sharded parameters under bf16 mixed precision
    at_256 = _per_gpu("gpt-oss-120b", "--engine", "fsdp2", "--zero", "3", "--gpus", "256")["params"]
    at_128 = _per_gpu("gpt-oss-120b", "--engine", "fsdp2", "--zero", "3", "--gpus", "128")["params"]
    experts = 36 * one_expert * fp32
    assert experts < at_256 < experts * 1.02
    assert at_128 - experts > 1.9 * (at_256 - experts)  # the rest (about) halves from 128 to 256 ranks


def test_deepspeed_zero3_gathers_a_whole_moe_layer_at_once():
    # ZeRO-3 fetches each module's own parameters before its forward: the experts module owns its
    # fused 3-D tensors, so one DeepSeek-V3 layer gathers all 256 experts (11.5e9 elements with
    # attention, router and shared expert: 21 GiB in bf16) however many ranks share them.
    sparse_layer = 11_507_286_016  # tests/estimate/model/test_param_counts.py checks the block against transformers
    buffers = _per_gpu("deepseek-v3", "--zero", "3", "--gpus", "256")["buffers"]
    assert buffers >= 2 * sparse_layer
