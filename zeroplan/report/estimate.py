"""Formatting only: results as a table (tabulate), JSON, CSV or Markdown.

Everything here renders the plain data of `zeroplan.estimate.serialize` (bytes as ints), so all
formats agree with the JSON contract. Bytes become GiB (2^30, the default), GB, MiB or MB only
here, and every figure is labelled with the unit it was divided by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zeroplan.estimate.serialize import MODEL_COLUMNS, gpu_memory_left_bytes, node_count
from zeroplan.report.common import CATEGORY_LABELS, amount, checkpointing_label, table
from zeroplan.spec.units import bytes_in_unit

_SHORT_LABELS = CATEGORY_LABELS | {"optimizer_states": "opt states", "temporaries": "temps"}
"""Labels of the (wide) per-phase table."""

_PRECISION_LABELS = {"fp32": "fp32", "fp16": "fp16 mixed", "bf16": "bf16 mixed", "pure-bf16": "pure bf16"}


def _describe_config(data: dict[str, Any]) -> str:
    """One line: engine, stage, world, precision, optimizer, batch, offload, device."""
    config = data["config"]
    nodes = node_count(config)
    fsdp1 = data.get("program", {}).get("fsdp1")  # torch's name of FSDP1's strategy beside the stage
    parts = [
        f"{data['engine']} ZeRO-{config['zero_stage']}" + (f" ({fsdp1['sharding_strategy']})" if fsdp1 else ""),
        f"{config['gpus']} GPU{'s' if config['gpus'] > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''} x {config['gpus_per_node']})",
        _PRECISION_LABELS.get(config["precision"], config["precision"]),
        config["optimizer"],
        f"micro-batch {config['micro_batch']} x {config['seq_len']} tokens",
        f"grad-accum {config['grad_accum']}",
        f"checkpointing {checkpointing_label(config)}",
        f"{config['attention']} attention",
    ]
    if config["offload_optimizer"] != "none":
        parts.append(f"optimizer offload {config['offload_optimizer']}")
    if config["offload_params"] != "none":
        parts.append(f"parameter offload {config['offload_params']}")
    parts.append(f"{config['device']} device")
    return ", ".join(parts)


def _describe_program(data: dict[str, Any]) -> str:
    """One line: the recipe and the program knobs it resolved to."""
    program = data["program"]
    loss = f"{program['loss']} loss" + (f" ({program['loss_chunks']} chunks)" if program["loss"] == "chunked" else "")
    parts = [
        f"model init {program['model_init']}",
        f"gradient sync {program['grad_sync']}" if data["config"]["grad_accum"] > 1 else None,
        "DDP" if program["ddp"] else None,
        _optimizer_step(data),
        "optimizer in backward" if program["optimizer_in_backward"] else None,
        loss,
        "activations offloaded to cpu" if program["activation_offload"] == "cpu" else None,
        f"torch.compile of {' and '.join('the blocks' if c == 'model' else 'the loss' for c in program['compile'])}"
        if program.get("compile") else None,
        _float8(program["float8"]) if program.get("float8") else None,
        _fsdp1_settings(program.get("fsdp1")),
    ]
    return f"recipe {program['recipe']}: " + ", ".join(part for part in parts if part)


def _float8(float8: dict[str, Any]) -> str:
    extras = ["float8 all-gather"] if float8["fsdp_all_gather"] else []
    extras += ["float8 saved"] if float8["saved"] == "float8" else []
    return f"float8 {float8['recipe']}" + (f" ({', '.join(extras)})" if extras else "")


def _fsdp1_settings(fsdp1: dict[str, Any] | None) -> str | None:
    """Engine fsdp1's settings that change memory, as FullyShardedDataParallel's arguments read."""
    if fsdp1 is None:
        return None
    parts = [f"use_orig_params {str(fsdp1['use_orig_params']).lower()}", f"backward_prefetch {fsdp1['backward_prefetch']}"]
    parts += ["forward_prefetch"] if fsdp1["forward_prefetch"] else []
    parts += ["sync_module_states"] if fsdp1["sync_module_states"] else []
    parts += ["cpu_ram_efficient_loading"] if fsdp1["cpu_ram_efficient_loading"] else []
    parts += [] if fsdp1["limit_all_gathers"] else ["no limit_all_gathers"]
    return "fsdp1 " + ", ".join(parts)


def _optimizer_step(data: dict[str, Any]) -> str:
    """The kernel that steps and the optimizer: the program's, or DeepSpeed's own (spec/optimizer_step.py)."""
    step = data["program"]["optimizer_step"]
    return f"{step['impl']} {data['config']['optimizer']}" + (f" ({step['via']})" if step["via"] else "")


def describe_mesh(mesh: dict[str, Any]) -> str:
    """One line: every degree, the schedule, and the data-parallel sharding left."""
    parts = [f"tp {mesh['tp']}" + (" (sequence parallel" + (", async" if mesh.get("async_tp") else "") + ")"
                                   if mesh["tp"] > 1 and mesh["sequence_parallel"] else ""),
             f"cp {mesh['cp']}",
             f"pp {mesh['pp']}" + (f" ({mesh['pp_schedule']}" + (f", {mesh['pp_virtual_stages']} stages per rank"
                                    if mesh["pp_virtual_stages"] > 1 else "") + ")" if mesh["pp"] > 1 else ""),
             f"dp_replicate {mesh['dp_replicate']}", f"dp_shard {mesh['dp_shard']}"]
    if mesh["ep"] > 1:
        parts.append(f"ep {mesh['ep']} (experts sharded over {mesh['expert_fsdp_degree']})")
    return f"Mesh: {' x '.join(parts)}; parameters sharded over dp_shard x cp = {mesh['fsdp_degree']} ranks"


def _is_mesh(data: dict[str, Any]) -> bool:
    """Whether the estimate has a mesh dimension beyond plain data parallelism (its ranks table is shown)."""
    mesh = data["mesh"]
    return any(mesh[name] > 1 for name in ("tp", "cp", "pp", "ep", "dp_replicate"))


def _ranks_table(data: dict[str, Any], units: str, markdown: bool) -> str:
    rows = []
    for index, rank in enumerate(data["ranks"]):
        per_gpu = rank["per_gpu"]
        rows.append([rank["kind"], rank["ranks"], rank["micro_batches_in_flight"]]
                    + [amount(per_gpu[key], units) for key in CATEGORY_LABELS]
                    + [amount(per_gpu["peak"], units), f"{per_gpu['peak_step']} {per_gpu['peak_phase']}",
                       "<-" if index == data["worst_rank"] else ""])
    return table(rows, ["rank kind", "GPUs", "in flight", *CATEGORY_LABELS.values(), "peak", "at", "worst"], markdown,
                 colalign=("left",) + ("right",) * (len(CATEGORY_LABELS) + 4) + ("left",))


def _terms_table(data: dict[str, Any], units: str, markdown: bool) -> str:
    """The terms live at the peak, largest first: what `--explain` adds."""
    rows = [[term["name"], CATEGORY_LABELS[term["category"]], amount(term["bytes"], units), term["source"]]
            for term in data["terms"]]
    return table(rows, ["term", "category", units, "source"], markdown, colalign=("left", "left", "right", "left"))


def estimate_header(data: dict[str, Any], markdown: bool = False) -> list[str]:
    """The lines that say what was estimated: the model, the configuration, the program."""
    model = data["model"]
    # A model given by its count alone is named after it ("7,500,000,000 params"): no need to repeat.
    name = "" if model["name"] == f"{model['params']:,} params" else f"{model['name']}: "
    first = f"{name}{model['params']:,} parameters ({model['trainable_params']:,} trainable); activation model: " \
            f"{model['implementation']}"
    return [f"### {first}" if markdown else first, _describe_config(data), _describe_program(data)]


def _estimate_text(data: dict[str, Any], units: str, markdown: bool, explain: bool = False) -> str:
    per_gpu, per_node = data["per_gpu"], data["per_node"]

    def heading(text: str) -> str:
        return f"### {text}" if markdown else text

    out = [*estimate_header(data, markdown), ""]
    if _is_mesh(data):
        worst = data["ranks"][data["worst_rank"]]["kind"]
        out += [describe_mesh(data["mesh"]), "", heading(f"Per GPU at the peak, by rank kind ({units})"),
                _ranks_table(data, units, markdown), "", heading(f"Worst rank: {worst}"), ""]
    out += [
        heading(f"Per GPU at the peak ({per_gpu['peak_step']} step, {per_gpu['peak_phase']})"),
        table(
            [[label, amount(per_gpu[key], units)] for key, label in CATEGORY_LABELS.items()]
            + [["peak", amount(per_gpu["peak"], units)]],
            ["category", units],
            markdown,
        ),
        "",
    ]
    if explain:
        out += [heading(f"Where the bytes go at the peak ({units}, largest first)"), _terms_table(data, units, markdown), ""]
    out += [
        heading(f"Per GPU by phase ({units})"),
        table(
            [
                [f"{row['step']} {row['phase']}"]
                + [amount(row[key], units) for key in CATEGORY_LABELS]
                + [amount(row["total"], units), _peak_marker(row, per_gpu)]
                for row in data["phases"]
            ],
            ["step phase", *_SHORT_LABELS.values(), "total", "peak"],
            markdown,
            colalign=("left",) + ("right",) * (len(_SHORT_LABELS) + 1) + ("left",),
        ),
        "",
        heading("Per node"),
        (
            f"CPU RAM {amount(per_node['cpu'], units)} {units} (pinned {amount(per_node['pinned'], units)} {units}),"
            f" NVMe {amount(per_node['nvme'], units)} {units}"
            + (f", unified memory {amount(per_node['unified'], units)} {units} (paged optimizer states: on the GPUs "
               "while they have room, host RAM under pressure)" if per_node.get("unified") else "")
        ),
    ]
    if "device_memory" in data:
        out += ["", heading(f"On the GPU ({units})"), *_device_lines(data, units)]
    if "fits" in data:
        free = gpu_memory_left_bytes(data)
        verdict = (
            f"yes, {amount(free, units)} {units} to spare"
            if data["fits"]
            else f"no, {amount(-free, units)} {units} over"
        )
        out += ["", f"Fits in {amount(data['gpu_memory'], units)} {units} per GPU: {verdict}"]
    if data["notes"]:
        out += ["", heading("Notes")] + [f"- {note}" for note in data["notes"]]
    return "\n".join(out) + "\n"


def _device_lines(data: dict[str, Any], units: str) -> list[str]:
    """The worst rank's three figures on the GPU: what torch.cuda and nvidia-smi would report."""
    per_gpu, device = data["per_gpu"], data["device_memory"]
    outside = ", ".join(f"{term['name']} {amount(term['bytes'], units)}" for term in device["outside"])
    lines = [f"allocated {amount(per_gpu['allocated'], units)} (torch.cuda.max_memory_allocated: the tensors as the caching "
             f"allocator rounds them, and cuBLAS's workspaces)",
             f"reserved  {amount(per_gpu['reserved'], units)} (torch.cuda.max_memory_reserved: its segments, "
             f"{device['segments']} at the end; {device['num_alloc_retries']} retries after freeing its cache)",
             f"device    {amount(per_gpu['device'], units)} (nvidia-smi: reserved and, outside the allocator, {outside})"]
    if device["ran_out_of_memory"]:
        lines.append(f"the allocator runs out of this GPU's memory with {amount(device['device_at_oom'], units)} in use "
                     "(reserved and outside): the figures are what the run would need")
    return lines


