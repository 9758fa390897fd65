"""The accuracy harness without measuring: the grid's design, the distribution, the reasons file,
the measurement cache and the report (the comparison itself: tests/measure/test_comparison.py).
Hand-computed numbers throughout; no worker process is started."""

import json
import math

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import MeasureError, SpecError
from zeroplan.measure import validate as v
from zeroplan.measure.grid import GRID, Row, row_specs, select_rows
from zeroplan.report.accuracy import write_report

MIB = 2**20


def _rank(rank: int, steady_categories: dict, first_bytes: int, phase: str = "backward") -> dict:
    return {"rank": rank,
            "steady": {"step": 2, "phase": phase, "peak_bytes": sum(steady_categories.values()), "categories": steady_categories},
            "first": {"step": 1, "phase": "optimizer_step", "peak_bytes": first_bytes, "categories": {}}}


def test_distribution_median_p90_and_signed_worst():
    errors = {f"r{i}": (-1) ** i * i / 100 for i in range(1, 11)}  # |e| = 1% .. 10%, r10 = +10%
    d = v.distribution(errors)
    assert d["median"] == pytest.approx(0.055)
    assert d["p90"] == pytest.approx(0.091)  # numpy.percentile([1..10], 90) = 9.1
    assert d["worst"] == pytest.approx(0.10) and d["worst_row"] == "r10"
    assert v.distribution({}) == {"rows": 0}
    assert math.isnan(v.percentile([], 50))


def test_grid_ids_are_unique_and_every_row_is_a_valid_spec():
    ids = [row.id for row in GRID]
    assert len(ids) == len(set(ids))
    for row in GRID:
        _, training = row_specs(row)
        assert training.gpus == row.world and training.device.value == "cpu"
    assert row_specs(GRID[0], "nccl")[1].device.value == "cuda"


def test_grid_covers_the_issue():
    rows = GRID
    families = {"qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "olmo2-tiny", "phi4-tiny",  # issue 13's dense families
                "qwen3moe-tiny", "dsv3-tiny", "gptoss-tiny"}  # and its mixtures of experts
    looped_pipeline = {"tests/data/tiny-llama-4l.toml"}  # 4 layers for pp 2 x 2 virtual stages (issue 14)
    tp_embedding = {"tests/data/tiny-llama-16k.toml"}  # a 16k vocabulary: the TP embedding's whole gradient (issue 14)
    loss_parallel = {"tests/data/tiny-llama-16k-kv4.toml"}  # 4 KV heads: loss parallelism at tp 4 (issue 23)
    nf4 = {"tests/data/tiny-llama-nf4.toml"}  # weights torchao's to_nf4 quantizes and splits in 2 (issue 23)
    assert {r.model for r in rows} == ({"tiny-llama", "tiny-gpt2", "llama-100m", "llama-1b"} | families | looped_pipeline
                                       | tp_embedding | loss_parallel | nf4)
    setups = {(r.engine, r.stage) for r in rows if not r.client_optimizer and r.recipe == "plain"}
    # DeepSpeed stage 0 in the plain loop: issue 23's row (bf16, a recomputed block beside the gradients so far);
    # FSDP1's NO_SHARD, SHARD_GRAD_OP, FULL_SHARD (issue 23)
    assert setups == {("torch", 0), ("torch", 1), ("fsdp2", 2), ("fsdp2", 3), ("deepspeed", 0), ("deepspeed", 1),
                      ("deepspeed", 2), ("deepspeed", 3), ("fsdp1", 0), ("fsdp1", 2), ("fsdp1", 3)}
    assert {r.compile for r in rows} == {(), ("model",), ("model", "loss")}  # torch.compile (issue 23)
    # the optimizer's kernel on every engine that steps a torch optimizer; no DDP and the optimizer in
    # backward on one rank; DeepSpeed with a client optimizer at every stage
    assert {r.engine for r in rows if r.optimizer_impl in ("foreach", "fused")} == {"torch", "fsdp2", "deepspeed"}
    assert {r.world for r in rows if r.ddp is False or r.optimizer_in_backward} == {1}
    assert {r.stage for r in rows if r.client_optimizer} == {0, 1, 2, 3}
    assert {(r.engine, r.stage) for r in rows if r.offload} == {("fsdp2", 2), ("fsdp2", 3), ("deepspeed", 2), ("deepspeed", 3)}
    assert {r.world for r in rows if r.simulate and r.model == "llama-1b"} == {8, 64}
    # selective checkpointing under both kernels, with and without autocast; eager without checkpointing
    assert {(r.attention, r.engine == "torch" and r.precision == "bf16") for r in rows if r.checkpointing == "selective"} == {
        ("fused", True), ("fused", False), ("eager", True), ("eager", False)}
    assert any(r.attention == "eager" and r.checkpointing == "none" for r in rows)
    # every recipe measure runs has rows: the Trainer itself, torchtitan's and torchtune's flows reproduced
    assert {r.recipe for r in rows} == {"plain", "hf-trainer", "torchtitan", "torchtune"}
    # every pair of precision, checkpointing and batch occurs for each main set-up (the L4 array)
    for engine, stage in setups - {("deepspeed", 0)}:  # stage 0's one row is no L4 set-up
        main = [r for r in rows if (r.engine, r.stage) == (engine, stage) and r.model in ("tiny-llama", "tiny-gpt2")
                and not (r.offload or r.small_buckets or r.simulate) and r.checkpointing in ("none", "full")
                and r.attention == "fused" and r.optimizer_impl is None and r.ddp is None and not (r.loss or r.checkpoint_every)
                and r.recipe == "plain"]
        for a, b in (("precision", "checkpointing"), ("precision", "seq_len"), ("checkpointing", "seq_len")):
            assert len({(getattr(r, a), getattr(r, b)) for r in main}) == 4, (engine, stage, a, b)
        assert {r.model for r in main} == {"tiny-llama", "tiny-gpt2"}


