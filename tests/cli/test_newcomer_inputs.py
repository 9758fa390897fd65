"""Issue 21 (hardening, round 2): each input a second newcomer tried, reproduced, with the answer it now gets.

Bad input: exit status 2, one `Error:` line naming the option, key or file and what to do, no traceback.
Input read but not modelled: the estimate, with a note that says so. Files a command writes are in
tests/spec/test_output_files.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from tests.paths import DATA

LLAMA_2_7B = json.loads((DATA / "hf_configs" / "llama-2-7b.json").read_text())


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def one_error(result, pattern: str) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert re.search(pattern, errors[0]), errors[0]
    return errors[0]


def notes_of(*args: str) -> list[str]:
    result = run(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["notes"]


def write(folder: Path, name: str, content) -> str:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


# ---------------------------------------------------------------- tracebacks before


def test_a_400_digit_micro_batch_in_a_deepspeed_json(tmp_path):
    config = write(tmp_path, "ds.json", '{"train_micro_batch_size_per_gpu": ' + "9" * 400 + "}")
    line = one_error(run("estimate", "llama-2-7b", "--config", config),  # was: OverflowError
                     r"ds\.json: train_micro_batch_size_per_gpu must be at most 65,536, got a number of 400 digits")
    assert len(line) < 300


def test_a_5000_character_model_name():
    line = one_error(run("estimate", "a" * 5000), r"unknown model 'a+\.\.\. \(5,000 characters\)")  # was: File name too long
    assert len(line) < 500


# ---------------------------------------------------------------- silent wrong answers before


@pytest.mark.parametrize("method, extra, said", [
    ("gptq", {"bits": 4}, "quantization_config (gptq, 4-bit): with adapters (--lora-rank R) the frozen base is counted "
                          "as the checkpoint stores it (--base-precision gptq)"),
    ("awq", {"bits": 4}, "quantization_config (awq, 4-bit): with adapters"),
    ("bitsandbytes", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "(--base-precision nf4)"),
    ("fp8", {"fmt": "e4m3"}, "quantization_config (fp8, e4m3 blocks None) is read but not modelled as FP8Linear"),
    ("torchao", {}, "quantization_config (torchao) is read but not modelled: estimated as"),
])
def test_a_quantization_config_says_what_the_base_is_counted_as(tmp_path, method, extra, said):
    config = write(tmp_path, "config.json", {**LLAMA_2_7B, "quantization_config": {"quant_method": method, **extra}})
    # was: counted as bf16 without a word; issue 23 models bitsandbytes, gptq and awq (with adapters)
    notes = notes_of("estimate", config, *(("--lora-rank", "8") if method in ("gptq", "awq", "bitsandbytes") else ()))
    assert any(said in note for note in notes), notes


def test_gemma3_with_a_vision_tower_says_it_is_not_counted():
    notes = notes_of("estimate", str(DATA / "hf_configs" / "gemma-3-4b.json"))
    assert any("vision tower (vision_config, SigLIP)" in note for note in notes), notes


def test_gemma3_text_only_has_no_such_note():
    assert not any("vision" in note for note in notes_of("estimate", str(DATA / "hf_configs" / "gemma-3-1b.json")))


@pytest.mark.parametrize("key, expected", [
    ("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
    ("gradient_accumulation", "gradient_accumulation_steps"),
    ("zero_optimisation", "zero_optimization"),
    ("bf_16", "bf16"),
])
def test_an_unknown_deepspeed_top_level_key_is_refused_with_the_nearest(tmp_path, key, expected):
    config = write(tmp_path, "ds.json", {key: 4, "zero_optimization": {"stage": 2}})
    # was: ignored, as DeepSpeed ignores it (micro-batch 1)
    one_error(run("estimate", "llama-2-7b", "--config", config),
              rf"ds\.json: {key} is not a DeepSpeed option \(did you mean '{expected}'\?\)")


def test_every_key_deepspeed_reads_is_accepted(tmp_path):
    """The published configs of tests/data read as before (no real key is taken for a typo)."""
    for path in sorted((DATA / "configs").glob("*.json")):
        result = run("estimate", "llama-2-7b", "--gpus", "8", "--config", str(path))
        # (hf_ds_config_zero3_old.json has a reduce_bucket_size of 0, which DeepSpeed refuses too)
        assert result.exit_code == 0 or "reduce_bucket_size must be >= 1" in result.output, (path.name, result.output)


def test_stage_auto_is_refused(tmp_path):
    config = write(tmp_path, "ds.json", {"zero_optimization": {"stage": "auto"}})
    one_error(run("estimate", "llama-2-7b", "--gpus", "8", "--config", config),  # was: estimated as ZeRO-0
              r"zero_optimization\.stage is \"auto\", which the Hugging Face Trainer \(accelerate\) runs as stage 2 and "
              r"DeepSpeed alone as stage 0")


def test_accelerate_really_fills_an_auto_stage_with_its_zero_stage():
    """Why "auto" is refused rather than read: accelerate's DeepSpeedPlugin fills it with 2, DeepSpeed drops it."""
    accelerate = pytest.importorskip("accelerate.utils")
    plugin = accelerate.DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": "auto",
                                                      "zero_optimization": {"stage": "auto"}})
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 2


