"""The Python API (docs/api.md): each function's `to_dict()` is its command's `--format json`
document, byte for byte once printed as the command prints it; keyword arguments are the options,
checked as the command checks them, with one-line errors; `import zeroplan` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import zeroplan
from zeroplan.cli import cli
from zeroplan.errors import FieldError, MissingDependencyError, SpecError, ZeroplanError
from tests.paths import REPO



def _cli_json(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return result.stdout


# command line, then the same call through the API
SAME = [
    (["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"],
     lambda: zeroplan.estimate("llama-2-7b", gpus=8, zero=3)),
    (["estimate", "llama-2-7b", "--gpus", "16", "--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
      "--checkpointing", "full", "--gpu-memory", "40GiB"],
     lambda: zeroplan.estimate("llama-2-7b", gpus=16, zero=3, offload_optimizer="cpu", offload_params="cpu",
                               checkpointing="full", gpu_memory="40GiB")),
    (["estimate", "gpt2", "--engine", "fsdp2", "--zero", "3", "--gpus", "2", "--device", "cpu", "--no-fsdp2-reshard-root",
      "--freeze", "embeddings"],
     lambda: zeroplan.estimate("gpt2", engine="fsdp2", zero=3, gpus=2, device="cpu", fsdp2_reshard_root=False,
                               freeze=["embeddings"])),
    (["estimate", "--params", "7.5e9", "--largest-layer", "1e8", "--gpus", "64", "--zero", "3", "--engine", "paper"],
     lambda: zeroplan.estimate(params=7.5e9, largest_layer="1e8", gpus=64, zero=3, engine="paper")),
    (["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--lora-rank", "16", "--lora-targets", "q_proj,v_proj"],
     lambda: zeroplan.estimate("llama-2-7b", gpus=8, zero=2, lora_rank=16, lora_targets=["q_proj", "v_proj"])),
    (["estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--zero", "3", "--engine", "fsdp2", "--seq-len", "8192"],
     lambda: zeroplan.estimate("llama-3-70b", gpus=64, tp=8, zero=3, engine="fsdp2", seq_len=8192)),
    (["compare", "llama-2-7b", "--zero", "0,1,2,3", "--gpus", "8,64", "--offload", "none,cpu", "--gpu", "a100-40gb"],
     lambda: zeroplan.compare("llama-2-7b", zero=[0, 1, 2, 3], gpus=[8, 64], offload="none,cpu", gpu="a100-40gb")),
    (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"],
     lambda: zeroplan.plan("llama-2-7b", gpu="h100-80gb", gpus=8)),
    (["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--mesh", "--engine", "fsdp2", "--top", "3"],
     lambda: zeroplan.plan("llama-3-8b", gpu="h100-80gb", gpus=16, mesh=True, engine="fsdp2", top=3)),
]


@pytest.mark.parametrize(("args", "call"), SAME, ids=[" ".join(args[:2] + args[2:4]) for args, _ in SAME])
def test_to_dict_is_the_command_s_json_byte_for_byte(args, call):
    printed = _cli_json(*args)
    result = call()
    assert result.render("json") == printed  # the command prints the result's own rendering
    # and the document itself: compare's JSON ends without a newline, as the command has always printed it
    assert json.dumps(result.to_dict(), indent=2) + ("" if args[0] == "compare" else "\n") == printed
    assert result.render("table") == CliRunner().invoke(cli, args).stdout


def test_the_issue_s_python_line_prints_the_command_s_document():
    """The done-when of issue 25, run as two processes. The command prints its JSON indented by two
    spaces (as it always has); printed with the same indentation, the API's document is the same bytes,
    and without it the same document."""
    python = ("import zeroplan, json; d = zeroplan.estimate('llama-2-7b', gpus=8, zero=3).to_dict(); "
              "print(json.dumps(d, indent=2)); print(json.dumps(d), file=__import__('sys').stderr)")
    api = subprocess.run([sys.executable, "-c", python], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    command = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", "llama-2-7b", "--gpus", "8", "--zero", "3",
                              "--format", "json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert api.stdout == command.stdout
    assert json.loads(api.stderr) == json.loads(command.stdout)


# -- keyword arguments: the options, checked as the command checks them -----------------------------

@pytest.mark.parametrize(("keywords", "message"), [
    ({"zero": 5}, r"^zero: 5 is not in the range 0<=x<=3\.$"),
    ({"gpus": 8.5}, r"^gpus: expected a whole number, got 8\.5$"),
    ({"gpus": True}, r"^gpus: expected a whole number, got True$"),
    ({"gpus": 0}, r"^gpus: 0 is not in the range 1<=x<=1048576\.$"),
    ({"ddp": 1}, r"^ddp: expected True or False, got 1$"),
    ({"precision": "fp8"}, r"^precision: 'fp8' is not one of"),
    ({"freeze": "torso"}, r"^freeze: 'torso' is not one of 'embeddings', 'blocks', 'final'\.$"),
    ({"zero_stage": 3}, r"^zero_stage: zeroplan\.estimate\(\) has no such option; did you mean zero\?$"),
    ({"micro_bach": 2}, r"^micro_bach: zeroplan\.estimate\(\) has no such option; did you mean micro_batch\?$"),
    ({"format": "json"}, r"^format: zeroplan\.estimate\(\) has no such option"),
    ({"config": "no-such-file.json"}, r"^config: File 'no-such-file\.json' does not exist\.$"),
    ({"gpu_memory": "80 parsecs"}, r"^gpu_memory: "),
])
def test_a_bad_keyword_is_one_field_error_naming_it(keywords, message):
    with pytest.raises(FieldError, match=message) as caught:
        zeroplan.estimate("llama-2-7b", **keywords)
    assert "\n" not in str(caught.value)


def test_a_count_is_checked_as_the_command_line_checks_its_text():
    with pytest.raises(FieldError, match=r"^params: must be at least 1"):
        zeroplan.estimate(params=0)
    assert zeroplan.estimate(params=7_500_000_000).to_dict()["model"]["params"] == 7_500_000_000


def test_library_errors_reach_the_caller_as_the_command_prints_them():
    with pytest.raises(SpecError) as caught:
        zeroplan.estimate("no-such-model")
    printed = CliRunner().invoke(cli, ["estimate", "no-such-model"])
    assert printed.exit_code == 2 and printed.stderr == f"Error: {caught.value}\n"


def test_checks_that_the_command_made_itself_are_the_api_s():
    with pytest.raises(ZeroplanError, match=r"--gpu and --gpu-memory both give the GPU's memory"):
        zeroplan.compare("llama-2-7b", gpu="h100-80gb", gpu_memory="80GiB")
    with pytest.raises(SpecError, match=r"^give the GPU: --gpu NAME"):
        zeroplan.plan("llama-2-7b", gpus=8)
    with pytest.raises(FieldError, match=r"^nproc: required: give zeroplan\.measure\(nproc=\.\.\.\)$"):
        zeroplan.measure("tiny-llama")
    with pytest.raises(SpecError, match=r"^--gpus 4 must equal --nproc 2"):
        zeroplan.measure("tiny-llama", nproc=2, gpus=4)


def test_render_checks_its_format_and_units():
    result = zeroplan.estimate("gpt2", gpus=2)
    with pytest.raises(FieldError, match=r"^format: 'yaml' is not one of table, json, csv, markdown, html$"):
        result.render("yaml")
    with pytest.raises(FieldError, match=r"^units: 'KiB' is not one of"):
        result.render("table", "KiB")
    assert result.render("table", "MiB").splitlines()[5].split()[-1] == "MiB"


def test_plan_emit_writes_the_best_plan_as_the_command_does(tmp_path):
    ours, theirs = tmp_path / "api.json", tmp_path / "cli.json"
    result = zeroplan.plan("llama-2-7b", gpu_memory="24GiB", gpus=4, emit=("deepspeed", str(ours)))
    printed = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--gpu-memory", "24GiB", "--gpus", "4", "--emit", "deepspeed",
                                       str(theirs)])
    assert printed.exit_code == 0, printed.output
    assert result.emitted == str(ours) and ours.read_text() == theirs.read_text()


def test_the_measure_command_prints_the_api_s_report(monkeypatch):
    """Without processes: the run is replaced by a fixed result, so that both calls measure the same."""
    pytest.importorskip("torch")
    from zeroplan.measure import launcher
    from zeroplan.measure.result import MeasureResult, PhaseResult, RankResult

    def fixed_run(model, training, **kwargs):
        cats = {"params": 100, "grads": 100, "optimizer_states": 200, "activations": 50, "buffers": 0, "temporaries": 0}
        phases = [PhaseResult(step, phase, 450, 450, cats) for step in (0, 1, 2)
                  for phase in (("engine",) if step == 0 else ("forward", "backward", "optimizer_step"))]
        return MeasureResult("gloo", training.engine.value, training.zero_stage, kwargs["nproc"], "x", model.name,
                             [RankResult(0, phases)], steps=2)

    monkeypatch.setattr(launcher, "run_measurement", fixed_run)
    args = ["tiny-llama", "--engine", "torch", "--zero", "0", "--nproc", "1", "--precision", "fp32", "--seq-len", "32"]
    report = zeroplan.measure("tiny-llama", engine="torch", zero=0, nproc=1, precision="fp32", seq_len=32)
    printed = CliRunner().invoke(cli, ["measure", *args, "--format", "json"])
    assert printed.stdout == report.render("json") == json.dumps(report.to_dict(), indent=2) + "\n"
    assert CliRunner().invoke(cli, ["measure", *args]).stdout == report.render("table")
    with pytest.raises(FieldError, match=r"^format: 'csv' is not one of table, json, html$"):
        report.render("csv")


def test_measure_without_torch_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # importlib.util.find_spec("torch") -> None
    with pytest.raises(MissingDependencyError, match="pip install torch"):
        zeroplan.measure("tiny-llama", nproc=2)


# -- the package: cheap to import, its subpackages callable ------------------------------------------

IMPORTED = """
import json, sys
import zeroplan
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("zeroplan", "torch", "pydantic", "click"))))
"""


def test_import_zeroplan_loads_nothing_but_the_package():
    done = subprocess.run([sys.executable, "-c", IMPORTED], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == ["zeroplan"]


def test_the_packages_named_like_the_functions_stay_packages_and_can_be_called():
    code = ("import zeroplan.estimate.serialize, zeroplan.plan.search, zeroplan.measure.comparison\n"
            "from zeroplan.estimate import estimate\n"
            "import zeroplan\n"
            "from zeroplan import compare\n"
            "assert zeroplan.estimate.serialize.estimate_to_dict and zeroplan.plan.search.plan\n"
            "print(zeroplan.estimate('gpt2', gpus=2).peak_bytes, compare('gpt2', zero=[3]).to_dict()['rows'][0]['zero_stage'],"
            " callable(zeroplan.measure), zeroplan.estimate.__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    peak, stage, measure_callable, name = done.stdout.split()
    assert int(peak) == zeroplan.estimate("gpt2", gpus=2).peak_bytes
    assert (stage, measure_callable, name) == ("3", "True", "zeroplan.estimate")


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'estimates'"):
        zeroplan.estimates  # noqa: B018
