"""The action list of torch's looped pipeline schedules, per rank, without torch (issue 14).

torch 2.13.0 torch/distributed/pipelining/schedules.py: `ScheduleInterleaved1F1B` and
`ScheduleInterleavedZeroBubble` build each rank's list of actions with `_get_warmup_ops` and
`_get_1f1b_rank_ops`; this module rebuilds the same order (the idle slots left out) so that the
estimate can walk it and see which stage chunks are alive at each moment (docs/engines/mesh.md).
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.caches import memo

FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"


class Action(NamedTuple):
    stage: int  # the global stage index
    kind: str  # F, B (full backward), I (input gradients), W (weight gradients)
    micro_batch: int


def warmup_ops(rank: int, local_stages: int, per_round: int, pp: int, micro_batches: int, factor: int) -> int:
    """schedules.py `_get_warmup_ops`: the last rank's (v - 1) rounds, `factor` more per hop away from it."""
    return min((local_stages - 1) * per_round + factor * (pp - 1 - rank), micro_batches * local_stages)


@memo(maxsize=256)  # a plan asks for the same few orders for every tp, cp, micro-batch and checkpointing
def looped_rank_actions(pp: int, local_stages: int, micro_batches: int, rank: int, zero_bubble: bool) -> tuple[Action, ...]:
    """The actions of one rank in order: `_calculate_single_rank_operations` of ScheduleInterleaved1F1B
    (warmup factor 2, full backwards) or ScheduleInterleavedZeroBubble (factor 1, backward split into
    I and W, the W held back by `rank` backwards: num_1f1b_microbatches = rank)."""
    rounds = max(1, micro_batches // pp)
    per_round = micro_batches // rounds
    warmup = warmup_ops(rank, local_stages, per_round, pp, micro_batches, 1 if zero_bubble else 2)
    total = local_stages * micro_batches
    backward_kind = BACKWARD_INPUT if zero_bubble else FULL_BACKWARD

    def forward_stage(step: int) -> int:
        return (step // per_round) % local_stages * pp + rank

    def backward_stage(step: int) -> int:
        return (local_stages - 1 - ((step - warmup) // per_round) % local_stages) * pp + rank

    counters: dict[tuple[str, int], int] = {}

    def action(stage: int, kind: str) -> Action:
        index = counters.get((kind, stage), 0)
        counters[(kind, stage)] = index + 1
        return Action(stage, kind, index)

    actions: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(total + warmup):  # warmup + 1F1B (total - warmup steps) + cooldown (warmup steps)
        if step < total:
            actions.append(action(forward_stage(step), FORWARD))
        if step >= warmup:
            actions.append(action(backward_stage(step), backward_kind))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                actions.append(action(backward_stage(backward_steps[weights_done]), BACKWARD_WEIGHT))
                weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        actions.append(action(backward_stage(backward_steps[weights_done]), BACKWARD_WEIGHT))
        weights_done += 1
    return tuple(actions)


def inputs_only_backwards(actions: tuple[Action, ...], resharded: frozenset[int]) -> frozenset[tuple[int, int]]:
    """(stage, micro-batch) of the I actions that find their stage's parameters sharded: FSDP2 swaps the
    sharded DTensors back onto the modules after a forward that reshards (reshard_after_forward), and an I
    with reshard_after_backward off leaves the gathered ones there until the stage's next forward.
    `stage_backward_input` (pipelining/_backward.py) takes its weights from `submod.parameters()`: sharded
    ones are not in the graph, so `get_param_groups` finds no group, nothing holds the graph after the
    outputs are detached, and the matching W computes no weight gradient (docs/engines/mesh.md)."""
    last_kind: dict[int, str] = {}
    inputs_only = set()
    for action in actions:
        # stage 0 skips its I and runs a full backward at W (stage.py `backward_one_chunk`: `if not self.is_first`)
        if action.kind == BACKWARD_INPUT and action.stage in resharded - {0} and last_kind.get(action.stage) == FORWARD:
            inputs_only.add((action.stage, action.micro_batch))
        if action.kind != BACKWARD_WEIGHT:  # W runs autograd on the kept graph: no FSDP hook swaps parameters
            last_kind[action.stage] = action.kind
    return frozenset(inputs_only)


class ChunkBytes(NamedTuple):
    """What one micro-batch of one stage keeps, by when it is freed."""

    saved: int  # saved tensors, from its forward to its backward (to its W under zero bubble)
    weight_grad_inputs: int  # output gradients of the ops holding parameters, kept from I to W (zero bubble)
    sent: int  # its output sent forward: kept by the pending send until the step ends
    sent_grad: int  # its input's gradient sent backward: kept likewise
    kept_output: int  # the last stage's output (the logits), kept in `output_chunks` until the step ends
    grads: int  # the stage's parameter gradients, allocated by its first backward (B or W) of the step


class LoopedPeak(NamedTuple):
    total: int  # everything the walk counts at the rank's peak
    grads: int  # of which the stages' gradients
    sends: int  # of which the pending sends (a collective used them: measured as buffers)
    chunks: int = 0  # stage chunks (micro-batches of its stages) whose saved tensors are alive then


def looped_peak(actions: tuple[Action, ...], chunks: dict[int, ChunkBytes], forward_transient: int,
                backward_transient: int, inputs_only: frozenset[tuple[int, int]] = frozenset()) -> LoopedPeak:
    """The highest of what a rank holds (saved tensors, W's inputs, pending sends, kept outputs,
    gradients) at the end of each forward and I and at the start of each backward, walking its actions.
    Sends are waited at the end of the step (schedules.py `_PipelineScheduleRuntime._step_microbatches`:
    `send_ops` popped after the last action); stage_backward_input keeps the graph (retain_graph) and
    the output gradients of the parameter-holding ops until stage_backward_weight (pipelining/_backward.py);
    an I in `inputs_only` (`inputs_only_backwards`) frees its chunk at once and its W does nothing."""
    held = 0  # saved tensors of the chunks alive, W inputs waiting and kept outputs
    sends = 0  # pending sends
    grads = 0  # gradients of the stages whose first backward ran
    stages_with_grads: set[int] = set()
    alive = 0  # stage chunks from their F to the backward that frees them
    peak = LoopedPeak(0, 0, 0)

    # each moment: `peak` becomes the larger (total first) of it and the moment; a moment below the peak's
    # total cannot be larger, so it is not made (a plan walks thousands of times)
    for stage, kind, micro_batch in actions:
        chunk = chunks[stage]
        if kind == FORWARD:
            held += chunk.saved + chunk.kept_output
            sends += chunk.sent
            alive += 1
            total = held + sends + grads + forward_transient
            if total >= peak.total:
                peak = max(peak, LoopedPeak(total, grads, sends, alive))
        elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
            own = chunk.grads if kind == FULL_BACKWARD and stage not in stages_with_grads else 0
            total = held + sends + grads + own + backward_transient
            if total >= peak.total:
                peak = max(peak, LoopedPeak(total, grads + own, sends, alive))
            sends += chunk.sent_grad
            if kind == FULL_BACKWARD:
                held -= chunk.saved
                grads += own
                stages_with_grads.add(stage)
                alive -= 1
            elif (stage, micro_batch) in inputs_only:
                held -= chunk.saved  # the outputs detached, no param group holds the graph
                alive -= 1
            else:
                held += chunk.weight_grad_inputs
                total = held + sends + grads
                if total >= peak.total:
                    peak = max(peak, LoopedPeak(total, grads, sends, alive))
        elif (stage, micro_batch) in inputs_only:
            continue  # no param groups: no weight gradient, nothing to free
        else:  # W: the chunk's saved tensors and output gradients go once its weight gradients exist
            if stage not in stages_with_grads:
                grads += chunk.grads
                stages_with_grads.add(stage)
            held -= chunk.saved + chunk.weight_grad_inputs
            alive -= 1
    return peak
