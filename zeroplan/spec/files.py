"""Files a user names for output: checked before any work starts, written whole or not at all.

A command that computes for a minute and then cannot write its result has wasted the minute, so
every output path is checked first (`writable_file`); the write itself goes to a temporary file in
the same directory and is renamed over the target (`write_atomic`), so a reader never sees half.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from zeroplan.errors import SpecError


def writable_file(path: str | Path, field: str) -> Path:
    """`path` as a Path if a file can be written there: its directory exists and is writable, and
    it is not itself a directory. `field` names the option in the one-line error."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise SpecError(f"{field}: {path} is a directory; name a file")
    if not folder.is_dir():
        raise SpecError(f"{field}: directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(f"{field}: directory {folder} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise SpecError(f"{field}: {path} exists and is not writable")
    return target


def write_atomic(path: str | Path, text: str, field: str = "output") -> None:
    """Write `text` to `path` through a temporary file and a rename: the whole file or no change."""
    target = Path(path)
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent if str(target.parent) else ".")
    except OSError as error:
        raise SpecError(f"{field}: cannot write {path}: {error.strerror or error}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except OSError as error:
        raise SpecError(f"{field}: cannot write {path}: {error.strerror or error}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
