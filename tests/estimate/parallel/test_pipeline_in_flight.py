"""The "in flight" column of a looped schedule is the walk's count at its peak (estimate/parallel/pipeline_schedule.py
`looped_peak`), against what torch 2.13.0 kept on 2 gloo ranks (docs/measure.md, "Looped pipeline schedules")."""

from __future__ import annotations


from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA

_TINY_LLAMA_4L = str(DATA / "tiny-llama-4l.toml")


def test_zero_bubble_second_rank_reports_the_four_chunks_measured_at_its_peak():
    # measured: at 1I1 four micro-batches of its 2-block stage are alive (1:0 waits for 1W0); the warm-up count said 3
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, precision="fp32", micro_batch=2, seq_len=128,
                            device="cpu", recipe="torchtitan", loss="standard", grad_accum=4,
                            mesh={"pp": 2, "pp_schedule": "zero-bubble", "pp_virtual_stages": 2})
    ranks = estimate_mesh(resolve_model(_TINY_LLAMA_4L), training).ranks
    assert [rank.kind.in_flight for rank in ranks] == [4, 4]
