"""`zeroplan measure` across nodes (issue 25, item 6): two "nodes" on this machine, each a
`zeroplan measure ... --nnodes 2 --node-rank K --nproc 1 --rdzv-endpoint 127.0.0.1:PORT` process,
meet at node 0's c10d store; node 0's --output holds both ranks. Bad endpoints, mismatched worlds,
a node that never comes and a failing rank each end in one line and exit status 2, in bounded time.

The node processes run in sessions of their own (zeroplan/measure/processes.py `spawn`) with a
marker in their environment, which every process they start inherits: after each test no process
with the marker is left.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.measure.processes import child_env, exit_status, kill_sessions, spawn
from tests.paths import REPO

RUN = ["measure", "tiny-llama", "--engine", "torch", "--zero", "0", "--precision", "fp32", "--micro-batch", "1",
       "--seq-len", "32", "--steps", "2", "--implementation", "reference", "--timeout", "120", "--nproc", "1"]
BOUND_S = 240
needs_torch = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="measure needs torch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(mark: str) -> list[int]:
    """Processes whose environment holds `mark` (not zombies)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/environ").read_bytes() and \
                    Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                found.append(int(pid))
        except OSError:
            continue
    return found


def run_nodes(tmp_path: Path, per_node: list[list[str]], env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """Start one `zeroplan measure` per entry of `per_node` (its own arguments after RUN); return each
    one's exit status, stdout and stderr."""
    mark = f"ZEROPLAN_NODES_TEST={uuid.uuid4().hex}"
    procs = []
    try:
        for index, args in enumerate(per_node):
            with open(tmp_path / f"node{index}.out", "wb") as out, open(tmp_path / f"node{index}.err", "wb") as err:
                node_env = child_env(None) | (env or {}) | dict([mark.split("=")])
                procs.append(spawn([sys.executable, "-m", "zeroplan", *RUN, *args], env=node_env, stdout=out, stderr=err,
                                   cwd=REPO))
        deadline = time.monotonic() + BOUND_S
        while any(exit_status(p) is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        statuses = [exit_status(p) for p in procs]
    finally:
        kill_sessions(procs)
    deadline = time.monotonic() + 10  # workers die with their server, which dies with its node
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(mark) == []
    return [(status, (tmp_path / f"node{i}.out").read_text(), (tmp_path / f"node{i}.err").read_text())
            for i, status in enumerate(statuses)]


def _nodes(port: int, *extra: str) -> list[str]:
    return ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "60", *extra]


@needs_torch
@pytest.mark.distributed
def test_two_nodes_meet_and_node_0_writes_both_ranks(tmp_path):
    port = _free_port()
    output = tmp_path / "m.json"
    (status0, out0, err0), (status1, out1, err1) = run_nodes(tmp_path, [
        _nodes(port, "--node-rank", "0", "--output", str(output), "--format", "json"),
        _nodes(port, "--node-rank", "1", "--output", str(tmp_path / "not-written.json")),
    ])
    assert (status0, status1) == (0, 0), err0 + err1
    data = json.loads(output.read_text())
    assert json.loads(out0) == data
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["world_size"] == 2
    assert data["nodes"] == {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{port}"}
    assert data["estimate"]["config"]["gpus"] == 2 and data["estimate"]["config"]["gpus_per_node"] == 1
    assert abs(data["error"]["steady"]["peak"]) <= 0.03
    assert err0 == "" and out1 == ""
    assert err1 == "node 1 of 2: ranks 1-1 measured; node 0 prints and writes the result\n"
    assert not (tmp_path / "not-written.json").exists()


@needs_torch
@pytest.mark.distributed
def test_a_failing_rank_on_one_node_is_the_line_both_print(tmp_path):
    port = _free_port()
    results = run_nodes(tmp_path, [_nodes(port, "--node-rank", "0"), _nodes(port, "--node-rank", "1")],
                        env={"ZEROPLAN_MEASURE_FAULT": "raise@1"})
    line = "Error: node 1: rank 1 failed: RuntimeError: injected fault on rank 1\n"
    assert [(status, err) for status, _, err in results] == [(2, line), (2, line)]


@needs_torch
@pytest.mark.distributed
@pytest.mark.parametrize(("node1", "line"), [
    (["--nnodes", "3"], "Error: --nnodes/--nproc: node 1 ({host}) has --nnodes 3 --nproc 1, node 0 --nnodes 2 --nproc 1; "
                        "give every node the same\n"),
    (["--seq-len", "64"], "Error: node 1 ({host}) would run another configuration than node 0: give every node the same "
                          "model and options\n"),
])
def test_nodes_that_disagree_stop_with_one_line(tmp_path, node1, line):
    port = _free_port()
    results = run_nodes(tmp_path, [_nodes(port, "--node-rank", "0"), _nodes(port, "--node-rank", "1", *node1)])
    expected = line.format(host=socket.gethostname())
    assert [(status, err) for status, _, err in results] == [(2, expected), (2, expected)]


@needs_torch
@pytest.mark.parametrize(("rank", "line"), [
    ("0", "Error: node 1 of 2 did not join --rdzv-endpoint 127.0.0.1:{port} within 1 s (--rdzv-timeout)\n"),
    ("1", "Error: no node 0 at --rdzv-endpoint 127.0.0.1:{port} within 1 s (--rdzv-timeout): start `zeroplan measure "
          "... --node-rank 0` on that machine\n"),
])
def test_a_node_that_never_comes_is_a_bounded_wait(tmp_path, rank, line):
    port = _free_port()
    started = time.monotonic()
    args = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "1", "--node-rank", rank]
    [(status, out, err)] = run_nodes(tmp_path, [args])
    assert (status, out, err) == (2, "", line.format(port=port))
    assert time.monotonic() - started < 60


@needs_torch
def test_node_0_says_when_it_cannot_listen_on_the_endpoint(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        [(status, _, err)] = run_nodes(tmp_path, [_nodes(port, "--node-rank", "0")])
    assert status == 2 and err.startswith(f"Error: --rdzv-endpoint: node 0 cannot listen on 127.0.0.1:{port}: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(("args", "line"), [
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint: cannot read 'node001'; write HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001:70000"], "--rdzv-endpoint: cannot read 'node001:70000'"),
    (["--nnodes", "2"], "--rdzv-endpoint: a run across nodes needs HOST:PORT"),
    (["--rdzv-endpoint", "node001:29500"], "--rdzv-endpoint: a run on one node needs no rendezvous"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node001:29500"], "--node-rank: 2 is not a node of --nnodes 2"),
    (["--node-rank", "1"], "--node-rank 1: a run on one node is node 0; give --nnodes N"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001:29500", "--gpus", "1"], "--gpus 1 must equal --nnodes x --nproc, 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001:29500", "--simulate"], "--nnodes: a simulated run is one process"),
])
def test_bad_node_options_are_one_line_before_anything_starts(args, line):
    result = CliRunner().invoke(cli, [*RUN, *args])
    assert result.exit_code == 2 and result.stderr.startswith(f"Error: {line}") and result.stderr.count("\n") == 1
