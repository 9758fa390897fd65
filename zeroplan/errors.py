"""The one family of errors zeroplan raises for bad input or impossible requests.

The CLI turns every `ZeroplanError` into one line on stderr and exit status 2; anything else is a
bug and keeps its traceback.
"""


class ZeroplanError(Exception):
    """Base of every error meant for the user: the message is one line and names the field."""


class SpecError(ZeroplanError):
    """A model, training or engine spec is invalid (a field, a file, or a combination)."""


class FieldError(SpecError):
    """One named argument of a library call is invalid. The message names the field; the CLI names
    the option that set it instead (`zeroplan.cli.common.user_message`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class UnknownModelError(SpecError):
    """MODEL is neither a catalogue name nor a readable spec or config.json file."""


class MeasureError(ZeroplanError):
    """A measurement could not be run or a worker failed."""


class DoesNotFitError(ZeroplanError):
    """The estimate of a run exceeds the GPU's memory, and the caller asked to stop there (strict)."""


class MissingDependencyError(ZeroplanError):
    """An optional package is needed for this command; the message says how to install it."""


class ZeroplanWarning(UserWarning):
    """Input read as the engine reads it, though probably not as meant (a key the engine ignores):
    the result is still computed; the CLI prints the message on one line on stderr."""
