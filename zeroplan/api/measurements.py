"""What `zeroplan measure` computes from its options, for the command line and `zeroplan.measure(...)`
alike: the estimate of the configuration, the real run on local ranks, and the report of both
(`options` is the dict the click command passes to its callback)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from zeroplan.api.results import MeasureReport
from zeroplan.errors import MissingDependencyError, SpecError


def measure_from_options(options: dict[str, Any], progress=None) -> MeasureReport | None:
    """Run the measurement the options describe and return the report; --output is written atomically
    (nothing when the run fails). A rank that ran out of memory is a result (`fits` False). `progress`
    (the launcher's `Progress`, with `announce`) is told of builds and phases as they happen, and of the
    estimate's notes once the run is found runnable, before its ranks start (a sequence past the model's
    context, what a config file holds that is not modelled); the report repeats them. Across nodes
    (--nnodes), node 0 returns every rank's report and the other nodes None."""
    from zeroplan.importers.options import input_notes, load_config, model_from_options, training_spec_from_options
    from zeroplan.measure.launcher import DEFAULT_RECIPE, choose_backend, measured_device, run_measurement
    from zeroplan.spec.files import writable_file

    if options["output"] is not None:
        writable_file(options["output"], "--output", stdout=True)  # before the run, not after it; - is standard output
    snapshot = options.get("snapshot")
    if snapshot is not None:
        writable_file(snapshot, "--snapshot")
    nproc, simulate = options["nproc"], options["simulate"]
    nodes = _nodes(options)
    if snapshot is not None and nodes is not None:
        raise SpecError("--snapshot: each node keeps its ranks' streams; measure on one node to draw them")
    world = nproc * (nodes.nnodes if nodes else 1)
    if simulate and options["backend"]:
        raise SpecError(f"--simulate runs the fake backend; leave out --backend {options['backend']}")
    if options["gpus"] not in (None, world):
        raise SpecError(f"--gpus {options['gpus']} must equal --nproc {nproc} (the ranks measured); leave out --gpus"
                        if nodes is None else f"--gpus {options['gpus']} must equal --nnodes x --nproc, {world}; leave out --gpus")
    _require("torch", "zeroplan measure runs PyTorch; install it with: pip install torch")
    backend = choose_backend(options["backend"], simulate)
    device = measured_device(backend).value
    if options["device"] not in (None, device):
        raise SpecError(f"--device {options['device']} does not match a {backend} run, which measures {device} memory; "
                        "leave out --device")

    config = load_config(options["config_file"])
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    recipe = options["recipe"] or DEFAULT_RECIPE
    given = {"gpus": world, "device": device, "recipe": recipe}
    if nodes is not None:  # the estimate's nodes are the run's
        if options["gpus_per_node"] not in (None, nproc):
            raise SpecError(f"--gpus-per-node {options['gpus_per_node']} must equal --nproc {nproc} across nodes; leave it out")
        given["gpus_per_node"] = nproc
    training = training_spec_from_options(options | given, config, model)
    if snapshot is not None and training.recipe.value == "hf-trainer":
        raise SpecError("--snapshot: the Trainer's allocation stream is not kept; measure the plain loop (--recipe plain)")
    if snapshot is not None and training.compile:
        raise SpecError("--snapshot: a compiled run is counted from the allocator's records, which keep no stream of "
                        "its allocations to draw; leave out --compile")
    # what the estimate takes as given, said before the ranks start (issue 21: a rotary model far past its context
    # ran on, slowly, without a word until the timeout)
    before = input_notes(model, training, config, options["model"])
    engine_config = None
    if training.engine.value == "deepspeed":
        _require("deepspeed", "engine deepspeed needs DeepSpeed; install it with: pip install 'zeroplan[deepspeed]'")
        if config is not None and config.kind == "DeepSpeed JSON":
            from zeroplan.importers.deepspeed_json import load_json
            from zeroplan.measure.engines.deepspeed_engine import user_config

            engine_config = load_json(config.path)
            user_config(engine_config, training, nproc)  # a stage or batch that disagrees fails here, before any rank starts

    from zeroplan.estimate import estimate_mesh
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.measure.comparison import compare, run_peaks
    from zeroplan.report.measure import report_data

    # the worst rank kind on a mesh, set against the rank that peaks highest; before the run: its errors come first
    estimated = estimate_to_dict(estimate_mesh(model, training), training)
    run = {"nproc": nproc, "backend": backend, "steps": options["steps"], "timeout_s": options["timeout_s"],
           "implementation": options["implementation"], "engine_config": engine_config, "progress": progress,
           "check_memory": options["memory_check"],
           **({"announce": progress.announce} if progress is not None else {})}
    if nodes is None:
        with _snapshot_parts(snapshot) as parts:
            result = run_measurement(model, training, simulate=simulate, snapshot=parts and parts.pattern, notes=before,
                                     **run)
            notes = parts.write(snapshot, result) if parts else []
    else:
        from zeroplan.measure.nodes import run_nodes

        result = run_nodes(model, training, nodes, **run)
        if result is None:  # another node than 0: node 0 reports every rank
            return None
    if training.mesh.ep > 1 and options.get("mesh_moe_imbalance") is None:  # estimated with the routing the run had
        from zeroplan.measure.grid_ep import with_measured_imbalance

        estimated = estimate_to_dict(estimate_mesh(model, with_measured_imbalance(training, result.notes)), training)
    measured = result.to_json_dict()
    comparison = compare(estimated["phases"], run_peaks(measured), engine=training.engine.value)
    data = report_data(estimated, measured, comparison)
    if nodes is None and notes:
        data["notes"] = data.get("notes", []) + notes
    data["notes"] = list(dict.fromkeys([*before, *data.get("notes", [])]))
    if nodes is not None:
        data["nodes"] = {"nnodes": nodes.nnodes, "nproc_per_node": nproc, "rdzv_endpoint": str(nodes.endpoint)}
    if options["output"] is not None:
        import json

        from zeroplan.spec.files import write_atomic  # temp file + os.replace, through symlinks; - is stdout

        write_atomic(options["output"], json.dumps(data), "--output")
    return MeasureReport(data, comparison)


