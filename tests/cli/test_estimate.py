"""The command line: options reach the TrainingSpec, outputs follow the JSON contract, every bad
input of issue 2 section 5 is one line on stderr with exit status 2, and estimate imports no torch.

Most tests replace the estimator with a recording stand-in (the CLI's job is to build the specs
and print the result, not to compute it); the end-to-end tests run the real estimator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import zeroplan.estimate

from zeroplan.cli import cli
from zeroplan.estimate.result import (
    CategoryBytes,
    Estimate,
    ModelSummary,
    NodeBytes,
    Phase,
    PhaseBytes,
    Step,
)
from zeroplan.spec.model import ParamCountSpec, TransformerSpec
from zeroplan.spec.training import TrainingSpec
from tests.paths import REPO

GIB = 2**30


def _has_real_estimator() -> bool:
    try:
        from zeroplan.estimate import estimate  # noqa: F401
    except ImportError:
        return False
    return True


needs_estimator = pytest.mark.skipif(not _has_real_estimator(), reason="zeroplan.estimate.estimate not written yet")


class RecordingEstimator:
    """Stands in for zeroplan.estimate.estimate: records its arguments, returns a fixed Estimate."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, TrainingSpec]] = []

    def __call__(self, model, training):
        self.calls.append((model, training))
        steady = CategoryBytes(params=1 * GIB, grads=1 * GIB, optimizer_states=4 * GIB, activations=3 * GIB, buffers=1 * GIB, overhead=1 * GIB)
        return Estimate(
            model=ModelSummary(name=model.name, params=123, trainable_params=123, implementation="stand-in"),
            engine=training.engine.value,
            phases=(
                PhaseBytes(Step.FIRST, Phase.FORWARD, CategoryBytes(params=1 * GIB, activations=3 * GIB, overhead=1 * GIB)),
                PhaseBytes(Step.STEADY, Phase.BACKWARD, steady),
            ),
            per_node=NodeBytes(cpu_bytes=2 * GIB, pinned_bytes=GIB, nvme_bytes=0),
            notes=("stand-in",),
        )

    @property
    def training(self) -> TrainingSpec:
        assert len(self.calls) == 1
        return self.calls[0][1]

    @property
    def model(self):
        assert len(self.calls) == 1
        return self.calls[0][0]


@pytest.fixture
def recorder(monkeypatch) -> RecordingEstimator:
    """Stands in for the estimate the CLI calls (`estimate_mesh`: every estimate is a mesh, of ones without tp/cp/pp/ep)."""
    from zeroplan.estimate.serialize import single_rank

    stand_in = RecordingEstimator()
    monkeypatch.setattr(zeroplan.estimate, "estimate_mesh",
                        lambda model, training: single_rank(stand_in(model, training), training, 1), raising=False)
    return stand_in


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


# --- options reach the spec ------------------------------------------------------------------


def test_every_training_option_sets_its_spec_field(recorder):
    result = run(
        "estimate", "llama-2-7b", "--gpus", "16", "--gpus-per-node", "4", "--zero", "3",
        "--offload-optimizer", "cpu", "--offload-params", "nvme", "--precision", "fp16",
        "--optimizer", "sgd", "--micro-batch", "4", "--seq-len", "4096", "--grad-accum", "8",
        "--checkpointing", "full", "--attention", "eager", "--engine", "deepspeed", "--device", "cpu",
        "--freeze", "embeddings", "--freeze", "final",
    )
    assert result.exit_code == 0, result.output
    assert recorder.training == TrainingSpec(
        gpus=16, gpus_per_node=4, zero_stage=3, offload_optimizer="cpu", offload_params="nvme",
        precision="fp16", optimizer="sgd", micro_batch=4, seq_len=4096, grad_accum=8,
        checkpointing="full", attention="eager", engine="deepspeed", device="cpu", freeze=("embeddings", "final"),
    )
    assert isinstance(recorder.model, TransformerSpec) and recorder.model.name == "llama-2-7b"


def test_no_options_give_the_spec_defaults(recorder):
    assert run("estimate", "gpt2").exit_code == 0
    assert recorder.training == TrainingSpec()


def test_params_makes_a_parameter_count_model(recorder):
    result = run("estimate", "--params", "7.5e9", "--largest-layer", "250M", "--trainable-params", "7_000_000_000")
    assert result.exit_code == 0, result.output
    assert recorder.model == ParamCountSpec(
        name=recorder.model.name, params=7_500_000_000, largest_layer_params=250_000_000, trainable_params=7_000_000_000
    )


