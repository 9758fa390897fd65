"""Activation offloading (`activation_offload cpu`): torchtune 0.6.1's OffloadActivations policy as
measure runs it, and as the estimate counts it."""

import pytest

from tests.grid_rows import assert_peaks_within_targets, measure_row_comparison

from zeroplan.estimate import estimate
from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")


def _training(**fields) -> TrainingSpec:
    base = dict(engine="torch", zero_stage=0, gpus=1, device="cpu", precision="bf16", micro_batch=4, seq_len=256,
                recipe="plain")
    return TrainingSpec(**(base | fields))


# -- the policy, run by measure --------------------------------------------------------------------


def test_pack_offloads_activations_of_1024_bytes_and_more_but_not_parameters():
    torch = pytest.importorskip("torch")
    from zeroplan.measure.activation_offload import OffloadActivations

    offload = OffloadActivations()
    small, large = torch.zeros(255), torch.zeros(256)  # 1020 and 1024 bytes of fp32
    weight = torch.nn.Parameter(torch.zeros(512))
    ids = [offload._pack(t) for t in (small, large, weight)]
    kept = {i: offload._tracker[i] for i in ids}
    assert [offloaded for _, offloaded in kept.values()] == [False, True, False]
    assert offload.host_bytes == 1024


def test_forward_stash_keeps_the_packs_of_the_last_five_ids():
    torch = pytest.importorskip("torch")
    from zeroplan.measure.activation_offload import OffloadActivations

    offload = OffloadActivations()
    ids = [offload._pack(torch.zeros(256)) for _ in range(8)]
    assert list(offload._fwd_stash) == ids[-5:]


def test_host_copies_are_not_counted_on_the_device_and_the_head_keeps_its_input():
    torch = pytest.importorskip("torch")
    import contextlib

    from zeroplan.measure.accounting import TensorAccounting
    from zeroplan.measure.activation_offload import offloading_for

    body, head = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    offload = offloading_for(head)
    live = []
    for hooks in (contextlib.nullcontext(), offload):
        with TensorAccounting() as accounting:
            accounting.begin_phase("forward", default_category="activations")
            with hooks:
                out = head(torch.relu(body(x)))
            live.append(accounting.end_phase().live_bytes)
    # packed: what body's mm saves, x (4 KiB) and its weight's transpose (16 KiB, no Parameter), and
    # relu's output (4 KiB); the head saves its input and weight through the no-op hooks
    assert offload.host_bytes == 64 * 64 * 4 + 2 * 16 * 64 * 4
    assert live[1] == live[0]  # the stash still holds the originals; the host copies are not counted
    out.sum().backward()
    assert offload.host_bytes == 0 and x.grad is not None


def test_offloading_trains_the_same_gradients():
    torch = pytest.importorskip("torch")
    from zeroplan.measure.activation_offload import offloading_for

    torch.manual_seed(0)
    body, head = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
    x = torch.randn(64, 32)
    head(torch.tanh(body(x))).square().mean().backward()
    want = [p.grad.clone() for p in body.parameters()]
    body.zero_grad(), head.zero_grad()
    with offloading_for(head):
        out = head(torch.tanh(body(x)))
    out.square().mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(body.parameters(), want))


# -- the estimate ----------------------------------------------------------------------------------


def test_blocks_saved_tensors_move_to_the_host():
    kept, offloaded = (activation_bytes(LLAMA, _training(activation_offload=o), 2) for o in ("none", "cpu"))
    blocks = kept.num_blocks * kept.saved_per_block
    assert offloaded.forward_end == kept.forward_end - blocks
    assert offloaded.host_bytes >= blocks
    # the loss is outside the hooks and the final norm's tensors are in the forward stash
    assert (offloaded.loss_saved, offloaded.final_norm) == (kept.loss_saved, kept.final_norm)


def test_backward_holds_one_block_in_flight_whatever_the_depth():
    deep = LLAMA.model_copy(update={"num_layers": 8})
    shallow, deeper = (activation_bytes(m, _training(activation_offload="cpu"), 2) for m in (LLAMA, deep))
    assert deeper.block_backward_peak(8) == shallow.block_backward_peak(2) == deeper.block_backward_peak(1)


def test_under_full_checkpointing_a_block_keeps_its_input_on_the_host():
    acts = activation_bytes(LLAMA, _training(checkpointing="full", activation_offload="cpu"), 2)
    full = activation_bytes(LLAMA, _training(checkpointing="full"), 2)
    assert acts.saved_per_block == full.saved_per_block  # the block brought back is its input
    assert acts.blocks_saved == full.embedding


def test_host_bytes_are_per_node_and_pinned_on_gpus():
    gpu = estimate(LLAMA, _training(device="cuda", activation_offload="cpu"))
    host = activation_bytes(LLAMA, _training(device="cuda", activation_offload="cpu"), 2).host_bytes
    assert gpu.per_node.cpu_bytes == gpu.per_node.pinned_bytes == host
    cpu = estimate(LLAMA, _training(activation_offload="cpu"))
    assert cpu.per_node.pinned_bytes == 0
    assert any(note.startswith("CPU run: the") and "activations offloaded" in note for note in cpu.notes)


# -- on 2 gloo ranks: the estimate against the measured program -------------------------------------


@pytest.mark.distributed
def test_fsdp2_with_offloaded_activations_within_targets():
    pytest.importorskip("torch")
    comparison, record = measure_row_comparison("tiny-llama/fsdp2-3/bf16/ckpt/4x256/w2/actoffload-cpu")
    assert_peaks_within_targets(comparison)
    assert any(note.startswith("activation offload: at most") for note in record["measurement"]["notes"])
