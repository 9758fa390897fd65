"""The click group behind `zeroplan`: loads each command's module only when it is used, and turns
every user error into one line on stderr with exit status 2.

User errors are click's usage errors, `ZeroplanError`, and pydantic's `ValidationError`; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

import click

from zeroplan.errors import ZeroplanError, ZeroplanWarning

USER_ERROR_STATUS = 2


def fail(message: str) -> NoReturn:
    """Print `message` as one line on stderr and exit with status 2."""
    try:
        click.echo(f"Error: {' '.join(str(message).split())}", err=True)
    except OSError:  # standard error is gone too: the status is all that is left to say it
        pass
    sys.exit(USER_ERROR_STATUS)


@contextlib.contextmanager
def warnings_on_one_line() -> Iterator[None]:
    """Print each `ZeroplanWarning` (input read as the engine reads it, probably not as meant) as one
    line on stderr, every time; other warnings keep Python's handling."""
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always", ZeroplanWarning)
        show = warnings.showwarning

        def show_one_line(message, category, filename, lineno, file=None, line=None) -> None:
            if issubclass(category, ZeroplanWarning):
                click.echo(f"Warning: {' '.join(str(message).split())}", err=True)
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_one_line
        yield


class LazyGroup(click.Group):
    """A group whose commands live in modules of `zeroplan.cli` named after them, imported on
    first use; `commands` maps each name to its summary (the first sentence of its help)."""

    def __init__(self, *args: Any, commands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.summaries = dict(commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.summaries)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.summaries:
            return None
        return importlib.import_module(f"zeroplan.cli.{cmd_name}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing of the commands, from the summaries: importing the commands would cost
        `zeroplan --help` several times click's own start-up (pydantic, the estimator)."""
        limit = formatter.width - 6 - max(map(len, self.summaries))  # as click.Group.format_commands
        rows = [(name, click.Command(name, help=summary).get_short_help_str(limit)) for name, summary in self.summaries.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> Any:
        """click's main, with user errors reported on one line (click prints usage and a hint over
        three lines, and a library error would otherwise end in a traceback), and standard output that
        cannot be written (`> /dev/full`, a full disk) reported the same way."""
        try:
            self._main(args, prog_name, **extra)
        except OSError as error:
            if not _raised_by_echo(error):
                raise  # not the output: a bug, with its traceback
            _silence_stdout()
            fail(f"cannot write standard output: {error.strerror or error}")

    def _main(self, args: Sequence[str] | None, prog_name: str | None, **extra: Any) -> None:
        extra.pop("standalone_mode", None)
        try:
            with warnings_on_one_line():
                status = super().main(args, prog_name, standalone_mode=False, **extra)
            try:
                sys.stdout.flush()  # a write error surfaces here, not in Python's exit, where it is a traceback
            except OSError as error:
                _silence_stdout()
                fail(f"cannot write standard output: {error.strerror or error}")
        except click.UsageError as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # `zeroplan` alone (click >= 8.2)
                click.echo(error.ctx.get_help())
                sys.exit(0)
            hint = f" (see '{error.ctx.command_path} -h')" if error.ctx is not None else ""
            fail(error.format_message() + hint)
        except click.ClickException as error:
            fail(error.format_message())
        except click.Abort:
            fail("aborted")
        except ZeroplanError as error:
            from zeroplan.cli.common import user_message

            fail(user_message(error))
        except Exception as error:
            from pydantic import ValidationError

            if not isinstance(error, ValidationError):
                raise
            from zeroplan.spec.validation import describe_validation_error

            fail(describe_validation_error(error))
        # standalone_mode=False returns the exit code of `ctx.exit(code)` (--help, --version) or the
        # command's return value (None).
        sys.exit(status if isinstance(status, int) else 0)


def _raised_by_echo(error: OSError) -> bool:
    """Whether `error` was raised by `click.echo`, through which every command writes its output (a
    file a command writes is written by `zeroplan.spec.files`, whose errors are one-line already)."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    if traceback is None:
        return False
    code = traceback.tb_frame.f_code
    return code.co_name == "echo" and code.co_filename == click.utils.__file__


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that Python's flush at exit does not fail a second time
    over the same bytes (the recipe of Python's signal documentation for a closed pipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's captured output): nothing to flush at exit
        pass
