"""PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF), read as torch 2.13 reads it.

Two parsers read the same text (c10/core/AllocatorConfig.h `setAllocatorSettings`):
1. the accelerator-generic one, c10/core/AllocatorConfig.cpp `AcceleratorAllocatorConfig::parseArgs`:
   `large_segment_size_mb` in a first pass (lines 255-263: `max_non_split_rounding_mb` and
   `max_split_size_mb` are checked against it), then the caching allocator's keys; on a CUDA build
   a key that neither it nor the CUDA parser registered is refused (lines 283-289);
2. on a CUDA build, c10/cuda/CUDAAllocatorConfig.cpp `CUDAAllocatorConfig::parseArgs` (lines 72-140):
   `backend`, the pinned-memory keys, `per_process_memory_fraction`, `throw_on_cudamalloc_oom`, ...
Both walk the tokens of `ConfigTokenizer` (AllocatorConfig.h): the text is cut at `,` `:` `[` `]`,
every white-space character is dropped (also inside a word), and after each key:value the token
that follows is skipped as the separator whatever it is (`checkToken` only compares). Numbers are
read with std::stoull / std::stod: a number prefix is enough ("100x" is 100, "-5" wraps around).
Accepting and refusing follow torch exactly (tests/estimate/device/test_alloc_conf.py feeds the same strings to
torch 2.13's own parser where the CPU build has it); the messages name the variable and the key and
quote torch's wording, or say plainly what torch's internal assertion means.

Which variable: c10/cuda/CUDAAllocatorConfig.h `CUDAAllocatorConfig::instance` reads
PYTORCH_CUDA_ALLOC_CONF, and PYTORCH_ALLOC_CONF only when the former is unset (torch 2.13.0's
`torch._C._accelerator_getAllocatorSettings()` agrees; the header's comment "PYTORCH_ALLOC_CONF is
primary" is not what 2.13 does).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from zeroplan.errors import SpecError

MIB = 2**20
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): "no limit" for max_split_size
K_MIN_LARGE_ALLOC_BYTES = 10 * MIB  # AllocatorConfig.h kMinLargeAlloc
DEFAULT_LARGE_SEGMENT_BYTES = 20 * MIB  # AllocatorConfig.h large_segment_size_{20971520}
ROUNDUP_INTERVALS = 16  # AllocatorConfig.cpp kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of 2
MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig.h pinned_max_register_threads()

VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # in the order 2.13 looks for them

# AllocatorConfig.cpp getMutableKeys (lines 14-24) and torch 2.13.0's libc10 (two pinned keys more)
GENERIC_KEYS = frozenset({
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "pinned_use_background_threads",
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
})
# CUDAAllocatorConfig.h getKeys(), torch 2.13.0 (the ROCm spellings are accepted by CUDA builds too)
CUDA_KEYS = frozenset({
    "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom",
})
BACKENDS = ("native", "cudaMallocAsync")  # CUDAAllocatorConfig.cpp parseAllocatorConfig (lines 37-42)


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator settings a CUDA build of torch 2.13 runs with; the defaults are torch's."""

    text: str = ""  # the setting as given
    variable: str | None = None  # the environment variable it came from; None: given directly or unset
    # the device caching allocator (AllocatorConfig.h members)
    large_segment_size_bytes: int = DEFAULT_LARGE_SEGMENT_BYTES
    max_split_size_bytes: int = SIZE_MAX
    max_non_split_rounding_bytes: int = DEFAULT_LARGE_SEGMENT_BYTES  # follows large_segment_size (cpp line 263)
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    # the pinned host allocator
    pinned_use_background_threads: bool = False
    pinned_max_round_threshold_bytes: int = SIZE_MAX
    pinned_max_cached_size_bytes: int = SIZE_MAX
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_reserve_segment_size_mb: int = 0
    pinned_free_catch_all: bool = False
    # CUDA-specific (CUDAAllocatorConfig.h members)
    backend: str = "native"
    release_lock_on_cudamalloc: bool = False
    graph_capture_record_stream_reuse: bool = False
    per_process_memory_fraction: float = 1.0
    throw_on_cudamalloc_oom: bool = False
    warnings: tuple[str, ...] = field(default=(), compare=False)  # what torch warns about and accepts

    def divisions_for(self, size_bytes: int) -> int:
        """AllocatorConfig.cpp `roundup_power2_divisions(size)` (lines 65-81): the divisions of the
        power-of-two interval holding `size` (index 0: below 2 MiB, 15: 32 GiB and above)."""
        log_size = size_bytes.bit_length() - 1
        index = max(log_size - 20, 0)  # 63 - clz(1 MiB) = 20
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


