"""Random config documents through `zeroplan estimate MODEL --config FILE` (issue 10): whatever the
file holds, the command ends with status 0 or 2, a user error is one line on stderr, and nothing
escapes as an exception. Examples are bounded in number and time so that this runs in CI in
about half a minute.
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import timedelta
from pathlib import Path

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.cli import cli
from zeroplan.importers.colossalai_py import _INT_KNOBS as COLOSSALAI_INT_KEYS
from zeroplan.importers.colossalai_py import _LEVEL_KEYS as COLOSSALAI_LEVEL_KEYS
from zeroplan.importers.deepspeed_json import BF16_KEYS, FP16_KEYS, ZERO_KEYS
from zeroplan.importers.values import OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS
from tests.paths import DATA, REPO

FUZZ = settings(max_examples=120, deadline=timedelta(seconds=5), derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def estimate_with(name: str, content: str | bytes):
    """`zeroplan estimate llama-100m --config <name>` on a file holding `content`."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8", errors="surrogatepass")
        return CliRunner().invoke(cli, ["estimate", "llama-100m", "--gpus", "8", "--config", str(path)])


def check(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), (result.exit_code, result.output)
    messages = [line for line in result.stderr.splitlines() if line.strip()]
    if result.exit_code == 2:
        assert len(messages) == 1 and messages[0].startswith("Error: "), result.stderr
    else:
        assert result.stdout.strip(), "exit 0 with no estimate"
        assert all(line.startswith("Warning: ") for line in messages), result.stderr


# ---------------------------------------------------------------- values a config may hold

_numbers = st.one_of(
    st.integers(-2, 4), st.integers(-10**12, 10**12), st.sampled_from([0, 1, 5e8, 1e9, 1e100, 2.5, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_scalars = st.one_of(_numbers, st.booleans(), st.none(), st.sampled_from(["auto", "cpu", "nvme", "none", "AdamW", ""]),
                     st.text(max_size=8))
_json_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                            max_leaves=12)


def _sections(keys, values) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(sorted(keys)), values, max_size=6)


_offload = st.one_of(_sections(OFFLOAD_OPTIMIZER_KEYS | OFFLOAD_PARAM_KEYS, _scalars), _scalars)
_zero = st.one_of(
    st.booleans(),
    _sections(ZERO_KEYS, _scalars).flatmap(lambda zero: st.fixed_dictionaries(
        {}, optional={"offload_optimizer": _offload, "offload_param": _offload}).map(lambda offload: {**zero, **offload})),
)
_deepspeed = st.fixed_dictionaries({}, optional={
    "zero_optimization": _zero,
    "fp16": st.one_of(_sections(FP16_KEYS, _scalars), _scalars),
    "bf16": st.one_of(_sections(BF16_KEYS, _scalars), _scalars),
    "optimizer": st.one_of(st.fixed_dictionaries({"type": _scalars}), _scalars),
    "train_batch_size": _scalars, "train_micro_batch_size_per_gpu": _scalars, "gradient_accumulation_steps": _scalars,
    "model_type": st.just("llama"), "steps_per_print": _scalars,
})


def _json_text(value) -> str:
    return json.dumps(value, allow_nan=True)


# Ways a hand-edited JSON file differs from JSON: comments, trailing commas, cut short, doubled keys.
_damage = st.sampled_from([
    lambda text: text,
    lambda text: "// a comment\n" + text,
    lambda text: text.replace("}", ",}", 1),
    lambda text: text[: len(text) // 2],
    lambda text: text.replace("{", '{"stage": 1, "stage": 2, ', 1),
    lambda text: "[" * 5000 + text + "]" * 5000,
    lambda text: "\ufeff" + text,
])


@FUZZ
@given(st.one_of(_deepspeed, _json_values), _damage)
def test_random_deepspeed_json_never_escapes(document, damage):
    check(estimate_with("ds.json", damage(_json_text(document))))


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_random_bytes_as_json_or_python_never_escape(content):
    check(estimate_with("ds.json", content))
    check(estimate_with("zero.py", content))


# ---------------------------------------------------------------- ColossalAI-style Python


def _python(value) -> str:
    """Python source for a value: dicts alternately as dict(...) calls and literals."""
    if isinstance(value, dict):
        if all(isinstance(key, str) and key.isidentifier() for key in value) and len(value) % 2 == 0:
            return "dict(" + ", ".join(f"{key}={_python(item)}" for key, item in value.items()) + ")"
        return "{" + ", ".join(f"{key!r}: {_python(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python(item) for item in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "float('nan')" if math.isnan(value) else ("1e400" if value > 0 else "-1e400")
    return repr(value)


_colossalai_keys = sorted(set().union(*COLOSSALAI_LEVEL_KEYS.values()) | set(COLOSSALAI_INT_KEYS))
_colossalai_zero = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from([f"ZeroRedundancyOptimizer_Level_{level}" for level in (1, 2, 3, 4)]), _scalars)},
    optional={"offload_optimizer_config": _offload, "offload_param_config": st.one_of(
        _offload, st.just({"device": "cpu", "fast_init": 10**9}))},
).flatmap(lambda zero: _sections(_colossalai_keys, _scalars).map(lambda more: {**more, **zero}))
# Statements a config must not contain, or that hold nothing to read (first: hypothesis favours it).
_odd_statements = st.sampled_from([
    "import os", "x = open('f')", "y = 2 ** 5", "z = " + "[" * 300 + "]" * 300, "w = " + "-" * 100_000 + "1",
    "v = " + "dict(a=" * 100 + "1" + ")" * 100, "zero = dict(type='ZeroRedundancyOptimizer_Level_3', ...)",
    '"""doc"""', "BATCH_SIZE = 8", "\ufeffzero = dict(type='ZeroRedundancyOptimizer_Level_2')",
])
_statements = st.lists(st.one_of(
    _odd_statements,
    _colossalai_zero.map(lambda zero: f"zero = {_python(zero)}"),
    _json_values.map(lambda value: f"optimizer = {_python(value)}"),
    _scalars.map(lambda value: f"gradient_accumulation = {_python(value)}"),
), max_size=3)