@pytest.mark.parametrize(
    "text, count",
    [("6738415616", 6_738_415_616), ("6.738415616e9", 6_738_415_616), ("6_738_415_616", 6_738_415_616),
     ("6,738,415,616", 6_738_415_616), ("7B", 7 * 10**9), ("1.5t", 1_500_000_000_000), ("125M", 125 * 10**6)],
)
def test_counts_are_read_exactly(text, count):
    from zeroplan.importers.options import parse_count

    assert parse_count(text, "--params") == count


def test_options_override_the_config_file(recorder, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 8,
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
    }))
    result = run("estimate", "gpt2", "--config", str(config), "--micro-batch", "2", "--gpus", "2")
    assert result.exit_code == 0, result.output
    training = recorder.training
    assert (training.zero_stage, training.micro_batch, training.precision.value, training.gpus) == (2, 2, "fp16", 2)
    assert training.deepspeed.reduce_bucket_size == 1000


COLOSSALAI_CONFIG = """OFFLOAD_PARAM_MAX_IN_CPU = 1000000000
optimizer = dict(type='Adam', lr=0.001, weight_decay=0)
zero = dict(
    type='ZeroRedundancyOptimizer_Level_3',
    dynamic_loss_scale=True,
    clip_grad=1.0,
    offload_optimizer_config=dict(device='cpu', pin_memory=True, fast_init=True),
    offload_param_config=dict(device='nvme', pin_memory=True,
                              max_in_cpu=OFFLOAD_PARAM_MAX_IN_CPU, nvme_path='/nvme_data'),
)
"""


def test_colossalai_config_of_the_zero_docs_sets_the_spec_and_options_override_it(recorder, tmp_path):
    # The config of the original ZeRO documentation (issue 2, section 3): Level_3, fp16 implied.
    config = tmp_path / "zero_config.py"
    config.write_text(COLOSSALAI_CONFIG)
    assert run("estimate", "llama-2-7b", "--config", str(config), "--gpus", "16", "--precision", "bf16").exit_code == 0
    training = recorder.training
    assert (training.zero_stage, training.offload_optimizer.value, training.offload_params.value) == (3, "cpu", "nvme")
    assert (training.optimizer.value, training.precision.value, training.gpus) == ("adam", "bf16", 16)
    assert training.deepspeed.offload_max_in_cpu == 1_000_000_000


def test_deepspeed_train_batch_size_is_split_over_the_gpus_given(recorder, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 64, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}))
    assert run("estimate", "gpt2", "--config", str(config), "--gpus", "8").exit_code == 0
    assert (recorder.training.micro_batch, recorder.training.grad_accum, recorder.training.zero_stage) == (4, 2, 2)


# --- outputs ---------------------------------------------------------------------------------