class _Parts:
    """Where the ranks write their snapshots (a temporary folder), and their assembly into one file."""

    def __init__(self, folder: str):
        self.folder, self.pattern = folder, os.path.join(folder, "rank{rank}.pickle")

    def write(self, path: str, result) -> list[str]:
        """Merge the ranks' snapshots into `path`; the notes of ranks that left none (a stream cut short)."""
        import pickle

        from zeroplan.estimate.device.snapshot import merge_snapshots, write_snapshot

        found, notes = [], []
        for rank in result.ranks:
            try:
                with open(self.pattern.replace("{rank}", str(rank.rank)), "rb") as part:
                    found.append(pickle.load(part))
            except FileNotFoundError:
                notes.append(f"--snapshot: rank {rank.rank} allocated more storages than the accounting keeps events "
                             "for; its device in the snapshot is empty")
        write_snapshot(path, merge_snapshots(found))
        return notes


@contextlib.contextmanager
def _snapshot_parts(snapshot: str | None) -> Iterator[_Parts | None]:
    """A temporary folder for the ranks' snapshots (None without --snapshot), removed afterwards."""
    if snapshot is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="zeroplan-snapshot-") as folder:
        yield _Parts(folder)


def _nodes(options: dict[str, Any]):
    """This node's place in a run across nodes (measure/nodes.py), or None for a run on this machine."""
    if options["nnodes"] == 1 and options["rdzv_endpoint"] is None:
        if options["node_rank"] != 0:
            raise SpecError(f"--node-rank {options['node_rank']}: a run on one node is node 0; give --nnodes N")
        return None
    from zeroplan.measure.nodes import Nodes, parse_endpoint

    if options["rdzv_endpoint"] is None:
        raise SpecError("--rdzv-endpoint: a run across nodes needs HOST:PORT, the first node's name and a free port")
    if options["nnodes"] == 1:
        raise SpecError("--rdzv-endpoint: a run on one node needs no rendezvous; give --nnodes N or leave it out")
    if options["simulate"]:
        raise SpecError("--nnodes: a simulated run is one process; leave out --simulate")
    return Nodes(options["nnodes"], options["node_rank"], parse_endpoint(options["rdzv_endpoint"]), options["rdzv_timeout_s"])


def _require(package: str, message: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise MissingDependencyError(message)