def test_a_rotary_model_past_its_context_gets_a_note():
    notes = notes_of("estimate", "llama-2-7b", "--seq-len", "100000")  # was: no word
    assert any("seq_len 100,000 is past llama-2-7b's max_position_embeddings 4,096: transformers runs it" in note
               for note in notes), notes


def test_measure_says_so_before_its_ranks_start(monkeypatch):
    # was: `measure tiny-llama --seq-len 100000` ran on without a word until its timeout; the note comes first now
    pytest.importorskip("torch")
    import zeroplan.measure.launcher as launcher
    from zeroplan.api.keywords import options_from_keywords, parameters
    from zeroplan.api.measurements import measure_from_options
    from zeroplan.cli.measure_options import MEASURE_OPTIONS

    heard = []

    def started(*args, **kwargs):
        raise RuntimeError("the ranks would start here")

    class Progress:
        announce = heard.append

    monkeypatch.setattr(launcher, "run_ranks", started)
    monkeypatch.setattr(launcher, "check_host_memory", lambda *args: None)  # the estimate's host bytes are large
    options = options_from_keywords("measure", parameters(MEASURE_OPTIONS),
                                    {"model": "tiny-llama", "nproc": 1, "engine": "torch", "seq_len": 100_000})
    with pytest.raises(RuntimeError, match="would start"):
        measure_from_options(options, Progress())
    assert any(line.startswith("note: seq_len 100,000 is past tiny-llama's max_position_embeddings 256") for line in heard), heard


def test_learned_positions_cannot_run_past_their_rows():
    one_error(run("estimate", "gpt2", "--seq-len", "100000"),
              r"seq_len 100,000: gpt2 has 1,024 learned positions \(max_position_embeddings\)")
    # the default 2048 is not refused (it was not asked for): it is noted
    assert any("seq_len 2,048 (the default) is past gpt2's 1,024 learned positions" in note
               for note in notes_of("estimate", "gpt2"))


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_nvme_offload_without_nvme_path_is_refused(tmp_path, section):
    config = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 3, section: {"device": "nvme"},
                                                               **({"offload_optimizer": {"device": "nvme",
                                                                                         "nvme_path": "/nvme"}}
                                                                  if section == "offload_param" else {})}})
    one_error(run("estimate", "llama-2-7b", "--gpus", "8", "--config", config),
              rf"ds\.json: zero_optimization\.{section}\.nvme_path is missing, and device nvme needs it")


