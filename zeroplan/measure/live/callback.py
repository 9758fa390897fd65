"""`zeroplan.ZeroplanCallback()`: the tracker (tracker.py) in a transformers Trainer, driven by its events.

- `on_init_end` (end of `Trainer.__init__`, the model built and placed, not yet wrapped): start;
  `train()` then wraps it (accelerate's prepare, `deepspeed.initialize`, `fully_shard`) under the
  accounting, in step 0's "engine" phase, as `zeroplan measure --recipe hf-trainer` counts it;
- `on_train_begin`: the optimizer the Trainer made; step 1's forward starts (its batch fetch included);
- `on_pre_optimizer_step`: the optimizer step (DeepSpeed's, inside backward, through torch's step hook);
- `on_step_end`: the step ends (after `zero_grad`); after `steps` steps the report, printed on rank 0;
- `on_train_end`: stop, whatever was measured.
The Trainer's arguments give what its objects do not say: gradient accumulation and bf16/fp16.
A callback added after the Trainer was made starts at `on_train_begin`, after the model was wrapped:
the engine's buffers made before (DDP's buckets) are then not counted, which the report notes.
"""

from __future__ import annotations

from typing import Any, TextIO

from transformers import TrainerCallback

from zeroplan.measure.live.tracker import Tracker, check_options


class ZeroplanCallback(TrainerCallback):
    """Estimate the run before step 1 (a warning, or with `strict=True` a `DoesNotFitError`, when the
    estimate exceeds the GPU; on CPU, with `gpu="h100-80gb"`, what that GPU would need), measure the
    first `steps` steps by category, and print the estimate beside the measurement on rank 0.
    `report` holds them: {"estimate": {category: bytes, ..., "peak": bytes}, "measured": {...}, "error": ...}."""

    def __init__(self, *, steps: int = 3, gpu: str | None = None, strict: bool = False, stream: TextIO | None = None,
                 units: str = "GiB"):
        self.options = {"steps": steps, "gpu": gpu, "strict": strict, "stream": stream, "units": units}
        check_options(steps=steps, gpu=gpu, units=units)  # now, not at the Trainer's first event
        self.tracker: Tracker | None = None

    @property
    def report(self) -> dict | None:
        return self.tracker.report if self.tracker is not None else None

    def _tracker(self, args: Any, model: Any) -> Tracker:
        mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        return Tracker(model, None, recipe="hf-trainer", grad_accum=args.gradient_accumulation_steps, precision=mixed,
                       **self.options)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.tracker is None:
            self.tracker = self._tracker(args, model).start()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.tracker is None:  # added after Trainer(...): the model is wrapped already
            self.tracker = self._tracker(args, model).start()
            self.tracker.notes.append("started at train begin, after the engine wrapped the model: what it allocated "
                                      "then (DDP's buckets) is not counted")
        self.tracker.begin_training(optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.optimizer_step_begins()

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.stop()