DEFAULT_SETTINGS = AllocatorSettings()

RECIPE_ALLOC_CONF = {"torchtitan": "expandable_segments:True"}
"""What a recipe's launcher sets when the environment does not: torchtitan's run_train.sh starts torchrun with
PYTORCH_ALLOC_CONF="expandable_segments:True" (PYTORCH_CUDA_ALLOC_CONF in its earlier versions)."""


class _Refused(Exception):
    """torch refuses the text: `detail` says why in our words, `torch_says` in torch's."""

    def __init__(self, detail: str, torch_says: str, *, syntax: bool = False):
        super().__init__(detail)
        self.detail, self.torch_says, self.syntax = detail, torch_says, syntax


_OUT_OF_TOKENS = "Index out of bounds in ConfigTokenizer"  # AllocatorConfig.h checkIndex
_NO_BRACKET = "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
_WHITESPACE = " \t\n\v\f\r"  # std::isspace in the C locale


def tokenize(text: str) -> list[str]:
    """AllocatorConfig.h `ConfigTokenizer`: words and the single characters , : [ ]; spaces dropped."""
    tokens, word = [], []
    for ch in text:
        if ch in ",:[]":
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(ch)
        elif ch not in _WHITESPACE:
            word.append(ch)
    if word:
        tokens.append("".join(word))
    return tokens


# patterns, compiled (and cached by `re`) at their first use: only a PYTORCH_CUDA_ALLOC_CONF value is parsed
_UNSIGNED = r"([+-]?)([0-9]+)"
_DOUBLE = r"""[+-]?(?:
      (?P<hex>0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?)
    | (?P<dec>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)
    | (?P<inf>[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)
    | (?P<nan>[nN][aA][nN](?:\([0-9A-Za-z_]*\))?))"""


def stoull(token: str) -> int:
    """std::stoull: the leading decimal number of `token` ("100x" -> 100, "-5" -> 2**64 - 5)."""
    match = re.match(_UNSIGNED, token)
    if match is None:
        raise _Refused(f"{token!r} is not a whole number", "stoull")
    value = int(match.group(2))
    if value > SIZE_MAX:
        raise _Refused(f"{token!r} is larger than 2**64 - 1", "stoull")
    return (-value) % 2**64 if match.group(1) == "-" else value


def stod(token: str) -> float:
    """std::stod: the leading number of `token` (decimal, hexadecimal, inf or nan); out of range
    (overflow, or a nonzero value below the smallest normal double) is refused as glibc does."""
    match = re.match(_DOUBLE, token, re.X)
    if match is None:
        raise _Refused(f"{token!r} is not a number", "stod")
    text = match.group(0)
    if match.group("inf") or match.group("nan"):
        return float(text.split("(")[0])
    if match.group("hex"):
        value, mantissa = float.fromhex(text), text.lower().replace("0x", "", 1).partition("p")[0]
    else:
        value, mantissa = float(text), text.lower().partition("e")[0]
    nonzero = any(c not in "0.+-" for c in mantissa)
    if math.isinf(value) or (nonzero and abs(value) < sys.float_info.min):
        raise _Refused(f"{token!r} is out of the range of a double", "stod")
    return value


def _is_power_of_2(value: int) -> bool:  # llvm::isPowerOf2_64
    return value > 0 and value & (value - 1) == 0


