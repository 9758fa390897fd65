"""The optimizer's kernel, one rank without DDP and the optimizer in backward, run for real on gloo
(tiny-llama, a few MB, seconds each) and held to the estimate of the same program: steady peak
within 3%, first-step peak within 5%."""

import pytest

pytest.importorskip("torch")

from zeroplan.estimate import estimate  # noqa: E402
from zeroplan.estimate.serialize import phase_to_dict  # noqa: E402
from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.measure.comparison import compare, run_peaks  # noqa: E402
from zeroplan.measure.launcher import run_measurement  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("nproc,knobs", [
    (2, {"optimizer_impl": "foreach"}),  # DDP: the foreach sqrt list over every parameter
    (1, {"ddp": False, "optimizer_in_backward": True, "optimizer_impl": "for-loop"}),  # torchtune single device
])
def test_estimate_matches_the_run(nproc, knobs):
    model = resolve_model("tiny-llama")
    training = TrainingSpec(engine="torch", zero_stage=0, gpus=nproc, device="cpu", precision="fp32", recipe="plain",
                            micro_batch=2, seq_len=128, **knobs)
    result = run_measurement(model, training, nproc=nproc, steps=3, timeout_s=240)
    comparison = compare([phase_to_dict(phase) for phase in estimate(model, training).phases], run_peaks(result.to_json_dict()))
    assert set(comparison.steps) == {"steady", "first"}
    for step in comparison.steps.values():
        assert step.peak.ok, (step.step, step.peak)