def test_nvme_below_stage_3_needs_no_path(tmp_path):
    """Stages 1-2 keep an "nvme" optimizer in CPU memory (no swapper): DeepSpeed reads no nvme_path there."""
    config = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    assert run("estimate", "llama-2-7b", "--gpus", "8", "--config", config).exit_code == 0


def test_nvme_without_a_path_in_accelerate_and_colossalai(tmp_path):
    accelerate = write(tmp_path, "accelerate.yaml", "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n"
                       "  zero_stage: 3\n  offload_optimizer_device: nvme\n  offload_param_device: nvme\n")
    one_error(run("estimate", "llama-2-7b", "--config", accelerate),
              r"deepspeed_config\.offload_optimizer_nvme_path is missing, and offload_optimizer_device nvme needs it")
    colossalai = write(tmp_path, "zero.py", "zero = dict(type='ZeroRedundancyOptimizer_Level_3', "
                       "offload_optimizer_config=dict(device='nvme'))\n")
    one_error(run("estimate", "llama-2-7b", "--gpus", "8", "--config", colossalai),
              r"zero\.offload_optimizer_config\.nvme_path is missing")


def test_nvme_by_options_is_estimated_and_the_emitted_config_names_its_path(tmp_path):
    """Options carry no path: the memory does not depend on it, so the estimate stands; `plan --emit` writes a
    placeholder path and says to set it."""
    assert run("estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--offload-optimizer", "nvme").exit_code == 0
    target = tmp_path / "ds.json"
    result = run("plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "8", "--zero", "3", "--offload", "nvme",
                 "--nvme", "8TB", "--emit", "deepspeed", str(target))
    assert result.exit_code == 0, result.output
    config = json.loads(target.read_text())["zero_optimization"]
    paths = [section.get("nvme_path") for section in (config["offload_optimizer"], config["offload_param"])
             if section["device"] == "nvme"]
    assert paths and all(paths)
    assert "set nvme_path" in result.stderr


@pytest.mark.parametrize("args, pattern", [
    (["--no-ddp", "--engine", "fsdp2", "--zero", "3"], r"ddp applies to engine torch; engine fsdp2 wraps the model itself"),
    (["--ddp", "--engine", "deepspeed"], r"ddp applies to engine torch; engine deepspeed"),
    (["--pp-virtual-stages", "2", "--engine", "fsdp2", "--zero", "3", "--gpus", "8"],
     r"--pp-virtual-stages: tunes pp, which is 1 here .*give --pp N"),
    (["--pp-schedule", "gpipe", "--engine", "fsdp2", "--zero", "3", "--gpus", "8"], r"--pp-schedule: tunes pp"),
    (["--no-sequence-parallel", "--engine", "fsdp2", "--zero", "3", "--gpus", "8"],
     r"--no-sequence-parallel: tunes tp, which is 1 here .*give --tp N"),
    (["--no-loss-parallel", "--engine", "fsdp2", "--zero", "3", "--gpus", "8"], r"--no-loss-parallel: tunes tp"),
    (["--moe-imbalance", "2"], r"--moe-imbalance: tunes ep"),
    (["--dropout", "0.1", "--engine", "paper"], r"dropout: engine paper counts model states only"),
    (["--lora-rank", "8", "--lora-alpha", "nan"], r"--lora-alpha: Input should be a finite number"),
    (["--lora-rank", "8", "--lora-alpha", "inf"], r"--lora-alpha: Input should be a finite number"),
    (["--lora-rank", "8", "--lora-alpha", "-1"], r"--lora-alpha: Input should be greater than 0"),
    (["--freeze", "embeddings", "--freeze", "blocks", "--freeze", "final"],
     r"freeze: every module group \(embeddings, blocks, final\) is frozen, so nothing trains"),
])
def test_knobs_that_do_not_apply_are_one_line_errors(args, pattern):
    one_error(run("estimate", "llama-2-7b", *args), pattern)  # was: accepted and ignored


