"""A synchronous collective's private copies are released where the collective returns.

gloo makes copies NCCL does not: its reduce-scatter reduces a clone of the whole input (docs/engines/fsdp2.md,
"What is not modelled"), and the clone is owned by gloo's Work. The Work's last reference is dropped either by the
calling thread when the collective returns, or a moment later by gloo's worker thread, which completes the Work's
future before it lets go of it (ProcessGroupGloo::runLoop). On a loaded CPU the worker can be descheduled for as
long as the next unit's all-gather and copy-out take, so the same run peaked a block's gradient higher on some
steps and ranks than on others (issue 23: the Trainer with FSDP2, fp32, micro-batch 1 x 64, -7.9% on one of two
ranks). While the accounting counts, each synchronous collective of torch.distributed waits, after it returns, for
the storages it created and did not return to be freed (at most `WAIT_S`), so that every step of every rank sees
them die at the same point of the program: where the collective returns, as when the calling thread drops the
Work last. Asynchronous calls are not waited for (their copies live until the caller waits); after any wait,
`Work.wait`'s or a synchronous collective's, the caller yields the processor for `YIELD_S`, so that the worker,
done with the Work, drops its reference before the caller drops the tensors it passed (measured: the Trainer's
FSDP2 at 1 x 64 tokens peaked higher on 4 of 36 steady rank-steps with the wait for copies alone, on none of 48
with the yield too; a worker descheduled longer still loses the race: docs/measure.md, "gloo's worker thread").
Only a gloo run is changed: NCCL makes no such copies, and a GPU program tracked live must not be slowed."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator

# torch.distributed's synchronous collectives that FSDP1, FSDP2, DDP and ZeroRedundancyOptimizer call through the
# module (`dist.reduce_scatter_single(...)`), so that patching the module's attribute reaches them
COLLECTIVES = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_gather",
               "all_gather_into_tensor", "all_gather_single", "broadcast")
WAIT_S = 2.0  # a worker thread releases a finished Work within microseconds once it runs
YIELD_S = 0.001  # after a wait: time for the worker to finish the Work's iteration of its loop


@contextlib.contextmanager
def released_at_return(await_scratch: Callable[[int, tuple, dict], None], next_serial: Callable[[], int]) -> Iterator[None]:
    """Within this block, each synchronous collective of `torch.distributed` calls `await_scratch(serial, args,
    kwargs)` after it returns: `serial` is the accounting's next storage serial when the collective began."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"):
        yield
        return
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrapped(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def collective(*args, **kwargs):
            try:
                asynchronous = bool(signature.bind_partial(*args, **kwargs).arguments.get("async_op", False))
            except TypeError:  # let the collective report its own argument error
                asynchronous = True
            if asynchronous:
                return function(*args, **kwargs)
            first = next_serial()
            result = function(*args, **kwargs)
            await_scratch(first, args, kwargs)
            time.sleep(YIELD_S)
            return result

        return collective

    from torch._C._distributed_c10d import Work

    original_wait = Work.wait

    def wait(self, *args, **kwargs):
        result = original_wait(self, *args, **kwargs)
        time.sleep(YIELD_S)
        return result

    for name, function in originals.items():
        setattr(dist, name, wrapped(function))
    Work.wait = wait
    try:
        yield
    finally:
        Work.wait = original_wait
        for name, function in originals.items():
            setattr(dist, name, function)


def wait_until(done: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    """Poll `done` (releasing the GIL between polls) until it is true or `timeout_s` has passed; whether it is."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True
