"""Measure across nodes: `zeroplan measure --nnodes N --node-rank K --rdzv-endpoint HOST:PORT --nproc P` on
every node starts that node's P workers as global ranks K*P .. K*P+P-1 of N*P, and node 0 assembles
every rank's result (docs/measure.md, "Several nodes").

The rendezvous is torchrun's static one over a c10d TCPStore at the endpoint: node 0 hosts the store
there and every other node joins it (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py;
c10d_rendezvous_backend.py `_create_tcp_store` hosts it on the endpoint's machine). Node 0 listens on
the endpoint's address when that is a loopback one (a run on one machine stays on it), else on every
interface, as the store does by itself. The workers join their process group through the same store,
as torchrun's workers use their agent's (env:// with TORCHELASTIC_USE_AGENT_STORE:
torch/distributed/rendezvous.py `_create_c10d_store`); the store's keys for this are the process
group's own, under "default_pg", apart from the nodes' under "zeroplan/".

What the nodes say to each other, in order (every wait bounded, every read a poll: no blocking call
into the store that could outlive its deadline):
- `zeroplan/joined/K`: node K's --nnodes, --nproc and the fingerprint of what it will run (model,
  training spec, steps, backend, implementation, engine config); `zeroplan/claims/K` counts the nodes
  that said they were node K (two is a mistake);
- `zeroplan/verdict`: node 0's, once every node has joined: "ok", or the mismatch every node reports;
- `zeroplan/stop`: written by a node whose run failed or ran out of memory: the others stop their
  workers (theirs would wait in a collective until their timeout);
- `zeroplan/failures/K`: node K's failure and when it happened; when a rank dies its peers on the
  other nodes fail too, so every node reports the first (the local launcher's rule);
- `zeroplan/done/K`: node K's outcomes (the workers' `ok` objects), or that it failed;
- `zeroplan/finished`, then `zeroplan/ack/K`: node 0 has read every result, and node K has seen that,
  so node 0 keeps the store up until no node needs it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zeroplan.errors import MeasureError, SpecError
from zeroplan.measure.launcher import NodeRanks, assemble_result, check_host_memory, check_runnable, run_ranks
from zeroplan.measure.result import MeasureResult
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

POLL_S = 0.2  # how often a node looks at the store while it waits
RESULT_SLACK_S = 120.0  # beyond the run's --timeout, how long node 0 waits for another node's result
FAILURE_GRACE_S = 10.0  # how long a failed node waits for the others' failures, to name the first
KEY = "zeroplan/"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """HOST:PORT ([v6 address]:PORT too); a SpecError naming --rdzv-endpoint otherwise."""
    host, _, port = str(text).strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(f"--rdzv-endpoint: cannot read {text!r}; write HOST:PORT, the first node's name and a free "
                        "port, e.g. node001:29500")
    return Endpoint(host, int(port))


@dataclass(frozen=True)
class Nodes:
    """This node's place in a run across nodes."""

    nnodes: int
    node_rank: int
    endpoint: Endpoint
    join_timeout_s: float  # how long a node waits for the others to join (torchrun's join_timeout)

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise SpecError(f"--node-rank: {self.node_rank} is not a node of --nnodes {self.nnodes} (0 to {self.nnodes - 1})")


