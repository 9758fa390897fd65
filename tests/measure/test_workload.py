"""The measured workload, in one process: the models built for real, their loss, and what
checkpointing and the attention kernel do to the activation bytes the accounting sees."""

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from zeroplan.estimate.model.layout import param_layout  # noqa: E402
from zeroplan.importers.catalog import params_model, resolve_model  # noqa: E402
from zeroplan.errors import MeasureError  # noqa: E402
from zeroplan.estimate.activations.transformer import activation_bytes  # noqa: E402
from zeroplan.measure.accounting import TensorAccounting  # noqa: E402
from zeroplan.measure.workload import build_workload, hf_available, make_batch  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402

CPU = torch.device("cpu")
IMPLEMENTATIONS = ["reference"] + (["hf"] if hf_available() else [])


def _training(**fields):
    defaults = dict(engine="fsdp2", zero_stage=3, gpus=2, precision="fp32", micro_batch=2, seq_len=64, device="cpu")
    return TrainingSpec(**(defaults | fields))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_built_model_has_the_parameters_of_the_spec(name, implementation):
    spec = resolve_model(name)
    workload = build_workload(spec, _training(), CPU, implementation=implementation)
    built = sum(p.numel() for p in workload.model.parameters())  # a tied head counts once
    assert built == param_layout(spec).total_params
    assert len(workload.model.transformer_blocks) == spec.num_layers
    family = "llama" if name == "tiny-llama" else "gpt2"
    expected = f"zeroplan-reference:{family}/sdpa" if implementation == "reference" else (
        "LlamaForCausalLM/sdpa" if family == "llama" else "GPT2LMHeadModel/sdpa"
    )
    assert workload.implementation.endswith(expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_loss_at_random_init_is_close_to_uniform_and_backpropagates(implementation):
    spec = resolve_model("tiny-llama")
    torch.manual_seed(0)
    model = build_workload(spec, _training(), CPU, implementation=implementation).model
    input_ids, labels = make_batch(spec, _training(), CPU)
    loss = model(input_ids, labels)
    # weights drawn with std 0.02 give near-uniform predictions: loss ~ ln(vocab)
    assert loss.item() == pytest.approx(math.log(spec.vocab_size), rel=0.05)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _forward_activation_bytes(implementation: str, **fields) -> int:
    return _measured_forward_activation_bytes(implementation, _training(seq_len=128, **fields))


@functools.lru_cache(maxsize=None)
def _measured_forward_activation_bytes(implementation: str, training: TrainingSpec) -> int:
    """Measured once per spec (several tests compare the same forward): the accounting counts bytes, no timings."""
    spec = resolve_model("tiny-llama")
    with TensorAccounting() as acc:
        model = build_workload(spec, training, CPU, implementation=implementation).model
        params = list(model.parameters())
        acc.set_classifier(lambda: {"params": params, "buffers": list(model.buffers())})
        input_ids, labels = make_batch(spec, training, CPU)
        acc.begin_phase("forward", default_category="activations")
        loss = model(input_ids, labels)
        phase = acc.end_phase()
        loss.backward()
    return phase.live_bytes - phase.peak_categories["params"] - phase.peak_categories["buffers"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_full_checkpointing_keeps_less_after_forward(implementation):
    plain = _forward_activation_bytes(implementation)
    full = _forward_activation_bytes(implementation, checkpointing="full")
    # Korthikanti et al. 2022 section 5: full recomputation keeps each block's input only
    # (2 x 128 x 128 floats per block here); the logits and loss are kept either way.
    assert full < 0.6 * plain


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_selective_checkpointing_keeps_less_than_none_and_more_than_full(implementation):
    plain = _forward_activation_bytes(implementation, attention="eager")
    selective = _forward_activation_bytes(implementation, attention="eager", checkpointing="selective")
    full = _forward_activation_bytes(implementation, attention="eager", checkpointing="full")
    assert full < selective < plain


@pytest.mark.skipif(not hf_available(), reason="needs transformers")
@pytest.mark.parametrize("attention", ["fused", "eager"])
def test_hf_selective_checkpointing_recomputes_the_attention_core_as_estimated(attention):
    """Selective recomputation of a Hugging Face model runs its attention core (not the whole
    attention module) under checkpoint: the forward keeps what activations.py says, to the
    fused kernel's log-sum-exp (16 bytes per token and block here, counted by the estimator)."""
    spec = resolve_model("tiny-llama")
    saved = {ck: _forward_activation_bytes("hf", attention=attention, checkpointing=ck) for ck in ("none", "selective")}
    acts = {ck: activation_bytes(spec, _training(seq_len=128, attention=attention, checkpointing=ck), 4)
            for ck in ("none", "selective")}
    predicted = acts["none"].forward_peak - acts["selective"].forward_peak
    lse = 4 * spec.num_heads * 2 * 128 * spec.num_layers
    assert predicted - lse <= saved["none"] - saved["selective"] <= predicted + lse
    if attention == "eager":  # the s x s probabilities of both blocks, less the kept k/v and mask
        assert predicted > 1_000_000


def test_eager_attention_keeps_the_score_matrices_that_sdpa_does_not():
    fused = _forward_activation_bytes("reference")
    eager = _forward_activation_bytes("reference", attention="eager")
    # eager keeps at least the a x s x s probabilities per block: 2 blocks x 2 x 4 x 128 x 128 floats
    assert eager - fused >= 2 * 2 * 4 * 128 * 128 * 4


def test_a_parameter_count_model_cannot_be_built():
    with pytest.raises(MeasureError, match="known by its parameter count only"):
        build_workload(params_model(1_000_000), _training(), CPU)


def test_unknown_implementation_is_refused():
    with pytest.raises(MeasureError, match="implementation: 'jax' is not one of"):
        build_workload(resolve_model("tiny-llama"), _training(), CPU, implementation="jax")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_frozen_groups_get_no_gradients(implementation):
    spec = resolve_model("tiny-llama")  # untied: the head is in "final"
    layout = param_layout(spec)
    model = build_workload(spec, _training(freeze=("embeddings", "final")), CPU, implementation=implementation).model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == layout.num_blocks * layout.block_params
    loss = model(*make_batch(spec, _training(), CPU))
    loss.backward()
    assert sum(p.numel() for p in model.parameters() if p.grad is not None) == trainable
