"""One line for a pydantic `ValidationError`, the same for every spec, file and option.

Each problem reads `key.path: message (got value)`; an unknown key reads `key: unknown key (did you
mean close_key?)` when the model knows a close one; several problems read `N errors in where: ...`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic is imported by whoever validates, not here
    from pydantic import BaseModel, ValidationError

    Schema = type[BaseModel] | Mapping[str, type[BaseModel]] | None


def describe_validation_error(error: ValidationError, where: str | None = None, schema: Schema = None) -> str:
    """One line naming each invalid key of `error`, prefixed with `where` (a file, a source) if given.

    `schema`, what was validated, lets an unknown key be answered with the closest known one: a
    model, or a discriminated union as {tag: model} (its errors' locations start with the tag,
    which the message leaves out)."""
    problems = [_problem(item, schema) for item in error.errors(include_url=False)]
    if len(problems) == 1:
        text = f"{where}: {problems[0]}" if where else problems[0]
    else:
        text = f"{len(problems)} errors{f' in {where}' if where else ''}: {'; '.join(problems)}"
    return text.replace("\n", " ")


def _problem(item: Mapping[str, Any], schema: Schema) -> str:
    loc = [str(part) for part in item["loc"]]
    model = schema
    if isinstance(schema, Mapping):
        model = schema.get(loc[0]) if loc else None
        loc = loc[1:] if model is not None else loc
    message = str(item["msg"]).removeprefix("Value error, ")
    if item["type"] == "extra_forbidden":
        import difflib  # only an unknown key needs suggestions, not start-up

        close = difflib.get_close_matches(loc[-1], sorted(_fields_at(model, loc[:-1])), n=1) if loc else []
        message = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
    elif loc and item["type"] != "missing" and not isinstance(item.get("input"), (dict, list)):
        message += f" (got {shown(item.get('input'))})"
    return f"{'.'.join(loc)}: {message}" if loc else message


def _fields_at(model: Any, path: Sequence[str]) -> set[str]:
    """The field names of the (sub-)model at `path` inside `model`; none where it is not a model."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
    return set(getattr(model, "model_fields", {}) or ())


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)` for a message, cut to about `limit` characters: a 400-digit number or a 5,000-character
    name is named by its size, not printed whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"a number of {len(str(abs(value))):,} digits"
    size = len(value) if isinstance(value, str) else len(text)  # a string's own length, not its repr's quotes
    return f"{text[: limit - 10]}... ({size:,} characters)"