def test_a_knob_for_a_searched_dimension_is_kept_by_plan_mesh():
    result = run("plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "64", "--engine", "fsdp2", "--mesh",
                 "--pp-schedule", "gpipe", "--top", "1")
    assert result.exit_code == 0, result.output


def test_a_model_with_no_trainable_parameter_is_refused(tmp_path):
    spec = write(tmp_path, "m.toml", 'kind = "params"\nname = "p"\nparams = 1000\ntrainable_params = 0\n')
    one_error(run("estimate", spec), r"trainable_params: Input should be greater than or equal to 1")


@pytest.mark.parametrize("option, value, bound", [
    ("--gpus", "1" + "0" * 30, "1<=x<=1048576"),
    ("--micro-batch", "1" + "0" * 30, "1<=x<=65536"),
    ("--seq-len", "1" + "0" * 30, "1<=x<=16777216"),
    ("--grad-accum", "1" + "0" * 30, "1<=x<=1048576"),
    ("--gpus-per-node", "1" + "0" * 30, "1<=x<=1048576"),
    ("--tp", "1" + "0" * 30, "1<=x<=1048576"),
    ("--lora-rank", "1" + "0" * 30, "1<=x<=65536"),
])
def test_counts_have_the_spec_s_bounds(option, value, bound):
    one_error(run("estimate", "llama-2-7b", option, value), rf"'{option}': 1{'0' * 30} is not in the range {re.escape(bound)}")


def test_loss_chunks_are_bounded():
    one_error(run("estimate", "llama-2-7b", "--loss", "chunked", "--loss-chunks", "1" + "0" * 30),
              r"'--loss-chunks': 10+ is not in the range 1<=x<=65536")


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "sub_group_size"])
def test_deepspeed_element_counts_are_bounded(tmp_path, key):
    config = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 3, key: 10**30}})
    one_error(run("estimate", "llama-2-7b", "--gpus", "8", "--config", config),
              rf"zero_optimization\.{key} must be at most 1,000,000,000,000,000")


def test_the_spec_bounds_every_count():
    """Every int field of the specs has an upper bound (spec/limits.py), so that no input carries a 10^30."""
    from zeroplan.spec.limits import field_bounds
    from zeroplan.spec.lora import LoraSpec
    from zeroplan.spec.mesh import MeshSpec
    from zeroplan.spec.model import ParamCountSpec, TransformerSpec
    from zeroplan.spec.moe import MLASpec, MoESpec
    from zeroplan.spec.training import DeepSpeedKnobs, TrainingSpec

    unbounded = []
    for model in (TrainingSpec, DeepSpeedKnobs, MeshSpec, TransformerSpec, ParamCountSpec, MoESpec, MLASpec, LoraSpec):
        for name, info in model.model_fields.items():
            if info.annotation in (int, int | None) and field_bounds(model, name)[1] is None:
                unbounded.append(f"{model.__name__}.{name}")
    assert unbounded == [], unbounded  # (QuantSpec.blocksize is one of eight sizes: a set, not a range)


def test_plan_does_not_count_on_unlimited_host_memory():
    result = run("plan", "llama-3.1-405b", "--gpu", "rtx4090-24gb", "--gpus", "1")
    assert result.exit_code == 0, result.output
    # was: "1 fit", needing 7,559 GiB of CPU memory on a node with one RTX 4090
    assert ", 0 fit" in result.stdout and "more CPU memory per node (7,559" in result.stdout
    assert "note: CPU memory per node taken as 48 GiB, twice the GPU memory of a node of 1 GPU" in result.stderr
    given = run("plan", "llama-3.1-405b", "--gpu", "rtx4090-24gb", "--gpus", "1", "--cpu-memory", "8TiB")
    assert ", 1 fit" in given.stdout and "CPU memory per node taken" not in given.stderr


