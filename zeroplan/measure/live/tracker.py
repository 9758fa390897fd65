"""The estimate and the measurement inside a user's own training program: one `Tracker`, driven by
`zeroplan.track(model, optimizer)` (a plain loop, accelerate) or by the Trainer callback (callback.py).

- `start()` enters the measure mode's accounting (accounting.py) and counts what exists already:
  the model's parameters, buffers and gradients, the optimizer's states. Started before the engine
  wraps the model (the callback: at the end of `Trainer.__init__`, before `train()` lets accelerate
  or DeepSpeed wrap it; `track`: called before `accelerator.prepare` or `DistributedDataParallel`),
  the engine's buffers are born under it (NOTES: DDP's buckets cannot be reached from Python).
  Step 0's phase "engine" lasts until the first step.
- At the first forward the program's objects are read (describe.py) with the batch's shape, the
  estimate is made as `zeroplan measure` makes it, and held against the GPU's memory: a warning, or
  with `strict` a `DoesNotFitError` before the forward runs. On CPU it says so, and with `gpu=` what
  that GPU would need.
- Phases as the worker's (worker.py): forward from the step's start or a micro-batch's forward;
  backward from `torch.autograd.backward`; optimizer_step from the optimizer's step (torch's global
  step pre-hook, or the Trainer's on_pre_optimizer_step) to the step's end (the Trainer's
  on_step_end; in a plain loop, the next forward). DDP's buckets, re-made at the first forward
  after a backward, are counted as buffers (torch_engine.rebuild_ddp_buckets).
- After `steps` steps it leaves the accounting (training goes on at full speed), gathers every
  rank's result (`all_gather_object`), and rank 0 prints the table of `zeroplan measure`.
The CUDA path shares all of it but the device and the memory probe (context.py), and counts only
tensors on the GPU.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, TextIO

import torch

from zeroplan.errors import DoesNotFitError, FieldError, ZeroplanWarning
from zeroplan.measure.live.describe import LiveRun, Undescribed, base_model, describe, innermost_optimizer, trainable_count


class Tracker:
    """Estimate and measure the first `steps` steps of the program that trains `model` (see the module
    docstring). `report` holds the estimate beside the measurement once they are done."""

    def __init__(self, model: Any, optimizer: Any = None, *, steps: int = 3, gpu: str | None = None, strict: bool = False,
                 grad_accum: int | None = None, precision: str | None = None, freeze: tuple[str, ...] = (),
                 recipe: str = "plain", stream: TextIO | None = None, units: str = "GiB"):
        if not isinstance(model, torch.nn.Module):
            raise FieldError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
        self.gpu = check_options(steps=steps, gpu=gpu, precision=precision, grad_accum=grad_accum, units=units)
        self.model, self.optimizer = model, optimizer
        self.steps, self.strict, self.units = steps, strict, units
        self.stream = stream if stream is not None else sys.stderr
        self._run = {"recipe": recipe, "grad_accum": grad_accum, "mixed_precision": precision, "freeze": tuple(freeze)}
        self.notes: list[str] = []
        self.estimate: dict | None = None  # the estimate's JSON (zeroplan estimate --format json), once made
        self.specs = None  # (TransformerSpec, TrainingSpec) read from the program
        self.data: dict | None = None  # the report of `zeroplan measure --format json`, once measured
        self._comparison = None
        self._accounting = self._recorder = None
        self._handles: list[Any] = []
        self._backward = None  # (torch.autograd.backward as found, ours)
        self._wrapper = None
        self._step = 0
        self._step_started = 0.0
        self._step_times: list[float] = []
        self._state = "new"  # new, running, done
        self._first_forward = True
        self._peft = False

    # -- the program's side ------------------------------------------------------------------------
    def start(self) -> "Tracker":
        """Enter the accounting and count what exists (see the module docstring)."""
        if self._state != "new":
            return self
        from zeroplan.measure.accounting import TensorAccounting
        from zeroplan.measure.context import make_probe
        from zeroplan.measure.phases import PhaseRecorder

        params = list(self.model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        if hasattr(self.model, "peft_config"):
            from zeroplan.measure.programs.peft_model import mark_adapters

            mark_adapters(self.model)  # adapters apart from the base in `params` (programs/peft_model.py)
            self._peft = True
        self._accounting = TensorAccounting(device_type="cuda" if self.device.type == "cuda" else None)
        self._accounting.__enter__()
        self._state = "running"
        self._accounting.track_existing(self._existing_tensors())
        self._accounting.set_classifier(self._classify)
        self._recorder = PhaseRecorder(self._accounting, make_probe(self.device))
        self._install_hooks()
        self._recorder.switch(0, "engine", default_category="temporaries", born_as="buffers")
        return self

    def begin_training(self, optimizer: Any = None) -> None:
        """Training starts: step 1's forward phase (the Trainer: on_train_begin, batch fetch included)."""
        if optimizer is not None:
            self.optimizer = optimizer
        if self._state == "running" and self._step == 0:
            self._begin_step(1)

    def optimizer_step_begins(self) -> None:
        if self._state == "running" and self._recorder.open is not None and self._recorder.open[1] == "backward":
            self._recorder.switch(self._step, "optimizer_step", default_category="temporaries")

    def end_step(self) -> None:
        """The step's end (the Trainer: on_step_end, after zero_grad): the next step, or the report."""
        if self._state != "running" or self._step == 0:
            return
        self._step_times.append(time.perf_counter() - self._step_started)
        if self._step >= self.steps:
            self.stop()
        else:
            self._begin_step(self._step + 1)

    def stop(self, report: bool = True) -> None:
        """Leave the accounting and remove the hooks; with steps measured, gather the ranks and report
        (every rank calls it at the same step: the report is gathered)."""
        if self._state != "running":
            return
        self._state = "done"
        try:
            self._recorder.close()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self._backward is not None and torch.autograd.backward is self._backward[1]:
                torch.autograd.backward = self._backward[0]
            self._accounting.__exit__(None, None, None)
        if report and any(p.step >= 1 for p in self._recorder.phases.values()):
            self._report()

    def __enter__(self) -> "Tracker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def report(self) -> dict | None:
        """{"estimate": {category: bytes, ..., "peak": bytes}, "measured": {...}, "error": {...}} at the
        steady state's peak (the first step's when only one was measured), in tensor bytes (the
        estimate's overhead, not a tensor, apart); "estimate" and "error" are None when the program
        could not be described. None until the steps are measured (or `stop()` is called)."""
        if self.data is None:
            return None
        if self._comparison is None:
            return {"estimate": None, "measured": _measured_peak(self.data), "error": None, "notes": list(self.notes)}
        step = self._comparison.steady or self._comparison.first
        return {
            "estimate": {line.name: line.estimated_bytes for line in step.lines},
            "measured": {line.name: line.measured_bytes for line in step.lines},
            "error": {line.name: line.error for line in step.lines},
            "step": step.step, "estimated_phase": step.estimated_phase, "measured_phase": step.measured_phase,
            "estimated_overhead": step.estimated_overhead_bytes, "notes": list(self.notes),
        }

    def to_dict(self) -> dict | None:
        """The whole report as `zeroplan measure --format json` has it (None before the steps are measured)."""
        return self.data

    def table(self, units: str | None = None) -> str:
        """The report as `zeroplan measure` prints it."""
        if self.data is None:
            return "zeroplan: nothing measured yet\n"
        units = units or self.units
        if self._comparison is None:
            from zeroplan.report.common import amount

            peak = _measured_peak(self.data)
            parts = ", ".join(f"{name} {amount(size, units, 3)}" for name, size in peak.items())
            return f"zeroplan measured ({units}, no estimate: {'; '.join(self.notes)}): {parts}\n"
        from zeroplan.report.measure import render_table

        return render_table(self.data, self._comparison, units)

    # -- hooks ---------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles += [
            register_module_forward_pre_hook(self._on_any_forward),  # the wrapper (DDP, DeepSpeed) is called first
            self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True),
            register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: self.optimizer_step_begins()),
        ]
        found = torch.autograd.backward  # Tensor.backward calls it by this name (torch/_tensor.py)

        def backward(*args: Any, **kwargs: Any) -> Any:
            if self._state == "running":
                self._on_backward()
            return found(*args, **kwargs)

        self._backward = (found, backward)
        torch.autograd.backward = backward

    def _on_any_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._state != "running" or (module is not self.model and getattr(module, "module", None) is not self.model):
            return
        if module is not self.model:
            self._wrapper = module
        phase = self._recorder.open[1] if self._recorder.open else None
        if self._step == 0:
            self._begin_step(1)
        elif phase == "optimizer_step":  # a plain loop: the step ended at the next forward
            self.end_step()
            if self._state != "running":
                return
        elif phase == "backward":  # the next micro-batch of the step
            self._recorder.switch(self._step, "forward", default_category="activations")
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            from zeroplan.measure.engines.torch_engine import rebuild_ddp_buckets

            rebuild_ddp_buckets(module)

    def _on_model_forward(self, module: torch.nn.Module, args: Any, kwargs: dict | None = None) -> None:
        # kwargs None: this hook was removed by `stop` in the same call, and torch calls it as a plain one
        if self._state != "running" or not self._first_forward:
            return
        self._first_forward = False
        input_ids = (kwargs or {}).get("input_ids", args[0] if args else None)
        self._estimate(tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ())

    def _on_backward(self) -> None:
        if self._recorder.open is not None and self._recorder.open[1] == "forward":
            self._recorder.switch(self._step, "backward", default_category="activations", born_as="temporaries")

    def _begin_step(self, step: int) -> None:
        self._step, self._step_started = step, time.perf_counter()
        self._recorder.switch(step, "forward", default_category="activations")

    # -- what is live, by category ---------------------------------------------------------------
    def _existing_tensors(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        found = params + [p.grad for p in params if p.grad is not None] + list(self.model.buffers())
        found += [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
        if self.optimizer is not None:
            from zeroplan.measure.engines.common import optimizer_state_tensors

            found += optimizer_state_tensors(innermost_optimizer(self.optimizer))
        return found

    def _classify(self) -> dict[str, list[torch.Tensor]]:
        """The engine's own classifier once it is known (those of the measure mode's runners)."""
        from torch.distributed.fsdp import FSDPModule

        optimizer = innermost_optimizer(self.optimizer) if self.optimizer is not None else None
        if type(self._wrapper).__name__ == "DeepSpeedEngine":
            from zeroplan.measure.engines.deepspeed_engine import deepspeed_tensors

            categories = deepspeed_tensors(self._wrapper, self._wrapper.module)
        elif isinstance(self.model, FSDPModule):
            from zeroplan.measure.engines.fsdp2_engine import fsdp2_tensors

            categories = fsdp2_tensors(self.model, optimizer)
        else:
            from zeroplan.measure.engines.torch_engine import ddp_tensors

            params = list(self.model.parameters())  # under deepspeed.zero.Init a parameter's storage is `ds_tensor`
            categories = ddp_tensors(self.model, optimizer, params + [p.ds_tensor for p in params
                                                                      if getattr(p, "ds_tensor", None) is not None])
        if self._peft:
            from zeroplan.measure.programs.peft_model import with_peft_categories

            categories = with_peft_categories(categories, self.model)
        return categories

    # -- the estimate --------------------------------------------------------------------------------
    def _estimate(self, batch_shape: tuple[int, ...]) -> None:
        """Read the program, estimate it, and hold the estimate against the GPU (see the module docstring)."""
        from zeroplan.errors import ZeroplanError

        autocast = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        run = LiveRun(self.model, self.optimizer, self._wrapper, batch_shape, autocast, **self._run)
        try:
            spec, training, notes = describe(run)
            self.notes += notes
            self.estimate = _estimate_dict(spec, training)
        except (Undescribed, ZeroplanError) as error:
            message = f"zeroplan cannot estimate this run: {' '.join(str(error).split())}; training goes on, measured only"
            self.notes.append(f"not estimated: {' '.join(str(error).split())}")
            warnings.warn(ZeroplanWarning(message), stacklevel=2)
            return
        self.specs = (spec, training)
        live = trainable_count(self.model)
        if live != self.estimate["model"]["trainable_params"]:
            self.notes.append(f"the program trains {live:,} parameters, the estimate {self.estimate['model']['trainable_params']:,}")
        self._check_fit(spec, training)

    def _check_fit(self, spec, training) -> None:
        from zeroplan.report.common import amount

        peak = self.estimate["per_gpu"]
        where = f"{peak['peak_step']} {peak['peak_phase']}"
        if self.device.type == "cuda":
            capacity = self.gpu.memory_bytes if self.gpu else torch.cuda.get_device_properties(self.device).total_memory
            name = self.gpu.name if self.gpu else torch.cuda.get_device_name(self.device)
            needed = peak["peak"]
            text = (f"zeroplan: estimated peak {amount(needed, self.units)} {self.units} per GPU ({where}) "
                    f"on {name} with {amount(capacity, self.units)} {self.units}")
        else:
            text = (f"zeroplan: a CPU run: estimated peak {amount(peak['peak'], self.units)} {self.units} of host "
                    f"memory per rank ({where})")
            if self.gpu is None:
                self._say(text + "; give gpu=NAME to hear what a GPU would need")
                return
            from zeroplan.spec.training import TrainingSpec

            on_gpu = {**training.model_dump(mode="json", exclude_none=True), "device": "cuda"}
            defaults = getattr(innermost_optimizer(self.optimizer), "defaults", {}) if self.optimizer is not None else {}
            if training.optimizer_impl is not None and defaults.get("fused") is None and defaults.get("foreach") is None:
                on_gpu["optimizer_impl"] = "foreach"  # torch's kernel for CUDA tensors, where the CPU run's was the for-loop
            needed = _estimate_dict(spec, TrainingSpec.model_validate(on_gpu))["per_gpu"]["peak"]
            capacity, name = self.gpu.memory_bytes, self.gpu.name
            text += (f"; on {name} ({amount(capacity, self.units)} {self.units}) it would need "
                     f"{amount(needed, self.units)} {self.units} per GPU")
        if needed <= capacity:
            self._say(text + ": fits")
            return
        message = text + ": DOES NOT FIT"
        if self.strict:
            self.stop(report=False)
            raise DoesNotFitError(message + "; stopped before step 1 (strict=True)")
        warnings.warn(ZeroplanWarning(message), stacklevel=2)

    def _say(self, text: str) -> None:
        if _rank() == 0:
            print(text, file=self.stream, flush=True)

    # -- the report ----------------------------------------------------------------------------------
    def _report(self) -> None:
        from zeroplan.measure.result import MeasureResult, RankResult

        rank = _rank()
        mine = RankResult(rank, list(self._recorder.phases.values()), self._step_times,
                          classifications=self._accounting.classifications).to_json_dict()
        ranks = [mine]
        if _world() > 1:
            gathered: list[Any] = [None] * _world()
            torch.distributed.all_gather_object(gathered, mine)
            ranks = gathered
        spec_training = self.specs[1] if self.specs else None
        backend = torch.distributed.get_backend() if _world() > 1 else "single process"
        result = MeasureResult(
            backend=backend, engine=spec_training.engine.value if spec_training else "unknown",
            zero_stage=spec_training.zero_stage if spec_training else 0, world_size=_world(),
            implementation=f"your program: {type(base_model(self.model)).__name__}",
            model=self.specs[0].name if self.specs else type(base_model(self.model)).__name__,
            ranks=[RankResult.from_json_dict(r) for r in sorted(ranks, key=lambda r: r["rank"])],
            steps=max(p.step for p in self._recorder.phases.values()), device=self.device.type, notes=list(self.notes),
        )
        measured = result.to_json_dict()
        if self.estimate is None:
            self.data = measured
        else:
            from zeroplan.measure.comparison import compare, run_peaks
            from zeroplan.report.measure import report_data

            self._comparison = compare(self.estimate["phases"], run_peaks(measured))
            self.data = report_data(self.estimate, measured, self._comparison)
        if rank == 0:
            self.stream.write(self.table())
            self.stream.flush()


def check_options(*, steps: int, gpu: str | None, precision: str | None = None, grad_accum: int | None = None,
                  units: str = "GiB"):
    """FieldError for a bad option of the tracker; the GPU preset `gpu` names (None without one)."""
    from zeroplan.spec.units import REPORT_UNITS

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise FieldError("steps", f"at least 2 (step 1 creates the optimizer states), got {steps!r}")
    if precision not in (None, "fp32", "bf16", "fp16"):
        raise FieldError("precision", f"the mixed precision the program runs: fp32, bf16 or fp16, not {precision!r}")
    if grad_accum is not None and (isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1):
        raise FieldError("grad_accum", f"a whole number of at least 1, got {grad_accum!r}")
    if units not in REPORT_UNITS:
        raise FieldError("units", f"{units!r} is not one of {', '.join(REPORT_UNITS)}")
    if gpu is None:
        return None
    from zeroplan.errors import SpecError
    from zeroplan.importers.gpus import get_gpu

    try:
        return get_gpu(gpu)
    except SpecError as error:  # it names --gpu: the keyword here
        raise FieldError("gpu", str(error).split(": ", 1)[-1]) from None


def _estimate_dict(spec, training) -> dict:
    """The estimate's JSON as `zeroplan measure` makes it (a mesh's worst rank)."""
    from zeroplan.estimate import estimate_mesh
    from zeroplan.estimate.serialize import estimate_to_dict

    return estimate_to_dict(estimate_mesh(spec, training), training)


def _measured_peak(data: dict) -> dict[str, int]:
    top = max(data["ranks"], key=lambda r: r["peak"])
    return {**top["categories"], "peak": top["peak"]}


def _rank() -> int:
    return torch.distributed.get_rank() if _world() > 1 else 0


def _world() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if distributed else 1


def track(model: Any, optimizer: Any = None, **options: Any) -> Tracker:
    """Estimate and measure the first steps of the loop that trains `model` with `optimizer`; started
    at once (call it before `accelerator.prepare` or `DistributedDataParallel(...)`), stopped after
    `steps` steps or at the end of a `with` block. Options: steps (3), gpu (a preset name), strict
    (False), grad_accum, precision (the mixed precision, when the loop's autocast starts inside the
    model), freeze (frozen groups), units (of the printed table), stream (sys.stderr)."""
    return Tracker(model, optimizer, **options).start()
