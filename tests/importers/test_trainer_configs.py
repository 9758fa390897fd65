"""Trainer configs through --config (issue 11 item 3): torchtitan job TOMLs, torchtune recipe YAMLs and
accelerate config YAMLs, recognised from their content. The files in tests/data/configs are the
programs' own (README.md there names each source); the expected settings are what those programs'
sources do with each key (cited in the importers)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError, ZeroplanWarning
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.torchtitan_toml import MODELS as TITAN_MODELS
from zeroplan.importers.torchtune_yaml import MODELS as TUNE_MODELS
from zeroplan.importers.training_config import load_training_config
from tests import paths

DATA = paths.DATA / "configs"


def load(path: Path):
    return load_training_config(path)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def estimate_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["estimate", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------- torchtitan


def test_torchtitan_v022_llama3_8b():
    config = load(DATA / "torchtitan_v0.2.2_llama3_8b.toml")
    assert (config.kind, config.model) == ("torchtitan TOML", "llama-3-8b")
    # data_parallel_shard_degree -1: all the --gpus ranks, FSDP2 resharding every block ("default").
    assert config.settings(gpus=8) == {
        "recipe": "torchtitan", "engine": "fsdp2", "zero_stage": 3, "micro_batch": 1, "seq_len": 8192,
        "precision": "bf16", "checkpointing": "op", "optimizer": "adamw", "optimizer_impl": "fused", "loss": "standard",
    }
    # one rank: parallel_dims.fsdp_enabled is false, the bare module trains
    assert config.settings(gpus=None)["engine"] == "torch"


def test_torchtitan_2024_schema_of_the_published_benchmarks():
    config = load(DATA / "torchtitan_2024_llama3_8b.toml")
    settings = config.settings(gpus=8)
    assert config.model == "llama-3-8b"
    # [training] batch_size; optimizer.fused unset: {"fused": False, "foreach": True}
    assert (settings["micro_batch"], settings["seq_len"], settings["optimizer_impl"]) == (1, 8192, "foreach")
    assert settings["checkpointing"] == "op"


def test_torchtitan_estimate_names_recipe_model_and_knobs():
    data = estimate_json("--config", str(DATA / "torchtitan_v0.2.2_llama3_8b.toml"), "--gpus", "8")
    assert data["model"]["name"] == "llama-3-8b"
    assert data["program"]["recipe"] == "torchtitan"
    assert (data["config"]["engine"], data["config"]["zero_stage"], data["config"]["gpus"]) == ("fsdp2", 3, 8)
    assert (data["config"]["seq_len"], data["config"]["checkpointing"]) == (8192, "op")
    table = CliRunner().invoke(cli, ["estimate", "--config", str(DATA / "torchtitan_v0.2.2_llama3_8b.toml"), "--gpus", "8"])
    assert "recipe torchtitan: model init meta" in table.stdout


@pytest.mark.parametrize("lines, expected", [
    ('[training]\nlocal_batch_size = 2\nglobal_batch_size = 64\n[parallelism]\ndata_parallel_shard_degree = 8\n',
     {"micro_batch": 2, "grad_accum": 4, "gpus": 8}),  # 64 / (2 x 8)
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "3"\n', {"checkpointing": "full", "checkpoint_every": 3}),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "1"\n', {"checkpointing": "full"}),
    ('[activation_checkpoint]\nmode = "full"\n', {"checkpointing": "full"}),
    ('[activation_checkpoint]\nmode = "none"\n', {"checkpointing": "none"}),
    ("[training]\nseq_len = 8\n", {"checkpointing": "full", "checkpoint_every": 2}),  # defaults: selective, "2"
    ('[training]\ndtype = "bfloat16"\n', {"precision": "pure-bf16"}),
    ('[training]\nmixed_precision_param = "float32"\n', {"precision": "fp32"}),
    ("[training]\nenable_cpu_offload = true\n", {"offload_optimizer": "cpu", "offload_params": "cpu"}),
    ('[parallelism]\nfsdp_reshard_after_forward = "never"\n', {"zero_stage": 2}),
    ('[optimizer]\nname = "Adam"\nimplementation = "for-loop"\nearly_step_in_backward = true\n',
     {"optimizer": "adam", "optimizer_impl": "for-loop", "optimizer_in_backward": True}),
])
def test_torchtitan_keys(tmp_path, lines, expected):
    text = '[model]\nname = "llama3"\nflavor = "8B"\n' + lines
    settings = load(write(tmp_path, "job.toml", text)).settings(gpus=8)
    assert {key: settings.get(key) for key in expected} == expected


def test_torchtitan_compile_and_float8_of_v022(tmp_path):
    # v0.2.2 job_config.py: [compile] components default ["model", "loss"]; float8 through the
    # quantize.linear.float8 converter and its section (recipe_name None: tensorwise)
    text = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["quantize.linear.float8"]\n[compile]\nenable = true\n'
            '[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    config = load(write(tmp_path, "job.toml", text))
    settings = config.settings(gpus=8)
    assert settings["compile"] == ("model", "loss")
    assert settings["float8"] == {"recipe": "rowwise", "saved": "high-precision", "fsdp_all_gather": False,
                                  "precompute_scale": False}
    assert any(note.startswith("torch.compile of the blocks and the loss") for note in config.notes)
    data = estimate_json("--config", str(tmp_path / "job.toml"), "--gpus", "8")
    assert data["program"]["compile"] == ["model", "loss"] and data["program"]["float8"]["recipe"] == "rowwise"


def test_torchtitan_2025_schema_with_compile_and_float8_estimates_llama_2_7b():
    # issue 23's "done when": a torchtitan TOML with [compile] and [float8] (the typed schema of 08b8b244f)
    path = DATA / "torchtitan_2025_llama3_8b_compile_float8.toml"
    settings = load(path).settings(gpus=2)
    assert settings["compile"] == ("model", "loss")
    assert settings["float8"] == {"recipe": "tensorwise", "saved": "high-precision", "fsdp_all_gather": True,
                                  "precompute_scale": True}
    data = estimate_json("llama-2-7b", "--gpus", "2", "--config", str(path))
    assert data["model"]["name"] == "llama-2-7b" and data["program"]["compile"] == ["model", "loss"]
    eager = estimate_json("llama-2-7b", "--gpus", "2", "--config", str(path), "--compile", "none", "--float8", "none")
    assert eager["program"]["compile"] == [] and eager["program"]["float8"] is None
    assert data["per_gpu"]["peak"] < eager["per_gpu"]["peak"]  # compiled blocks and loss keep less


def test_torchtitan_2024_tensor_parallel_compile_float8_and_async_tp(tmp_path):
    # 9dec370 config_manager.py: [training] tensor_parallel_degree and compile, [experimental]
    # enable_async_tensor_parallel, [float8] (the Dec-2024 torchao saved float8 casts)
    text = ('[model]\nname = "llama3"\nflavor = "70B"\n[training]\nbatch_size = 16\nseq_len = 8192\n'
            'tensor_parallel_degree = 8\ndata_parallel_shard_degree = 32\ncompile = true\n'
            '[experimental]\nenable_async_tensor_parallel = true\n[activation_checkpoint]\nmode = "full"\n'
            '[float8]\nenable_float8_linear = true\nenable_fsdp_float8_all_gather = true\n'
            'precompute_float8_dynamic_scale_for_fsdp = true\n')
    settings = load(write(tmp_path, "job.toml", text)).settings(gpus=None)
    assert settings["gpus"] == 256 and settings["mesh"]["tp"] == 8 and settings["mesh"]["async_tp"] is True
    assert settings["compile"] == ("model",)
    assert settings["float8"]["saved"] == "float8" and settings["float8"]["fsdp_all_gather"] is True
    data = estimate_json("--config", str(tmp_path / "job.toml"))
    assert data["mesh"]["async_tp"] is True


@pytest.mark.parametrize("lines,message", [
    ('[compile]\nenable = true\ncomponents = ["blocks"]\n', r'job\.toml: compile\.components must be a list of "model"'),
    ('[model]\nconverters = ["mx"]\n', r"model\.converters .*MX \(mxfp8\) training is not modelled"),
    ('[float8]\nrecipe_name = "blockwise"\n', r"float8\.recipe_name must be tensorwise, rowwise or rowwise_with_gw_hp"),
])
def test_torchtitan_compile_and_float8_bad_input(tmp_path, lines, message):
    converters = 'converters = ["float8"]\n' if "recipe_name" in lines else ""
    text = '[model]\nname = "llama3"\nflavor = "8B"\n' + converters + lines.replace("[model]\n", "")
    with pytest.raises(SpecError, match=message):
        load(write(tmp_path, "job.toml", text)).settings(gpus=8)


def test_torchtitan_2024_delayed_float8_scaling_is_refused(tmp_path):
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[float8]\nenable_float8_linear = true\n'
            'scaling_type_weight = "delayed"\n')
    with pytest.raises(SpecError, match=r"float8\.scaling_type_weight 'delayed': delayed scaling is not modelled"):
        load(write(tmp_path, "job.toml", text)).settings(gpus=8)


# ---------------------------------------------------------------- torchtune


def test_torchtune_single_device_1b():
    config = load(DATA / "torchtune_llama3_2_1B_full_single_device.yaml")
    assert (config.kind, config.model) == ("torchtune YAML", "llama-3.2-1b")
    assert config.settings() == {
        "recipe": "torchtune", "engine": "torch", "zero_stage": 0, "gpus": 1, "micro_batch": 4, "grad_accum": 1,
        "precision": "pure-bf16", "device": "cuda", "checkpointing": "none", "optimizer_in_backward": True,
        "loss": "chunked", "loss_chunks": 8, "optimizer": "adam8bit", "paged_optimizer": True,
    }


def test_torchtune_3b_single_device_estimate():
    data = estimate_json("--config", str(DATA / "torchtune_llama3_2_3B_full_single_device.yaml"), "--seq-len", "4096")
    assert data["model"]["name"] == "llama-3.2-3b"
    assert data["program"]["recipe"] == "torchtune" and data["program"]["optimizer_in_backward"] is True
    assert (data["config"]["engine"], data["config"]["checkpointing"], data["config"]["precision"]) == ("torch", "full", "pure-bf16")
    # PagedAdamW8bit: its states of tensors of 1e5 elements or more are in unified memory, outside the peak
    assert data["config"]["paged_optimizer"] is True and data["per_node"]["unified"] > 0
    assert any(note.startswith("paged optimizer states:") for note in data["notes"])


def test_torchtune_distributed_8b():
    config = load(DATA / "torchtune_llama3_1_8B_full.yaml")
    settings = config.settings(gpus=8)
    assert config.model == "llama-3-8b"
    assert any("Llama 3.1 has Llama 3's layers and sizes" in note for note in config.notes)
    assert {key: settings[key] for key in ("engine", "zero_stage", "micro_batch", "checkpointing", "optimizer",
                                           "optimizer_impl", "optimizer_in_backward")} == {
        "engine": "fsdp2", "zero_stage": 3, "micro_batch": 2, "checkpointing": "full", "optimizer": "adamw",
        "optimizer_impl": "fused", "optimizer_in_backward": False}


def test_torchtune_without_recipe_line_follows_gpus(tmp_path):
    text = ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\ndtype: bf16\n"
            "loss:\n  _component_: torch.nn.CrossEntropyLoss\noptimizer:\n  _component_: torch.optim.AdamW\n"
            "  foreach: false\nfsdp_cpu_offload: true\nenable_activation_offloading: true\ntokenizer:\n  max_seq_len: 1024\n")
    config = load(write(tmp_path, "tune.yaml", text))
    one, many = config.settings(gpus=None), config.settings(gpus=4)
    assert (one["engine"], many["engine"], many["zero_stage"]) == ("torch", "fsdp2", 3)
    assert "offload_optimizer" not in one and many["offload_optimizer"] == many["offload_params"] == "cpu"
    assert one["optimizer_impl"] == "for-loop" and one["loss"] == "standard" and one["seq_len"] == 1024
    assert one["activation_offload"] == "cpu"


# ---------------------------------------------------------------- accelerate


def test_accelerate_fsdp2():
    config = load(DATA / "accelerate_fsdp2.yaml")
    assert (config.kind, config.model) == ("accelerate YAML", None)
    assert config.settings() == {"recipe": "hf-trainer", "engine": "fsdp2", "gpus": 8, "gpus_per_node": 8,
                                 "precision": "bf16", "zero_stage": 3, "checkpointing": "full"}


def test_accelerate_deepspeed_section():
    settings = load(DATA / "accelerate_deepspeed_zero3.yaml").settings()
    assert {key: settings[key] for key in ("engine", "zero_stage", "gpus", "gpus_per_node", "offload_optimizer",
                                           "grad_accum", "model_init", "precision")} == {
        "engine": "deepspeed", "zero_stage": 3, "gpus": 16, "gpus_per_node": 8, "offload_optimizer": "cpu",
        "grad_accum": 4, "model_init": "zero-init", "precision": "bf16"}


def test_accelerate_deepspeed_config_file_fills_autos_from_the_model():
    # the file's "auto" buckets are filled from the hidden size as the Trainer fills them (h*h, 0.9*h*h, 10*h)
    data = estimate_json("llama-100m", "--config", str(DATA / "accelerate_deepspeed_file.yaml"))
    knobs = data["config"]["deepspeed"]
    assert (knobs["reduce_bucket_size"], knobs["stage3_param_persistence_threshold"]) == (768 * 768, 10 * 768)
    assert (data["config"]["gpus"], data["config"]["zero_stage"], data["program"]["model_init"]) == (4, 3, "zero-init")
    assert data["config"]["precision"] == "fp32"  # mixed_precision absent: accelerate's "no" fills bf16 "auto"


def test_accelerate_multi_gpu_is_ddp():
    settings = load(DATA / "accelerate_multi_gpu.yaml").settings()
    assert (settings["engine"], settings["zero_stage"], settings["gpus"], settings["precision"]) == ("torch", 0, 2, "fp16")


# ---------------------------------------------------------------- the format comes from the content


@pytest.mark.parametrize("name, text, kind", [
    ("job", '[model]\nname = "llama3"\nflavor = "70B"\n', "torchtitan TOML"),
    ("tune.txt", "model:\n  _component_: torchtune.models.llama2.llama2_7b\nbatch_size: 1\n", "torchtune YAML"),
    ("default_config", "distributed_type: MULTI_GPU\nnum_processes: 2\n", "accelerate YAML"),
    ("ds_config.conf", '{"zero_optimization": {"stage": 2}}', "DeepSpeed JSON"),
    ("zero_config", "zero = dict(type='ZeroRedundancyOptimizer_Level_2')\n", "ColossalAI Python"),
])
def test_format_from_content(tmp_path, name, text, kind):
    assert load(write(tmp_path, name, text)).kind == kind


def test_catalogue_names_of_the_model_tables_exist():
    for name in {*TITAN_MODELS.values(), *TUNE_MODELS.values()}:
        assert resolve_model(name).name == name


# ---------------------------------------------------------------- bad input: one line, the field named


@pytest.mark.parametrize("name, text, message", [
    ("bad.toml", '[model]\nname = "llama3"\nflavor = 8B\n', r"bad\.toml: invalid TOML: .*\(at line 3, column 11\)"),
    ("bad.yaml", "model:\n  _component_: x\n   batch_size: [1\n", r"bad\.yaml:3: invalid YAML: "),
    ("odd.cfg", "just some words\n", r"odd\.cfg: unknown config format: expected a DeepSpeed JSON"),
    ("t.toml", "[job]\ndescription = 'x'\n", r"t\.toml: unknown config format: a TOML file without torchtitan's"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8b"\n',
     r"t\.toml: model\.flavor '8b' of model 'llama3' is not in zeroplan's catalogue \(close: llama3 8B"),
    ("t.toml", '[model]\nname = "qwen3"\nflavor = "0.6B"\n', r"model\.flavor '0\.6B' of model 'qwen3' is not in"),
    ("t.toml", '[model]\nflavor = "8B"\nname = "llama3"\n[training]\nlocal_batch_sise = 2\n',
     r"t\.toml: training\.local_batch_sise is not a torchtitan v0\.2\.2 option \(did you mean 'local_batch_size'\?\)"),
    ("u.yaml", "model:\n  _component_: torchtune.models.llama3_2.llama3_2_3B\nbatch_size: 1\n",
     r"u\.yaml: model\._component_ torchtune\.models\.llama3_2\.llama3_2_3B is not in zeroplan's catalogue "
     r"\(close: torchtune\.models\.llama3_2\.llama3_2_3b"),
    ("u.yaml", "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n",
     r"u\.yaml: model\.lora_attn_modules is missing \(torchtune's LoRA model builders require it\)"),
    ("a.yaml", "distributed_type: FSDP\nnum_procesess: 8\n",
     r"a\.yaml: num_procesess is not an accelerate config key \(did you mean 'num_processes'\?\)"),
])
def test_bad_configs_at_load(tmp_path, name, text, message):
    with pytest.raises(SpecError, match=message):
        load(write(tmp_path, name, text))


_TUNE = ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\n"
         "loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n"
         "optimizer:\n  _component_: torch.optim.AdamW\n")


@pytest.mark.parametrize("name, text, gpus, message", [
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = 8\n'
     'data_parallel_shard_degree = 2\n', 8, r"t\.toml: parallelism\.data_parallel_shard_degree is 2, so the mesh takes 16 "
     r"GPUs \(x tp x cp x pp x data_parallel_replicate_degree\) but --gpus is 8"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 4\n'
     'pipeline_parallel_schedule = "ZBVZeroBubble"\n', 8, r"parallelism\.pipeline_parallel_schedule 'ZBVZeroBubble' is not modelled"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nselective_ac_option = "ops"\n',
     8, r"activation_checkpoint\.selective_ac_option must be 'op' or a whole number of blocks, got 'ops'"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[optimizer]\nname = "Lion"\n',
     8, r"optimizer\.name 'Lion' is not a torchtitan optimizer zeroplan models"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nglobal_batch_size = 20\n'
     '[parallelism]\ndata_parallel_shard_degree = 4\n', None,
     r"training\.global_batch_size 20 is not a multiple of local_batch_size 2 x 4 data-parallel ranks"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nglobal_batch_size = 64\n', None,
     r"training\.global_batch_size needs the data-parallel degree"),
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 4\n', 8,
     r"parallelism\.data_parallel_shard_degree is 4 but --gpus is 8"),
    ("u.yaml", "# tune run full_finetune_single_device --config x\n" + _TUNE, 8,
     r"full_finetune_single_device, which trains on one GPU; leave out --gpus 8"),
    ("u.yaml", _TUNE + "dtype: fp16\n", None, r"u\.yaml: dtype fp16 is refused by torchtune's full-finetune recipes"),
    ("u.yaml", _TUNE + "  lr: 2e-5\n  fusd: true\n", None,
     r"optimizer\.fusd is not an argument of optimizer\._component_ \(did you mean 'fused'\?\)"),
    ("u.yaml", _TUNE.replace("torch.optim.AdamW", "torch.optim.Adafactor"), None,
     r"optimizer\._component_ 'torch\.optim\.Adafactor' is not modelled"),
    ("u.yaml", _TUNE + "tensor_parallel_dim: 2\n", 8, r"tensor_parallel_dim is more than 1: not modelled yet: issue 14"),
    ("a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: FULL_SHARD\n", None,
     r"fsdp_config\.fsdp_auto_wrap_policy is NO_WRAP: zeroplan models FSDP1 with TRANSFORMER_BASED_WRAP"),
    ("a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: FULL_SHARD\n",
     None, r"fsdp_config\.fsdp_reshard_after_forward must be true or false with FSDP2, got 'FULL_SHARD'"),
    ("a.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 3\n",
     None, r"deepspeed_config\.zero_stage cannot be given with deepspeed_config_file: accelerate refuses it"),
    ("a.yaml", "distributed_type: XLA\n", None, r"distributed_type 'XLA' is not modelled"),
    ("a.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: gpu\n", None,
     r"deepspeed_config\.offload_param_device must be none, cpu or nvme, got 'gpu'"),
])
def test_bad_configs_at_settings(tmp_path, name, text, gpus, message):
    with pytest.raises(SpecError, match=message):
        load(write(tmp_path, name, text)).settings(gpus=gpus)


def test_optimizer_in_backward_with_accumulation_is_refused_as_torchtune_refuses_it(tmp_path):
    path = write(tmp_path, "u.yaml", _TUNE + "optimizer_in_bwd: true\ngradient_accumulation_steps: 4\n")
    result = CliRunner().invoke(cli, ["estimate", "--config", str(path)])
    assert result.exit_code == 2
    assert "optimizer_in_backward steps at every backward" in result.stderr and len(result.stderr.splitlines()) == 1


# ---------------------------------------------------------------- unknown keys: warn where the program ignores them


@pytest.mark.parametrize("name, text, warning", [
    ("t.toml", '[model]\nname = "llama3"\nflavor = "8B"\nnorm_type = "rmsnorm"\n[training]\nbatch_size = 1\nwarmup = 2\n',
     r"t\.toml: training\.warmup is not read by torchtitan \(2024 schema\)"),
    ("u.yaml", _TUNE + "enable_activation_checkpoint: true\n",
     r"enable_activation_checkpoint is not read by torchtune's full-finetune recipes \(did you mean "
     r"'enable_activation_checkpointing'\?\)"),
    ("u.yaml", "# tune run full_finetune_single_device\n" + _TUNE + "fsdp_cpu_offload: true\n",
     r"fsdp_cpu_offload is read by the distributed recipe only: ignored"),
    ("a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_ofload_params: true\n",
     r"fsdp_config\.fsdp_ofload_params is not read by accelerate \(did you mean 'fsdp_offload_params'\?\)"),
])
def test_ignored_keys_warn(tmp_path, name, text, warning):
    config = load(write(tmp_path, name, text))  # warnings wait until the settings are known to be good
    config.settings(gpus=8 if name.endswith(".toml") else None)
    with pytest.warns(ZeroplanWarning, match=warning):
        config.warn()
    assert config.warnings == []  # issued once


def test_known_files_read_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroplanWarning)
        for path in sorted(DATA.glob("*.toml")) + sorted(DATA.glob("*.yaml")):
            config = load(path)
            config.settings(gpus=8 if "single_device" not in path.name else None, hidden_size=4096)
            assert config.warnings == [], path


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path):
    path = write(tmp_path, "bad.yaml", "distributed_type: FSDP\n  num_processes: 8\n")
    result = CliRunner().invoke(cli, ["estimate", "llama-100m", "--config", str(path)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Error: ") and f"{path}:2: invalid YAML: mapping values are not allowed here" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_missing_model_says_the_config_names_none(tmp_path):
    result = CliRunner().invoke(cli, ["estimate", "--config", str(DATA / "accelerate_fsdp2.yaml")])
    assert result.exit_code == 2
    assert "missing MODEL" in result.stderr and "(the --config file, accelerate YAML, names no model)" in result.stderr


def test_warnings_wait_for_a_good_config(tmp_path):
    # an ignored key and a fatal error: the error alone, on one line
    path = write(tmp_path, "u.yaml", _TUNE + "dtype: fp16\nunknown_key: 1\n")
    result = CliRunner().invoke(cli, ["estimate", "--config", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "dtype fp16" in result.stderr
    path = write(tmp_path, "v.yaml", _TUNE + "unknown_key: 1\n")
    result = CliRunner().invoke(cli, ["estimate", "--config", str(path)])
    assert result.exit_code == 0
    assert result.stderr.startswith("Warning: ") and "unknown_key is not read by torchtune" in result.stderr