def test_model_and_a_config_that_names_another_model_say_which_is_estimated():
    config = str(DATA / "configs" / "torchtune_llama3_1_8B_full.yaml")
    notes = notes_of("estimate", "mistral-7b", "--config", config)  # was: the file's model replaced silently
    assert any(note.startswith("MODEL mistral-7b is estimated, not llama-3-8b, the model of "
                               "torchtune_llama3_1_8B_full.yaml: MODEL wins") for note in notes), notes
    assert not any("MODEL" in note for note in notes_of("estimate", "--config", config))


@pytest.mark.parametrize("value, kind", [('"4096"', "a string"), ("true", "a boolean"), ("4096.0", "a fraction")])
def test_config_json_types_are_strict(tmp_path, value, kind):
    text = json.dumps(LLAMA_2_7B).replace('"hidden_size": 4096', f'"hidden_size": {value}')
    config = write(tmp_path, "config.json", text)
    one_error(run("estimate", config), rf"config\.json: hidden_size must be a whole number, got .* \({kind}\)")


def test_config_json_booleans_and_rates_are_strict(tmp_path):
    config = write(tmp_path, "config.json", {**LLAMA_2_7B, "tie_word_embeddings": "false"})
    one_error(run("estimate", config), r"tie_word_embeddings must be true or false, got 'false' \(a string\)")
    config = write(tmp_path, "config.json", {**LLAMA_2_7B, "attention_dropout": "0.1"})
    one_error(run("estimate", config), r"attention_dropout must be a number")


# ---------------------------------------------------------------- misleading before


@pytest.mark.parametrize("name, kind", [
    ("configs/deepspeed_docs_zero3.json", "is a DeepSpeed config, not a model"),
    ("configs/hf_ds_config_zero2.json", "is a DeepSpeed config, not a model"),
    ("configs/torchtitan_v0.2.2_llama3_8b.toml", "is a torchtitan job TOML, not a model spec"),
    ("configs/torchtune_llama3_2_1B_full_single_device.yaml", r"a \.yaml file is a trainer's config"),
    ("configs/accelerate_fsdp2.yaml", r"a \.yaml file is a trainer's config"),
    ("configs/colossalai_zero3.py", r"a \.py file is a trainer's config"),
])
def test_a_trainer_config_given_as_model_says_to_use_config(name, kind):
    # was: "12 errors ... Field required"
    one_error(run("estimate", str(DATA / name)), rf"{kind}.*give it with --config")


def test_an_accelerate_json_given_as_model(tmp_path):
    config = write(tmp_path, "accelerate.json", {"distributed_type": "FSDP", "num_processes": 8})
    one_error(run("estimate", config), r"is an accelerate config, not a model; give it with --config")


def test_a_config_json_without_model_type(tmp_path):
    config = write(tmp_path, "config.json", {key: value for key, value in LLAMA_2_7B.items() if key != "model_type"})
    one_error(run("estimate", config),  # was: "21 errors ... Field required"
              r"config\.json: has no model_type, .* the families read are .*llama.*; for LlamaForCausalLM add "
              r"\"model_type\": \"llama\"")


def test_compare_takes_a_gpu_range_as_plan_does():
    result = run("compare", "llama-2-7b", "--zero", "3", "--gpus", "8-32", "--format", "json")
    assert result.exit_code == 0, result.output  # was: "write a list such as 0,1,2,3"
    assert [row["gpus"] for row in json.loads(result.stdout)["rows"]] == [8, 16, 32]


def test_an_empty_model():
    one_error(run("estimate", ""), r"MODEL is empty; give a catalogue name")  # was: "a directory without a config.json"
    one_error(run("estimate", "  "), r"MODEL is empty")


def test_a_lora_file_s_regex_targets_name_the_file_s_key(tmp_path):
    adapter = write(tmp_path, "adapter_config.json", {"r": 16, "target_modules": r".*\.(q_proj|v_proj)"})
    one_error(run("estimate", "llama-2-7b", "--lora", adapter),  # was: blamed --lora-targets
              r"adapter_config\.json: target_modules: .* is a string, which PEFT reads as a regular expression")