def test_json_output_follows_the_contract(recorder):
    result = run("estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--format", "json", "--gpu-memory", "80GiB")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    per_gpu = data["per_gpu"]
    categories = ("params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "overhead")
    assert sum(per_gpu[key] for key in categories) == per_gpu["peak"] == 11 * GIB
    assert (per_gpu["peak_step"], per_gpu["peak_phase"]) == ("steady", "backward")
    assert data["fits"] is True and data["gpu_memory"] == 80 * GIB
    assert data["config"]["zero_stage"] == 3 and data["config"]["gpus"] == 8
    assert data["per_node"] == {"cpu": 2 * GIB, "pinned": GIB, "nvme": 0, "unified": 0}


def test_gpu_memory_in_gb_can_say_it_does_not_fit(recorder):
    result = run("estimate", "gpt2", "--gpu-memory", "11GB", "--format", "json")  # 11e9 < 11 GiB peak
    assert json.loads(result.stdout)["fits"] is False
    table = run("estimate", "gpt2", "--gpu-memory", "11GB", "--units", "GB").stdout
    assert f"Fits in 11.00 GB per GPU: no, {(11 * GIB - 11e9) / 1e9:.2f} GB over" in table


def test_gpu_memory_takes_a_gpu_preset_name(recorder):
    # "80GB HBM3" on the H100 datasheet is 80 GiB of DRAM (zeroplan/importers/gpus.py).
    result = run("estimate", "gpt2", "--gpu-memory", "H100-80GB", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gpu_memory"] == 80 * GIB


@pytest.mark.parametrize("output_format, marker", [("table", "Per GPU at the peak"), ("markdown", "### Per GPU"), ("csv", "step,phase,params_GiB")])
def test_each_format_prints(recorder, output_format, marker):
    result = run("estimate", "gpt2", "--format", output_format)
    assert result.exit_code == 0, result.output
    assert marker in result.stdout
    assert result.stderr == ""


def test_models_lists_the_catalogue_with_published_counts():
    result = run("models", "--format", "json")
    assert result.exit_code == 0, result.output
    counts = {row["name"]: row["params"] for row in json.loads(result.stdout)}
    # Published totals quoted in issue 2 section 2.
    assert counts["llama-2-7b"] == 6_738_415_616
    assert counts["mixtral-8x7b"] == 46_702_792_704
    assert "6,738,415,616" in run("models").stdout


@pytest.mark.parametrize(
    "args, example",
    [
        (["-h"], "zeroplan estimate llama-2-7b --gpus 8 --zero 3"),
        (["--help"], "zeroplan estimate llama-2-7b --gpus 8 --zero 3"),
        (["estimate", "-h"], "zeroplan estimate llama-2-7b --gpus 8 --zero 3"),
        (["estimate", "--help"], "zeroplan estimate --params 7.5e9 --gpus 64 --zero 3 --engine paper"),
        (["models", "-h"], "zeroplan models --format json"),
    ],
)
def test_help_carries_examples(args, example):
    result = run(*args)
    assert result.exit_code == 0
    assert "Examples:" in result.stdout and example in result.stdout


def test_every_registered_command_loads_and_has_help():
    from zeroplan.cli import COMMANDS

    for name in COMMANDS:
        result = run(name, "-h")
        assert result.exit_code == 0, (name, result.output)
        assert result.stdout.startswith(f"Usage: zeroplan {name}"), name


def test_zeroplan_alone_prints_the_help():
    result = run()
    assert result.exit_code == 0 and result.stdout.startswith("Usage: zeroplan") and result.stderr == ""


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "zeroplan", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0 and "estimate" in done.stdout


# --- bad input: one line, exit 2, nothing on stdout (issue 2 section 5) -----------------------


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


LLAMA_TOML = """name = "bad"
vocab_size = 32000
hidden_size = {hidden}
num_layers = 2
num_heads = 32
num_kv_heads = {kv}
intermediate_size = 11008
max_position_embeddings = 4096
position_embedding = "rotary"
norm = "rmsnorm"
mlp = "gated"
tie_word_embeddings = false
"""


BAD_INPUTS = {
    "unknown model name, close names suggested": (["estimate", "llama-2-7bb"], r"unknown model 'llama-2-7bb'; did you mean llama-2-7b"),
    "missing model file": (["estimate", "no/such/config.json"], r"model file 'no/such/config.json' does not exist"),
    "missing --config file": (["estimate", "gpt2", "--config", "no_such_ds.json"], r"--config.*'no_such_ds.json' does not exist"),
    "wrong type: --gpus": (["estimate", "gpt2", "--gpus", "eight"], r"'--gpus': 'eight' is not a valid integer"),
    "wrong type: --params": (["estimate", "--params", "seven"], r"'--params': cannot read count 'seven'"),
    "fractional --params": (["estimate", "--params", "1.5"], r"'--params': '1.5' is not a whole number"),
    "bad --gpu-memory": (["estimate", "gpt2", "--gpu-memory", "80 apples"], r"'--gpu-memory': unknown unit 'apples'"),
    "unknown GPU name": (["estimate", "gpt2", "--gpu-memory", "h100"], r"cannot read size 'h100'.*or name a GPU: .*h100-80gb"),
    "zero gpus": (["estimate", "gpt2", "--gpus", "0"], r"'--gpus': 0 is not in the range 1<=x<=1048576"),
    "negative micro-batch": (["estimate", "gpt2", "--micro-batch", "-1"], r"'--micro-batch': -1 is not in the range 1<=x<=65536"),
    "zero seq-len": (["estimate", "gpt2", "--seq-len", "0"], r"'--seq-len': 0 is not in the range 1<=x<=16777216"),
    "zero params": (["estimate", "--params", "0"], r"'--params': must be at least 1"),
    "gpus not divisible by gpus per node": (["estimate", "gpt2", "--gpus", "12", "--gpus-per-node", "8"], r"gpus 12 is not divisible by gpus_per_node 8"),
    "stage outside 0-3": (["estimate", "gpt2", "--zero", "4"], r"'--zero': 4 is not in the range 0<=x<=3"),
    "parameter offload below stage 3": (["estimate", "gpt2", "--zero", "2", "--offload-params", "cpu"], r"offload_params requires zero_stage 3"),
    "unknown choice": (["estimate", "gpt2", "--precision", "fp8"], r"'--precision': 'fp8' is not one of 'fp32', 'fp16', 'bf16', 'pure-bf16'"),
    "MODEL and --params together": (["estimate", "gpt2", "--params", "7e9"], r"MODEL 'gpt2' and --params given together"),
    "neither MODEL nor --params": (["estimate"], r"missing MODEL"),
    "--largest-layer without --params": (["estimate", "gpt2", "--largest-layer", "1000"], r"--largest-layer and --trainable-params describe a --params model"),
    "largest layer above params": (["estimate", "--params", "1000", "--largest-layer", "2000"], r"largest_layer_params 2000 exceeds params 1000"),
    "unknown option, close name suggested": (["estimate", "gpt2", "--gpsu", "8"], r"No such option '--gpsu'. \(?Did you mean (one of: .*)?'--gpus'"),
    "unknown command": (["estimat"], r"No such command 'estimat'"),
}

BAD_FILES = {
    "malformed spec file, with its line": ("bad.toml", 'name = "x"\nhidden_size = = 3\n', r"invalid TOML.*line 2"),
    "malformed config.json, with its line": ("config.json", '{"model_type": "llama",\n "hidden_size": }', r"invalid JSON.*line 2"),
    "wrong type in a spec file": ("types.toml", LLAMA_TOML.format(hidden="\"big\"", kv=8), r"hidden_size: Input should be a valid integer"),
    "hidden size not divisible by heads": ("heads.toml", LLAMA_TOML.format(hidden=4100, kv=8), r"hidden_size 4100 is not divisible by num_heads 32"),
    "key/value heads not dividing heads": ("kv.toml", LLAMA_TOML.format(hidden=4096, kv=5), r"num_kv_heads 5 does not divide num_heads 32"),
    "unsupported config.json": ("config.json", '{"model_type": "bert", "hidden_size": 768}', r"bert.*llama"),
    "incomplete config.json": ("config.json", '{"model_type": "llama", "vocab_size": 32000}', r"hidden_size"),
}


def _assert_one_line_error(result, pattern: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stdout == ""  # nothing half-written
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in result.stderr
    import re

    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("args, pattern", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_option_is_one_line_exit_2(recorder, args, pattern):
    _assert_one_line_error(run(*args), pattern)
    assert recorder.calls == []


@pytest.mark.parametrize("name, text, pattern", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_model_file_is_one_line_exit_2(recorder, tmp_path, name, text, pattern):
    _assert_one_line_error(run("estimate", _write(tmp_path, name, text)), pattern)
    assert recorder.calls == []


def test_library_errors_raised_while_estimating_are_one_line_too(monkeypatch):
    from zeroplan.errors import SpecError

    def validation_error(model, training):
        TrainingSpec(gpus=0, micro_batch="many")

    def spec_error(model, training):
        raise SpecError("zero_stage 3 with engine torch:\n use fsdp2 or deepspeed")

    monkeypatch.setattr(zeroplan.estimate, "estimate_mesh", validation_error, raising=False)
    _assert_one_line_error(
        run("estimate", "gpt2"),
        r"^Error: 2 errors: gpus: Input should be greater than or equal to 1 \(got 0\); micro_batch: Input should be a valid integer",
    )
    monkeypatch.setattr(zeroplan.estimate, "estimate_mesh", spec_error, raising=False)
    _assert_one_line_error(run("estimate", "gpt2"), r"^Error: zero_stage 3 with engine torch: use fsdp2 or deepspeed$")


def test_a_bug_is_not_disguised_as_a_user_error(monkeypatch):
    def bug(model, training):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(zeroplan.estimate, "estimate_mesh", bug, raising=False)
    result = run("estimate", "gpt2")
    assert result.exit_code == 1 and isinstance(result.exception, ZeroDivisionError)


CONFIG_FILES = {
    "DeepSpeed config with an invalid stage": ("ds.json", '{"zero_optimization": {"stage": 5}}', r"zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    # (a trailing comma is not the example: DeepSpeed reads hjson, which allows it)
    "DeepSpeed config that is not JSON": ("ds.json", '{"zero_optimization": {"stage": 2 "x": 1}}', r"ds.json: invalid JSON: .* \(at line 1, column \d+\)"),
    "wrong type in a DeepSpeed config": ("ds.json", '{"train_micro_batch_size_per_gpu": "four"}', r"ds.json: train_micro_batch_size_per_gpu must be a whole number, got 'four'"),
    "zero count in a DeepSpeed config": ("ds.json", '{"gradient_accumulation_steps": 0}', r"ds.json: gradient_accumulation_steps must be >= 1, got 0"),
    "ColossalAI-style config containing code": ("zero.py", "import os\nzero = dict(type='ZeroRedundancyOptimizer_Level_3')\n", r"zero.py:1: .*found an import"),
    "ColossalAI-style config calling a function": ("zero.py", "zero = dict(type=print('x'))\n", r"zero.py:1: .*found a call to print"),
}


@pytest.mark.parametrize("name, text, pattern", CONFIG_FILES.values(), ids=CONFIG_FILES.keys())
def test_bad_config_file_is_one_line_exit_2(recorder, tmp_path, name, text, pattern):
    _assert_one_line_error(run("estimate", "gpt2", "--config", _write(tmp_path, name, text)), pattern)
    assert recorder.calls == []


# --- no torch on the estimate path -----------------------------------------------------------


def _imported_modules(*cli_args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m zeroplan ...` with torch made unimportable; the modules it loaded."""
    code = "import sys; sys.modules['torch'] = None; from zeroplan.cli import main; main(sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *cli_args],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    modules = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


def test_models_command_imports_no_torch():
    done, modules = _imported_modules("models")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "zeroplan.importers.catalog" in modules  # the import log is read
    assert not {name for name in modules if name.split(".")[0] in ("torch", "transformers", "deepspeed")}


@needs_estimator
def test_estimate_imports_no_torch():
    done, modules = _imported_modules("estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--format", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "zeroplan.estimate" in modules
    assert not {name for name in modules if name.split(".")[0] in ("torch", "transformers", "deepspeed")}
    assert json.loads(done.stdout)["model"]["params"] == 6_738_415_616


# --- end to end with the real estimator ------------------------------------------------------

# ZeRO paper (Rajbhandari et al. 2020), Table 1: per-device model-state memory in GB for
# Ψ = 7.5B parameters on N_d = 64 devices, K = 12: baseline 120, P_os 31.4, P_os+g 16.6, P_os+g+p 1.88.
PAPER_TABLE_1 = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}


@needs_estimator
@pytest.mark.parametrize("stage, published_gb", PAPER_TABLE_1.items())
def test_paper_engine_reproduces_zero_table_1(stage, published_gb):
    result = run("estimate", "--params", "7.5e9", "--gpus", "64", "--zero", str(stage), "--engine", "paper", "--precision", "fp16", "--format", "json")
    assert result.exit_code == 0, result.output
    peak_gb = json.loads(result.stdout)["per_gpu"]["peak"] / 1e9
    assert peak_gb == pytest.approx(published_gb, abs=0.05)
    table = run("estimate", "--params", "7.5e9", "--gpus", "64", "--zero", str(stage), "--engine", "paper", "--precision", "fp16", "--units", "GB").stdout
    assert f"{peak_gb:,.2f}" in next(line for line in table.splitlines() if line.startswith("peak"))


@needs_estimator
def test_real_estimate_json_categories_sum_to_the_peak():
    result = run("estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--format", "json", "--gpu-memory", "80GiB")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    per_gpu = data["per_gpu"]
    categories = ("params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "overhead")
    assert all(type(per_gpu[key]) is int for key in categories)
    assert sum(per_gpu[key] for key in categories) == per_gpu["peak"]
    assert max(row["total"] for row in data["phases"]) == per_gpu["peak"]
    assert data["model"] == {**data["model"], "params": 6_738_415_616, "trainable_params": 6_738_415_616}
    assert isinstance(data["fits"], bool)
