"""An estimate priced as the planner prices it (issue 24: one configuration costs the same in `estimate`,
`plan` and `plan --mesh`): the step-time rates of the GPU with the options' overrides, calibrated from a
measured step when asked, and an estimate's `step` and (when it does not fit) `suggestions`."""

from __future__ import annotations

from typing import Any


def rates_from_options(options: dict, preset, model, training) -> tuple[Any, tuple[str, ...]]:
    """The step-time rates of `preset` (None: the default preset's speeds) with the options' overrides and the
    speed knobs of `training`'s program (torch.compile of the blocks, torchao float8, async TP), calibrated when
    --calibrate is given; and the notes to print (the calibration's)."""
    from zeroplan.plan.rates import rates_for

    names = ("gpu_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_memory_gbps", "nvme_gbps",
             "max_efficiency")
    rates = rates_for(preset, **{name: options.get(name) for name in names}, compile="model" in training.compile,
                      float8=training.float8 is not None, async_tp=training.mesh.async_tp)
    if not options.get("calibrate_file"):
        return rates, ()
    from zeroplan.plan.calibrate import calibrate, read_measurement

    found = calibrate(model, read_measurement(options["calibrate_file"]), rates)
    return rates.model_copy(update={"calibration": found.factor}), (found.note,)


def priced(data: dict, model, training, preset, gpu_memory: int | None, options: dict) -> list[str]:
    """Add `step` (with --gpu) and, when the peak does not fit the GPU's memory, `suggestions` to an estimate's JSON
    `data`; the lines to print under its table."""
    lines: list[str] = []
    if preset is not None:
        from zeroplan.plan.serialize import step_to_dict
        from zeroplan.plan.step_time import step_time
        from zeroplan.report.plan import step_line

        rates, notes = rates_from_options(options, preset, model, training)
        data["step"] = step_to_dict(step_time(model, training, rates), rates)
        lines.append(step_line(data["step"]))
        lines.extend(f"note: {note}" for note in notes)
    if gpu_memory is not None and not data["fits"]:
        from zeroplan.plan.serialize import suggestions_to_dict
        from zeroplan.plan.suggest import suggest_changes
        from zeroplan.report.plan import suggestion_lines

        data["suggestions"] = suggestions_to_dict(suggest_changes(model, training, gpu_memory))
        lines.extend(suggestion_lines(data["suggestions"], options["units"]))
    return lines
