"""The measure result and its JSON: the fields the CLI and users read (issue 3, item 4)."""

import json

from zeroplan.measure.result import MeasureResult, PhaseResult, RankResult


def _cats(total: int, params: int = 100) -> dict[str, int]:
    return {"params": params, "grads": 0, "optimizer_states": 0, "activations": total - params, "buffers": 0, "temporaries": 0}


def _rank(rank: int) -> RankResult:
    phases = [
        PhaseResult(0, "model", 100, 100, _cats(100)),
        PhaseResult(0, "engine", 150, 180, _cats(180)),
        PhaseResult(1, "forward", 300, 400, _cats(400)),
        PhaseResult(1, "backward", 200, 500, _cats(500)),
        PhaseResult(1, "optimizer_step", 200, 300, _cats(300)),
        PhaseResult(2, "forward", 300, 450, _cats(450)),
        PhaseResult(2, "backward", 200, 520, _cats(520)),
        PhaseResult(2, "optimizer_step", 200, 300, _cats(300)),
        PhaseResult(3, "backward", 200, 510, _cats(510)),
    ]
    return RankResult(rank, phases, [0.5, 0.25, 0.25])


def test_json_holds_what_issue_3_asks_for_and_reads_back():
    result = MeasureResult("gloo", "fsdp2", 3, 2, "zeroplan-reference:llama/sdpa", "tiny-llama", [_rank(0), _rank(1)], steps=3)
    data = json.loads(json.dumps(result.to_json_dict()))
    for key in ("backend", "engine", "world_size", "implementation", "ranks", "peak", "fits"):
        assert key in data
    rank = data["ranks"][0]
    assert (rank["rank"], rank["peak"], rank["peak_phase"], rank["peak_step"], rank["peak_stage"]) == (0, 520, "backward", 2, "steady")
    assert set(rank["categories"]) == {"params", "grads", "optimizer_states", "activations", "buffers", "temporaries"}
    assert sum(rank["categories"].values()) == rank["peak"]
    assert RankResult.from_json_dict(rank) == result.ranks[0]


def test_summary_is_in_the_estimates_phases_with_the_steady_state_the_highest_of_later_steps():
    rows = {(r["step"], r["phase"]): r["peak_bytes"] for r in _rank(0).summary()}
    assert rows == {
        ("first", "init"): 180,
        ("first", "forward"): 400,
        ("first", "backward"): 500,
        ("first", "optimizer_step"): 300,
        ("steady", "forward"): 450,
        ("steady", "backward"): 520,
        ("steady", "optimizer_step"): 300,
    }


def test_a_rank_out_of_memory_makes_the_result_not_fit():
    oom = _rank(1)
    oom.fits, oom.oom_message = False, "OutOfMemoryError: CUDA out of memory"
    result = MeasureResult("nccl", "torch", 0, 2, "x", "m", [_rank(0), oom], steps=2, device="cuda")
    assert not result.fits and result.to_json_dict()["fits"] is False
    assert result.peak_bytes == 520
