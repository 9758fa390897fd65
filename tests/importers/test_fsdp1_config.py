"""FSDP1 from an accelerate config YAML as `accelerate config` (1.15.0) writes it and `accelerate launch` runs it, the
FSDP1 knobs' one-line errors, and the estimate's report of them (issue 23)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError, ZeroplanWarning
from zeroplan.importers.training_config import load_training_config

# commands/config/cluster.py's answers for FSDP1 (version 1, FULL_SHARD, BACKWARD_PRE, ...), as the file it writes
WRITTEN = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "accelerate.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def settings(tmp_path: Path, text: str) -> dict:
    return load_training_config(write(tmp_path, text)).settings(gpus=None, hidden_size=None)


def test_the_written_file_is_fsdp1_full_shard(tmp_path):
    values = settings(tmp_path, WRITTEN)
    assert values["engine"] == "fsdp1" and values["zero_stage"] == 3 and values["precision"] == "bf16"
    assert values["gpus"] == 2 and values["recipe"] == "hf-trainer"
    assert values["fsdp1"] == {"hybrid": False, "use_orig_params": True, "backward_prefetch": "backward-pre",
                               "forward_prefetch": False, "sync_module_states": True, "cpu_ram_efficient_loading": True}


def test_estimate_of_llama_2_7b_with_the_written_file(tmp_path):
    """issue 23's "done when": `zeroplan estimate llama-2-7b --gpus 2 --config FILE` with accelerate's FSDP1 file."""
    result = CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "2", "--config", str(write(tmp_path, WRITTEN)),
                                      "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["engine"] == "fsdp1" and data["program"]["fsdp1"]["sharding_strategy"] == "FULL_SHARD"
    assert data["program"]["fsdp1"]["backward_prefetch"] == "backward-pre"
    assert data["per_gpu"]["peak"] > 0


@pytest.mark.parametrize("key_value, expected", [
    ("fsdp_sharding_strategy: SHARD_GRAD_OP", (2, False)),
    ("fsdp_sharding_strategy: NO_SHARD", (0, False)),
    ("fsdp_sharding_strategy: HYBRID_SHARD", (3, True)),
    ("fsdp_sharding_strategy: HYBRID_SHARD_ZERO2", (2, True)),
    ("fsdp_sharding_strategy: 2", (2, False)),  # the plugin's 1-based number
])
def test_sharding_strategy_is_the_stage(tmp_path, key_value, expected):
    text = WRITTEN.replace("  fsdp_version: 1\n", f"  fsdp_version: 1\n  {key_value}\n")
    values = settings(tmp_path, text)
    assert (values["zero_stage"], values["fsdp1"]["hybrid"]) == expected


def test_keys_left_out_take_accelerate_launch_s_defaults(tmp_path):
    """commands/launch.py: use_orig_params, sync_module_states and cpu_ram_efficient_loading default to true,
    FSDP_SHARDING_STRATEGY to FULL_SHARD; no backward prefetch unless asked; fsdp_version 1 when absent."""
    text = ("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n"
            "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    values = settings(tmp_path, text)
    assert values["engine"] == "fsdp1" and values["zero_stage"] == 3
    assert values["fsdp1"] == {"hybrid": False, "use_orig_params": True, "backward_prefetch": "none",
                               "forward_prefetch": False, "sync_module_states": True, "cpu_ram_efficient_loading": True}


def test_reshard_after_forward_alone_runs_full_shard_with_a_warning(tmp_path):
    """accelerate 1.15: launch passes FSDP_SHARDING_STRATEGY=FULL_SHARD, which the FSDP1 plugin reads first."""
    config = load_training_config(write(tmp_path, WRITTEN.replace("fsdp_reshard_after_forward: FULL_SHARD",
                                                                  "fsdp_reshard_after_forward: SHARD_GRAD_OP")))
    with pytest.warns(ZeroplanWarning, match=r"fsdp_reshard_after_forward SHARD_GRAD_OP is not what accelerate 1\.15 runs"):
        values = config.settings(gpus=None, hidden_size=None)
    assert values["zero_stage"] == 3


def test_the_plugin_reads_the_sharding_strategy_first():
    """The warning above is accelerate's own behaviour: with launch's environment the plugin is FULL_SHARD."""
    accelerate = pytest.importorskip("accelerate.utils")
    pytest.importorskip("torch")
    env = {"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op"}
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        plugin = accelerate.FullyShardedDataParallelPlugin()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert plugin.sharding_strategy.name == "FULL_SHARD"


def test_offload_params_offloads_the_optimizer_step_too(tmp_path):
    values = settings(tmp_path, WRITTEN.replace("fsdp_offload_params: false", "fsdp_offload_params: true"))
    assert values["offload_params"] == values["offload_optimizer"] == "cpu"


@pytest.mark.parametrize("replace, message", [
    (("  fsdp_version: 1\n", "  fsdp_version: 1\n  fsdp_activation_checkpointing_offload: true\n"),
     r"fsdp_config\.fsdp_activation_checkpointing_offload requires fsdp_version 2"),
    (("fsdp_reshard_after_forward: FULL_SHARD", "fsdp_reshard_after_forward: true"),
     r"fsdp_config\.fsdp_reshard_after_forward is a sharding strategy name under FSDP1 .* true/false is FSDP2's"),
    (("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
     r"fsdp_config\.fsdp_auto_wrap_policy is SIZE_BASED_WRAP: zeroplan models FSDP1 with TRANSFORMER_BASED_WRAP"),
    (("fsdp_backward_prefetch: BACKWARD_PRE", "fsdp_backward_prefetch: SOMETIMES"),
     r"fsdp_config\.fsdp_backward_prefetch must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH"),
    (("fsdp_sync_module_states: true", "fsdp_sync_module_states: false"),
     r"fsdp_config\.fsdp_sync_module_states must be true with fsdp_cpu_ram_efficient_loading"),
    (("  fsdp_version: 1\n", "  fsdp_version: 1\n  fsdp_sharding_strategy: QUARTER_SHARD\n"),
     r"fsdp_config\.fsdp_sharding_strategy must be one of FULL_SHARD"),
])
def test_fsdp2_keys_and_bad_values_in_an_fsdp1_file(tmp_path, replace, message):
    with pytest.raises(SpecError, match=message):
        settings(tmp_path, WRITTEN.replace(*replace))


@pytest.mark.parametrize("key, message", [
    ("fsdp_use_orig_params: true", r"fsdp_config\.fsdp_use_orig_params is FSDP1's; FSDP2 always keeps the original parameters"),
    ("fsdp_backward_prefetch: BACKWARD_PRE", r"fsdp_config\.fsdp_backward_prefetch is FSDP1's"),
    ("fsdp_sync_module_states: true", r"fsdp_config\.fsdp_sync_module_states is FSDP1's"),
])
def test_fsdp1_keys_in_an_fsdp2_file_are_ignored_with_a_warning(tmp_path, key, message):
    text = f"distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n  {key}\n"
    with pytest.warns(ZeroplanWarning, match=message):
        values = settings(tmp_path, text)
    assert values["engine"] == "fsdp2"


def test_forward_prefetch_in_an_fsdp2_file_is_refused_as_accelerate_refuses_it(tmp_path):
    text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_forward_prefetch: true\n"
    with pytest.raises(SpecError, match=r"fsdp_config\.fsdp_forward_prefetch is FSDP1's; accelerate refuses it"):
        settings(tmp_path, text)


def _estimate(*args: str):
    return CliRunner().invoke(cli, ["estimate", "tiny-llama", *args])


@pytest.mark.parametrize("args, message", [
    (("--engine", "fsdp1", "--zero", "1", "--gpus", "2"), "engine fsdp1 covers zero_stage 0 (NO_SHARD), 2"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "2", "--fsdp1-hybrid"), "fsdp1.hybrid replicates across nodes"),
    (("--engine", "fsdp2", "--zero", "3", "--gpus", "2", "--fsdp1-hybrid"), "fsdp1.hybrid applies to engine fsdp1"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "2", "--offload-params", "cpu"),
     "engine fsdp1 offloads parameters and optimizer together"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "2", "--offload-optimizer", "nvme"), "engine fsdp1 offloads to cpu only"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "2", "--recipe", "torchtitan"), "recipe torchtitan runs FSDP2"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "2", "--model-init", "meta"), "model_init meta: FSDP1 takes a built model"),
    (("--engine", "fsdp1", "--zero", "3", "--gpus", "4", "--tp", "2"), "engine fsdp1 runs data parallelism only"),
    (("--engine", "fsdp1", "--zero", "0", "--gpus", "4", "--gpus-per-node", "2", "--fsdp1-hybrid"),
     "fsdp1.hybrid shards within a node"),
    (("--engine", "deepspeed", "--zero", "3", "--gpus", "2", "--lora-rank", "8", "--base-precision", "nf4",
      "--quant-storage", "bf16", "--offload-params", "cpu", "--offload-optimizer", "cpu"),
     "offload_params: a quantized base is offloaded by engine fsdp1 only"),
])
def test_knobs_that_do_not_apply_are_one_line_errors(args, message):
    result = _estimate(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_the_report_names_torch_s_strategy_and_the_settings():
    result = _estimate("--engine", "fsdp1", "--zero", "2", "--gpus", "4", "--gpus-per-node", "2", "--fsdp1-hybrid",
                       "--recipe", "plain")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "fsdp1 ZeRO-2 (_HYBRID_SHARD_ZERO2)" in lines[1]
    assert "fsdp1 use_orig_params false, backward_prefetch backward-pre" in lines[2]


def test_the_trainer_s_other_strategies_say_how_to_run_them():
    result = _estimate("--engine", "fsdp1", "--zero", "2", "--gpus", "2")
    assert "reads FSDP_SHARDING_STRATEGY (FULL_SHARD when unset)" in result.output


def test_fsdp1_knobs_stay_out_of_other_engines_json():
    result = _estimate("--engine", "fsdp2", "--zero", "3", "--gpus", "2", "--format", "json")
    data = json.loads(result.output)
    assert "fsdp1" not in data["config"] and "fsdp1" not in data["program"]


@pytest.mark.parametrize("args, message", [
    (("--recipe", "plain", "--offload-optimizer", "cpu", "--offload-params", "cpu"),
     "offload: FSDP1's CPUOffload pins host memory, which fails without a GPU"),
    (("--recipe", "hf-trainer"), "fsdp1.sync_module_states: accelerate's FSDP1 plugin needs a GPU for it"),
    (("--recipe", "hf-trainer", "--no-fsdp1-sync-module-states", "--fsdp1-hybrid", "--gpus-per-node", "1"),
     "fsdp1.hybrid: FSDP1 builds HYBRID_SHARD's node groups from the GPU count"),
])
def test_what_a_cpu_cannot_run_is_refused_before_any_worker_starts(args, message):
    pytest.importorskip("torch")  # measure checks for torch before it reads the run
    result = CliRunner().invoke(cli, ["measure", "tiny-llama", "--engine", "fsdp1", "--zero", "3", "--nproc", "2",
                                      "--seq-len", "64", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
