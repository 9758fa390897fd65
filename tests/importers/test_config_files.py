"""Reading DeepSpeed JSON and ColossalAI-style configs into training settings, and writing them back.

Good examples are published configs (tests/data/configs/README.md says where each comes from); the
expected settings are what DeepSpeed / ColossalAI do with them, read off their source.
"""

from __future__ import annotations

import ast
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.importers.training_config import read_training_config, write_deepspeed_config, write_fsdp2_snippet
from zeroplan.importers.deepspeed_json import BF16_KEYS, FP16_KEYS, ZERO_KEYS
from zeroplan.importers.values import OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS
from zeroplan.errors import SpecError
from zeroplan.spec.training import TrainingSpec
from tests import paths

DATA = paths.DATA / "configs"


def write(tmp_path: Path, name: str, content: object) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def ds(tmp_path: Path, config: dict, **kwargs) -> dict:
    return read_training_config(write(tmp_path, "ds.json", config), **kwargs)


def zero3(**zero) -> dict:
    return {"zero_optimization": {"stage": 3, **zero}}


# ---------------------------------------------------------------- DeepSpeed: published configs


def test_deepspeed_docs_zero3_example():
    assert read_training_config(DATA / "deepspeed_docs_zero3.json") == {
        "engine": "deepspeed", "zero_stage": 3, "precision": "fp16", "optimizer": "adamw"}


@pytest.mark.parametrize("name, device", [("deepspeed_docs_zero3_offload_cpu.json", "cpu"),
                                          ("deepspeed_docs_zero3_offload_nvme.json", "nvme")])
def test_deepspeed_docs_offload_examples(name, device):
    got = read_training_config(DATA / name)
    # no fp16/bf16 section: DeepSpeed trains in fp32 (both default to enabled=False)
    # no optimizer section: the client optimizer passed to deepspeed.initialize steps
    assert got == {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": device,
                   "offload_params": device, "precision": "fp32", "deepspeed": {"client_optimizer": True}}
    TrainingSpec(**got)


def test_deepspeed_getting_started_needs_the_gpu_count():
    path = DATA / "deepspeed_getting_started.json"
    with pytest.raises(SpecError, match=r"deepspeed_getting_started\.json: train_batch_size .*GPU count"):
        read_training_config(path)
    # DeepSpeed with 8 ranks: micro = 8 // 8 // 1 (config.py _set_batch_related_parameters);
    # "zero_optimization": true is the deprecated form of stage 1.
    assert read_training_config(path, gpus=8) == {
        "engine": "deepspeed", "zero_stage": 1, "precision": "fp16", "optimizer": "adam",
        "micro_batch": 1, "grad_accum": 1}
    assert read_training_config(path, gpus=2)["micro_batch"] == 4


def test_hf_zero2_auto_values_are_left_to_the_defaults():
    got = read_training_config(DATA / "hf_ds_config_zero2.json")
    assert got == {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu", "optimizer": "adamw",
                   "deepspeed": {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000,
                                 "overlap_comm": True, "contiguous_gradients": True, "offload_pin_memory": True}}
    assert type(got["deepspeed"]["reduce_bucket_size"]) is int  # 2e8 in JSON is a float
    spec = TrainingSpec(**got)
    assert spec.precision.value == "bf16" and spec.micro_batch == 1  # "auto": zeroplan's defaults


def test_hf_zero3_docs_style_auto(tmp_path):
    config = zero3(offload_optimizer={"device": "cpu", "pin_memory": True},
                   offload_param={"device": "cpu", "pin_memory": True}, overlap_comm=True,
                   contiguous_gradients=True, sub_group_size=1e9, reduce_bucket_size="auto",
                   stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                   stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9,
                   stage3_gather_16bit_weights_on_model_save=True)
    config.update({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}, "train_batch_size": "auto",
                   "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})
    # the Trainer fills the hidden-size "auto" values (tests/importers/test_odd_configs.py)
    assert ds(tmp_path, config, hidden_size=1024) == {
        "engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
        "precision": "bf16",
        "deepspeed": {"reduce_bucket_size": 1024**2, "stage3_prefetch_bucket_size": int(0.9 * 1024**2),
                      "stage3_param_persistence_threshold": 10240, "sub_group_size": 10**9,
                      "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
                      "overlap_comm": True, "contiguous_gradients": True, "offload_pin_memory": True,
                      "client_optimizer": True}}


def test_old_hf_zero3_reduce_bucket_size_zero_is_rejected_as_deepspeed_does():
    # DeepSpeedZeroConfig.reduce_bucket_size: Field(pp_int(5e8), gt=0)
    with pytest.raises(SpecError, match=r"hf_ds_config_zero3_old\.json: zero_optimization\.reduce_bucket_size "
                                        r"must be >= 1, got 0"):
        read_training_config(DATA / "hf_ds_config_zero3_old.json")


def test_brief_example(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2e8}}
    assert ds(tmp_path, config) == {
        "engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "precision": "bf16",
        "optimizer": "adamw", "micro_batch": 4, "grad_accum": 8, "deepspeed": {"reduce_bucket_size": 200_000_000}}


