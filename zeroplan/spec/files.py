"""Files a user names for output: checked before any work starts, written whole or not at all.

A command that computes for a minute and then cannot write its result has wasted the minute, so
every output path is checked first (`writable_file`); the write itself (`write_atomic`) goes to a
temporary file beside the target and is renamed over it, so a reader never sees half. What the
shell's `>` would do is kept where it is safe: a symlink is written through to its target (the link
stays), `-` means standard output, a replaced file keeps its mode (and, for root, its owner) and a new
one gets the umask's. What `>` would do but a rename cannot is refused: a device, a FIFO or a socket
is not a file to replace (root once turned /dev/full into a regular file this way).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

from zeroplan.errors import SpecError

STDOUT = "-"
"""The name that means standard output, as for most command-line tools."""

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"))


def is_stdout(path: str | Path | None) -> bool:
    """Whether an output option names standard output (`-`)."""
    return path is not None and str(path) == STDOUT


def _short(path: str | Path) -> str:
    """The path as a message shows it: a name of thousands of characters is cut, with its length."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:180]}... ({len(text):,} characters)"


def _target(path: str | Path, field: str) -> Path:
    """The file a write to `path` lands in: symlinks followed (a dangling one names the file it will
    create), every name within the file system's limits."""
    text = str(path)
    if not text:
        raise SpecError(f"{field}: empty file name; name a file")
    if "\x00" in text:
        raise SpecError(f"{field}: the file name contains a NUL byte")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > 255:  # NAME_MAX of every Linux and macOS file system zeroplan runs on
            raise SpecError(f"{field}: file name {_short(part)!r} is longer than 255 bytes, the most a file system allows")
    try:
        return Path(os.path.realpath(text))
    except (OSError, ValueError) as error:
        raise SpecError(f"{field}: cannot use {_short(path)}: {getattr(error, 'strerror', None) or error}") from None


def _existing_kind(target: Path, path: str | Path, field: str) -> os.stat_result | None:
    """The stat of the target if it exists (None if not); a directory, device, FIFO or socket is refused."""
    try:
        info = target.stat()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SpecError(f"{field}: cannot use {_short(path)}: {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise SpecError(f"{field}: {_short(path)} is a directory; name a file")
    for test, kind in _KINDS:
        if test(info.st_mode):
            raise SpecError(f"{field}: {_short(path)} is {kind}, not a regular file; name a file "
                            f"(or {STDOUT} for standard output)")
    return info


def writable_file(path: str | Path, field: str, stdout: bool = False) -> Path:
    """`path` as a Path if a file can be written there: its directory exists and is writable, and it
    is neither a directory nor a device, FIFO or socket (after symlinks). `field` names the option in
    the one-line error; `stdout` allows `-` (standard output), returned as is."""
    if is_stdout(path):
        if not stdout:
            raise SpecError(f"{field}: {STDOUT} (standard output) is not taken here; name a file")
        return Path(STDOUT)
    target = _target(path, field)
    existing = _existing_kind(target, path, field)
    folder = target.parent
    try:
        if not folder.is_dir():
            raise SpecError(f"{field}: directory {_short(folder)} does not exist; create it first")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise SpecError(f"{field}: directory {_short(folder)} is not writable")
        if existing is not None and not os.access(target, os.W_OK):
            raise SpecError(f"{field}: {_short(path)} exists and is not writable")
    except OSError as error:  # e.g. a path longer than PATH_MAX
        raise SpecError(f"{field}: cannot use {_short(path)}: {error.strerror or error}") from None
    return Path(path)


def _new_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0666 less the umask (mkstemp's own is 0600)."""
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: str | Path, content: str | bytes, field: str = "output") -> None:
    """Write `content` to `path` through a temporary file and a rename: the whole file or no change.
    `-` writes to standard output; a symlink is written through; a replaced file keeps its mode."""
    if is_stdout(path):
        stream = sys.stdout.buffer if isinstance(content, bytes) else sys.stdout
        stream.write(content)
        stream.flush()
        return
    target = _target(path, field)
    existing = _existing_kind(target, path, field)
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        # a short name of our own: the target's name may already be near the 255-byte limit
        handle, tmp = tempfile.mkstemp(prefix=".zeroplan-", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise SpecError(f"{field}: cannot write {_short(path)}: {error.strerror or error}") from None
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
            os.fchmod(out.fileno(), stat.S_IMODE(existing.st_mode) if existing is not None else _new_file_mode())
            if existing is not None and os.geteuid() == 0:  # root replacing another user's file keeps its owner
                os.fchown(out.fileno(), existing.st_uid, existing.st_gid)
        os.replace(tmp, target)
    except OSError as error:
        raise SpecError(f"{field}: cannot write {_short(path)}: {error.strerror or errno.errorcode.get(error.errno, error)}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
