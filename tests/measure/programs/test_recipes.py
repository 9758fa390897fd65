"""`zeroplan measure --recipe torchtitan|torchtune` (issue 11, item 4): neither program runs here
(docs/measure.md says why), so zeroplan's loop reproduces each from its source and its result
says so; torchtitan 0.3.0's ChunkedLossWrapper flow is run and held to the estimator's count of it.
"""

from __future__ import annotations

import pytest

from zeroplan.errors import MeasureError
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.programs.reproduction import reproduction_name
from zeroplan.spec.training import TrainingSpec

TINY = resolve_model("tiny-llama")
MODEL = "hf-transformers-5.23.0:LlamaForCausalLM/sdpa"


def _titan(**fields) -> TrainingSpec:
    base = dict(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=2, device="cpu", precision="bf16",
                micro_batch=2, seq_len=128)
    return TrainingSpec(**(base | fields))


def _tune(**fields) -> TrainingSpec:
    base = dict(recipe="torchtune", engine="torch", zero_stage=0, gpus=1, device="cpu", precision="pure-bf16",
                micro_batch=2, seq_len=128)
    return TrainingSpec(**(base | fields))


def test_measure_runs_both_recipes_and_keeps_plain_as_the_default():
    from zeroplan.measure.launcher import DEFAULT_RECIPE, RUNNABLE_RECIPES

    assert DEFAULT_RECIPE == "plain"
    assert set(RUNNABLE_RECIPES) == {"plain", "hf-trainer", "torchtitan", "torchtune"}


def test_torchtitan_result_names_the_program_it_reproduces_and_its_knobs():
    """torchtitan 0.3.0: meta init, per-op checkpointing, ChunkedLossWrapper (8 chunks), a
    reduce-scatter at every micro-batch, fused AdamW."""
    name = reproduction_name(_titan(checkpointing="op", grad_accum=2), MODEL)
    assert name == ("zeroplan loop reproducing torchtitan 0.3.0 (model init meta, op checkpointing, chunked loss "
                    "(ChunkedLossWrapper, 8 chunks), reduce every micro-batch, fused AdamW) on " + MODEL)


def test_torchtune_result_names_its_single_device_program():
    """torchtune 0.6.1 full_finetune_single_device: built on the device, CEWithChunkedOutputLoss,
    the optimizer stepped in backward, pure bf16; no DDP."""
    assert reproduction_name(_tune(), MODEL) == (
        "zeroplan loop reproducing torchtune 0.6.1 (model init device, chunked loss (CEWithChunkedOutputLoss, 8 chunks), "
        "foreach AdamW in backward, pure bf16) on " + MODEL)


def test_an_explicit_knob_shows_in_the_name():
    name = reproduction_name(_titan(loss="standard", grad_accum=2, grad_sync="last", checkpointing="full",
                                    checkpoint_every=2), MODEL)
    assert "full checkpointing of one block in 2, standard loss, reduce the last micro-batch" in name


def test_the_chunked_loss_of_each_recipe_is_its_own_flow():
    pytest.importorskip("torch")
    import torch

    from zeroplan.measure.workload import build_workload

    titan = build_workload(TINY, _titan(gpus=1, engine="torch", zero_stage=0, precision="fp32"), torch.device("cpu"))
    tune = build_workload(TINY, _tune(precision="fp32"), torch.device("cpu"))
    assert (titan.model.loss, tune.model.loss) == ("chunked-torchtitan", "chunked")
    assert titan.model.loss_chunks == tune.model.loss_chunks == 8


def test_torchtitan_chunked_loss_equals_torch_cross_entropy():
    """Each chunk's backward runs inside the forward; the decoder's backward then starts from the
    accumulated gradient: loss, hidden-state and head gradients are torch's own."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from zeroplan.measure import losses

    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, requires_grad=True)
    norm, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 40, bias=False)
    labels = losses.shifted_labels(torch.randint(0, 40, (2, 16)))
    reference = F.cross_entropy(head(norm(x)).reshape(-1, 40), labels.reshape(-1), ignore_index=-100)
    want = torch.autograd.grad(reference, (x, head.weight))
    loss = losses.torchtitan_chunked_loss(norm(x), head, labels, 4)
    assert head.weight.grad is not None  # the head's gradient exists before backward: computed in forward
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(x.grad, want[0], atol=1e-6) and torch.allclose(head.weight.grad, want[1], atol=1e-6)
    with pytest.raises(ValueError, match="ChunkedLossWrapper sequence length must be divisible by num_chunks"):
        losses.torchtitan_chunked_loss(norm(x), head, labels, 5)


def test_torchtitan_chunked_loss_under_ddp_is_refused_before_any_rank_starts():
    pytest.importorskip("torch")
    from zeroplan.measure.launcher import run_measurement

    training = _titan(engine="torch", zero_stage=0, precision="fp32", ddp=True)
    with pytest.raises(MeasureError, match="^ddp: torchtitan's chunked loss runs each chunk's backward inside the forward"):
        run_measurement(TINY, training, nproc=2, backend="gloo")


@pytest.mark.distributed
def test_torchtitan_chunked_loss_measured_within_targets_of_its_estimate():
    """2 gloo ranks, FSDP2 stage 3, fp32 (where the head's gradient is fp32 in both), the torchtitan
    recipe's defaults: the estimator's ChunkedLossWrapper terms against the flow run."""
    pytest.importorskip("torch")
    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import phase_to_dict
    from zeroplan.measure.comparison import compare, run_peaks
    from zeroplan.measure.launcher import run_measurement

    training = _titan(precision="fp32", fsdp2={"units": "root"})  # measure runs the chunked loss with the head in the root
    result = run_measurement(TINY, training, nproc=2, backend="gloo", steps=2, timeout_s=300)
    assert result.implementation.startswith("zeroplan loop reproducing torchtitan 0.3.0 (model init meta, chunked loss "
                                            "(ChunkedLossWrapper, 8 chunks)")
    comparison = compare([phase_to_dict(phase) for phase in estimate(TINY, training).phases], run_peaks(result.to_json_dict()))
    assert abs(comparison.steady.peak.error) <= 0.03
    assert abs(comparison.first.peak.error) <= 0.05


def test_torchtitan_chunked_loss_with_a_head_unit_is_refused_before_any_worker_starts():
    """With [norm, lm_head] an FSDP2 unit of its own (torchtitan's wrapping), the ChunkedLossWrapper's
    backward inside the forward crashed the gloo workers (SIGSEGV); measure says so instead."""
    pytest.importorskip("torch")
    from zeroplan.errors import MeasureError
    from zeroplan.measure.launcher import run_measurement

    with pytest.raises(MeasureError, match="fsdp2.units: measure runs torchtitan's chunked loss with the head in the root"):
        run_measurement(TINY, _titan(precision="fp32"), nproc=2, backend="gloo", steps=2, timeout_s=60)