def run_nodes(model: TransformerSpec, training: TrainingSpec, nodes: Nodes, *, nproc: int, backend: str | None,
              steps: int, timeout_s: float, implementation: str, engine_config: dict | None, announce=None,
              progress=None, check_memory: bool = True) -> MeasureResult | None:
    """This node's part of a run across nodes: node 0 returns every rank's result, the others None;
    `check_memory` as launcher.run_measurement's, for this node's ranks."""
    backend = check_runnable(model, training, nproc=nproc, backend=backend, simulate=False, steps=steps,
                             timeout_s=timeout_s)
    if backend == "fake":
        raise SpecError("--nnodes: a simulated run is one process; leave out --simulate")
    if check_memory:
        check_host_memory(model, training, nproc, backend)
    world_size = nodes.nnodes * nproc
    fingerprint = _fingerprint(model, training, steps, backend, implementation, engine_config, world_size)
    store, listener = _open_store(nodes)
    k = nodes.node_rank
    try:
        _join(store, nodes, nproc, fingerprint)
        env = {"MASTER_ADDR": nodes.endpoint.host, "MASTER_PORT": str(nodes.endpoint.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_RANK": str(k)}
        if backend == "gloo" and _is_loopback(nodes.endpoint.host):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # two "nodes" on one machine: stay on it
        node = NodeRanks(first=k * nproc, world_size=world_size, env=env, watch=lambda: _watch(store))
        kwargs = {"announce": announce} if announce is not None else {}
        try:
            outcomes = run_ranks(model, training, nproc=nproc, backend=backend, steps=steps, timeout_s=timeout_s,
                                 implementation=implementation, engine_config=engine_config, progress=progress,
                                 node=node, **kwargs)
        except _Stopped:
            stop = json.loads(store.get(KEY + "stop"))
            store.set(KEY + f"done/{k}", json.dumps([]))  # stopped: the node that stopped the run says why
            if "error" in stop:
                raise MeasureError(_first_failure(store, nodes)) from None
            outcomes = []  # another node's rank ran out of memory: its result is the run's
        except MeasureError as error:
            # When a rank dies its peers on the other nodes fail too ("connection reset by peer"): every
            # node reports the failure that happened first (the local launcher's rule, launcher.py)
            failed_at = getattr(error, "failed_at", None) or time.time()
            store.set(KEY + f"failures/{k}", json.dumps({"time": failed_at, "error": f"node {k}: {error}"}))
            store.set(KEY + "stop", json.dumps({"node": k, "error": True}))
            store.set(KEY + f"done/{k}", json.dumps({"error": True}))
            raise MeasureError(_first_failure(store, nodes)) from None
        if any(not outcome["result"]["fits"] for outcome in outcomes):
            store.set(KEY + "stop", json.dumps({"node": k, "oom": True}))
        store.set(KEY + f"done/{k}", json.dumps(outcomes))
        if k != 0:
            _wait_for(store, [KEY + "finished"], time.monotonic() + timeout_s + RESULT_SLACK_S,
                      "node 0 did not say it had every result")
            return None
        everything = _collect(store, nodes, timeout_s)
        return assemble_result(everything, model, training, backend, world_size, steps)
    finally:
        _leave(store, nodes)
        del store
        if listener is not None:
            listener.close()


class _Stopped(Exception):
    """Another node asked every node to stop (`zeroplan/stop`)."""


def _watch(store) -> None:
    if store.check([KEY + "stop"]):
        raise _Stopped()


def _fingerprint(model, training, steps, backend, implementation, engine_config, world_size) -> str:
    what = {"model": model.model_dump(mode="json"), "training": training.model_dump(mode="json"), "steps": steps,
            "backend": backend, "implementation": implementation, "engine_config": engine_config,
            "world_size": world_size}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _open_store(nodes: Nodes):
    """Node 0: the store's server at the endpoint (its own socket, bound where the module docstring
    says); the others: a client, once something listens there (a plain TCP probe until then, so
    that a node 0 that is not up yet costs no failed connection of the store's own)."""
    import torch.distributed as dist

    host, port = nodes.endpoint.host, nodes.endpoint.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise SpecError(f"--rdzv-endpoint: cannot resolve {host!r}: {error.strerror or error}") from None
    timeout = timedelta(seconds=max(nodes.join_timeout_s, 1.0))
    if nodes.node_rank == 0:
        family, address = infos[0][0], infos[0][4][0]
        if not _is_loopback(host):
            address = "::" if family == socket.AF_INET6 else "0.0.0.0"
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(128)
        except OSError as error:
            listener.close()
            raise SpecError(f"--rdzv-endpoint: node 0 cannot listen on {nodes.endpoint}: {error.strerror or error}; "
                            "give this machine's name and a free port") from None
        store = dist.TCPStore(host, port, is_master=True, master_listen_fd=listener.fileno(), wait_for_workers=False,
                              timeout=timeout)
        return store, listener
    deadline = time.monotonic() + nodes.join_timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=POLL_S * 5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise MeasureError(f"no node 0 at --rdzv-endpoint {nodes.endpoint} within {nodes.join_timeout_s:g} s "
                                   "(--rdzv-timeout): start `zeroplan measure ... --node-rank 0` on that machine") from None
            time.sleep(POLL_S)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout), None


def _join(store, nodes: Nodes, nproc: int, fingerprint: str) -> None:
    """Say who this node is; node 0 checks that every node runs the same world and says so."""
    k = nodes.node_rank
    if store.add(KEY + f"claims/{k}", 1) > 1:
        raise SpecError(f"--node-rank: another node joined {nodes.endpoint} as node {k} already; give each node its own")
    store.set(KEY + f"joined/{k}", json.dumps({"nnodes": nodes.nnodes, "nproc": nproc, "job": fingerprint,
                                               "host": socket.gethostname()}))
    deadline = time.monotonic() + nodes.join_timeout_s
    if k != 0:
        _wait_for(store, [KEY + "verdict"], deadline, "node 0 did not check the nodes in time")
        verdict = json.loads(store.get(KEY + "verdict"))
        if verdict != "ok":
            raise SpecError(verdict["error"])
        return
    keys = [KEY + f"joined/{other}" for other in range(nodes.nnodes)]
    try:
        _wait_for(store, keys, deadline, "")
    except MeasureError:
        missing = [str(other) for other, key in enumerate(keys) if not store.check([key])]
        message = (f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {nodes.nnodes} did not join "
                   f"--rdzv-endpoint {nodes.endpoint} within {nodes.join_timeout_s:g} s (--rdzv-timeout)")
        store.set(KEY + "verdict", json.dumps({"error": message}))  # the nodes that came leave with the same line
        raise MeasureError(message) from None
    problem = _mismatch([json.loads(store.get(key)) for key in keys])
    store.set(KEY + "verdict", json.dumps("ok" if problem is None else {"error": problem}))
    if problem is not None:
        raise SpecError(problem)


def _mismatch(joined: list[dict[str, Any]]) -> str | None:
    """What differs between the nodes, as one line; None when they run one world."""
    ours = joined[0]
    for other, theirs in enumerate(joined[1:], start=1):
        if (theirs["nnodes"], theirs["nproc"]) != (ours["nnodes"], ours["nproc"]):
            return (f"--nnodes/--nproc: node {other} ({theirs['host']}) has --nnodes {theirs['nnodes']} --nproc "
                    f"{theirs['nproc']}, node 0 --nnodes {ours['nnodes']} --nproc {ours['nproc']}; give every node the same")
        if theirs["job"] != ours["job"]:
            return (f"node {other} ({theirs['host']}) would run another configuration than node 0: give every node the "
                    "same model and options")
    return None


def _wait_for(store, keys: list[str], deadline: float, what: str) -> None:
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise MeasureError(what or "timed out")
        time.sleep(POLL_S)


def _first_failure(store, nodes: Nodes) -> str:
    """The message of the failure that happened first on any node, once every node has stopped (or a
    few seconds have passed: a node that died whole says nothing)."""
    deadline = time.monotonic() + FAILURE_GRACE_S
    done = [KEY + f"done/{k}" for k in range(nodes.nnodes)]
    while not store.check(done) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    failures = [json.loads(store.get(key)) for k in range(nodes.nnodes) if store.check([key := KEY + f"failures/{k}"])]
    return min(failures, key=lambda failure: failure["time"])["error"]


def _collect(store, nodes: Nodes, timeout_s: float) -> list[dict]:
    """Every node's outcomes (node 0's own included); the first failure's message if a node failed."""
    keys = [KEY + f"done/{k}" for k in range(nodes.nnodes)]
    deadline = time.monotonic() + timeout_s + RESULT_SLACK_S
    while not store.check(keys):
        stop = json.loads(store.get(KEY + "stop")) if store.check([KEY + "stop"]) else None
        if stop is not None and "error" in stop:
            raise MeasureError(_first_failure(store, nodes))
        if time.monotonic() > deadline:
            missing = [str(k) for k, key in enumerate(keys) if not store.check([key])]
            raise MeasureError(f"node {', '.join(missing)} sent no result within {timeout_s + RESULT_SLACK_S:g} s")
        time.sleep(POLL_S)
    results = [json.loads(store.get(key)) for key in keys]
    if any(isinstance(r, dict) for r in results):
        raise MeasureError(_first_failure(store, nodes))
    outcomes = [outcome for node_outcomes in results for outcome in node_outcomes]
    if any(not o["result"]["fits"] for o in outcomes):  # as the local launcher: only the ranks that ran out of memory
        outcomes = [o for o in outcomes if not o["result"]["fits"]]
    return outcomes


def _leave(store, nodes: Nodes) -> None:
    """Node 0 says every result was read (or that the run ended) and keeps the store up until each node
    that joined has left (bounded); another node says it leaves."""
    try:
        if nodes.node_rank != 0:
            store.set(KEY + f"ack/{nodes.node_rank}", "1")
            return
        store.set(KEY + "finished", "1")
        joined = [k for k in range(1, nodes.nnodes) if store.check([KEY + f"joined/{k}"])]
        deadline = time.monotonic() + 30.0
        while not store.check([KEY + f"ack/{k}" for k in joined]) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except Exception:  # noqa: BLE001 - the store may be gone with an interrupted run: nothing left to say
        pass