def test_select_rows_by_glob_substring_quick_and_offload():
    assert [r.id for r in select_rows(GRID, "tiny-llama/torch-0/*/w2")] == [
        "tiny-llama/torch-0/fp32/nockpt/2x128/w2", "tiny-llama/torch-0/bf16/ckpt/2x128/w2",
        "tiny-llama/torch-0/bf16/selective/2x128/w2", "tiny-llama/torch-0/fp32/op/2x128/w2",
        "tiny-llama/torch-0/bf16/op/2x128/w2", "tiny-llama/torch-0/bf16/ckpt-every2/2x128/w2"]
    assert all("fake64" in r.id for r in select_rows(GRID, "fake64"))
    quick = select_rows(GRID, quick=True)
    assert {(r.engine, r.stage) for r in quick} == {("torch", 0), ("torch", 1), ("fsdp2", 2), ("fsdp2", 3), ("deepspeed", 2), ("deepspeed", 3)}
    assert any(r.simulate and r.world == 8 for r in quick)
    assert not any(r.needs_cpu_adam for r in select_rows(GRID, "deepspeed", skip_deepspeed_offload=True))
    with pytest.raises(SpecError, match="rows: no row of the grid matches 'nope'"):
        select_rows(GRID, "nope")


def test_reasons_exact_then_glob(tmp_path):
    path = tmp_path / "reasons.toml"
    path.write_text('"a/b" = "exact"\n"a/*" = "glob"\n')
    reasons = v.load_reasons(path)
    assert v.reason_for("a/b", reasons) == "exact"
    assert v.reason_for("a/c", reasons) == "glob"
    assert v.reason_for("b/c", reasons) == ""
    assert v.load_reasons(tmp_path / "missing.toml") == {}
    path.write_text('"a" = 3\n')
    with pytest.raises(SpecError, match="a: a reason must be a string"):
        v.load_reasons(path)


def _record(row: Row, peak_mib: float = 10.0) -> dict:
    cats = {"params": int(peak_mib * MIB)}
    return {"fingerprint": v.fingerprint(row, "gloo", v.DEFAULT_STEPS), "seconds": 12.0,
            "measurement": {"ranks": [_rank(0, cats, int(peak_mib * MIB))]}}