def _peak_marker(row: dict[str, Any], per_gpu: dict[str, Any]) -> str:
    is_peak = (row["step"], row["phase"]) == (per_gpu["peak_step"], per_gpu["peak_phase"])
    return "<-" if is_peak else ""  # under the column "peak"


def _estimate_csv(data: dict[str, Any], units: str) -> str:
    """The per-phase table, one row per (step, phase), sizes in `units` (named in the header)."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "phase", *(f"{key}_{units}" for key in CATEGORY_LABELS), f"total_{units}", "is_peak"])
    for row in data["phases"]:
        writer.writerow(
            [row["step"], row["phase"]]
            + [f"{bytes_in_unit(row[key], units):.4f}" for key in (*CATEGORY_LABELS, "total")]
            + [int(bool(_peak_marker(row, data["per_gpu"])))]
        )
    return buffer.getvalue()


def _terms_csv(data: dict[str, Any], units: str) -> str:
    """The terms live at the peak, one row each, sizes in `units` (named in the header)."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["term", "category", f"size_{units}", "source"])
    for term in data["terms"]:
        writer.writerow([term["name"], term["category"], f"{bytes_in_unit(term['bytes'], units):.4f}", term["source"]])
    return buffer.getvalue()


def render_estimate(data: dict[str, Any], output_format: str = "table", units: str = "GiB", explain: bool = False) -> str:
    """`data` from `estimate_to_dict`, as text in `output_format` (one of FORMATS); with `explain`, the terms
    live at the peak too (as CSV: the terms instead of the phases). JSON always carries them."""
    if output_format == "json":
        import json

        return json.dumps(data, indent=2) + "\n"
    if output_format == "csv":
        return _terms_csv(data, units) if explain else _estimate_csv(data, units)
    return _estimate_text(data, units, markdown=output_format == "markdown", explain=explain)


def render_models(rows: Sequence[dict[str, Any]], output_format: str = "table") -> str:
    """The catalogue rows of `zeroplan.estimate.serialize.model_rows` in `output_format`."""
    if output_format == "json":
        import json

        return json.dumps(list(rows), indent=2) + "\n"
    if output_format == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=MODEL_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()
    shown = ["name", "family", "params", "layers", "hidden", "heads", "kv_heads", "experts", "vocab"]
    cells = [
        [f"{row[column]:,}" if column == "params" else ("" if row[column] is None else str(row[column])) for column in shown]
        for row in rows
    ]
    return table(cells, shown, markdown=output_format == "markdown", left=2) + "\n"