@pytest.mark.parametrize("command", ["estimate", "compare"])
def test_a_lora_file_s_rank_and_targets_name_the_file_s_keys(tmp_path, command):
    adapter = write(tmp_path, "adapter_config.json", {"r": 5000, "target_modules": ["q_proj"]})
    one_error(run(command, "llama-2-7b", "--lora", adapter),  # was: blamed --lora-rank
              r"adapter_config\.json: r: 5000 exceeds the dimensions of self_attn\.q_proj")
    adapter = write(tmp_path, "adapter_config.json", {"r": 8, "target_modules": ["qkv"]})
    one_error(run(command, "llama-2-7b", "--lora", adapter), r"adapter_config\.json: target_modules: 'qkv' names no module")
    # an option given over the file is named as the option
    one_error(run(command, "llama-2-7b", "--lora", adapter, "--lora-targets", "qkv2"), r"--lora-targets: 'qkv2' names no")
    adapter = write(tmp_path, "adapter_config.json", {"r": 10**21, "target_modules": ["q_proj"]})
    one_error(run(command, "llama-2-7b", "--lora", adapter), r"adapter_config\.json: r: Input should be less than or equal")


def test_plan_mesh_emit_deepspeed_without_an_engine_does_not_loop(tmp_path):
    # was: "use --emit torchtitan", then with it "recipe torchtitan runs FSDP2 ..., not deepspeed"
    deepspeed = run("plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "64", "--mesh", "--emit", "deepspeed",
                    str(tmp_path / "ds.json"))
    assert deepspeed.exit_code == 0, deepspeed.output
    torchtitan = run("plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "64", "--mesh", "--emit", "torchtitan",
                     str(tmp_path / "job.toml"))
    assert torchtitan.exit_code == 0, torchtitan.output
    assert (tmp_path / "ds.json").exists() and (tmp_path / "job.toml").exists()


# ---------------------------------------------------------------- UX


def test_the_mesh_plan_reason_is_left_aligned_and_wrapped():
    result = run("plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "8192", "--engine", "fsdp2",
                 "--mesh")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert header.endswith("why it ranks here")  # was "why", right-aligned over a column padded to ~300 characters
    column = header.index("why it ranks here")
    below = lines[lines.index(header) + 2:]
    rows = [line for line in below[:next(i for i, line in enumerate(below) if line.startswith("assumptions"))] if line.strip()]
    assert rows and all(len(line) <= column + 80 for line in rows)
    first = next(line for line in rows if line.lstrip().startswith("1 "))
    assert first[column:].startswith("cheapest")  # left-aligned under its header


def test_the_mesh_estimate_says_what_it_estimates_first():
    result = run("estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--zero", "3", "--engine", "fsdp2")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("llama-3-70b: 70,553,706,496 parameters")  # was: after the per-rank table
    assert lines[1].startswith("fsdp2 ZeRO-3, 64 GPUs")
    assert lines.index(next(line for line in lines if line.startswith("Mesh: "))) > 2
    assert sum(line.startswith("llama-3-70b: ") for line in lines) == 1


@pytest.mark.parametrize("args, marker_header", [
    (["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3"], "peak"),
    (["estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--pp", "2", "--grad-accum", "2", "--zero", "3",
      "--engine", "fsdp2", "--recipe", "torchtitan"], "worst"),
])
def test_every_marker_column_has_a_header(args, marker_header):
    text = run(*args).stdout
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if index + 1 < len(lines) and set(lines[index + 1]) <= {"-", " "} and lines[index + 1].strip():
            underlines = lines[index + 1].split()
            # no column without a name (was: "-------" under an empty header, for the "<- peak" marker)
            assert len(line.split("  ")) and len([part for part in re.split(r"\s{2,}", line.strip()) if part]) == len(underlines), (line, lines[index + 1])
    assert any(line.rstrip().endswith(f"  {marker_header}") for line in lines)
    assert any(line.rstrip().endswith("  <-") for line in lines)
