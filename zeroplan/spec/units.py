"""Byte units: parsing sizes the user types and formatting bytes for reports.

Bytes are ints everywhere in zeroplan; conversion happens only here, at the edge.
NOTE: GiB (gibibyte) is 1024**3 bytes; GB (gigabyte) is 10**9 bytes. Both are labelled as such.
"""

from __future__ import annotations

import re

from zeroplan.errors import SpecError

UNIT_BYTES = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

REPORT_UNITS = ("GiB", "GB", "MiB", "MB")
"""The units every command's --units accepts (bytes per unit: UNIT_BYTES)."""
REPORT_UNITS_HELP = "GiB/MiB = 2^30/2^20 bytes, GB/MB = 10^9/10^6 bytes (json is always bytes)."
UNIT_POWERS = {"GiB": "2^30", "GB": "10^9", "MiB": "2^20", "MB": "10^6"}
"""Each report unit as the power it divides by, for table headings."""

MAX_SIZE_BYTES = 2**60  # 1 EiB: far above any machine; a larger number is a typo, and inf/1e400 cannot be counted

_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size_bytes(text: str, field: str) -> int:
    """Parse '80GiB', '40 GB', '1.5e9' (bytes) into an int number of bytes.

    A bare number is bytes. `field` names the option in the error message.
    """
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise SpecError(f"{field}: cannot read size {text!r}; write e.g. 80GiB, 40GB or 1e9 (bytes)")
    number, unit = float(match.group(1)), match.group(2).upper() or "B"
    if unit not in UNIT_BYTES:
        raise SpecError(f"{field}: unknown unit {match.group(2)!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    if not number * UNIT_BYTES[unit] <= MAX_SIZE_BYTES:  # also catches inf from 1e400
        raise SpecError(f"{field}: size {text!r} is larger than 1 EiB; write e.g. 80GiB")
    size_bytes = int(number * UNIT_BYTES[unit])
    if size_bytes <= 0:
        raise SpecError(f"{field}: size must be positive, got {text!r}")
    return size_bytes


def bytes_in_unit(size_bytes: int, unit: str) -> float:
    """`size_bytes` expressed in `unit` (one of REPORT_UNITS)."""
    return size_bytes / UNIT_BYTES[unit.upper()]


def format_bytes(size_bytes: int, unit: str, digits: int = 2) -> str:
    """'12.34 GiB' style text, labelled with the unit it was divided by."""
    return f"{bytes_in_unit(size_bytes, unit):,.{digits}f} {unit}"
