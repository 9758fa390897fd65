"""estimate/parallel/pipeline_schedule.py against torch's own looped schedules (torch 2.13.0
torch/distributed/pipelining/schedules.py): the action order each rank runs, and what the walk keeps."""

from __future__ import annotations

import pytest

from zeroplan.estimate.parallel.pipeline_schedule import ChunkBytes, looped_peak, looped_rank_actions


def _torch_actions(schedule: str, pp: int, virtual: int, micro_batches: int, rank: int) -> list[str]:
    """`_calculate_single_rank_operations` of a schedule object built without a process group (its
    constructor reads the group size from the stages; the order needs only these four fields)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
           "zero-bubble": schedules.ScheduleInterleavedZeroBubble}[schedule]
    built = object.__new__(cls)
    built.pp_group_size, built.n_local_stages, built._n_microbatches = pp, virtual, micro_batches
    built.number_of_rounds = max(1, micro_batches // pp)
    built.microbatches_per_round = micro_batches // built.number_of_rounds
    return [str(action) for action in built._calculate_single_rank_operations(rank) if action is not None]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize("pp,virtual,micro_batches", [(2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16),
                                                      (2, 4, 2), (4, 2, 3)])
def test_each_rank_runs_the_actions_torch_lists(schedule, pp, virtual, micro_batches):
    for rank in range(pp):
        ours = looped_rank_actions(pp, virtual, micro_batches, rank, zero_bubble=schedule == "zero-bubble")
        assert [f"{a.stage}{a.kind}{a.micro_batch}" for a in ours] == _torch_actions(schedule, pp, virtual, micro_batches, rank)


def _stage_chunks(stages: tuple[int, ...], counted: int) -> dict[int, ChunkBytes]:
    """One byte saved per micro-batch of stage `counted`, nothing else: the walk then counts its chunks alive."""
    return {s: ChunkBytes(saved=int(s == counted), weight_grad_inputs=0, sent=0, sent_grad=0, kept_output=0, grads=0)
            for s in stages}


def test_interleaved_1f1b_keeps_three_chunks_of_the_second_ranks_first_stage():
    # pp 2 x 2, 4 micro-batches, rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 ...: 1F2 runs before 1B0
    actions = looped_rank_actions(2, 2, 4, 1, zero_bubble=False)
    assert looped_peak(actions, _stage_chunks((1, 3), 1), 0, 0).total == 3


def test_zero_bubble_keeps_a_chunk_until_its_weight_gradient():
    # rank 1 holds its W back one backward (num_1f1b_microbatches = rank): 1F3 runs while 1:0 waits for 1W0
    actions = looped_rank_actions(2, 2, 4, 1, zero_bubble=True)
    assert looped_peak(actions, _stage_chunks((1, 3), 1), 0, 0).total == 4


def test_pending_sends_and_kept_logits_last_until_the_step_ends():
    # every forward of rank 1's stage 1 sends its output, every backward of stage 3 sends its input's gradient,
    # every forward of stage 3 keeps its logits (output_chunks): at the last backward all 12 are still held
    chunks = {1: ChunkBytes(0, 0, sent=1, sent_grad=0, kept_output=0, grads=0),
              3: ChunkBytes(0, 0, sent=0, sent_grad=1, kept_output=1, grads=0)}
    actions = looped_rank_actions(2, 2, 4, 1, zero_bubble=False)
    assert looped_peak(actions, chunks, 0, 0)[:3] == (4 + 4 + 4, 0, 4 + 4)  # total, grads, sends