class _Walk:
    """The tokens and the reading positions, as ConfigTokenizer gives them to the parsers."""

    def __init__(self, text: str):
        self.tokens = tokenize(text)

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            raise _Refused(f"{key}: the text ends where a ':' or a value should follow", _OUT_OF_TOKENS, syntax=True)
        return self.tokens[i]

    def size_t(self, i: int, key: str) -> int:
        return stoull(self.at(i, key))

    def double(self, i: int, key: str) -> float:
        return stod(self.at(i, key))

    def boolean(self, i: int, key: str) -> bool:
        token = self.at(i, key)
        if token not in ("True", "False"):
            raise _Refused(f"{key}: write True or False, got {token!r}",
                           f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{token}'")
        return token == "True"

    def skip_key(self, i: int, key: str) -> int:
        """ConfigTokenizer::skipKey: past the ':' to the value, or to the ']' closing a list."""
        self.at(i + 1, key)  # the ':' (only its presence is checked)
        i += 2
        if self.at(i, key) != "[":
            return i
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            i += 1
        if i >= len(self.tokens):
            raise _Refused(f"{key}: a '[' list has no closing ']'", _NO_BRACKET, syntax=True)
        return i


def _mb_at_least(walk: _Walk, i: int, key: str, minimum_mb: int) -> int:
    """max_split_size_mb and max_non_split_rounding_mb (cpp lines 104-137): >= large_segment_size."""
    value = walk.size_t(i, key)
    if value < minimum_mb:
        raise _Refused(f"{key}: must be at least {minimum_mb} (the large segment size in MiB), got {value}",
                       f"CachingAllocator option {key} too small, must be >= {minimum_mb}")
    return min(value, SIZE_MAX // MIB) * MIB


def _roundup_divisions(walk: _Walk, i: int, key: str, divisions: list[int]) -> int:
    """parseRoundUpPower2Divisions (cpp lines 155-221): an int for every interval, or a list
    [boundary_mb:divisions, ..., >:divisions]; a boundary b sets the interval log2(b), the first one
    also every interval below it, '>' every interval after the last one set."""
    walk.at(i + 1, key)
    i += 2
    if walk.at(i, key) != "[":
        value = walk.size_t(i, key)
        if not _is_power_of_2(value):
            raise _Refused(f"{key}: the divisions must be a power of 2, got {value}",
                           "For roundups, the divisions has to be power of 2 ")
        divisions[:] = [value] * ROUNDUP_INTERVALS
        return i
    first, last_index = True, 0
    i += 1
    while i < len(walk) and walk.tokens[i] != "]":
        boundary_at = i
        walk.at(i + 1, key)
        value = walk.size_t(i + 2, key)
        i += 2
        if value != 0 and not _is_power_of_2(value):
            raise _Refused(f"{key}: divisions must be a power of 2 or 0, got {value}",
                           "For roundups, the divisions has to be power of 2 or 0 to disable roundup ")
        if walk.tokens[boundary_at] == ">":
            divisions[last_index + 1:] = [value] * len(divisions[last_index + 1:])
        else:
            boundary = walk.size_t(boundary_at, key)
            if not _is_power_of_2(boundary):
                raise _Refused(f"{key}: interval boundaries (MiB) must be powers of 2, got {boundary}",
                               "For roundups, the intervals have to be power of 2 ")
            index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last_index = index
        if walk.at(i + 1, key) != "]":
            i += 1  # the ',' (only its presence is checked)
        i += 1
    if i >= len(walk):
        raise _Refused(f"{key}: a '[' list has no closing ']'", _NO_BRACKET, syntax=True)
    return i


def _generic(walk: _Walk, registered: frozenset[str] | None) -> dict:
    """AcceleratorAllocatorConfig::parseArgs (cpp lines 241-297): the values it sets."""
    out: dict = {"large_segment_size_bytes": DEFAULT_LARGE_SEGMENT_BYTES}
    divisions = [0] * ROUNDUP_INTERVALS
    i = 0
    while i < len(walk):  # first pass: large_segment_size_mb, wherever the token stands
        if walk.tokens[i] == "large_segment_size_mb":
            key = "large_segment_size_mb"
            walk.at(i + 1, key)
            value = walk.size_t(i + 2, key)
            i += 2
            floor_mb = K_MIN_LARGE_ALLOC_BYTES // MIB
            if value <= floor_mb:
                raise _Refused(f"{key}: must be more than {floor_mb}, got {value}",
                               f"CachingAllocator option {key} must be > {floor_mb} MB")
            out["large_segment_size_bytes"] = min(value, SIZE_MAX // MIB) * MIB
        i += 1
    large_mb = out["large_segment_size_bytes"] // MIB
    out["max_non_split_rounding_bytes"] = out["large_segment_size_bytes"]
    i = 0
    while i < len(walk):
        key = walk.tokens[i]
        if key == "max_split_size_mb":
            walk.at(i + 1, key)
            out["max_split_size_bytes"] = _mb_at_least(walk, i + 2, key, large_mb)
            i += 2
        elif key == "max_non_split_rounding_mb":
            walk.at(i + 1, key)
            out["max_non_split_rounding_bytes"] = _mb_at_least(walk, i + 2, key, large_mb)
            i += 2
        elif key == "garbage_collection_threshold":
            walk.at(i + 1, key)
            value = walk.double(i + 2, key)
            i += 2
            if not 0.0 < value < 1.0:
                raise _Refused(f"{key}: must be strictly between 0 and 1, got {value}",
                               "garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
            out["garbage_collection_threshold"] = value
        elif key == "roundup_power2_divisions":
            i = _roundup_divisions(walk, i, key, divisions)
            out["roundup_power2_divisions"] = tuple(divisions)
        elif key in ("expandable_segments", "pinned_use_background_threads"):
            walk.at(i + 1, key)
            out[key] = walk.boolean(i + 2, key)
            i += 2
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            walk.at(i + 1, key)
            out[key.removesuffix("_mb") + "_bytes"] = min(walk.size_t(i + 2, key), SIZE_MAX // MIB) * MIB
            i += 2
        else:
            if key != "large_segment_size_mb" and registered is not None and key not in GENERIC_KEYS | registered:
                raise _Refused(f"unrecognized key {key!r}",
                               f"Unrecognized key '{key}' in Accelerator allocator config.")
            i = walk.skip_key(i, key)
        if i + 1 < len(walk):
            i += 1  # the separator (torch compares it with ',' and goes on either way)
        i += 1
    return out


def _cuda(walk: _Walk) -> dict:
    """CUDAAllocatorConfig::parseArgs (CUDAAllocatorConfig.cpp lines 72-140): the values it sets."""
    out: dict = {}
    i = 0
    while i < len(walk):
        key = walk.tokens[i]
        if key == "backend":  # parseAllocatorConfig (lines 10-70)
            walk.at(i + 1, key)
            value = walk.at(i + 2, key)
            i += 2
            if value not in BACKENDS:
                raise _Refused(f"{key}: {value!r} is not native or cudaMallocAsync",
                               "Unknown allocator backend, options are native and cudaMallocAsync")
            out["backend"] = value
        elif key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc"):
            walk.at(i + 1, key)
            out["release_lock_on_cudamalloc"] = walk.boolean(i + 2, key)
            i += 2
        elif key in ("pinned_use_cuda_host_register", "pinned_use_hip_host_register"):
            walk.at(i + 1, key)
            out["pinned_use_cuda_host_register"] = walk.boolean(i + 2, key)
            i += 2
        elif key in ("graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"):
            walk.at(i + 1, key)
            out[key] = walk.boolean(i + 2, key)
            i += 2
        elif key == "pinned_num_register_threads":  # lines 170-188
            walk.at(i + 1, key)
            value = walk.size_t(i + 2, key)
            i += 2
            if not _is_power_of_2(value):
                raise _Refused(f"{key}: must be a power of 2, got {value}",
                               f"Number of register threads has to be power of 2, got {value}")
            if value > MAX_REGISTER_THREADS:
                raise _Refused(f"{key}: at most {MAX_REGISTER_THREADS}, got {value}",
                               f"Number of register threads should be less than or equal to {MAX_REGISTER_THREADS}, got {value}")
            out[key] = value
        elif key == "pinned_reserve_segment_size_mb":  # lines 190-199
            walk.at(i + 1, key)
            value = walk.size_t(i + 2, key)
            i += 2
            if value == 0:
                raise _Refused(f"{key}: must be greater than 0",
                               "Pinned reserve segment size has to be greater than 0")
            out[key] = value
        elif key == "per_process_memory_fraction":  # lines 158-168
            walk.at(i + 1, key)
            value = walk.double(i + 2, key)
            i += 2
            if not 0.0 <= value <= 1.0:
                raise _Refused(f"{key}: must be between 0 and 1, got {value}",
                               "per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            out[key] = value
        else:  # the generic parser's keys (and refused the unknown ones already)
            i = walk.skip_key(i, key)
        if i + 1 < len(walk):
            i += 1
        i += 1
    return out


def parse_generic(text: str, *, registered: frozenset[str] | None) -> dict:
    """The accelerator-generic parser alone: the settings it sets, or a SpecError. `registered`:
    the keys a device parser registered (CUDA_KEYS on a CUDA build); None as on a CPU-only build,
    where no device parser is registered and an unknown key is skipped (what torch 2.13.0's
    `torch._C._accelerator_setAllocatorSettings` does on this project's CPU build)."""
    try:
        return _generic(_Walk(text), registered)
    except _Refused as refused:
        raise SpecError(_message("PYTORCH_ALLOC_CONF", refused)) from None


def parse_alloc_conf(text: str, *, variable: str | None = None) -> AllocatorSettings:
    """The settings a CUDA build of torch 2.13 takes from `text`; a one-line SpecError naming the
    variable and the key where torch would refuse it."""
    walk = _Walk(text)
    try:
        values = _generic(walk, CUDA_KEYS) | _cuda(walk)
    except _Refused as refused:
        raise SpecError(_message(variable or "PYTORCH_CUDA_ALLOC_CONF", refused)) from None
    settings = replace(DEFAULT_SETTINGS, text=text, variable=variable, **values)
    return replace(settings, warnings=_warnings(settings, values))


def settings_from_environment(environ: Mapping[str, str]) -> AllocatorSettings:
    """The settings of a process started with `environ`: PYTORCH_CUDA_ALLOC_CONF, else
    PYTORCH_ALLOC_CONF (CUDAAllocatorConfig.h `instance()`), else torch's defaults."""
    for variable in VARIABLES:
        if variable in environ:
            return parse_alloc_conf(environ[variable], variable=variable)
    return DEFAULT_SETTINGS


def _message(variable: str, refused: _Refused) -> str:
    hint = "; write comma-separated key:value pairs, e.g. expandable_segments:True,max_split_size_mb:512" \
        if refused.syntax else ""
    return f"{variable}: {refused.detail} (torch 2.13 refuses it: \"{refused.torch_says.strip()}\"){hint}"


def _warnings(settings: AllocatorSettings, values: dict) -> tuple[str, ...]:
    """What torch accepts but warns about (cpp lines 134-139 and libc10's pinned-threshold warning)."""
    warnings = []
    native_only = {"max_split_size_bytes", "roundup_power2_divisions", "garbage_collection_threshold"}
    if settings.backend == "cudaMallocAsync" and native_only & set(values):
        warnings.append("backend:cudaMallocAsync ignores max_split_size_mb, roundup_power2_divisions and "
                        "garbage_collection_threshold")
    if settings.pinned_max_round_threshold_bytes > settings.pinned_max_cached_size_bytes:
        warnings.append("pinned_max_round_threshold_mb > pinned_max_cached_size_mb: the cache size limit takes precedence")
    return tuple(warnings)
