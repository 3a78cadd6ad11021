"""The one loader behind every extension point: a config field names a ``package.module:attribute`` and this
imports it, checks that it fits the seam, and says exactly what is wrong when it does not.

Errors are raised at start-up (``load_config`` loads ``plugins.modules``; each service loads its seams as it
starts), never at the first record: a ``PluginError`` names the field, the path and the mismatch. The seams and
their signatures are listed in docs/extending.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any


class PluginError(ValueError):
    """A seam's path does not load, or what it names does not fit the seam. Starts with the config field."""


def _split(field: str, path: str) -> tuple[str, str]:
    module, sep, attribute = path.strip().partition(":")
    if not sep or not module or not attribute:
        raise PluginError(f"{field}: {path!r} is not a 'package.module:attribute' path")
    return module, attribute


@functools.cache
def load_object(field: str, path: str) -> Any:
    """What ``path`` names. Cached: a seam is looked up once per process, however often it is used."""
    module_name, attribute = _split(field, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the plugin module's own error at import
        raise PluginError(f"{field}: {path!r} does not load: module {module_name!r}: {exc!r}") from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginError(
                f"{field}: {path!r} does not load: {module_name!r} has no {attribute!r}"
            ) from None
    return target


def check_call(field: str, path: str, target: Any, params: Sequence[str]) -> None:
    """Refuse a callable that cannot be called with the seam's positional arguments ``params``."""
    if not callable(target):
        raise PluginError(f"{field}: {path!r} is a {type(target).__name__}, not a function")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none to inspect: let the call decide
        return
    try:
        signature.bind(*params)
    except TypeError as exc:
        raise PluginError(
            f"{field}: {path!r} has the signature {signature} but the seam calls it with"
            f" ({', '.join(params)}): {exc}"
        ) from None


def load_function(field: str, path: str, params: Sequence[str] = ()) -> Callable[..., Any]:
    """The function ``path`` names, checked against the seam's positional arguments ``params`` (once per
    process: a seam called per record pays a dictionary lookup)."""
    return _checked_function(field, path, tuple(params))


@functools.cache
def _checked_function(field: str, path: str, params: tuple[str, ...]) -> Callable[..., Any]:
    target = load_object(field, path)
    check_call(field, path, target, params)
    return target  # type: ignore[no-any-return]


def load_class(field: str, path: str, base: type | None = None) -> type:
    """The class ``path`` names (a subclass of ``base`` when one is given)."""
    target = load_object(field, path)
    if not isinstance(target, type):
        raise PluginError(f"{field}: {path!r} is a {type(target).__name__}, not a class")
    if base is not None and not issubclass(target, base):
        raise PluginError(f"{field}: {path!r} is not a {base.__name__}")
    return target


def import_modules(field: str, modules: Sequence[str]) -> None:
    """Import plugin modules for what they register (modes) as they load."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise PluginError(f"{field}: module {name!r} does not load: {exc!r}") from exc
