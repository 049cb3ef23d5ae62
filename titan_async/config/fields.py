"""Type-checked assignment of TOML values to dataclass fields."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Literal, Union

_SCALARS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def describe(hint: Any) -> str | None:
    """What a value of type `hint` looks like in TOML, or None if TOML cannot set it."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return None if None in parts else " or ".join(parts)
    if origin is list and args:
        inner = describe(args[0])
        return None if inner is None else f"a list of {inner.removeprefix('a ').removeprefix('an ')}s"
    return None


def coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(True, value converted to `hint`) if `value` fits `hint`, else (False, None)."""
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else None
    if hint is str:
        return isinstance(value, str), value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args and not isinstance(value, bool), value
    if origin in (Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                ok, converted = coerce(value, arg)
                if ok:
                    return True, converted
        return False, None
    if origin is list and isinstance(value, list):
        converted = [coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in converted), [v for _, v in converted]
    return False, None


def settable_fields(cls: type) -> dict[str, Any]:
    """Field name -> type hint for the fields of dataclass `cls` that TOML can set."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.init and not f.name.startswith("_") and describe(hints[f.name]) is not None
    }


def subsections(section: Any) -> dict[str, Any]:
    """Field name -> nested section object, for fields whose class sets `toml_subsection = True`
    (written as `[section.field]` tables)."""
    return {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(section)
        if getattr(type(getattr(section, f.name)), "toml_subsection", False)
    }


def closest(name: str, candidates: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest candidate, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def type_name(value: Any) -> str:
    """How TOML calls the type of `value`."""
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(value), type(value).__name__
    )
