"""zeroplan: does it fit, where do the bytes go, and which ZeRO config is best.

The Python API (docs/api.md), loaded on first use so that `import zeroplan` stays as cheap as the
command line's start-up and imports no torch:
- `zeroplan.estimate(model, **options)`, `zeroplan.compare(...)`, `zeroplan.plan(...)`,
  `zeroplan.measure(...)`: the commands, with their options as keyword arguments, returning
  objects whose `to_dict()` is the command's `--format json` document (zeroplan/api/);
- `zeroplan.ZeroplanCallback()` and `zeroplan.track(model, optimizer)`: the estimate and the
  measurement inside your own training program (zeroplan/measure/live/).

`zeroplan.estimate`, `zeroplan.plan` and `zeroplan.measure` are also the packages of the estimator,
the planner and the measurement (`from zeroplan.estimate.serialize import ...` keeps working):
called, such a package is the API function of its name.
"""

import sys
from types import ModuleType

__version__ = "0.1.0"

_CALLABLE_PACKAGES = ("estimate", "plan", "measure")
_FROM_API = ("compare", "ZeroplanCallback", "track")
__all__ = ["__version__", *_CALLABLE_PACKAGES, *_FROM_API]


class _CallablePackage(ModuleType):
    """A subpackage that, called, runs the API function of its name (`zeroplan.estimate(...)`)."""

    def __call__(self, *args, **kwargs):
        import zeroplan.api

        return getattr(zeroplan.api, self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Zeroplan(ModuleType):
    """The package's own module type: the import system binds each subpackage it loads as an
    attribute of its parent (importlib._bootstrap `_find_and_load_unlocked`); those named like an
    API function are made callable as they are bound, whichever import loads them first."""

    def __setattr__(self, name, value):
        if name in _CALLABLE_PACKAGES and type(value) is ModuleType:
            value.__class__ = _CallablePackage
        super().__setattr__(name, value)


def __getattr__(name):  # PEP 562: only for names not bound yet
    if name in _CALLABLE_PACKAGES:
        import importlib

        return importlib.import_module(f"zeroplan.{name}")  # bound, callable, by _Zeroplan.__setattr__
    if name in _FROM_API:
        import zeroplan.api

        return getattr(zeroplan.api, name)
    raise AttributeError(f"module 'zeroplan' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})


sys.modules[__name__].__class__ = _Zeroplan