@FUZZ
@given(_statements)
def test_random_colossalai_python_never_escapes(statements):
    check(estimate_with("zero.py", "\n".join(statements) + "\n"))


# ---------------------------------------------------------------- torchtitan TOML, torchtune and accelerate YAML

from zeroplan.importers.accelerate_yaml import DEEPSPEED_KEYS as ACCELERATE_DEEPSPEED_KEYS  # noqa: E402
from zeroplan.importers.accelerate_yaml import FSDP_KEYS, TOP_LEVEL_KEYS as ACCELERATE_KEYS  # noqa: E402
from zeroplan.importers.torchtitan_toml import _2024_SECTIONS, _V022_SECTIONS  # noqa: E402
from zeroplan.importers.torchtune_yaml import KNOWN_KEYS as TORCHTUNE_KEYS  # noqa: E402
from zeroplan.importers.torchtune_yaml import MODELS as TORCHTUNE_MODELS, OPTIMIZERS as TORCHTUNE_OPTIMIZERS  # noqa: E402

# Fewer examples than the older readers get: each is a CLI run, and CI's time is shared.
FUZZ_NEW = settings(FUZZ, max_examples=50)

_toml_scalars = st.one_of(_numbers, st.booleans(), st.sampled_from(["op", "2", "0", "-1", "selective", "full", "none",
                                                                    "memory_budget", "bfloat16", "float32", "fused",
                                                                    "never", "llama3", "8B", "70B", "debugmodel", ""]),
                          st.text(max_size=6), st.lists(st.sampled_from(["float8", "model", "mx"]), max_size=2))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return str(value)


def _toml_text(tables: dict) -> str:
    return "".join(f"[{table}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in keys.items())
                   for table, keys in tables.items())


def _tables(sections: dict) -> st.SearchStrategy[dict]:
    names = sorted(name for name, keys in sections.items() if not isinstance(keys, dict))
    return st.dictionaries(st.sampled_from(names), st.just(None), max_size=5).flatmap(
        lambda chosen: st.fixed_dictionaries({name: _sections(sections[name], _toml_scalars) for name in chosen}))


_torchtitan = st.one_of(_tables(_V022_SECTIONS), _tables(_2024_SECTIONS)).map(
    lambda tables: {"model": {"name": "llama3", "flavor": "8B"}, **tables})
