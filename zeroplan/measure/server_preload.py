"""What the worker server imports once, before it forks any worker (measure/worker_server.py).

Imported only in that server: every worker forked from it inherits these modules already loaded
and `SERVER_PID`, the pid of the parent it must die with. Only modules whose import reads no
setting a worker changes: torch reads OMP_NUM_THREADS at its import, which the worker re-applies
(`worker_server._enter_worker`); DeepSpeed picks its accelerator from DS_ACCELERATOR at import,
so it is not preloaded, nor is transformers (a worker may run without it).
"""

import os

import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - imported by every torch optimizer's constructor, a third of a worker's start
import torch.distributed  # noqa: F401
import torch.optim  # noqa: F401

import zeroplan.measure.accounting  # noqa: F401,E402 - the worker's own modules (pydantic specs): half a second more
import zeroplan.measure.context  # noqa: F401,E402
import zeroplan.measure.engines  # noqa: F401,E402
import zeroplan.measure.worker  # noqa: F401,E402
import zeroplan.measure.workload  # noqa: F401,E402

SERVER_PID = os.getpid()
