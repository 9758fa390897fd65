"""Python keyword arguments as a command's options, read by the command line's own declarations.

Each option is declared once, as a click parameter of its command (zeroplan/cli/): its name, type,
range, choices and default. The API reads keyword arguments through those same parameters, so
`zeroplan.estimate("llama-2-7b", gpus=8, zero=3)` gives the function that computes the command's
result exactly the options dict that `zeroplan estimate llama-2-7b --gpus 8 --zero 3` gives it:
the keyword of an option is its long name underscored (`--micro-batch` -> `micro_batch`,
`--ddp/--no-ddp` -> `ddp=True/False`), None means "not given", and a bad value is one
`FieldError` naming the keyword.

Python values are held to what they mean: a whole number where the command line takes one (not
8.5, not True), a bool for a flag; a list or tuple where the command line takes a comma-separated
list (`zero=[0, 1, 2, 3]` for `--zero 0,1,2,3`) or a repeatable option (`freeze=["embeddings"]`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from zeroplan.errors import FieldError

OUTPUT_ONLY = ("output_format", "units")
"""How the command line prints its result (`--format`, `--units`): an API result renders itself
(`render(format, units)`), so these are not keyword arguments."""


def parameters(decorators: Iterable[Callable]) -> list[click.Parameter]:
    """The click parameters that a list of option decorators declares, in their order."""

    def probe() -> None: ...

    for decorator in reversed(list(decorators)):
        probe = decorator(probe)
    return list(reversed(probe.__click_params__))  # type: ignore[attr-defined]


def keyword(param: click.Parameter) -> str:
    """The keyword argument of a parameter: `--gpus-per-node` -> gpus_per_node; MODEL -> model."""
    if isinstance(param, click.Argument):
        return str(param.name)
    return param.opts[0].lstrip("-").replace("-", "_")


def options_from_keywords(function: str, params: list[click.Parameter], keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The options dict that the click command with `params` passes to its callback, from the
    keyword arguments of `zeroplan.<function>(...)`; every parameter not given takes its default."""
    accepted = {keyword(p): p for p in params if p.name not in OUTPUT_ONLY}
    keyword_of = {p.name: keyword(p) for p in params}
    for name in keywords:
        if name not in accepted:
            # the name of the spec field an option sets (zero_stage for --zero) means that option
            close = [keyword_of[name]] if name in keyword_of else difflib.get_close_matches(name, accepted, n=1)
            raise FieldError(name, f"zeroplan.{function}() has no such option"
                             + (f"; did you mean {close[0]}?" if close else f" (see `zeroplan {function} --help`)"))
    given = {accepted[name].name: _as_typed(accepted[name], name, value)
             for name, value in keywords.items() if value is not None}
    command = click.Command(f"zeroplan {function}", params=params, add_help_option=False)
    try:
        # click converts and checks a default_map value as it does a value typed on the command line
        return dict(command.make_context(command.name, [], default_map=given).params)
    except click.MissingParameter as error:
        name = keyword_of[error.param.name] if error.param is not None else "?"
        raise FieldError(name, f"required: give zeroplan.{function}({name}=...)") from None
    except click.BadParameter as error:
        name = keyword_of[error.param.name] if error.param is not None else "?"
        raise FieldError(name, error.message) from None


def _as_typed(param: click.Parameter, name: str, value: Any) -> Any:
    """`value` as the command line would have typed it, refusing what click would silently coerce
    (int(8.5) is 8, int(True) is 1)."""
    if param.multiple or param.nargs != 1:
        if isinstance(value, str) and param.multiple:
            return (value,)
        if not isinstance(value, (list, tuple)):
            raise FieldError(name, f"expected a list or tuple, got {value!r}")
        return tuple(value)
    kind = param.type
    if isinstance(kind, click.types.BoolParamType):
        if not isinstance(value, bool):
            raise FieldError(name, f"expected True or False, got {value!r}")
    elif isinstance(kind, click.types.IntParamType):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise FieldError(name, f"expected a whole number, got {value!r}")
    elif isinstance(kind, click.types.FloatParamType):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise FieldError(name, f"expected a number, got {value!r}")
    elif kind is click.STRING and isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)  # a comma-separated list (--zero 0,1,2,3)
    elif type(kind).__module__.startswith("zeroplan.") and isinstance(value, (int, float)):
        if isinstance(value, bool):
            raise FieldError(name, f"expected a number or a string, got {value!r}")
        return str(value)  # zeroplan's own types (a count, a size) check a number as they check its text
    return value
