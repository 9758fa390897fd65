"""Building the LoRA / QLoRA model a measurement runs (zeroplan/measure/programs/peft_model.py),
checked against PEFT's and bitsandbytes' definitions: an adapter of rank r on a linear layer
in -> out has r x (in + out) parameters (lora_A: r x in, lora_B: out x r; Hu et al. 2021, section
4.1), DoRA adds one magnitude per output feature (Liu et al. 2024, eq. 5), a 4-bit weight packs two
values per byte, an 8-bit weight one."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from zeroplan.errors import MeasureError  # noqa: E402
from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.measure.accounting import ADAPTER_KEY, TensorAccounting  # noqa: E402
from zeroplan.measure.grid import GRID  # noqa: E402
from zeroplan.measure.programs import peft_model  # noqa: E402
from zeroplan.measure.result import PhaseResult, RankResult  # noqa: E402
from zeroplan.measure.workload import build_workload  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402

needs_lora_spec = pytest.mark.skipif("lora" not in TrainingSpec.model_fields,
                                     reason="TrainingSpec.lora (zeroplan/spec/lora.py) is not in this tree")

# tiny-llama's linear layers per block, (in, out): q, k, v, o (2 of 4 heads are kv heads), gate, up, down
TINY_LLAMA_LINEARS = ((128, 128), (128, 64), (128, 64), (128, 128), (128, 352), (128, 352), (352, 128))
TINY_LLAMA_LAYERS = 2


def _training(**fields) -> TrainingSpec:
    base = {"engine": "torch", "zero_stage": 0, "gpus": 1, "device": "cpu", "precision": "fp32", "recipe": "plain",
            "micro_batch": 2, "seq_len": 64}
    return TrainingSpec.model_validate(base | fields)


def _build(**fields):
    return build_workload(resolve_model("tiny-llama"), _training(**fields), torch.device("cpu")).model


def _adapter_numel(model) -> int:
    return sum(p.numel() for p in peft_model.adapter_parameters(model))


@needs_lora_spec
def test_lora_on_all_linear_layers_has_rank_times_in_plus_out_per_layer():
    model = _build(lora={"rank": 8, "targets": ["all-linear"]})
    expected = TINY_LLAMA_LAYERS * sum(8 * (fan_in + fan_out) for fan_in, fan_out in TINY_LLAMA_LINEARS)
    assert _adapter_numel(model) == expected == 37_376
    # everything that trains is an adapter: PEFT froze the base
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


@needs_lora_spec
def test_dora_adds_one_magnitude_per_output_feature_and_modules_to_save_copies_the_head():
    lora = TINY_LLAMA_LAYERS * sum(8 * (fan_in + fan_out) for fan_in, fan_out in TINY_LLAMA_LINEARS)
    magnitudes = TINY_LLAMA_LAYERS * sum(fan_out for _, fan_out in TINY_LLAMA_LINEARS)
    assert _adapter_numel(_build(lora={"rank": 8, "targets": ["all-linear"], "dora": True})) == lora + magnitudes
    head = 512 * 128  # vocab x hidden, the untied lm_head
    assert _adapter_numel(_build(lora={"rank": 8, "targets": ["all-linear"], "modules_to_save": ["lm_head"]})) == lora + head


@needs_lora_spec
def test_targets_by_name_adapt_only_those_layers():
    model = _build(lora={"rank": 4, "targets": ["q_proj", "v_proj"]})
    assert _adapter_numel(model) == TINY_LLAMA_LAYERS * 4 * ((128 + 128) + (128 + 64))


@needs_lora_spec
def test_a_target_the_model_does_not_have_is_a_measure_error():
    with pytest.raises(MeasureError, match=r"training\.lora: Target modules .*c_fc"):
        _build(lora={"rank": 8, "targets": ["c_fc"]})


@needs_lora_spec
@pytest.mark.parametrize("precision,bytes_per_weight", [("nf4", 0.5), ("fp4", 0.5), ("int8", 1)])
def test_a_kbit_base_packs_every_linear_but_the_head(precision, bytes_per_weight):
    bnb = pytest.importorskip("bitsandbytes")
    double_quant = {"double_quant": True} if precision != "int8" else {}  # spec/lora.py: 4-bit only
    model = _build(lora={"rank": 8, "targets": ["all-linear"]}, quant={"base_precision": precision, "compute_dtype": "fp32"} | double_quant)
    layers = [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert len(layers) == TINY_LLAMA_LAYERS * len(TINY_LLAMA_LINEARS)
    packed = sum(m.weight.untyped_storage().nbytes() for m in layers)
    assert packed == int(TINY_LLAMA_LAYERS * sum(i * o for i, o in TINY_LLAMA_LINEARS) * bytes_per_weight)
    assert type(model.lm.lm_head).__name__ == "Linear"  # transformers keeps the head whole
    if precision != "int8":  # absmax per 64-value block, double-quantized
        assert all(m.weight.quant_state.nested for m in layers)
    # prepare_model_for_kbit_training: the base is frozen; only adapters train
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in peft_model.adapter_parameters(model)}


@needs_lora_spec
def test_a_kbit_base_on_the_meta_device_is_refused():
    pytest.importorskip("bitsandbytes")
    training = _training(lora={"rank": 8, "targets": ["all-linear"]}, quant={"base_precision": "nf4"})
    with pytest.raises(MeasureError, match="training.quant: bitsandbytes quantizes weights where they are"):
        build_workload(resolve_model("tiny-llama"), training, torch.device("meta"))


def test_the_accounting_splits_the_parameters_into_base_and_adapter():
    with TensorAccounting() as accounting:
        base = torch.zeros(1000)  # 4000 bytes
        adapter = torch.zeros(10)  # 40 bytes
        accounting.set_classifier(lambda: {"params": [base, adapter], ADAPTER_KEY: [adapter]})
        accounting.begin_phase("forward", default_category="activations")
        activation = torch.ones(100)
        phase = accounting.end_phase()
        del activation
    assert phase.peak_categories["params"] == 4040
    assert phase.adapter_params_bytes == 40


def test_the_split_is_in_the_json_of_adapter_runs_only():
    plain = PhaseResult(1, "forward", 10, 20, {"params": 8, "activations": 12})
    adapted = PhaseResult(1, "forward", 10, 20, {"params": 8, "activations": 12}, None, 3)
    assert "params_split" not in RankResult(0, [plain]).to_json_dict()
    data = RankResult(0, [adapted]).to_json_dict()
    assert data["params_split"] == {"base": 5, "adapter": 3}
    assert RankResult.from_json_dict(data).phases[0].adapter_params_bytes == 3


def test_grid_lora_rows_are_named_for_the_feature():
    rows = [row for row in GRID if row.lora is not None]
    ids = [row.id.removeprefix("trainer-") if row.recipe == "hf-trainer" else row.id for row in rows]
    assert rows and all(row_id.startswith(("lora-", "qlora-")) for row_id in ids)
    assert all(row_id.startswith("qlora-") == (row.lora.base_precision in ("int8", "nf4", "fp4", "torchao-nf4")) for row, row_id in zip(rows, ids))


@needs_lora_spec
def test_grid_lora_rows_are_valid_training_specs():
    for row in (row for row in GRID if row.lora is not None):
        TrainingSpec.model_validate(row.training_fields())


def test_counting_quantization_states_reads_no_parameter_through_its_getter():
    # DeepSpeed ZeRO-3's parameter dict gathers a partitioned parameter on __getitem__ in forward
    # (parameter_offload.py ZeROOrderedDict): a count on one rank only would leave the ranks' collectives mismatched
    class Gathering(dict):
        def __getitem__(self, key):
            raise AssertionError(f"gathered {key}")

    linear = torch.nn.Linear(4, 4)
    linear._parameters = Gathering(linear._parameters)
    model = torch.nn.Sequential(linear)
    assert peft_model.quantization_state_tensors(model) == []
