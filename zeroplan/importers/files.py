"""Reading a user's file before any parser sees it: bounded in size and nesting, text only.

A config or model file is a few kilobytes; these bounds turn a wrong file (a binary, a log, a
generated document nested 100,000 deep) into one `SpecError` line instead of a parser's traceback,
a `RecursionError` or minutes of work.
"""

from __future__ import annotations

import re
from pathlib import Path

from zeroplan.errors import SpecError

MAX_FILE_BYTES = 1 << 20  # 1 MiB: DeepSpeed configs and config.json files are a few KB
MAX_NESTING = 64  # DeepSpeed configs nest 3 deep, config.json files 4; json recurses once per level

# A double-quoted string (skipped whole, so that brackets inside it do not count) or one bracket.
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def read_text(path: Path, what: str, where: str | None = None) -> str:
    """The UTF-8 text of a regular file of at most MAX_FILE_BYTES, a leading BOM removed (Python
    and hjson accept one). `what` names the file's kind, `where` the file in messages (its path)."""
    where = where or str(path)
    try:
        if path.exists() and not path.is_file():
            raise SpecError(f"{where}: is not a regular file")
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise SpecError(f"{where}: cannot read {what}: {error.strerror or error}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{where}: is {max(path.stat().st_size, len(data)):,} bytes; "
                        f"a config file is at most {MAX_FILE_BYTES:,} bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise SpecError(f"{where}: is not UTF-8 text (byte {error.start}: a binary file?)") from None
    if "\x00" in text:
        raise SpecError(f"{where}: contains NUL bytes: not a text file")
    return text


def check_nesting(text: str, where: str) -> None:
    """Refuse JSON nested deeper than MAX_NESTING, before a recursive parser meets it."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecError(f"{where}: nested deeper than {MAX_NESTING} levels of [ and {{; not a config file")
        elif token in "]}":
            depth -= 1


def invalid_json(where: str, error: ValueError) -> str:
    """The one wording of a JSON document that does not parse, as tomllib words its own errors:
    `where: invalid JSON: problem (at line L, column C)`."""
    import json  # only a file that is read as JSON reaches here; estimate's start-up does not need it

    if isinstance(error, json.JSONDecodeError):
        return f"{where}: invalid JSON: {error.msg} (at line {error.lineno}, column {error.colno})"
    return f"{where}: invalid JSON: {error}"  # e.g. an integer of more than 4,300 digits (sys.get_int_max_str_digits)
