"""Run a Hugging Face model under FakeTensorMode (simulated ranks) as a real run computes it.

transformers takes a FakeTensor for a trace (utils/import_utils.py `is_tracing`): wherever its
code would read a tensor's values it assumes the worst instead. For a causal LM trained on
unpacked batches this happens once, in masking_utils.py `find_packed_sequence_indices`, which a
real run answers None (position ids 0..s-1 in every row: one sequence per row) so the attention
gets no mask (SDPA `is_causal`, eager's mask skipped); under fake tensors it returns the packed-
sequence ids instead, and the model builds an explicit (batch, 1, s, s) mask a real run never holds.

`fake_tensor_mode()` is the worker's FakeTensorMode with `as_real_run()`, which answers that question as the real run does, for fake position ids only. It holds
because `zeroplan measure`'s batches never carry position ids (workload.py `make_batch`): the
model makes its own `arange`, which is never packed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def as_real_run() -> Iterator[None]:
    """Within: transformers' packed-sequence check returns None for fake position ids (a real run's answer)."""
    try:
        from transformers import masking_utils
    except ImportError:  # the reference model has no such check
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    original = masking_utils.find_packed_sequence_indices

    def unpacked_when_fake(position_ids):
        # a real run's position ids here are the model's arange: the check finds one sequence per row
        return None if isinstance(position_ids, FakeTensor) else original(position_ids)

    masking_utils.find_packed_sequence_indices = unpacked_when_fake
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def fake_tensor_mode() -> Iterator[None]:
    """FakeTensorMode for a simulated rank, under which transformers computes as a real run does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with as_real_run(), FakeTensorMode():
        yield
