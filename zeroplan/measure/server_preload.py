"""What the worker server imports once, before it forks any worker (measure/worker_server.py).

Imported only in that server: every worker forked from it inherits these modules already loaded
and `SERVER_PID`, the pid of the parent it must die with. What an import reads from the
environment is the server's: the launcher starts a new server when its environment changes
(`worker_server.running_server`), and the one variable a launcher gives each worker apart that an
import reads, OMP_NUM_THREADS (torch), the worker re-applies (`worker_server._enter_worker`).
Not preloaded: DeepSpeed, whose accelerator (DS_ACCELERATOR) a gloo worker sets before importing it
(engines/deepspeed_engine.py `prepare_environment`).

transformers (with accelerate, which it imports) is a worker's next largest import: 2.2 s of a
3.2 s two-rank hf run once torch is loaded. Its Trainer is not preloaded: it imports peft and
bitsandbytes, whose import leaves a 144-byte tensor that a fresh worker importing them during
its run counts (seen on every LoRA row of the grid); a forked worker must measure what a fresh
one does.
"""

import os

import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - imported by every torch optimizer's constructor, a third of a worker's start
import torch.distributed  # noqa: F401
import torch.optim  # noqa: F401

try:  # the hf extra: the default implementation where it is installed (workload.hf_available)
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401
except ImportError:
    pass

import zeroplan.measure.accounting  # noqa: F401,E402 - the worker's own modules (pydantic specs): half a second more
import zeroplan.measure.context  # noqa: F401,E402
import zeroplan.measure.engines  # noqa: F401,E402
import zeroplan.measure.worker  # noqa: F401,E402
import zeroplan.measure.workload  # noqa: F401,E402

SERVER_PID = os.getpid()