# ---------------------------------------------------------------- DeepSpeed: semantics


def test_aliases_are_accepted(tmp_path):
    # populate_by_name=True: "prefetch_bucket_size" is the field, "stage3_prefetch_bucket_size" its alias
    got = ds(tmp_path, zero3(prefetch_bucket_size=1e7, max_live_parameters=3, param_persistence_threshold=0))
    assert got["deepspeed"] == {"stage3_prefetch_bucket_size": 10**7, "stage3_max_live_parameters": 3,
                                "stage3_param_persistence_threshold": 0, "client_optimizer": True}


def test_offload_where_deepspeed_does_not_read_it_is_dropped(tmp_path):
    got = ds(tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                              "offload_optimizer": {"device": "cpu"}}})
    assert got["offload_optimizer"] == "cpu" and "offload_params" not in got
    got = ds(tmp_path, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert "offload_optimizer" not in got
    TrainingSpec(**got)


def test_offload_param_knobs(tmp_path):
    got = ds(tmp_path, zero3(offload_param={"device": "nvme", "nvme_path": "/x", "buffer_count": 6,
                                            "buffer_size": 1e8, "max_in_cpu": 2e9, "pin_memory": False}))
    assert got["offload_params"] == "nvme"
    assert got["deepspeed"] == {"offload_buffer_count": 6, "offload_buffer_size": 10**8,
                                "offload_max_in_cpu": 2 * 10**9, "offload_pin_memory": False, "client_optimizer": True}


def test_nvme_optimizer_offload_below_stage_3_is_cpu_memory(tmp_path):
    # stage_1_and_2.py: any device but "none" sets cpu_offload; only stage 3 swaps to NVMe
    got = ds(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert got["offload_optimizer"] == "cpu"
    with pytest.raises(ValueError, match=r"offload_optimizer nvme requires zero_stage 3 with deepspeed"):
        TrainingSpec(zero_stage=2, offload_optimizer="nvme")


def test_deprecated_cpu_offload(tmp_path):
    assert ds(tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True}})["offload_optimizer"] == "cpu"
    with pytest.raises(SpecError, match=r"zero_optimization\.cpu_offload is deprecated and cannot be given "
                                        r"with offload_optimizer"):
        ds(tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_precision_modes(tmp_path):
    assert ds(tmp_path, {"bfloat16": {"enabled": True}})["precision"] == "bf16"  # the old section name
    assert ds(tmp_path, {"fp16": {"enabled": False}, "bf16": {"enabled": False}})["precision"] == "fp32"
    pure = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    assert ds(tmp_path, pure)["precision"] == "pure-bf16"
    assert "precision" not in ds(tmp_path, {"bf16": {"enabled": "auto"}})


def test_batch_sizes(tmp_path):
    assert ds(tmp_path, {"train_micro_batch_size_per_gpu": 4}) == {
        "engine": "deepspeed", "zero_stage": 0, "precision": "fp32", "micro_batch": 4, "grad_accum": 1,
        "deepspeed": {"client_optimizer": True}}
    assert "grad_accum" not in ds(tmp_path, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"})
    three = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    assert ds(tmp_path, three)["gpus"] == 8  # DeepSpeed asserts 256 == 4 * 8 * world size
    assert "gpus" not in ds(tmp_path, three, gpus=8)
    with pytest.raises(SpecError, match=r"train_batch_size 256 != train_micro_batch_size_per_gpu 4 x "
                                        r"gradient_accumulation_steps 8 x 4 GPUs"):
        ds(tmp_path, three, gpus=4)
    with pytest.raises(SpecError, match=r"train_batch_size 100 is not train_micro_batch_size_per_gpu 3"):
        ds(tmp_path, {**three, "train_batch_size": 100, "train_micro_batch_size_per_gpu": 3})
    assert ds(tmp_path, {"train_batch_size": 64, "gradient_accumulation_steps": 2}, gpus=4)["micro_batch"] == 8


# ---------------------------------------------------------------- DeepSpeed: bad input


@pytest.mark.parametrize("stage", [4, -1, "x", True, 2.5, None])
def test_invalid_stage(tmp_path, stage):
    with pytest.raises(SpecError, match=r"^.*ds\.json: zero_optimization\.stage must be 0, 1, 2 or 3, got "):
        ds(tmp_path, {"zero_optimization": {"stage": stage}})


def test_malformed_json_names_line_and_column(tmp_path):
    # not a trailing comma, which DeepSpeed's hjson reader accepts: a bracket that closes nothing
    path = write(tmp_path, "bad.json", '{\n  "zero_optimization": {\n    "stage": 3,\n  ]\n}\n')
    with pytest.raises(SpecError, match=r"^\S*bad\.json: invalid JSON: .* \(at line 4, column 3\)"):
        read_training_config(path)
    with pytest.raises(SpecError, match=r"list\.json: a DeepSpeed config must be a JSON object"):
        read_training_config(write(tmp_path, "list.json", "[1, 2]"))


@pytest.mark.parametrize("config, message", [
    (zero3(reduce_bucket_sise=1), r"zero_optimization\.reduce_bucket_sise is not a DeepSpeed option "
                                  r"\(did you mean 'reduce_bucket_size'\?\)"),
    (zero3(offload_param={"device": "cpu", "max_in_cpus": 1}),
     r"zero_optimization\.offload_param\.max_in_cpus is not a DeepSpeed option \(did you mean 'max_in_cpu'\?\)"),
    (zero3(offload_optimizer={"device": "gpu"}), r"zero_optimization\.offload_optimizer\.device must be one of "
                                                 r"none, cpu, nvme, got 'gpu'"),
    (zero3(offload_optimizer={"device": "cpu", "pin_memory": "yes"}),
     r"zero_optimization\.offload_optimizer\.pin_memory must be true or false"),
    (zero3(reduce_bucket_size=1234.5), r"zero_optimization\.reduce_bucket_size must be a whole number, got 1234\.5"),
    (zero3(stage3_max_live_parameters=True), r"zero_optimization\.stage3_max_live_parameters must be a whole number, got True"),
    (zero3(stage3_max_live_parameters=-1), r"zero_optimization\.stage3_max_live_parameters must be >= 0, got -1"),
    (zero3(overlap_comm="yes"), r"zero_optimization\.overlap_comm must be true or false, got 'yes'"),
    (zero3(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2),
     r"zero_optimization\.stage3_prefetch_bucket_size is given twice \(also as prefetch_bucket_size\)"),
    (zero3(offload_optimizer={"device": "cpu", "pin_memory": True},
           offload_param={"device": "cpu", "pin_memory": False}),
     r"zero_optimization\.offload_optimizer\.pin_memory is true but zero_optimization\.offload_param\.pin_memory is false"),
    ({"zero_optimization": [3]}, r"zero_optimization must be a mapping of options"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"bf16\.enabled and fp16\.enabled are both true"),
    ({"fp16": {"enable": True}}, r"fp16\.enable is not a DeepSpeed option \(did you mean 'enabled'\?\)"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"fp16\.fp16_master_weights_and_grads is true"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     r"bf16\.bf16_master_weights_and_grads and bf16_optimizer_states must be set together"),
    ({"torch_autocast": {"enabled": True}}, r"torch_autocast\.enabled is true: zeroplan does not model"),
    ({"optimizer": {"type": "OneBitAdam"}}, r"optimizer\.type 'OneBitAdam' is not modelled by zeroplan"),
    ({"optimizer": {"type": "Lamb"}}, r"optimizer\.type 'Lamb' is not modelled"),
    ({"train_micro_batch_size_per_gpus": 4}, r"train_micro_batch_size_per_gpus is not a DeepSpeed option "
                                             r"\(did you mean 'train_micro_batch_size_per_gpu'\?\)"),
    ({"zero_optimisation": {"stage": 3}}, r"zero_optimisation is not a DeepSpeed option \(did you mean 'zero_optimization'\?\)"),
    ({"train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu must be >= 1, got 0"),
    ({"gradient_accumulation_steps": 2.5}, r"gradient_accumulation_steps must be a whole number"),
])
def test_bad_deepspeed_configs(tmp_path, config, message):
    with pytest.raises(SpecError, match=r"ds\.json: " + message):
        ds(tmp_path, config)


def test_case_insensitive_optimizer_names(tmp_path):
    assert ds(tmp_path, {"optimizer": {"type": "adamW"}})["optimizer"] == "adamw"
    assert ds(tmp_path, {"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})["optimizer"] == "sgd"


def test_unknown_format_and_missing_file(tmp_path):
    # a YAML mapping that is neither torchtune's nor accelerate's (the format is read from the content)
    with pytest.raises(SpecError, match=r"cfg\.yaml: unknown config format: a YAML mapping with neither torchtune's "
                                        r"model\._component_ nor accelerate's distributed_type$"):
        read_training_config(write(tmp_path, "cfg.yaml", "a: 1"))
    with pytest.raises(SpecError, match=r"missing\.json: cannot read DeepSpeed config"):
        read_training_config(tmp_path / "missing.json")


# ---------------------------------------------------------------- DeepSpeed's own key lists


def _deepspeed_fields(relative: str, class_name: str) -> set[str]:
    """Field names and aliases of a DeepSpeed config class, read from the installed source with ast."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed")
    tree = ast.parse((Path(spec.origin).parent / relative).read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    names = set()
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
            for call in ast.walk(item):
                if isinstance(call, ast.Call):
                    names |= {k.value.value for k in call.keywords if k.arg == "alias"}
    return names


@pytest.mark.parametrize("relative, class_name, ours", [
    ("runtime/zero/config.py", "DeepSpeedZeroConfig", ZERO_KEYS),
    ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadParamConfig", OFFLOAD_PARAM_KEYS),
    ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadOptimizerConfig", OFFLOAD_OPTIMIZER_KEYS),
    ("runtime/precision_config.py", "DeepSpeedFP16Config", FP16_KEYS),
    ("runtime/precision_config.py", "DeepSpeedBF16Config", BF16_KEYS),
])
def test_known_keys_cover_installed_deepspeed(relative, class_name, ours):
    """Every key the installed DeepSpeed accepts must read (else a valid config is refused)."""
    theirs = _deepspeed_fields(relative, class_name)
    assert theirs - ours == set()


# ---------------------------------------------------------------- ColossalAI-style Python


def test_colossalai_seed_full_example():
    assert read_training_config(DATA / "colossalai_zero3_nvme.py") == {
        "engine": "deepspeed", "zero_stage": 3, "precision": "fp16", "optimizer": "adam",
        "offload_optimizer": "nvme", "offload_params": "nvme",
        # Level_3 defaults overlap_comm=False (DeepSpeed's stage 3 default is True)
        "deepspeed": {"overlap_comm": False, "sub_group_size": 10**12, "offload_max_in_cpu": 1_000_000_000,
                      "offload_pin_memory": True}}


def test_colossalai_docs_examples():
    assert read_training_config(DATA / "colossalai_zero3.py") == {
        "engine": "deepspeed", "zero_stage": 3, "precision": "fp16", "optimizer": "adam",
        "deepspeed": {"overlap_comm": False, "sub_group_size": 10**12}}
    cpu = read_training_config(DATA / "colossalai_zero3_cpu.py")
    assert (cpu["offload_optimizer"], cpu["offload_params"]) == ("cpu", "cpu")
    TrainingSpec(**cpu)
    assert read_training_config(DATA / "colossalai_docs_level_form.py")["zero_stage"] == 3


def py(tmp_path: Path, text: str) -> dict:
    return read_training_config(write(tmp_path, "zero.py", text))


def test_colossalai_levels_1_and_2(tmp_path):
    assert py(tmp_path, "zero = dict(type='ZeroRedundancyOptimizer_Level_1')")["zero_stage"] == 1
    got = py(tmp_path, "zero = dict(type='ZeroRedundancyOptimizer_Level_2', cpu_offload=True, "
                       "reduce_bucket_size=2e8)\ngradient_accumulation = 4\n")
    assert got == {"engine": "deepspeed", "zero_stage": 2, "precision": "fp16", "offload_optimizer": "cpu",
                   "grad_accum": 4,
                   # Level_2's allgather_bucket_size default is 5000000000 (DeepSpeed: 5e8)
                   "deepspeed": {"allgather_bucket_size": 5_000_000_000, "reduce_bucket_size": 200_000_000}}
    TrainingSpec(**got)


def test_colossalai_allowed_forms(tmp_path):
    text = '''"""A docstring is fine."""
SCALE = -1.5
OPT = dict(device='cpu', pin_memory=False)
LIST = [1, (2, 3), {'a': None}]
zero = {'type': 'ZeroRedundancyOptimizer_Level_3', 'offload_optimizer_config': OPT,
        'max_live_parameters': 1e8}
optimizer = dict(type='HybridAdam')
'''
    got = py(tmp_path, text)
    assert got["offload_optimizer"] == "cpu"
    assert got["deepspeed"] == {"overlap_comm": False, "sub_group_size": 10**12,
                                "stage3_max_live_parameters": 100_000_000, "offload_pin_memory": False}
    assert got["optimizer"] == "adam"


@pytest.mark.parametrize("text, message", [
    ("import os\nzero = dict()\n", r"zero\.py:1: only constants and dict\(\.\.\.\) are allowed, found an import"),
    ("A = 1\nB = 2\nzero = open('x')\n", r"zero\.py:3: only constants and dict\(\.\.\.\) are allowed, "
                                        r"found a call to open$"),
    ("zero = dict(\n  type=AMP_TYPE.TORCH)\n", r"zero\.py:2: .* found an attribute access \(AMP_TYPE\.TORCH\)"),
    ("x = [i for i in range(3)]\n", r"zero\.py:1: .* found a comprehension"),
    ("x = f'{1}'\n", r"found an f-string"),
    ("x = lambda: 1\n", r"found a lambda"),
    ("def f():\n    pass\n", r"zero\.py:1: .* found a function definition \(f\)"),
    ("class C:\n    pass\n", r"found a class definition \(C\)"),
    ("x = 2**5\n", r"found an expression \(2 \*\* 5\); write the number itself"),
    ("x: int = 1\n", r"found an annassign statement"),
    ("if True:\n    x = 1\n", r"found an if statement"),
    ("a.b = 1\n", r"found an assignment to 'a\.b'"),
    ("x = dict(**y)\n", r"found a \*\* unpacking"),
    ("x = dict([('a', 1)])\n", r"found dict\(\) with a positional argument"),
    ("x = y\n", r"zero\.py:1: name 'y' is not assigned above"),
    ("x = b'raw'\n", r"found Constant"),
    ("zero = dict(\n    type='ZeroRedundancyOptimizer_Level_3',\n    ...\n)\n", r"zero\.py:4:1: invalid Python: .*remove it"),
    ("zero = dict(...)\n", r"zero\.py:1: .* found dict\(\) with a positional argument"),
    ("zero = dict(offload_optimizer_config=dict(device='cpu'), ...)\n",
     r"zero\.py:1:\d+: invalid Python: .*remove it"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_4')\n",
     r"zero\.py:1: zero\.type must be ZeroRedundancyOptimizer_Level_1, _2 or _3, got 'ZeroRedundancyOptimizer_Level_4'"),
    ("zero = dict(type='ShardedOptimizerV2')\n", r"zero\.type must be"),
    ("zero = dict(dynamic_loss_scale=True)\n", r"zero\.type is missing"),
    ("zero = dict(level=1)\n", r"zero\.level must be 2 or 3, got 1"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_3',\n  offload_optimizer=dict(device='cpu'))\n",
     r"zero\.py:2: zero\.offload_optimizer is not a ZeroRedundancyOptimizer_Level_3 option "
     r"\(did you mean 'offload_optimizer_config'\?\)"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_3', cpu_offload=True)\n",
     r"zero\.cpu_offload is not a ZeroRedundancyOptimizer_Level_3 option"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_2', offload_optimizer_config=dict(device='cpu'))\n",
     r"zero\.offload_optimizer_config is not a ZeroRedundancyOptimizer_Level_2 option"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_3', offload_param_config=dict(device='cpu'))\n",
     r"zero\.offload_param_config needs offload_optimizer_config too"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_3',\n"
     "  offload_optimizer_config=dict(device='disk'))\n",
     r"zero\.py:2: zero\.offload_optimizer_config\.device must be one of none, cpu, nvme"),
    ("zero = dict(type='ZeroRedundancyOptimizer_Level_3', reduce_bucket_size=1.5)\n",
     r"zero\.reduce_bucket_size must be a whole number"),
    ("optimizer = dict(type='Lamb')\n", r"zero\.py:1: optimizer\.type 'Lamb' is not modelled"),
    ("gradient_accumulation = 2\nzero = dict(type='ZeroRedundancyOptimizer_Level_2',\n"
     "  gradient_accumulation_steps=4)\n", r"zero\.py:3: zero\.gradient_accumulation_steps is 4 but "
                                           r"gradient_accumulation is 2"),
    ("zero = 3\n", r"zero\.py:1: zero must be a mapping of options"),
])
def test_bad_colossalai_configs(tmp_path, text, message):
    with pytest.raises(SpecError, match=message):
        py(tmp_path, text)


def test_colossalai_config_is_never_executed(tmp_path):
    marker = tmp_path / "executed"
    with pytest.raises(SpecError, match=r"found a call to open"):
        py(tmp_path, f"zero = open({str(marker)!r}, 'w')\n")
    with pytest.raises(SpecError, match=r"found an import"):
        py(tmp_path, f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    assert not marker.exists()


# ---------------------------------------------------------------- writing DeepSpeed configs

SPECS = [
    TrainingSpec(engine="deepspeed", zero_stage=0, precision="fp32", optimizer="sgd"),
    TrainingSpec(engine="deepspeed", zero_stage=1, precision="fp16", gpus=8, micro_batch=2, grad_accum=4),
    TrainingSpec(engine="deepspeed", zero_stage=2, offload_optimizer="cpu", gpus=16, gpus_per_node=8,
                 deepspeed={"reduce_bucket_size": 2e8, "overlap_comm": True, "offload_pin_memory": False}),
    TrainingSpec(engine="deepspeed", zero_stage=3, offload_optimizer="nvme", offload_params="nvme",
                 precision="pure-bf16", optimizer="adam",
                 deepspeed={"stage3_max_live_parameters": 0, "offload_buffer_count": 8, "offload_max_in_cpu": 0}),
]
_NOT_IN_DEEPSPEED = {"seq_len", "checkpointing", "attention", "device", "freeze", "fsdp2", "gpus_per_node"}


def round_trip(spec: TrainingSpec) -> TrainingSpec:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ds_config.json"
        path.write_text(json.dumps(write_deepspeed_config(spec), indent=2))
        read = read_training_config(path)
    return TrainingSpec(**{**spec.model_dump(include=_NOT_IN_DEEPSPEED), **read})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"stage{s.zero_stage}-{s.precision.value}")
def test_deepspeed_round_trip(spec):
    assert round_trip(spec) == spec


_knobs = st.fixed_dictionaries({}, optional={
    "reduce_bucket_size": st.integers(1, 10**10), "allgather_bucket_size": st.integers(1, 10**10),
    "overlap_comm": st.sampled_from([None, True, False]), "contiguous_gradients": st.booleans(),
    "stage3_prefetch_bucket_size": st.integers(0, 10**9), "stage3_max_live_parameters": st.integers(0, 10**10),
    "stage3_max_reuse_distance": st.integers(0, 10**10),
    "stage3_param_persistence_threshold": st.integers(0, 10**7), "offload_pin_memory": st.booleans(),
    "offload_buffer_count": st.integers(1, 64), "offload_buffer_size": st.integers(1, 10**9),
    "offload_max_in_cpu": st.integers(0, 10**10)})


@st.composite
def deepspeed_specs(draw) -> TrainingSpec:
    stage = draw(st.integers(0, 3))
    offload_optimizer = draw(st.sampled_from(["none", "cpu"] + (["nvme"] if stage == 3 else []))) if stage else "none"
    offload_params = draw(st.sampled_from(["none", "cpu", "nvme"])) if stage == 3 else "none"
    precisions = ["fp32", "fp16", "bf16"] + (["pure-bf16"] if stage else [])
    return TrainingSpec(engine="deepspeed", zero_stage=stage, offload_optimizer=offload_optimizer,
                        offload_params=offload_params, precision=draw(st.sampled_from(precisions)),
                        optimizer=draw(st.sampled_from(["adam", "adamw", "sgd"])),
                        # gpus must divide into nodes of min(gpus, 8)
                        gpus=draw(st.one_of(st.integers(1, 8), st.integers(1, 64).map(lambda n: 8 * n))),
                        micro_batch=draw(st.integers(1, 64)), grad_accum=draw(st.integers(1, 64)),
                        deepspeed=draw(_knobs))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deepspeed_specs())
def test_deepspeed_round_trip_property(spec):
    assert round_trip(spec) == spec


def test_written_config_fields():
    config = write_deepspeed_config(SPECS[2])
    assert config["train_batch_size"] == 1 * 1 * 16  # micro * accum * gpus
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert config["zero_optimization"]["overlap_comm"] is True
    assert "overlap_comm" not in write_deepspeed_config(SPECS[1])["zero_optimization"]  # DeepSpeed decides
    assert write_deepspeed_config(SPECS[0])["optimizer"]["params"]["momentum"] > 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"stage{s.zero_stage}")
def test_written_config_is_accepted_by_deepspeed(spec):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig  # validates every section (pydantic, extra=forbid)

    config = write_deepspeed_config(spec.model_copy(update={"gpus": 1}))
    parsed = DeepSpeedConfig(config)
    assert parsed.zero_optimization_stage == spec.zero_stage
    assert parsed.train_micro_batch_size_per_gpu == spec.micro_batch


def test_write_deepspeed_config_rejects_what_deepspeed_cannot_run():
    with pytest.raises(SpecError, match=r"optimizer adam8bit has no DeepSpeed optimizer\.type"):
        write_deepspeed_config(TrainingSpec(optimizer="adam8bit"))
    with pytest.raises(SpecError, match=r"pure-bf16 needs zero_stage 1, 2 or 3"):
        write_deepspeed_config(TrainingSpec(zero_stage=0, precision="pure-bf16"))


# ---------------------------------------------------------------- FSDP2 snippet


def _fully_shard_reshard(source: str) -> list[object]:
    calls = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fully_shard"]
    calls.sort(key=lambda call: call.lineno)
    return [next(k.value.value for k in call.keywords if k.arg == "reshard_after_forward") for call in calls]


@pytest.mark.parametrize("spec, reshard", [
    (TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=2), [False, False]),
    (TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=3), [True, True]),
    (TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=3, fsdp2={"reshard_root_after_forward": False}), [True, False]),
    (TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=3, offload_optimizer="cpu", offload_params="cpu", precision="fp16",
                  optimizer="sgd"), [True, True]),
    (TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=2, precision="pure-bf16", optimizer="sgd"), [False, False]),
])
def test_fsdp2_snippet_compiles_and_reshards_by_stage(spec, reshard):
    """The root form (units root: the plain recipe); units split: tests/importers/test_fsdp2_snippet.py."""
    source = write_fsdp2_snippet(spec)
    compile(source, "<fsdp2 plan>", "exec")
    assert _fully_shard_reshard(source) == reshard  # blocks, then root
    assert ("CPUOffloadPolicy(pin_memory=True)" in source) == (spec.offload_params.value == "cpu")


def test_fsdp2_snippet_rejects_what_fsdp2_cannot_do():
    with pytest.raises(SpecError, match=r"zero_stage 1 has no FSDP2 form"):
        write_fsdp2_snippet(TrainingSpec(engine="deepspeed", zero_stage=1))
    with pytest.raises(SpecError, match=r"FSDP2 offloads to cpu only"):
        write_fsdp2_snippet(TrainingSpec(engine="deepspeed", zero_stage=3, offload_optimizer="nvme"))


def test_fsdp2_snippet_runs_on_one_cpu_rank(tmp_path):
    """The snippet really shards and trains a tiny model (gloo, world size 1, CPU offload unpinned)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    spec = TrainingSpec(recipe="plain", engine="fsdp2", zero_stage=3, precision="bf16", device="cpu",
                        offload_optimizer="cpu", offload_params="cpu")
    namespace: dict[str, object] = {}
    exec(compile(write_fsdp2_snippet(spec), "<fsdp2 plan>", "exec"), namespace)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        blocks = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)]
        model, optimizer = namespace["apply_plan"](torch.nn.Sequential(*blocks), blocks)
        model(torch.randn(4, 8)).float().sum().backward()
        optimizer.step()
        assert type(model).__name__.startswith("FSDP")
        assert len(optimizer.state) == 4  # AdamW states for 2 weights + 2 biases
    finally:
        dist.destroy_process_group()