def test_run_rows_measures_only_what_the_mode_asks(monkeypatch):
    rows = select_rows(GRID, "tiny-llama/torch-0/*/nockpt/*/w2,tiny-llama/torch-0/*/ckpt/*/w2")
    measured = []
    monkeypatch.setattr(v, "measure_row", lambda row, options: measured.append(row.id) or _record(row))
    stale = _record(rows[1]) | {"fingerprint": "0"}
    cache = {rows[0].id: _record(rows[0]), rows[1].id: stale}
    done = []
    out = v.run_rows(rows, cache, v.RunOptions(measure="missing"), on_done=lambda row, rec, now: done.append((row.id, now)))
    assert measured == [rows[1].id] and done == [(rows[0].id, False), (rows[1].id, True)]
    assert out[rows[1].id]["fingerprint"] != "0" and cache[rows[1].id] is stale  # the input is not changed
    v.run_rows(rows, cache, v.RunOptions(measure="none"))
    assert measured == [rows[1].id]
    v.run_rows(rows, cache, v.RunOptions(measure="all"))
    assert measured == [rows[1].id, rows[0].id, rows[1].id]


def test_report_round_trips_the_cache_and_lists_misses(tmp_path):
    row = GRID[0]
    record = _record(row, peak_mib=1.0)  # a made-up measurement far below the estimate: a miss
    reasons = {row.id: "made up for the test"}
    report = v.build_report(GRID, {row.id: record}, reasons, backend="gloo", steps=v.DEFAULT_STEPS, command="zeroplan validate")
    write_report(report, tmp_path / "a.md", tmp_path / "a.json")
    assert v.load_records(tmp_path / "a.json") == {row.id: record}
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["rows"][0]["status"] == "miss" and data["rows"][1]["status"] == "not measured"
    md = (tmp_path / "a.md").read_text()
    assert "**These are CPU measurements, not GPU ones**" in md
    assert f"| {row.id} | peak +" in md and "| made up for the test |" in md
    # a row whose specs changed since it was measured is flagged stale
    old = record | {"fingerprint": "0"}
    assert v.build_report([row], {row.id: old}, {}, backend="gloo", steps=3, command="c").rows[0].stale


def test_update_report_keeps_rows_written_by_another_run(tmp_path):
    a, b = GRID[0], GRID[1]
    paths = {"json_path": tmp_path / "r.json", "write": lambda report: write_report(report, tmp_path / "r.md", tmp_path / "r.json")}
    v.update_report(GRID, {a.id: _record(a)}, {}, backend="gloo", steps=3, command="c", **paths)
    v.update_report(GRID, {b.id: _record(b)}, {}, backend="gloo", steps=3, command="c", wall_seconds=60.0, **paths)
    assert set(v.load_records(paths["json_path"])) == {a.id, b.id}
    v.update_report(GRID, {}, {}, backend="gloo", steps=3, command="c", **paths)
    assert (tmp_path / "r.md").read_text().startswith("# Accuracy: estimate against measurement")
    assert json.loads(paths["json_path"].read_text())["wall_seconds"] == 60.0


