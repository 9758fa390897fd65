"""Host memory around a local run: what its ranks will hold on this machine, checked against what the
machine has available before any worker starts, and the kernel's word when a rank was killed anyway.

Before issue 21, `measure --config <torchtitan 8B TOML>` on a 23 GiB machine started two ranks
that the estimate put at 73 GiB each; the kernel's OOM killer ended rank 0 after 58 s and the run
said "rank 0 exited with status -9: no output".

What a run holds on the host, by the estimate (zeroplan.estimate.estimate_mesh):
- gloo (device cpu): every rank's peak, summed over the ranks (the device is the host), plus the
  per-node host bytes of offload (zero on a CPU run, where offloaded bytes are in the peaks);
- nccl: the per-node host bytes of offload (the peaks are on the GPUs);
- fake (--simulate): nothing (fake tensors have no storage).
It leaves out what no tensor holds: each worker's interpreter and torch (about 40 MiB private per
forked worker of tiny-llama, docs/measure.md), so a run just under the limit can still run short.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from zeroplan.errors import MeasureError
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec
from zeroplan.spec.units import format_bytes

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
KMSG = Path("/dev/kmsg")


@dataclass(frozen=True)
class HostNeed:
    """What a run's ranks hold on this machine, by the estimate."""

    total_bytes: int
    ranks: int
    largest_rank_bytes: int  # the rank that holds most (ranks differ on a pipeline)


@dataclass(frozen=True)
class HostAvailable:
    available_bytes: int
    source: str  # where the figure comes from, as the message names it


def run_need(model: TransformerSpec, training: TrainingSpec, nproc: int, backend: str) -> HostNeed:
    """The host bytes of `nproc` local ranks of `training` on `backend` (module docstring)."""
    from zeroplan.estimate import estimate_mesh

    if backend == "fake":
        return HostNeed(0, nproc, 0)
    mesh = estimate_mesh(model, training)
    nodes = max(1, training.nodes)
    offload_bytes = nodes * max(rank.estimate.per_node.cpu_bytes for rank in mesh.ranks)
    if backend == "nccl":
        return HostNeed(offload_bytes, nproc, 0)
    per_rank = [(rank.ranks, rank.estimate.peak_bytes) for rank in mesh.ranks]  # device cpu: no CUDA overhead
    return HostNeed(sum(count * peak for count, peak in per_rank) + offload_bytes, nproc,
                    max(peak for _, peak in per_rank))


def available() -> HostAvailable | None:
    """Memory this process's runs can still use: MemAvailable (proc(5): what can be allocated without
    swapping), or what the cgroup's limit leaves where that is less (a container's limit does not show
    in MemAvailable); None where neither can be read."""
    found = []
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB$", MEMINFO.read_text(), re.MULTILINE)
        if match:
            found.append(HostAvailable(int(match[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    limit = _cgroup_left()
    if limit is not None:
        found.append(HostAvailable(limit, "left under this cgroup's memory limit"))
    return min(found, key=lambda a: a.available_bytes) if found else None


def _cgroup_left() -> int | None:
    """limit - usage of this process's memory cgroup (v2 memory.max/current, v1 limit_in_bytes/usage_in_bytes)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            folder, files = CGROUP / path.lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            folder, files = CGROUP / "memory" / path.lstrip("/"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = ((folder / name).read_text().strip() for name in files)
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**60:  # "max", or v1's near-2^63 "unlimited"
            return max(0, int(limit) - int(usage))
    return None


def check_fits(need: HostNeed, have: HostAvailable | None) -> None:
    """Raise MeasureError when the run's estimated host bytes exceed what is available."""
    if have is None or need.total_bytes <= have.available_bytes:
        return
    each = (f" ({need.ranks} ranks, up to {format_bytes(need.largest_rank_bytes, 'GiB')} each)"
            if need.largest_rank_bytes else "")
    raise MeasureError(
        f"memory: the estimate puts this run at {format_bytes(need.total_bytes, 'GiB')} of host memory{each}, and this "
        f"machine has {format_bytes(have.available_bytes, 'GiB')} available ({have.source}); measure fewer ranks or a "
        "smaller batch or model, or pass --no-memory-check to run it anyway"
    )


_OOM_KILL = re.compile(r"Killed process (\d+) \(")  # mm/oom_kill.c __oom_kill_process: "%s: Killed process %d (%s) ..."


def oom_kill_record(pid: int, kernel_log: list[str] | None = None) -> str | None:
    """The kernel's line saying its OOM killer ended `pid` ("Out of memory: Killed process PID (python3)
    total-vm:..., anon-rss:..."), from `kernel_log` or /dev/kmsg; None when there is none or it cannot be read."""
    lines = _read_kmsg() if kernel_log is None else kernel_log
    for line in reversed(lines):
        text = line.split(";", 1)[1] if ";" in line else line  # /dev/kmsg: "prio,seq,time,flags;message"
        match = _OOM_KILL.search(text)
        if match and int(match[1]) == pid:
            return text.strip()
    return None


def _read_kmsg() -> list[str]:
    """Every record in the kernel's ring buffer (/dev/kmsg, read without blocking); [] if it cannot be read."""
    records = []
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return records
    try:
        while True:
            try:
                records.append(os.read(fd, 8192).decode(errors="replace"))
            except BlockingIOError:  # the end of the buffer
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on from the next
                continue
    finally:
        os.close(fd)
    return records


def killed_message(rank: int, status: int, pid: int, detail: str) -> str:
    """The failure of a rank that ended by a signal (`status` < 0); SIGKILL is most often the OOM killer."""
    import signal

    signum = -status
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum != signal.SIGKILL:
        return f"rank {rank} was killed by {name}: {detail or 'no output'}"
    record = oom_kill_record(pid)
    why = f"the kernel says: {record}" if record else "the kernel's log (dmesg) says whether its OOM killer ended it"
    return f"rank {rank} was killed (signal 9): out of memory? {why}" + (f"; its last output: {detail}" if detail else "")
