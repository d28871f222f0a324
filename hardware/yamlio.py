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

from hardware.errors import InputError, check_name, did_you_mean, excerpt, shown_path
from hardware.fileio import read_text

T = TypeVar("T")


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


MAX_DEPTH = 32  # nesting of mappings and lists; no file the tool reads needs more than 4
MAX_INT_DIGITS = 24  # integer literals; Python itself refuses to parse more than 4,300 digits
MAX_NODES = 20_000  # keys and values in one file (MaxText's base.yml has about 1,500): parsing 1 MB of tiny
# entries in pure Python takes 20-30 s


class _Refused(Exception):
    def __init__(self, what: str, mark: Any):
        super().__init__(what)
        self.what, self.mark = what, mark


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no code execution) that also refuses what a shared file has no need of: aliases (a
    0.5 KB file of nested aliases expands to gigabytes), duplicate keys (YAML would keep the last silently),
    nesting deeper than MAX_DEPTH (Python's recursion limit), more than MAX_NODES values (time) and integers
    longer than MAX_INT_DIGITS."""

    depth = 0
    nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise _Refused("YAML aliases (*name) are not accepted; write the value out", self.peek_event().start_mark)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES:,} values", self.peek_event().start_mark)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise _Refused(f"duplicate key {excerpt(key_node.value)}", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: Any) -> int:
        if len(node.value) > MAX_INT_DIGITS:
            raise _Refused(f"integer of {len(node.value):,} characters (at most {MAX_INT_DIGITS})", node.start_mark)
        return super().construct_yaml_int(node)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: loader.construct_mapping(node))


def parse_yaml(text: str, where: str) -> Any:
    """Parse YAML (or JSON, which YAML reads) with StrictLoader; errors name `where` and the line."""
    try:
        loader = StrictLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except _Refused as e:
        line = f" at line {e.mark.line + 1}" if e.mark else ""
        raise InputError(f"{where}: {e.what}{line}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise InputError(f"{where}: not valid YAML{at}") from None
    except RecursionError:
        raise InputError(f"{where}: nested too deeply") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A small YAML (or JSON) mapping from a user's file: read_text's checks, then parse_yaml."""
    p = Path(path)
    data = parse_yaml(read_text(p), shown_path(p))
    if not isinstance(data, dict):
        raise InputError(f"{shown_path(p)}: expected a mapping of field: value at the top level")
    return data


def _check_text(value: str, where: str) -> str:
    """Text fields other than names (descriptions, sources) may be long but carry no control characters."""
    if not value.replace("\n", " ").isprintable():
        raise InputError(f"{where}: expected printable text (no control characters), got {excerpt(value)}")
    return value


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check one value against a (simple) annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads '2.765e12' (no exponent sign) as a string
            try:
                value = float(value)
            except ValueError:
                raise InputError(f"{where}: expected a number, got {excerpt(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"{where}: expected a number, got {excerpt(value)}")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise InputError(f"{where}: expected an integer, got {excerpt(value)}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise InputError(f"{where}: expected true or false, got {excerpt(value)}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise InputError(f"{where}: expected a string, got {excerpt(value)}")
        return check_name(value, where) if where.endswith(".name") else _check_text(value, where)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(typ)
        if not isinstance(value, list | tuple):
            raise InputError(f"{where}: expected a list, got {excerpt(value)}")
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
        raise InputError(f"{where}: expected a mapping, got {excerpt(data)}")
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
