"""Build typed, frozen dataclasses from parsed YAML, with errors that name the key path.

Why not a validation library: the messages are the product here (one line: key path, value,
what is allowed), and the types we need are few (scalars, Literal, unions, tuples, nested
dataclasses). Range and cross-field checks live in each dataclass's `__post_init__`, so a
config built in Python is checked exactly like one read from YAML.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from fsdp_bench.errors import FieldError, unknown_key, yaml_scalar

T = TypeVar("T")


def bad_value(key: str, value: object, allowed: str) -> FieldError:
    """The standard error for a value outside what a key allows."""
    return FieldError(key, value, allowed)


def at_least(obj: object, key: str, minimum: int) -> None:
    """The standard check of an integer field with a lower bound."""
    value = getattr(obj, key)
    if value < minimum:
        raise bad_value(key, value, f"expected an integer >= {minimum}")


def build(cls: type[T], data: object) -> T:
    """Construct dataclass `cls` from a mapping, checking keys and types recursively."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if not isinstance(data, Mapping):
        raise bad_value("", data, f"expected a mapping with keys: {', '.join(names)}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise unknown_key(key, names)
        try:
            kwargs[key] = coerce(hints[key], value)
        except FieldError as err:
            raise err.under(key) from None
    return cls(**kwargs)


def coerce(tp: Any, value: object) -> Any:
    """Check `value` against type `tp`, converting only where YAML is ambiguous."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value)  # type: ignore[arg-type]
    if tp is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise bad_value("", value, f"expected {describe_type(tp)}")
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return coerce(option, value)
            except FieldError:
                continue
        raise bad_value("", value, f"expected {describe_type(tp)}")
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise bad_value("", value, f"expected {describe_type(tp)}")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(coerce(item_type, item))
            except FieldError as err:
                raise err.under(f"[{index}]") from None
        return tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise bad_value("", value, "expected a mapping")
        return dict(value)
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"schema: unsupported field type {tp!r}")
    raise bad_value("", value, f"expected {describe_type(tp)}")


def describe_type(tp: Any) -> str:
    """Human wording of a type, for error messages."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(yaml_scalar(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        choices: list[str] = []
        others: list[str] = []
        for option in typing.get_args(tp):
            if option is bool:
                choices += ["true", "false"]
            elif typing.get_origin(option) is Literal:
                choices += [yaml_scalar(a) for a in typing.get_args(option)]
            else:
                others.append(describe_type(option))
        if choices:
            others.insert(0, "one of " + ", ".join(choices))
        return " or ".join(others)
    if origin is tuple:
        return f"a list of {describe_type(typing.get_args(tp)[0])}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {
        type(None): "null",
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
    }.get(tp, str(tp))


def non_default_fields(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass tree that differ from their defaults, as plain data.

    Used for run ids: a field added later with a default leaves existing ids unchanged.
    """
    out: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            nested = non_default_fields(value)
            if nested:
                out[field.name] = nested
            continue
        # type check too: True == 1, but they are different settings
        default = field.default
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        if default is not dataclasses.MISSING and value == default and type(value) is type(default):
            continue
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def field_paths(cls: type) -> dict[str, Any]:
    """Every dotted leaf path of a dataclass tree and its type (for axis and exclude keys)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            for sub, sub_tp in field_paths(tp).items():  # type: ignore[arg-type]
                out[f"{field.name}.{sub}"] = sub_tp
        else:
            out[field.name] = tp
    return out


def to_plain(obj: Any) -> Any:
    """A dataclass tree as JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
