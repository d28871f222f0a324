"""Safe YAML reading and typed construction of frozen dataclasses, with one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hardware.errors import InputError, did_you_mean

T = TypeVar("T")
MAX_FILE_BYTES = 1_000_000  # user files larger than this are refused before parsing


def file_stamp(path: str | Path) -> tuple[int, int] | None:
    """(modification time in ns, size) of a file, None when it is missing: a cache key that changes when the
    file is edited."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def cache_per_version(load: Callable[[str], T]) -> Callable[[str], T]:
    """load(path), cached per version of the file (file_stamp), so that a long-lived process (a notebook)
    re-reads a profile or model YAML after it is edited."""
    cached = functools.cache(lambda path, stamp: load(path))

    @functools.wraps(load)
    def wrapper(path: str) -> T:
        return cached(path, file_stamp(path))
    return wrapper


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a small YAML mapping with yaml.safe_load (no code execution)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: file not found")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise InputError(f"{p}: file is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise InputError(f"{p}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise InputError(f"{p}: expected a mapping of field: value at the top level")
    return data


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check one value against a (simple) annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads '2.765e12' (no exponent sign) as a string
            try:
                value = float(value)
            except ValueError:
                raise InputError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise InputError(f"{where}: expected an integer, got {value!r}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise InputError(f"{where}: expected true or false, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise InputError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        (inner, *_rest) = typing.get_args(typ)
        if not isinstance(value, list | tuple):
            raise InputError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if dataclasses.is_dataclass(typ):
        return build(typ, value, where)
    return value


def build(cls: type, data: Any, where: str) -> Any:
    """Construct dataclass `cls` from a mapping, naming any missing, unknown or mistyped field."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    flds = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in flds:
            raise InputError(f"{where}: unknown field {key!r}{did_you_mean(key, flds)}")
    kwargs = {}
    for name, f in flds.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InputError(f"{where}: missing field {name!r} ({_type_name(hints[name])})")
    return cls(**kwargs)


def _type_name(typ: Any) -> str:
    return getattr(typ, "__name__", str(typ))


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass to plain dict (tuples to lists) for YAML/JSON output."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        return v

    return plain(obj)
