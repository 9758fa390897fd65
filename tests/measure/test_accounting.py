"""The live-tensor accounting, in one process: exact bytes, resizes, peaks and their categories."""

import gc
import json
import os
import threading

import pytest

torch = pytest.importorskip("torch")

from zeroplan.measure.accounting import TensorAccounting, births_as  # noqa: E402
from zeroplan.measure.worker import write_json_atomic  # noqa: E402

FLOAT32 = 4


def test_counts_every_new_storage_and_releases_it_when_freed():
    with TensorAccounting() as acc:
        a = torch.empty(1000)
        b = a.view(10, 100)  # a view: same storage, no new bytes
        assert acc.current_bytes == 1000 * FLOAT32
        c = torch.zeros(10, dtype=torch.bfloat16)
        assert acc.current_bytes == 1000 * FLOAT32 + 10 * 2
        del a
        assert acc.current_bytes == 1000 * FLOAT32 + 20  # b keeps the storage alive
        del b, c
        gc.collect()
        assert acc.current_bytes == 0


def test_storage_resize_is_counted_both_ways():
    # FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_.
    with TensorAccounting() as acc:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
        assert acc.current_bytes == 0
        t.untyped_storage().resize_(256 * FLOAT32)
        assert acc.current_bytes == 256 * FLOAT32
    assert torch.UntypedStorage.resize_.__name__ == "resize_"  # restored on exit
    assert "accounting" not in getattr(torch.UntypedStorage.resize_, "__qualname__", "")


def test_peak_categories_are_those_live_at_the_peak_and_sum_to_it():
    with TensorAccounting() as acc:
        weight = torch.nn.Parameter(torch.randn(512, 512))
        acc.set_classifier(lambda: {"params": [weight], "grads": [weight.grad] if weight.grad is not None else []})
        acc.begin_phase("forward", default_category="activations")
        x = torch.randn(64, 512)
        h = (x @ weight).relu()  # x and h are saved for backward
        del x, h  # freed before the phase ends: only the peak remembers them
        after = torch.empty(16)
        phase = acc.end_phase()
    weight_bytes = 512 * 512 * FLOAT32
    assert phase.peak_categories["params"] == weight_bytes
    # the peak held x, the matmul output and the relu output (3 x 64 x 512 floats), not `after`
    assert phase.peak_categories["activations"] == 3 * 64 * 512 * FLOAT32
    assert sum(phase.peak_categories.values()) == phase.peak_bytes
    assert phase.live_bytes == weight_bytes + after.numel() * FLOAT32


def test_peak_is_exact_when_many_small_allocations_follow_the_last_classification():
    # Re-classification happens only every 1/256 of growth; the total must stay exact anyway.
    with TensorAccounting(min_granularity_bytes=1 << 20) as acc:
        acc.set_classifier(lambda: {})
        acc.begin_phase("forward", default_category="activations")
        kept = [torch.empty(100) for _ in range(50)]
        del kept[-10:]
        phase = acc.end_phase()
    assert phase.peak_bytes == 50 * 100 * FLOAT32
    assert phase.peak_categories["activations"] == phase.peak_bytes
    assert acc.classifications <= 3


def test_a_storage_named_only_after_the_peak_takes_its_later_name():
    # Optimizer states are created inside step() and named once step() returns.
    with TensorAccounting() as acc:
        holder = {}
        acc.set_classifier(lambda: {"optimizer_states": list(holder.values())})
        acc.begin_phase("optimizer_step", default_category="temporaries")
        holder["exp_avg"] = torch.zeros(1000)
        scratch = torch.empty(1000)
        del scratch
        phase = acc.end_phase()
    assert phase.peak_categories["optimizer_states"] == 1000 * FLOAT32
    assert phase.peak_categories["temporaries"] == 1000 * FLOAT32


def test_births_during_engine_setup_count_as_buffers_in_later_phases():
    with TensorAccounting() as acc:
        acc.set_classifier(lambda: {})
        acc.begin_phase("engine", default_category="temporaries", born_as="buffers")
        bucket = torch.empty(300)
        acc.end_phase()
        acc.begin_phase("forward", default_category="activations")
        activation = torch.empty(100)
        with births_as("buffers"):
            rebuilt = torch.empty(50)
        phase = acc.end_phase()
    assert phase.peak_categories["buffers"] == (300 + 50) * FLOAT32
    assert phase.peak_categories["activations"] == 100 * FLOAT32
    del bucket, activation, rebuilt


def test_a_free_on_another_thread_is_counted():
    # gloo drops the last reference to a collective's tensor on its own thread.
    with TensorAccounting() as acc:
        box = [torch.empty(1000)]
        thread = threading.Thread(target=box.clear)
        thread.start()
        thread.join()
        one = torch.empty(1)  # the next event applies any free queued while the lock was held
        assert acc.current_bytes == one.numel() * FLOAT32


def test_unknown_category_is_refused():
    with TensorAccounting() as acc:
        with pytest.raises(ValueError, match="category 'weights' is not one of"):
            acc.begin_phase("x", default_category="weights")


def test_atomic_json_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic(str(path), {"rank": 0, "bad": object()})
    assert os.listdir(tmp_path) == []
    write_json_atomic(str(path), {"rank": 0})
    assert json.loads(path.read_text()) == {"rank": 0}
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_classifier_that_runs_ops_during_a_resize_does_not_deadlock():
    # A runner may compute its tensors (a DTensor's local view, a flattened buffer) while the
    # accounting classifies after a storage resize, outside any dispatch.
    with TensorAccounting(min_granularity_bytes=1) as acc:
        weight = torch.zeros(64)
        acc.set_classifier(lambda: {"params": [weight.view(8, 8) + 0]})
        acc.begin_phase("forward", default_category="activations")
        t = torch.empty(1)
        t.untyped_storage().resize_(4096)  # a new peak: classify, which runs an add
        phase = acc.end_phase()
    assert phase.peak_bytes == 64 * FLOAT32 + 4096


def test_a_buffer_named_after_the_op_that_made_it_counts_under_its_name():
    # DeepSpeed stores its 2 GB reduce bucket in an attribute after torch.empty returns, and
    # frees it before backward ends: it must not count as an activation.
    with TensorAccounting() as acc:
        engine = {}
        acc.set_classifier(lambda: {"buffers": list(engine.values())})
        acc.begin_phase("backward", default_category="activations")
        engine["bucket"] = torch.empty(100_000)
        engine["bucket"].zero_()  # the engine's next op
        del engine["bucket"]
        phase = acc.end_phase()
    assert phase.peak_categories["buffers"] == 100_000 * FLOAT32
    assert phase.peak_categories["activations"] == 0
