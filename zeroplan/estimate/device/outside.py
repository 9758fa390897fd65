"""Memory a training process holds on its GPU outside PyTorch's caching allocator, as named terms.

nvidia-smi shows, per process, the caching allocator's reserved segments plus what the CUDA driver
and the libraries allocate themselves: the CUDA context (the driver's state and the kernels it has
loaded) and NCCL's communication buffers, one set per communicator. Each term here names its
source, and every one can be overridden (`overrides={"cuda_context": ...}`). cuBLAS's workspaces are
*inside* the allocator (aten/src/ATen/cuda/CublasHandlePool.cpp `getNewWorkspace` allocates them
from it), so they are allocations to replay, not terms here: `cublas_workspace_bytes`.

Nothing is fitted: the context sizes are published measurements (nvidia-smi with no tensor
allocated) for the GPU they were measured on, and a GPU without one takes a stated default; the
NCCL terms are NCCL's own buffer sizes (src/init.cc `computeBuffSizes`, src/transport/p2p.cc,
src/transport/nvls.cc) times channel counts read from published NCCL logs.
docs/engines/allocator.md ("Outside the allocator") lists what is left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeroplan.errors import SpecError

MIB = 2**20


@dataclass(frozen=True)
class OutsideTerm:
    """One kind of memory outside the allocator: its bytes on one rank and where they come from."""

    name: str
    size_bytes: int
    source: str
    overridden: bool = False


@dataclass(frozen=True)
class ProcessGroup:
    """One process group a rank is a member of (one NCCL communicator): a mesh dimension's group,
    or the world. `p2p_peers`: ranks it sends to or receives from point to point (pipeline stages)."""

    name: str
    size: int
    nodes: int = 1
    p2p_peers: int = 0


# -- the CUDA context ---------------------------------------------------------------------------

# (compute capability) -> (bytes, what was measured, source). nvidia-smi's per-process figure with
# no tensor allocated, CUDA lazy module loading (PyTorch's default since 1.13).
MEASURED_CONTEXTS: dict[tuple[int, int], tuple[int, str]] = {
    (8, 6): (256 * MIB, "RTX 3090, torch 2.7.1+cu128, driver 610.43.03: \"a flat 256 MiB\" held by a bare CUDA "
                        "context (github.com/invoke-ai/InvokeAI/issues/9413)"),
    (8, 9): (426 * MIB, "RTX 6000 Ada, torch 2.10.0+cu130: nvidia-smi 426 MiB after torch.cuda.mem_get_info(0), "
                        "torch allocated/reserved 0 (github.com/unslothai/unsloth-zoo/pull/1053)"),
}
# No measurement for the GPU: PyTorch's maintainer's figure for CUDA >= 11.7 with lazy loading,
# "around 400MB" (github.com/pytorch/pytorch/issues/109888).
DEFAULT_LAZY_CONTEXT_BYTES = 400 * MIB
# Eager module loading (CUDA < 11.7, or CUDA_MODULE_LOADING=EAGER): PyTorch's own measurement when it
# made lazy loading the default, 666,632,192 bytes used after a 6.4 MB tensor (a 20 MiB segment)
# with CUDA_MODULE_LOADING=DEFAULT (github.com/pytorch/pytorch/pull/86509).
EAGER_CONTEXT_BYTES = 666_632_192 - 20 * MIB


def cuda_context(compute_capability: tuple[int, int] | None, cuda_version: tuple[int, int] | None,
                 module_loading: str = "lazy") -> OutsideTerm:
    """The CUDA context of one process on one GPU."""
    if module_loading not in ("lazy", "eager"):
        raise SpecError(f"module_loading: {module_loading!r} is not lazy or eager (CUDA_MODULE_LOADING)")
    if module_loading == "eager" or (cuda_version is not None and cuda_version < (11, 7)):
        return OutsideTerm("cuda_context", EAGER_CONTEXT_BYTES,
                           "eager module loading: github.com/pytorch/pytorch/pull/86509, 666,632,192 B used with "
                           "CUDA_MODULE_LOADING=DEFAULT, less its 20 MiB segment")
    if compute_capability in MEASURED_CONTEXTS:
        size, source = MEASURED_CONTEXTS[compute_capability]
        return OutsideTerm("cuda_context", size, source)
    cc = "unknown" if compute_capability is None else f"sm_{compute_capability[0]}{compute_capability[1]}"
    return OutsideTerm("cuda_context", DEFAULT_LAZY_CONTEXT_BYTES,
                       f"no published measurement for {cc}: the stated default, \"around 400MB\" for CUDA >= 11.7 "
                       "with lazy loading (github.com/pytorch/pytorch/issues/109888)")


# -- NCCL ---------------------------------------------------------------------------------------

NCCL_STEPS = 8  # src/include/device.h
LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16  # init.cc DEFAULT_LL_BUFFSIZE: lines/thread x threads x steps x 16 B
LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8  # init.cc DEFAULT_LL128_BUFFSIZE: elems/thread x threads x steps x 8 B
SIMPLE_BUFFSIZE = 1 << 22  # init.cc DEFAULT_BUFFSIZE, NCCL_BUFFSIZE: 4 MiB
NVLS_CHUNK_BYTES = 128 * 1024  # nvls.cc NCCL_NVLS_CHUNKSIZE default
NVLS_CHANNELS_SM90 = 16  # nvls.cc NVLS_NCHANNELS_SM90
NVLS_CHANNELS_SM100 = 24  # nvls.cc NVLS_NCHANNELS_SM100_NVL (one NVLink domain)
P2P_CHUNK_BYTES = {"nvswitch": 1 << 19, "pcie": 1 << 17, "net": 1 << 17}  # init.cc P2P_{NVL,PCI,NET}_CHUNKSIZE

# Ring channels NCCL builds, read from published NCCL_DEBUG=INFO logs (NCCL picks them by searching
# the topology, src/graph/search.cc; the logs are what it found on these systems).
RING_CHANNELS: dict[tuple[str, str], tuple[int, str]] = {
    ("ampere", "nvswitch"): (24, "HGX A100, 8 GPUs: \"Channel 23/24\" (github.com/NVIDIA/nccl-tests/issues/100)"),
    ("hopper", "nvswitch"): (16, "H800 x 8: \"16 coll channels, 0 nvls channels, 16 p2p channels, 16 p2p channels "
                                 "per peer\" (github.com/NVIDIA/nccl/issues/892); no H100 log found"),
}
PCIE_RING_CHANNELS = (2, "8 GPUs over PCIe/SHM: channels 00 and 01 (github.com/NVIDIA/nccl-tests/issues/228)")
DEFAULT_RING_CHANNELS = (16, "no published log for this GPU and link: the H800 NVLink figure, 16, is assumed")


def ring_channels(architecture: str, interconnect: str) -> tuple[int, str]:
    if interconnect == "pcie":
        return PCIE_RING_CHANNELS
    return RING_CHANNELS.get((architecture, interconnect), DEFAULT_RING_CHANNELS)


def nccl_buffer_sizes(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """(LL, LL128, SIMPLE) bytes per connection: NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE, NCCL_BUFFSIZE
    or the defaults (init.cc `computeBuffSizes`)."""
    def read(name: str, default: int) -> int:
        text = environ.get(name)
        if text is None:
            return default
        if not text.strip().isdigit() or int(text) <= 0:
            raise SpecError(f"{name}: {text!r} is not a positive number of bytes")
        return int(text)
    return read("NCCL_LL_BUFFSIZE", LL_BUFFSIZE), read("NCCL_LL128_BUFFSIZE", LL128_BUFFSIZE), \
        read("NCCL_BUFFSIZE", SIMPLE_BUFFSIZE)


def nccl_terms(group: ProcessGroup, *, architecture: str, interconnect: str, compute_capability: tuple[int, int] | None,
               environ: Mapping[str, str]) -> list[OutsideTerm]:
    """NCCL's buffers for one communicator on one rank: ring connections (all-gather, reduce-scatter,
    all-reduce), NVLink SHARP on Hopper and later NVSwitch systems, point-to-point buffers."""
    if group.size < 2:
        return []  # a group of one never talks
    ll, ll128, simple = nccl_buffer_sizes(environ)
    channels, channel_source = ring_channels(architecture, interconnect)
    # p2p.cc p2pSendSetup/p2pRecvSetup: per connection the SIMPLE buffer (on the sender when it reads
    # over NVLink) plus LL and LL128 (on the receiver); a ring rank has one send and one receive
    # connection per channel, so it holds one whole set per channel
    terms = [OutsideTerm(f"nccl_ring:{group.name}", channels * (ll + ll128 + simple),
                         f"{channels} ring channels x (LL {ll:,} + LL128 {ll128:,} + SIMPLE {simple:,} B), NCCL "
                         f"src/init.cc computeBuffSizes and src/transport/p2p.cc; channels: {channel_source}")]
    if interconnect == "nvswitch" and compute_capability is not None and compute_capability >= (9, 0) \
            and group.nodes == 1 and environ.get("NCCL_NVLS_ENABLE", "2") != "0":
        nvls_channels = NVLS_CHANNELS_SM90 if compute_capability < (10, 0) else NVLS_CHANNELS_SM100
        # nvls.cc ncclNvlsBufferSetup: nChannels x 2 x (chunk x NCCL_STEPS) per head, one head per local rank
        terms.append(OutsideTerm(f"nccl_nvls:{group.name}", nvls_channels * 2 * NVLS_CHUNK_BYTES * NCCL_STEPS * group.size,
                                 f"NVLink SHARP: {nvls_channels} channels x 2 x {NVLS_CHUNK_BYTES * NCCL_STEPS:,} B x "
                                 f"{group.size} heads (src/transport/nvls.cc ncclNvlsBufferSetup)"))
    if group.p2p_peers:
        link = "net" if group.nodes > 1 else interconnect if interconnect in P2P_CHUNK_BYTES else "pcie"
        chunk = min(P2P_CHUNK_BYTES[link], simple // NCCL_STEPS)  # computeBuffSizes caps it at SIMPLE / steps
        terms.append(OutsideTerm(f"nccl_p2p:{group.name}", group.p2p_peers * channels * chunk * NCCL_STEPS,
                                 f"{group.p2p_peers} peers x {channels} channels x {chunk:,} B x {NCCL_STEPS} steps "
                                 "(src/init.cc P2P chunk sizes; channels per peer taken as the ring's)"))
    return terms


# -- cuBLAS (inside the allocator) --------------------------------------------------------------

_CUBLAS_CONFIG = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, environ: Mapping[str, str]) -> int:
    """One cuBLAS workspace (per handle and stream), CublasHandlePool.cpp `parseChosenWorkspaceSize`
    (lines 165-207): CUBLAS_WORKSPACE_CONFIG ":KiB:count" pairs, else 32 MiB on compute capability
    9.x, 10.x and 12.x and ":4096:2:16:8" (8 MiB + 128 KiB) before. cuBLASLt shares it (lines
    209-220: unified workspaces unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0)."""
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is not None:
        pairs = _CUBLAS_CONFIG.findall(config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    use_32mib = compute_capability is not None and compute_capability[0] in (9, 10, 12)
    return 4096 * 8 * 1024 if use_32mib else 4096 * 1024 * 2 + 16 * 1024 * 8


def outside_terms(*, architecture: str, compute_capability: tuple[int, int] | None,
                  cuda_version: tuple[int, int] | None, interconnect: str, process_groups: tuple[ProcessGroup, ...],
                  environ: Mapping[str, str] | None = None, module_loading: str = "lazy",
                  overrides: Mapping[str, int] | None = None) -> tuple[OutsideTerm, ...]:
    """Every term outside the allocator on one rank: the context, then each communicator's buffers.
    `interconnect`: nvswitch (SXM GPUs on NVLink switches), pcie; `overrides`: term name -> bytes."""
    if interconnect not in ("nvswitch", "pcie"):
        raise SpecError(f"interconnect: {interconnect!r} is not nvswitch or pcie")
    environ = environ or {}
    terms = [cuda_context(compute_capability, cuda_version, module_loading)]
    for group in process_groups:
        terms += nccl_terms(group, architecture=architecture, interconnect=interconnect,
                            compute_capability=compute_capability, environ=environ)
    overrides = dict(overrides or {})
    unknown = set(overrides) - {t.name for t in terms}
    if unknown:
        raise SpecError(f"overrides: no term named {sorted(unknown)[0]!r} (terms: {', '.join(t.name for t in terms)})")
    bad = [name for name, value in overrides.items() if isinstance(value, bool) or not isinstance(value, int) or value < 0]
    if bad:
        raise SpecError(f"overrides: {bad[0]}: give a whole number of bytes >= 0, got {overrides[bad[0]]!r}")
    return tuple(OutsideTerm(t.name, overrides[t.name], f"given (was {t.size_bytes:,} B: {t.source})", True)
                 if t.name in overrides else t for t in terms)
