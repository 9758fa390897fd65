"""The real run's allocation stream (measure/accounting.py's event log) and its replay through the
caching allocator model (measure/allocator_replay.py): the stream is the accounting's own counts
in order, and a 2-rank CPU run's replay gives reserved >= allocated, with allocated at the
tracker's peak."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from zeroplan.estimate.device.events import Alloc, Free  # noqa: E402
from zeroplan.estimate.device.figures import tensor_peak  # noqa: E402
from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.measure import launcher  # noqa: E402
from zeroplan.measure.accounting import TensorAccounting  # noqa: E402
from zeroplan.measure.allocator_replay import replay_summary  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402
from tests.worker_processes import workers_recorded  # noqa: E402

FLOAT32 = 4


def test_the_event_log_follows_allocations_frees_and_resizes():
    with TensorAccounting() as acc:
        a = torch.empty(1000)
        b = torch.empty(10)
        storage = b.untyped_storage()
        storage.resize_(0)  # FSDP2's free_storage
        storage.resize_(40 * FLOAT32)  # and alloc_storage: a new allocation of the same storage
        del a
        gc.collect()
    kinds = [(type(e).__name__, e.size_bytes if isinstance(e, Alloc) else None) for e in acc.events]
    assert kinds == [("Alloc", 4000), ("Alloc", 40), ("Free", None), ("Alloc", 160), ("Free", None)]
    # the keys pair each free with its allocation; a re-allocated storage gets a new key
    assert acc.events[2] == Free(acc.events[1].key) and acc.events[3].key != acc.events[1].key
    assert acc.events[4] == Free(acc.events[0].key)
    assert tensor_peak(acc.events) == 4000 + 160


def test_the_log_is_bounded():
    with TensorAccounting(event_limit=3) as acc:
        kept = [torch.empty(1) for _ in range(5)]
    assert acc.events_truncated and len(acc.events) <= 3 and kept
    summary = replay_summary(acc.events, truncated=True, environ={})
    assert summary["replayed"] is False and "event_limit" in summary["reason"]


def test_a_bad_alloc_conf_is_reported_not_raised():
    summary = replay_summary([Alloc(1, 10)], truncated=False, environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"})
    assert summary["replayed"] is False and summary["reason"].startswith("PYTORCH_CUDA_ALLOC_CONF: expandable_segments")


@pytest.mark.distributed
def test_a_two_rank_cpu_run_replays():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                            gpus=2, recipe="plain")
    with workers_recorded(launcher):
        result = launcher.run_measurement(resolve_model("tiny-llama"), training, nproc=2, steps=2, timeout_s=180,
                                          implementation="reference")
    for rank in result.ranks:
        replayed = rank.to_json_dict()["allocator_replay"]
        assert replayed["replayed"] and replayed["events"] > 100
        # the stream's own peak is the accounting's peak over the run (the phases cover the whole run)
        assert replayed["stream_peak_bytes"] == rank.peak_bytes
        # the allocator hands out 512-byte multiples and keeps whole segments
        assert replayed["reserved_peak_bytes"] >= replayed["allocated_peak_bytes"] >= replayed["stream_peak_bytes"]
        assert replayed["reserved_peak_bytes"] % (2 * 2**20) == 0  # every segment is a multiple of 2 MiB
