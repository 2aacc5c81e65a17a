"""Engine arguments that name objects, such as ``probes=`` and ``steering=``: a dict name ->
object (or path to a saved one), or a list of objects named by their ``name``. One reader, so
both arguments take the same forms and give the same errors.

No vLLM imports.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from probehook.errors import CaptureConfigError


def load_named(
    value: Any, argument: str, cls: type, load: Callable[[Any], Any], what: str
) -> dict[str, Any]:
    """``{name: object}`` from ``value``.

    Args:
        argument: the argument's name in messages (``"probes"``).
        cls: the objects' class; paths are read with ``load``.
        what: the objects' name in messages (``"probe"``).
    """

    def one(item: Any, where: str) -> Any:
        if isinstance(item, str | os.PathLike):
            return load(item)
        if not isinstance(item, cls):
            raise CaptureConfigError(
                f"{where} is a {type(item).__name__}, not a {what}: pass probehook."
                f"{cls.__name__} objects or paths to saved ones."
            )
        return item

    if isinstance(value, Mapping):
        loaded = {}
        for name, item in value.items():
            if not isinstance(name, str) or not name:
                raise CaptureConfigError(
                    f"{what.capitalize()} names must be non-empty strings; got {name!r}."
                )
            loaded[name] = one(item, f"{argument}[{name!r}]")
        return loaded
    if isinstance(value, str | os.PathLike) or not isinstance(value, Sequence):
        raise CaptureConfigError(
            f"{argument}={value!r} must be a dict name -> {what}, or a list of {what}s with names."
        )
    loaded = {}
    for i, item in enumerate(value):
        obj = one(item, f"{argument}[{i}]")
        if not obj.name:
            raise CaptureConfigError(
                f"{argument}[{i}] has no name; pass a dict {{'name': {what}}} or give it a name."
            )
        if obj.name in loaded:
            raise CaptureConfigError(f"Two {what}s are named {obj.name!r}; names must differ.")
        loaded[obj.name] = obj
    return loaded


def select_names(
    selected: Any, known: Sequence[str], argument: str, what: str, error: type[Exception]
) -> tuple[str, ...]:
    """A request's choice among an engine's named objects: None or True: all of ``known``;
    False: none; names: those, in order, once each (an unknown one raises ``error``)."""
    if selected is None or selected is True:
        return tuple(known)
    if selected is False:
        return ()
    unknown = [n for n in selected if n not in known]
    if unknown:
        raise error(
            f"Per-request {argument} {unknown} are not engine {what}s; valid names are "
            f"{sorted(known)}."
        )
    return tuple(dict.fromkeys(selected))
