"""`--snapshot FILE`: the predicted (or measured) step as `torch.cuda.memory._snapshot()` pickles it.

Read back by torch's own reader (`python -m torch.cuda._memory_viz stats|trace|segments`, run as a
subprocess: the CPU build has the module), and checked against the estimate's JSON: the trace's allocations
and frees, summed, give the tensor peak and (replayed) the allocated peak; its segment events give the
reserved peak; blocks never overlap and lie inside their segments.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli as main
from zeroplan.estimate.device.alloc_conf import parse_alloc_conf
from zeroplan.estimate.device.allocator import replay
from zeroplan.estimate.device.events import Alloc, Free

pytest.importorskip("torch")  # torch's reader of the format; writing it needs no torch

# MemoryViz.js `unpickle` (pytorch.org/memory_viz): the opcodes its reader handles; anything else throws there
VIEWER_OPCODES = {"PROTO", "FRAME", "MEMOIZE", "SHORT_BINUNICODE", "BINUNICODE", "BININT", "BININT1", "BININT2",
                  "LONG1", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "MARK", "APPEND", "APPENDS", "SETITEM",
                  "SETITEMS", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "NEWTRUE", "NEWFALSE", "NONE",
                  "BINFLOAT", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "STOP"}


def estimate(tmp_path: Path, *args: str) -> tuple[dict, dict, Path]:
    path = tmp_path / "step.pickle"
    result = CliRunner().invoke(main, ["estimate", *args, "--format", "json", "--snapshot", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output), pickle.loads(path.read_bytes()), path


def memory_viz(tmp_path: Path, *args: str) -> str:
    """`python -m torch.cuda._memory_viz ARGS`; `segments` draws with flamegraph.pl, which it would download:
    a local one that passes the folded stacks through stands in (the stacks are what the reader made)."""
    home = tmp_path / "home"
    script = home / ".cache" / "flamegraph.pl"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\ncat\n")
    script.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HOME": str(home)}, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def replay_trace(trace: list[dict]) -> dict:
    """What the trace alone says: requested bytes live (alloc up, free_requested down, as torch's allocated
    statistic), reserved bytes (segment events), and blocks inside live segments that never overlap. Mapped pages
    of an expandable segment join the range they touch, as the viewer joins them (MemoryViz.js `map_segment`)."""
    live, memory = {}, {}  # block address -> size; start -> end of each range of reserved memory
    requested = peak_requested = reserved = peak_reserved = 0
    stream, keys = [], {}
    for number, entry in enumerate(trace):
        action, addr, size = entry["action"], entry.get("addr"), entry["size"]
        if action == "alloc":
            assert addr not in live
            assert any(start <= addr and addr + size <= end for start, end in memory.items()), f"alloc {addr} outside"
            assert all(addr + size <= other or other + length <= addr for other, length in live.items())
            live[addr] = size
            requested += size
            keys[addr] = number
            stream.append(Alloc(number, size))
        elif action == "free_requested":
            requested -= live[addr]
            stream.append(Free(keys.pop(addr)))
        elif action == "free_completed":
            del live[addr]
        elif action in ("segment_alloc", "segment_map"):
            start, end = addr, addr + size
            before = next((s for s, e in memory.items() if e == start), None)
            if before is not None:
                start = before
            end = memory.pop(end, end)
            memory[start] = end
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            assert not any(addr <= block < addr + size for block in live), "memory freed under a live block"
            start = next(s for s, e in memory.items() if s <= addr and addr + size <= e)
            end = memory.pop(start)
            if start < addr:
                memory[start] = addr
            if addr + size < end:
                memory[addr + size] = end
            reserved -= size
        peak_requested, peak_reserved = max(peak_requested, requested), max(peak_reserved, reserved)
    return {"requested": peak_requested, "reserved": peak_reserved, "reserved_end": reserved, "stream": stream}


def check_against(data: dict, snapshot: dict) -> None:
    """Every device (rank kind i) of the snapshot against ranks[i] of the estimate's JSON."""
    assert len(snapshot["device_traces"]) == len(data["ranks"])
    workspaces = data["device_memory"]["cublas_workspaces"]
    for index, rank in enumerate(data["ranks"]):
        per_gpu = rank["per_gpu"]
        found = replay_trace(snapshot["device_traces"][index])
        # the tensors at the peak plus cuBLAS's workspaces, unrounded (the overhead lives outside the allocator)
        assert found["requested"] == per_gpu["peak"] - per_gpu["overhead"] + workspaces
        assert found["reserved"] == per_gpu["reserved"]
        # the same stream through the allocator model, under the settings the snapshot names: the JSON's allocated peak
        settings = parse_alloc_conf(snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"])
        assert replay(found["stream"], settings).peak_allocated_bytes == per_gpu["allocated"]
        segments = [s for s in snapshot["segments"] if s["device"] == index]
        assert sum(s["total_size"] for s in segments) == found["reserved_end"]
        for segment in segments:  # the blocks tile their segment, in address order
            address = segment["address"]
            for block in segment["blocks"]:
                assert block["address"] == address and block["requested_size"] <= block["size"]
                address += block["size"]
            assert address == segment["address"] + segment["total_size"]


def test_memory_viz_reads_an_estimate_snapshot(tmp_path):
    data, snapshot, path = estimate(tmp_path, "llama-2-7b", "--gpus", "8", "--zero", "3")
    check_against(data, snapshot)
    assert {op.name for op, _, _ in pickletools.genops(path.read_bytes())} <= VIEWER_OPCODES
    stats = memory_viz(tmp_path, "stats", str(path))
    assert f"segments: {len(snapshot['segments'])}" in stats
    trace = memory_viz(tmp_path, "trace", str(path))
    assert trace.startswith(f"Device 0 ----------------\n{len(snapshot['device_traces'][0])} entries")
    assert "cudaMalloc(" in trace and "del " in trace
    memory_viz(tmp_path, "segments", str(path), "-o", "segments.svg")
    folded = (tmp_path / "segments.svg").read_text()
    # the blocks live at the end are named by their terms, with category and moment (the steady optimizer step)
    last = data["phases"][-1]
    assert last["optimizer_states"] > 0
    assert ";active_allocated;rank kind:0:" in folded and "category:0:optimizer_states" in folded
    assert f"allocated for:0:{last['step']} " in folded
    assert any(f":0:{term['name']} " in folded for term in data["terms"] if term["category"] == "optimizer_states")


def test_each_rank_kind_is_a_device_with_expandable_segments(tmp_path):
    """A pipeline of torchtitan (expandable segments, its recipe's PYTORCH_CUDA_ALLOC_CONF): one device per rank
    kind, segments mapped page by page."""
    data, snapshot, path = estimate(tmp_path, "llama-3-8b", "--gpus", "32", "--pp", "4", "--grad-accum", "8", "--zero",
                                    "3", "--engine", "fsdp2", "--recipe", "torchtitan")
    assert len(data["ranks"]) > 1
    check_against(data, snapshot)
    assert snapshot["allocator_settings"]["expandable_segments"] is True
    assert all(segment["is_expandable"] for segment in snapshot["segments"])
    assert any(entry["action"] == "segment_map" for entry in snapshot["device_traces"][0])
    trace = memory_viz(tmp_path, "trace", str(path))
    assert all(f"Device {i} ----" in trace for i in range(len(data["ranks"])))
    memory_viz(tmp_path, "stats", str(path))


def test_through_the_api(tmp_path):
    import zeroplan

    result = zeroplan.estimate("llama-2-7b", gpus=8, zero=3, snapshot=tmp_path / "a.pickle")
    result.snapshot(tmp_path / "b.pickle")
    assert (tmp_path / "a.pickle").read_bytes() == (tmp_path / "b.pickle").read_bytes()
    check_against(result.to_dict(), pickle.loads((tmp_path / "a.pickle").read_bytes()))


@pytest.mark.parametrize("where", ["missing directory", "a file as the directory", "a directory as the file",
                                   "read-only directory"])
def test_a_place_it_cannot_be_written_is_refused_before_any_work(tmp_path, where):
    (tmp_path / "file").write_text("")
    (tmp_path / "locked").mkdir(mode=0o500)
    if where == "read-only directory" and os.geteuid() == 0:
        pytest.skip("running as root: a read-only directory is still writable")
    target = {"missing directory": tmp_path / "no" / "s.pickle", "a file as the directory": tmp_path / "file" / "s.pickle",
              "a directory as the file": tmp_path, "read-only directory": tmp_path / "locked" / "s.pickle"}[where]
    result = CliRunner().invoke(main, ["estimate", "llama-2-7b", "--gpus", "8", "--snapshot", str(target)])
    assert result.exit_code == 2 and result.stdout == ""
    assert "--snapshot" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("Error: ") and "Traceback" not in result.stderr


def test_a_cpu_run_has_no_allocator_to_draw(tmp_path):
    result = CliRunner().invoke(main, ["estimate", "gpt2", "--device", "cpu", "--snapshot", str(tmp_path / "s.pickle")])
    assert result.exit_code == 2 and "--snapshot: a cpu run has no CUDA caching allocator" in result.stderr
    assert not (tmp_path / "s.pickle").exists()


def test_a_measured_run_reads_too(tmp_path):
    """Two gloo ranks of a tiny model: each rank's stream, replayed through the model, is a device of the
    snapshot that torch's reader reads, with the peaks the run's `allocator_replay` reports."""
    path = tmp_path / "measured.pickle"
    result = CliRunner().invoke(main, ["measure", "tiny-llama", "--engine", "torch", "--zero", "1", "--nproc", "2",
                                       "--precision", "fp32", "--seq-len", "64", "--format", "json",
                                       "--snapshot", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    snapshot = pickle.loads(path.read_bytes())
    assert len(snapshot["device_traces"]) == 2
    for rank in data["ranks"]:
        found = replay_trace(snapshot["device_traces"][rank["rank"]])
        replayed = rank["allocator_replay"]
        assert found["requested"] == replayed["stream_peak_bytes"]
        assert found["reserved"] == replayed["reserved_peak_bytes"]
        assert replay(found["stream"]).peak_allocated_bytes == replayed["allocated_peak_bytes"]
    trace = memory_viz(tmp_path, "trace", str(path))
    assert "Device 0 ----" in trace and "Device 1 ----" in trace
    assert "allocated in" in json.dumps(snapshot["device_traces"][0][:50])
    memory_viz(tmp_path, "stats", str(path))


def test_a_block_another_stream_uses_waits_and_an_oom_is_an_entry():
    """record_stream: a freed block stays `active_pending_free` until that stream's work is done (torch's
    free_requested, then free_completed at the next allocation after the event completed); an allocation the
    device cannot hold is an `oom` entry with what was free."""
    from zeroplan.estimate.device.events import RecordStream, StreamSync
    from zeroplan.estimate.device.snapshot import DeviceHistory, snapshot_of
    from zeroplan.estimate.device.alloc_conf import DEFAULT_SETTINGS

    mib = 1 << 20
    waiting = replay([Alloc("a", 3 * mib), RecordStream("a", 1), Free("a")], record_history=True)
    assert [e.action for e in waiting.history] == ["segment_alloc", "alloc", "free_requested"]
    (segment,) = waiting.segments_at_end
    assert [b.state for b in segment.blocks] == ["active_pending_free", "inactive"]
    done = replay([Alloc("a", 3 * mib), RecordStream("a", 1), Free("a"), StreamSync(1), Alloc("b", 3 * mib)],
                  record_history=True)
    assert [e.action for e in done.history][-2:] == ["free_completed", "alloc"]
    assert done.history[-1].address == done.history[1].address  # b reuses a's block
    short = replay([Alloc("a", 30 * mib), Alloc("b", 30 * mib)], capacity_bytes=40 * mib, record_history=True)
    oom = short.history[-1]
    assert (oom.action, oom.address, oom.size_bytes) == ("oom", 10 * mib, 30 * mib)
    drawn = snapshot_of({0: DeviceHistory(short, lambda key: [])}, DEFAULT_SETTINGS)
    assert drawn["device_traces"][0][-1] == {"action": "oom", "device_free": 10 * mib, "size": 30 * mib, "stream": 0,
                                             "frames": []}


@pytest.mark.parametrize("case", ["the Trainer", "a compiled run", "across nodes", "a missing folder"])
def test_measure_refuses_a_snapshot_it_cannot_write_before_the_run(tmp_path, case):
    extra, message = {
        "the Trainer": (["--recipe", "hf-trainer"], "--snapshot: the Trainer's allocation stream is not kept"),
        "a compiled run": (["--engine", "fsdp2", "--zero", "3", "--compile", "model"], "--snapshot: a compiled run is counted from the allocator's records"),
        "across nodes": (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:9"], "--snapshot: each node keeps its ranks'"),
        "a missing folder": ([], "--snapshot: directory"),
    }[case]
    target = tmp_path / ("no" if case == "a missing folder" else ".") / "s.pickle"
    result = CliRunner().invoke(main, ["measure", "tiny-llama", "--nproc", "1", *extra, "--snapshot", str(target)])
    assert result.exit_code == 2 and result.stderr.startswith(f"Error: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1 and not target.exists()