_toml_damage = st.sampled_from([
    lambda text: text,
    lambda text: text[: len(text) // 2],
    lambda text: text + "[model]\nname = 'llama3'\n",  # a table defined twice
    lambda text: text.replace(" = ", " : ", 1),
    lambda text: "x = " + "[" * 3000 + "]" * 3000 + "\n" + text,
])


@FUZZ_NEW
@given(_torchtitan, _toml_damage)
def test_random_torchtitan_toml_never_escapes(tables, damage):
    check(estimate_with("job.toml", damage(_toml_text(tables))))


_yaml_scalars = st.one_of(_scalars, st.sampled_from(["bf16", "fp32", "fp16", "FSDP", "DEEPSPEED", "MULTI_GPU", "NO",
                                                     "XLA", "cpu", "cuda", True, 2, "op", "selective"]))
_torchtune = st.fixed_dictionaries(
    {"model": st.fixed_dictionaries({"_component_": st.one_of(st.sampled_from(sorted(TORCHTUNE_MODELS)), _scalars)})},
    optional={
        "optimizer": st.fixed_dictionaries({"_component_": st.one_of(st.sampled_from(sorted(TORCHTUNE_OPTIMIZERS)),
                                                                     _scalars)},
                                           optional={"fused": _yaml_scalars, "foreach": _yaml_scalars, "lr": _scalars}),
        "loss": st.fixed_dictionaries({"_component_": st.sampled_from(
            ["torchtune.modules.loss.CEWithChunkedOutputLoss", "torch.nn.CrossEntropyLoss", "x"])},
            optional={"num_output_chunks": _scalars}),
        "tokenizer": st.fixed_dictionaries({}, optional={"max_seq_len": _scalars}),
    },
).flatmap(lambda base: _sections(TORCHTUNE_KEYS - {"model", "optimizer", "loss", "tokenizer"}, _yaml_scalars).map(
    lambda more: {**more, **base}))
_accelerate = st.fixed_dictionaries(
    {"distributed_type": _yaml_scalars},
    optional={"fsdp_config": st.one_of(_sections(FSDP_KEYS, _yaml_scalars), _scalars),
              "deepspeed_config": st.one_of(_sections(ACCELERATE_DEEPSPEED_KEYS - {"deepspeed_config_file"}, _yaml_scalars),
                                            _scalars)},
).flatmap(lambda base: _sections(ACCELERATE_KEYS - {"fsdp_config", "deepspeed_config"}, _yaml_scalars).map(
    lambda more: {**more, **base}))
_yaml_damage = st.sampled_from([
    lambda text: text,
    lambda text: "# tune run full_finetune_single_device --config x\n" + text,
    lambda text: "# tune run full_finetune_distributed --config x\n" + text,
    lambda text: text[: len(text) // 2],
    lambda text: text.replace(":", "", 1),
    lambda text: "[" * 3000 + text,
    lambda text: "a: &x [1]\nb: *x\n" + text,
])


@FUZZ_NEW
@given(st.one_of(_torchtune, _accelerate, _json_values), _yaml_damage)
def test_random_torchtune_and_accelerate_yaml_never_escape(document, damage):
    import yaml

    check(estimate_with("config.yaml", damage(yaml.safe_dump(document, allow_unicode=True))))


@FUZZ_NEW
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_random_bytes_as_toml_or_yaml_or_unnamed_never_escape(content):
    check(estimate_with("job.toml", content))
    check(estimate_with("config", content))


# ---------------------------------------------------------------- issue 21: an unknown key in every format

from zeroplan.importers.deepspeed_json import TOP_LEVEL_KEYS as DEEPSPEED_TOP_KEYS  # noqa: E402
from zeroplan.importers.torchtitan_toml import TORCHTITAN_SECTIONS  # noqa: E402

_KNOWN = (DEEPSPEED_TOP_KEYS | ZERO_KEYS | FP16_KEYS | BF16_KEYS | ACCELERATE_KEYS | FSDP_KEYS | ACCELERATE_DEEPSPEED_KEYS
          | TORCHTUNE_KEYS | TORCHTITAN_SECTIONS | set(_colossalai_keys))
# a key no reader knows: lower-case words, as a typo or an invented option would be
_unknown = st.from_regex(r"[a-z][a-z0-9_]{2,24}", fullmatch=True).filter(lambda key: key not in _KNOWN and not any(
    key in keys for keys in _V022_SECTIONS.values() if isinstance(keys, (set, frozenset))))


def refused_or_warned(result, key: str) -> None:
    """An unknown key is never dropped in silence: an error naming it (exit 2), or an estimate with a warning that
    names it, where the program itself ignores such a key (torchtune's top level, accelerate's sections)."""
    check(result)
    lines = result.stderr.splitlines()
    prefix = "Error: " if result.exit_code == 2 else "Warning: "
    assert any(line.startswith(prefix) and key in line for line in lines), (key, result.exit_code, result.stderr)


def _estimate(name: str, content: str, *extra: str, gpus: bool = True):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_text(content)
        return CliRunner().invoke(cli, ["estimate", *extra, *(["--gpus", "8"] if gpus else []), "--config", str(path)])


@FUZZ_NEW
@given(_unknown, st.sampled_from(["top", "zero_optimization", "bf16", "offload_optimizer"]))
def test_an_unknown_deepspeed_key_is_refused(key, where):
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    section = {"top": config, "zero_optimization": config["zero_optimization"], "bf16": config["bf16"],
               "offload_optimizer": config["zero_optimization"]["offload_optimizer"]}[where]
    section[key] = 1
    refused_or_warned(_estimate("ds.json", json.dumps(config), "llama-100m"), key)


@FUZZ_NEW
@given(_unknown, st.sampled_from(["v0.2.2 top", "v0.2.2 training", "2024 top", "2024 training"]))
def test_an_unknown_torchtitan_key_is_refused_or_warned(key, where):
    schema, place = where.split()
    text = (DATA / "configs" / f"torchtitan_{schema}_llama3_8b.toml").read_text()
    text = text + f"\n[{key}]\nx = 1\n" if place == "top" else text.replace("[training]\n", f"[training]\n{key} = 1\n", 1)
    refused_or_warned(_estimate("job.toml", text), key)


@FUZZ_NEW
@given(_unknown, st.sampled_from(["top", "optimizer"]))
def test_an_unknown_torchtune_key_is_refused_or_warned(key, where):
    text = (DATA / "configs" / "torchtune_llama3_2_1B_full_single_device.yaml").read_text()
    text = text + f"\n{key}: 1\n" if where == "top" else text.replace("optimizer:\n", f"optimizer:\n  {key}: 1\n", 1)
    refused_or_warned(_estimate("recipe.yaml", text, gpus=False), key)  # a single-device recipe


@FUZZ_NEW
@given(_unknown, st.sampled_from(["top", "fsdp_config"]))
def test_an_unknown_accelerate_key_is_refused_or_warned(key, where):
    text = (DATA / "configs" / "accelerate_fsdp2.yaml").read_text()
    text = text + f"{key}: 1\n" if where == "top" else text.replace("fsdp_config:\n", f"fsdp_config:\n  {key}: 1\n", 1)
    refused_or_warned(_estimate("accelerate.yaml", text, "llama-100m"), key)


@FUZZ_NEW
@given(_unknown)
def test_an_unknown_colossalai_zero_key_is_refused(key):
    text = (DATA / "configs" / "colossalai_zero3.py").read_text().replace("zero = dict(\n", f"zero = dict(\n    {key}=1,\n")
    refused_or_warned(_estimate("zero.py", text, "llama-100m"), key)


@FUZZ_NEW
@given(_unknown)
def test_an_unknown_lora_or_model_spec_key_is_refused(key):
    with tempfile.TemporaryDirectory() as folder:
        adapter = Path(folder) / "adapter_config.json"
        adapter.write_text(json.dumps({"r": 8, "target_modules": ["q_proj"], key: 1}))
        refused_or_warned(CliRunner().invoke(cli, ["estimate", "llama-100m", "--lora", str(adapter)]), key)
        spec = Path(folder) / "model.toml"
        spec.write_text((REPO / "model_specs" / "tiny-llama.toml").read_text()
                        + f"\n{key} = 1\n")
        refused_or_warned(CliRunner().invoke(cli, ["estimate", str(spec)]), key)


def _config_json_estimate(config: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        result = CliRunner().invoke(cli, ["estimate", str(path), "--format", "json"])
    check(result)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


_LLAMA = json.loads((DATA / "hf_configs" / "llama-100m.json").read_text())
_LLAMA_ESTIMATE = None


@FUZZ_NEW
@given(st.dictionaries(_unknown.filter(lambda key: key not in _LLAMA and key not in (
    "quantization_config", "vision_config", "text_config", "layer_types", "mlp_only_layers") and not key.startswith("n_")
    and key not in __import__("zeroplan.importers.hf_config", fromlist=["_INT_KEYS"])._INT_KEYS),
                       _json_values, min_size=1, max_size=3))
def test_keys_a_config_json_holds_beyond_the_read_ones_change_nothing(extra):
    """A config.json carries many keys zeroplan does not read (rope_theta, hidden_act, ...): they are neither
    refused nor allowed to change the estimate."""
    global _LLAMA_ESTIMATE
    if _LLAMA_ESTIMATE is None:
        _LLAMA_ESTIMATE = _config_json_estimate(_LLAMA)
    assert _config_json_estimate({**_LLAMA, **extra})["per_gpu"] == _LLAMA_ESTIMATE["per_gpu"]


@FUZZ_NEW
@given(st.sampled_from(["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                        "tie_word_embeddings", "attention_dropout"]),
       st.one_of(st.text(max_size=6), st.booleans(), st.lists(st.integers(), max_size=2), st.floats(allow_nan=True),
                 st.integers(10**15, 10**400)))
def test_a_read_config_json_key_of_the_wrong_type_is_refused(key, value):
    if key == "tie_word_embeddings" and isinstance(value, bool):
        return
    if key == "attention_dropout" and isinstance(value, float) and 0 <= value < 1:
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps({**_LLAMA, key: value}, allow_nan=True))
        result = CliRunner().invoke(cli, ["estimate", str(path)])
    check(result)
    assert result.exit_code == 2, (key, value, result.output)
    assert key in result.stderr, result.stderr