def test_cli_reestimates_cached_rows(tmp_path):
    row = GRID[0]
    write_report(v.build_report(GRID, {row.id: _record(row)}, {}, backend="gloo", steps=3, command="c"),
                   None, tmp_path / "r.json")
    result = CliRunner().invoke(cli, ["validate", "--rows", row.id, "--measure", "none", "--output-json",
                                      str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")])
    assert result.exit_code == 0, result.output
    assert row.id in result.output and "steady_peak: 1 rows" in result.output
    assert (tmp_path / "r.md").exists()


def test_cli_unknown_rows_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(cli, ["validate", "--rows", "nope", "--output-json", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert result.output == "Error: rows: no row of the grid matches 'nope'\n"


def test_summary_takes_steady_and_first_peaks_per_rank_and_the_gpu_counters():
    from zeroplan.measure.result import MeasureResult, PhaseResult, RankResult

    def phase(step, name, peak, device=None):
        return PhaseResult(step, name, peak, peak, {"params": peak}, device)

    gpu = lambda a, r: {"allocated_peak_bytes": a, "reserved_peak_bytes": r}
    rank = RankResult(0, [phase(0, "engine", 5), phase(1, "backward", 9, gpu(10, 12)), phase(1, "optimizer_step", 8, gpu(9, 16)),
                          phase(2, "backward", 11, gpu(12, 16)), phase(3, "backward", 12, gpu(13, 14)), phase(3, "optimizer_step", 7, gpu(8, 20))])
    result = MeasureResult("nccl", "torch", 0, 1, "impl", "m", [rank], steps=3)
    summary = v.summarize_measurement(result)
    (entry,) = summary["ranks"]
    assert (entry["steady"]["step"], entry["steady"]["phase"], entry["steady"]["peak_bytes"]) == (3, "backward", 12)
    assert (entry["first"]["step"], entry["first"]["phase"], entry["first"]["peak_bytes"]) == (1, "backward", 9)
    assert entry["device"]["steady"] == gpu(13, 20) and entry["device"]["first"] == gpu(10, 16)
    one_step = MeasureResult("gloo", "torch", 0, 1, "impl", "m", [RankResult(0, [phase(1, "backward", 9)])], steps=1)
    with pytest.raises(MeasureError, match="rank 0 has no steady-state step"):
        v.summarize_measurement(one_step)


def test_cli_fails_when_rows_could_not_be_measured_and_leaves_no_lock(tmp_path, monkeypatch):
    """Issue 10: every row failing exited 0 and left `.r.json.lock` beside the report."""
    rows = select_rows(GRID, "tiny-llama/torch-0/*/nockpt/*")
    monkeypatch.setattr(v, "measure_row", lambda row, options: {"fingerprint": v.fingerprint(row, "gloo", options.steps),
                                                                "failure": "rank 0 failed: made up for the test"})
    result = CliRunner().invoke(cli, ["validate", "--rows", "tiny-llama/torch-0/*/nockpt/*", "--output-json",
                                      str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")])
    assert result.exit_code == 1, result.output
    assert f"{len(rows)} of {len(rows)} rows could not be measured" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # the lock file is gone


def test_cli_checks_its_outputs_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(v, "measure_row", lambda row, options: pytest.fail("measured before the outputs were checked"))
    result = CliRunner().invoke(cli, ["validate", "--rows", GRID[0].id, "--output-json", str(tmp_path / "no" / "r.json"),
                                      "--output-md", str(tmp_path / "r.md")])
    assert result.exit_code == 2
    assert result.output.startswith("Error: --output-json: directory") and "does not exist" in result.output
    assert list(tmp_path.iterdir()) == []


def test_outside_a_checkout_the_reports_must_be_named(tmp_path, monkeypatch):
    """Run from an installed copy, the default was ./docs/ of whatever directory the user stood in."""
    monkeypatch.setattr(v, "checkout_docs", lambda: None)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["validate", "--measure", "none"])
    assert result.exit_code == 2
    assert "give --output-md and --output-json" in result.output
    assert list(tmp_path.iterdir()) == []


def test_cached_rows_say_when_they_were_measured_not_how_long_they_took(tmp_path, monkeypatch):
    """Issue 21: a cached row was shown as "measured ... [12 s]" as if measured in this run."""
    rows = select_rows(GRID, "tiny-llama/torch-0/*/nockpt/*")
    cached = _record(rows[0]) | {"measured_at": "2026-11-20T10:00:00Z"}
    write_report(v.build_report(GRID, {rows[0].id: cached}, {}, backend="gloo", steps=3, command="c"), None,
                 tmp_path / "r.json")
    monkeypatch.setattr(v, "measure_row", lambda row, options: _record(row) | {"seconds": 7.0})
    result = CliRunner().invoke(cli, ["validate", "--rows", "tiny-llama/torch-0/*/nockpt/*", "--measure", "missing",
                                      "--output-json", str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")])
    assert result.exit_code == 0, result.output
    lines = {row.id: next(line for line in result.stderr.splitlines() if f" {row.id}: " in line) for row in rows}
    assert lines[rows[0].id].endswith(" [cached: measured on 2026-11-20]")
    assert all(lines[row.id].endswith(" [7 s]") for row in rows[1:])
    result = CliRunner().invoke(cli, ["validate", "--rows", rows[0].id, "--measure", "none",
                                      "--output-json", str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")])
    assert result.stderr.splitlines()[0].endswith(" [cached: measured on 2026-11-20]")


@pytest.mark.parametrize(("unit", "divisor"), [("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("GiB", 2**30)])
def test_validate_takes_units_as_every_command_does(tmp_path, unit, divisor):
    row = GRID[0]
    write_report(v.build_report(GRID, {row.id: _record(row)}, {}, backend="gloo", steps=3, command="c"), None,
                 tmp_path / "r.json")
    result = CliRunner().invoke(cli, ["validate", "--rows", row.id, "--measure", "none", "--units", unit,
                                      "--output-json", str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")])
    assert result.exit_code == 0, result.output
    measured = f"{10 * MIB / divisor:,.2f}"
    assert f" measured {measured} {unit}, " in result.stderr  # the progress line
    header, _, first = result.stdout.splitlines()[:3]
    assert f"est. peak {unit}" in header and f"meas. peak {unit}" in header
    assert measured in first.split()
    assert "est. peak MiB" in (tmp_path / "r.md").read_text()  # the markdown report keeps MiB


def test_rows_that_read_test_files_run_from_any_directory_in_a_checkout(tmp_path, monkeypatch):
    """Issue 21: the spec files of tests/data were read relative to the working directory."""
    from zeroplan.measure.grid import row_files

    monkeypatch.chdir(tmp_path)
    rows = [row for row in GRID if row_files(row)]
    assert rows
    for row in rows:
        model, _ = row_specs(row)
        assert model.name in {"tiny-llama-4l", "tiny-llama-16k", "tiny-llama-16k-kv4", "tiny-llama-nf4"}
    v.check_files(GRID, rows, {})


def test_a_copy_without_the_test_files_says_so_before_measuring(tmp_path, monkeypatch):
    """Issue 21: `validate --quick` in an installed copy measured its rows, then failed on
    tests/data/tiny-llama-4l.toml while writing the report (a cached row reads it)."""
    from zeroplan.measure import grid

    monkeypatch.setattr(grid, "CHECKOUT", tmp_path / "site-packages")  # an installed copy: no tests/ beside it
    monkeypatch.setattr(v, "measure_row", lambda row, options: pytest.fail("measured before the files were checked"))
    reading = next(row for row in GRID if grid.row_files(row))
    missing = tmp_path / "site-packages" / reading.model
    write_report(v.build_report([GRID[0]], {GRID[0].id: _record(GRID[0])}, {}, backend="gloo", steps=3, command="c"),
                 None, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    data["rows"].append({"id": reading.id, "record": _record(GRID[0])})  # a cached measurement of such a row
    (tmp_path / "r.json").write_text(json.dumps(data))
    args = ["--output-json", str(tmp_path / "r.json"), "--output-md", str(tmp_path / "r.md")]

    result = CliRunner().invoke(cli, ["validate", "--quick", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"Error: {missing} is missing: row {reading.id} reads it; it is a spec file of zeroplan's "
                             "tests, which only a checkout has: run validate in a zeroplan checkout, or write the report "
                             "to another --output-json (its cache has measurements of such rows)\n")
    result = CliRunner().invoke(cli, ["validate", "--rows", reading.id, *args])
    assert result.exit_code == 2
    assert result.stderr.endswith("or select rows that do not read it with --rows\n")
    assert not (tmp_path / "r.md").exists()


def test_the_lock_is_exclusive_and_removed(tmp_path):
    lock = tmp_path / ".r.json.lock"
    with v._locked(lock):
        assert lock.exists()
    assert not lock.exists()


def test_the_gpu_grids_refuse_to_run_without_cuda(tmp_path):
    # this machine has no CUDA GPU (a CPU build of torch): one line, exit 2, nothing written
    outputs = ["--output-md", str(tmp_path / "r.md"), "--output-json", str(tmp_path / "r.json")]
    for grid, needed in (("gpu-1", 1), ("gpu-8", 8)):
        result = CliRunner().invoke(cli, ["validate", "--backend", "nccl", "--grid", grid, *outputs])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            f"Error: --backend nccl: the selected rows need {needed} GPU(s) on one node and no CUDA GPU is visible "
            "here (a CPU build of torch sees none): run it on a GPU machine, or use --backend gloo"]
    assert not list(tmp_path.iterdir())
    result = CliRunner().invoke(cli, ["validate", "--grid", "gpu-1", *outputs])
    assert result.exit_code == 2 and "--grid gpu-1 runs on GPUs: add --backend nccl" in result.output


def test_the_gpu_grid_rows_are_valid_and_fit_their_gpus():
    # every row builds its specs for nccl (device cuda) and is estimated below 40 GB per GPU
    from zeroplan.estimate import estimate
    from zeroplan.measure.grid import row_specs
    from zeroplan.measure.grid_gpu import GRIDS

    for name, rows in GRIDS.items():
        assert {row.world for row in rows} == {int(name.split("-")[1])}
        for row in rows:
            model, training = row_specs(row, "nccl")
            assert training.device.value == "cuda"
            assert estimate(model, training).peak_bytes < 40 * 10**9


def test_the_committed_rows_set_the_estimate_s_stream_beside_the_real_one():
    # issue 22: every measured row's estimate is replayed through the allocator model; a row whose measurement kept
    # the real stream (measure/allocator_replay.py) is set beside it with the same PYTORCH_CUDA_ALLOC_CONF
    committed = json.loads((v.checkout_docs() / "accuracy.json").read_text())
    records = {row["id"]: row["record"] for row in committed["rows"] if "record" in row}

    def streams(row):
        return [rank.get("allocator_replay") or {} for rank in records.get(row.id, {}).get("measurement", {}).get("ranks", ())]

    kept = [row for row in GRID if any(stream.get("replayed") for stream in streams(row))]
    # a compiled run keeps no stream, and its record says why
    compiled = [row for row in GRID if streams(row) and not any(stream.get("replayed") for stream in streams(row))]
    assert kept and compiled
    report = v.build_report([kept[0], compiled[0]], records, {}, backend="gloo", steps=3, command="c")
    with_stream, without = report.rows
    real = max(rank["allocator_replay"]["reserved_peak_bytes"] for rank in records[kept[0].id]["measurement"]["ranks"])
    assert with_stream.replay.replayed_reserved_bytes == real
    assert with_stream.replay.estimated_reserved_bytes % (2 << 20) == 0  # whole segments (2 MiB and up)
    assert with_stream.replay.error == with_stream.replay.estimated_reserved_bytes / real - 1
    assert with_stream.replay.no_stream_because is None
    assert without.replay.replayed_reserved_bytes is None and without.replay.error is None
    assert without.replay.no_stream_because == streams(compiled[0])[0]["reason"]
    assert report.distributions()["reserved_replay"]["rows"] == 1
    difference = abs(with_stream.replay.estimated_reserved_bytes - real)
    assert report.replay_differences == {"median_bytes": difference, "p90_bytes": difference,
                                         "within_one_segment": int(difference <= 20 << 20), "rows": 1,
                                         "large_segment_bytes": 20 << 20}
    # a record from before measure kept streams has no allocator_replay at all
    old = json.loads(json.dumps(records[kept[0].id]))
    for rank in old["measurement"]["ranks"]:
        del rank["allocator_replay"]
    before = v.build_report([kept[0]], {kept[0].id: old}, {}, backend="gloo", steps=3, command="c")
    assert before.rows[0].replay.no_stream_because == "measured before measure kept the stream"
    assert before.replay_differences is None
