"""Odd and hostile config files and MODEL arguments (issue 10, items 2, 3, 5, 7, 10, 11): each
reads as the engine would read it, or fails on one line naming the file and the key, exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError, ZeroplanWarning
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.options import training_spec_from_options
from zeroplan.importers.training_config import read_training_config, write_deepspeed_config
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA

CONFIGS = DATA / "configs"
GIB = 2**30


def run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


# ---------------------------------------------------------------- item 2: no traceback


@pytest.mark.parametrize("name", ["binary.json", "binary.py"])
def test_binary_config_is_one_line(tmp_path, name):
    path = write(tmp_path, name, bytes(range(256)) * 4)
    error = one_line_error(run("estimate", "llama-2-7b", "--config", str(path)))
    assert f"{name}: is not UTF-8 text" in error


def test_nul_bytes_in_a_python_config_are_one_line(tmp_path):
    path = write(tmp_path, "nul.py", "zero = dict(type='ZeroRedundancyOptimizer_Level_3')\x00\n")
    with pytest.raises(SpecError, match=r"nul\.py: contains NUL bytes"):
        read_training_config(path)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_deeply_nested_json_is_refused_before_parsing(tmp_path, text):
    path = write(tmp_path, "deep.json", text)
    error = one_line_error(run("estimate", "llama-2-7b", "--config", str(path)))
    assert "deep.json: nested deeper than 64 levels" in error


def test_deeply_nested_model_json_is_refused(tmp_path):
    path = write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match=r"deep\.json: nested deeper than 64 levels"):
        resolve_model(str(path))


def test_deeply_nested_python_config_is_one_line(tmp_path):
    path = write(tmp_path, "deep.py", "x = " + "[" * 5000 + "]" * 5000 + "\n")
    error = one_line_error(run("estimate", "llama-2-7b", "--config", str(path)))
    assert "deep.py" in error


def test_oversized_config_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('{"zero_optimization": {"stage": 3}}' + " " * (1 << 20), encoding="utf-8")
    with pytest.raises(SpecError, match=r"big\.json: is 1,048,\d+ bytes; a config file is at most 1,048,576"):
        read_training_config(path)


def test_huge_integer_in_json_is_one_line(tmp_path):
    path = write(tmp_path, "huge.json", '{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}")
    error = one_line_error(run("estimate", "llama-2-7b", "--config", str(path)))
    assert "huge.json" in error


# ---------------------------------------------------------------- item 3: sub_group_size


def test_sub_group_size_is_read_and_written(tmp_path):
    path = write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 1e8}}))
    assert read_training_config(path)["deepspeed"] == {"sub_group_size": 100_000_000, "client_optimizer": True}
    spec = TrainingSpec(zero_stage=3, deepspeed={"sub_group_size": 12345})
    assert write_deepspeed_config(spec)["zero_optimization"]["sub_group_size"] == 12345


def _largest_sub_group_by_deepspeed(numels: list[int], n: int, sub_group_size: int) -> int:
    """The largest sub-group DeepSpeed's own stage3.py `_create_fp16_sub_groups` cuts from tensors
    of `numels` elements (in parameter order), each partitioned ceil(numel / n) per rank."""
    from types import SimpleNamespace

    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    params = [SimpleNamespace(partition_numel=lambda numel=numel: -(-numel // n)) for numel in numels]
    cut = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=sub_group_size),
                                                                       params)
    return max(sum(p.partition_numel() for p in sub_group) for sub_group in cut)


def test_sub_group_size_sets_the_nvme_swap_buffers():
    """stage3.py `_create_fp16_sub_groups` cuts the partition into sub-groups of at least sub_group_size
    elements; the optimizer swapper pins buffer_count (4) fp32 buffers of the largest one
    (swap_tensor/optimizer_utils.py), on each of a node's 8 GPUs. llama-2-70b on 8 GPUs: about
    4 x (1e9 - 1e8) x 4 bytes x 8 GPUs = 115.2 GB less host memory per node with sub_group_size 1e8."""
    from zeroplan.estimate import estimate

    model = resolve_model("llama-2-70b")
    # Llama-2-70B's tensors in parameter order (config.json: hidden 8192, 80 layers, 8 KV heads of
    # 128, intermediate 28672, vocabulary 32000, untied head)
    h, kv, mlp, vocab = 8192, 8 * 128, 28672, 32000
    layer = [h * h, kv * h, kv * h, h * h, mlp * h, mlp * h, h * mlp, h, h]
    numels = [vocab * h, *layer * 80, h, vocab * h]
    base = dict(zero_stage=3, gpus=8, offload_optimizer="nvme", offload_params="nvme")
    default = estimate(model, TrainingSpec(**base)).per_node.cpu_bytes
    small = estimate(model, TrainingSpec(**base, deepspeed={"sub_group_size": 100_000_000})).per_node.cpu_bytes
    largest = [_largest_sub_group_by_deepspeed(numels, 8, size) for size in (1_000_000_000, 100_000_000)]
    assert default - small == 4 * (largest[0] - largest[1]) * 4 * 8
    assert default - small == pytest.approx(115.2e9, rel=0.02)


def test_colossalai_sub_group_size_default_is_level_3s():
    # ZeroRedundancyOptimizer_Level_3.__init__: sub_group_size=1000000000000
    got = read_training_config(CONFIGS / "colossalai_zero3.py")
    assert got["deepspeed"]["sub_group_size"] == 1_000_000_000_000


# ---------------------------------------------------------------- item 5: the HF Trainer's "auto"


def test_hf_trainer_auto_values_are_filled_from_the_hidden_size():
    # transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize
    got = read_training_config(CONFIGS / "hf_docs_zero3_auto.json", hidden_size=4096)
    assert got["deepspeed"]["reduce_bucket_size"] == 4096 * 4096
    assert got["deepspeed"]["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096) == 15_099_494
    assert got["deepspeed"]["stage3_param_persistence_threshold"] == 40_960


def test_hf_trainer_fills_only_reduce_bucket_size_below_stage_3(tmp_path):
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    got = read_training_config(write(tmp_path, "z2.json", json.dumps(config)), hidden_size=1024)
    assert got["deepspeed"] == {"reduce_bucket_size": 1024 * 1024, "client_optimizer": True}


def test_hf_auto_without_a_hidden_size_names_the_key():
    with pytest.raises(SpecError, match=r'hf_docs_zero3_auto\.json: zero_optimization\.reduce_bucket_size is "auto"'
                                        r".*hidden size"):
        read_training_config(CONFIGS / "hf_docs_zero3_auto.json")
    error = one_line_error(run("estimate", "--params", "7e9", "--zero", "3",
                               "--config", str(CONFIGS / "hf_docs_zero3_auto.json")))
    assert "zero_optimization.reduce_bucket_size" in error


def test_hf_auto_config_on_llama_2_7b_is_what_the_trainer_runs():
    """The issue: DeepSpeed's defaults in place of the Trainer's values cost 0.9 GiB per GPU
    (a 5e8-element reduce bucket of bf16 against 4096^2 elements)."""
    from zeroplan.estimate import estimate

    model = resolve_model("llama-2-7b")
    options = {"gpus": 8}
    filled = training_spec_from_options(options, CONFIGS / "hf_docs_zero3_auto.json", model=model)
    assert filled.deepspeed.reduce_bucket_size == 4096 * 4096
    defaults = filled.model_copy(update={"deepspeed": filled.deepspeed.model_copy(update={
        "reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000})})
    saved = estimate(model, defaults).peak.total_bytes - estimate(model, filled).peak.total_bytes
    assert 0.85 * GIB < saved < 0.95 * GIB
    result = run("estimate", "llama-2-7b", "--gpus", "8", "--config", str(CONFIGS / "hf_docs_zero3_auto.json"),
                 "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["deepspeed"]["reduce_bucket_size"] == 4096 * 4096


# ---------------------------------------------------------------- item 7: wrong successes


def test_model_config_given_as_config_is_refused():
    path = DATA / "hf_configs" / "llama-2-7b.json"
    error = one_line_error(run("estimate", "llama-2-7b", "--config", str(path)))
    assert "llama-2-7b.json: is a model config (it has model_type), not a DeepSpeed config; give it as MODEL" in error


def test_duplicate_json_keys_are_refused_as_deepspeed_does(tmp_path):
    # deepspeed/runtime/config.py: object_pairs_hook=dict_raise_error_on_duplicate_keys
    path = write(tmp_path, "dup.json", '{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(SpecError, match=r"dup\.json: duplicate key 'stage'"):
        read_training_config(path)


@pytest.mark.parametrize("text", ["", '"""Only a docstring."""\n', "BATCH_SIZE = 128\nNUM_EPOCHS = 2\n"])
def test_python_config_without_settings_is_refused(tmp_path, text):
    path = write(tmp_path, "empty.py", text)
    with pytest.raises(SpecError, match=r"empty\.py: sets none of zero, optimizer, gradient_accumulation"):
        read_training_config(path)


@pytest.mark.parametrize("text", ["", "  \n", "// nothing\n", "{}"])
def test_empty_json_config_is_refused(tmp_path, text):
    path = write(tmp_path, "empty.json", text)
    with pytest.raises(SpecError, match=r"empty\.json: "):
        read_training_config(path)


# ---------------------------------------------------------------- item 10: friction


def test_comments_and_trailing_commas_read_as_deepspeed_reads_them(tmp_path):
    # deepspeed/runtime/config.py DeepSpeedConfig: hjson.load(...) for a config path
    pytest.importorskip("hjson")
    text = '{\n  // ZeRO-3\n  "zero_optimization": {"stage": 3, "sub_group_size": 1e8,},  # bash-style too\n}\n'
    got = read_training_config(write(tmp_path, "commented.json", text))
    assert got["zero_stage"] == 3 and got["deepspeed"] == {"sub_group_size": 100_000_000, "client_optimizer": True}


def test_without_hjson_the_message_says_how_to_read_comments(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "hjson", None)  # import hjson raises ImportError
    path = write(tmp_path, "commented.json", '{\n  // ZeRO-3\n  "zero_optimization": {"stage": 3}\n}\n')
    with pytest.raises(SpecError, match=r"commented\.json: invalid JSON: .* \(at line 2, column 3\) .*pip install hjson"):
        read_training_config(path)


def test_bom_in_python_config_is_accepted_as_python_does(tmp_path):
    path = write(tmp_path, "bom.py", b"\xef\xbb\xbfzero = dict(type='ZeroRedundancyOptimizer_Level_2')\n")
    assert read_training_config(path)["zero_stage"] == 2


def test_bom_in_json_config_is_accepted(tmp_path):
    path = write(tmp_path, "bom.json", b'\xef\xbb\xbf{"zero_optimization": {"stage": 1}}')
    assert read_training_config(path)["zero_stage"] == 1


def test_directory_model_reads_its_config_json(tmp_path):
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "hf_configs" / "llama-2-7b.json").read_text())
    assert resolve_model(str(folder)).hidden_size == 4096


def test_directory_model_without_config_json_says_so(tmp_path):
    with pytest.raises(SpecError, match=r"is a directory without a config\.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["LLAMA-2-7B", "Llama-2-7b", "GPT2"])
def test_catalogue_names_ignore_case(name):
    assert resolve_model(name).name == name.lower()


# ---------------------------------------------------------------- item 11: the ColossalAI docs' typo


def test_colossalai_docs_fast_init_typo_is_estimated_with_a_warning():
    with pytest.warns(ZeroplanWarning, match=r"colossalai_docs_fast_init_typo\.py:14: zero\.offload_param_config\."
                                             r"fast_init is ignored by ColossalAI.*max_in_cpu"):
        got = read_training_config(CONFIGS / "colossalai_docs_fast_init_typo.py")
    # as ColossalAI runs it: both offloads to CPU, max_in_cpu left at its default
    assert (got["offload_optimizer"], got["offload_params"]) == ("cpu", "cpu")
    assert "offload_max_in_cpu" not in got["deepspeed"]


def test_colossalai_typo_warning_is_one_line_on_stderr():
    result = run("estimate", "llama-2-7b", "--gpus", "8", "--config", str(CONFIGS / "colossalai_docs_fast_init_typo.py"))
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("Warning: ") and "fast_init" in warnings[0]
