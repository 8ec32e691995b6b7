"""Method configs are nested dataclasses; this module reads and writes them.

- `to_dict` / `from_dict`: the JSON form stored as a run's config.json.
- `apply_overrides`: `--set section.key=value`, parsed against the field's type.
- `load_config_file`: `--config FILE` (a run's config.json or a bare tree).

Keys are field names with a trailing underscore dropped, so a field `lambda_` is set
as `e2.lambda`. Every unknown key or malformed value is a UsageError naming the key,
the expected type and the valid keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

from .errors import UsageError


def key_of(field: dataclasses.Field) -> str:
    return field.name.rstrip("_")


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {key_of(f): (f, hints[f.name]) for f in dataclasses.fields(cls)}


def to_dict(cfg: Any) -> dict:
    out = {}
    for key, (field, _) in _fields(type(cfg)).items():
        value = getattr(cfg, field.name)
        out[key] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for key, (_, tp) in _fields(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += valid_keys(tp, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])} (e.g. 1,2,3)"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            type(None): "none"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert a JSON-ish value to the field type; raise ValueError if impossible."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError:
                pass
        raise ValueError
    if origin is list:
        if not isinstance(value, list):
            raise ValueError
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ValueError
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    raise ValueError


def _parse_text(text: str, tp: Any) -> Any:
    """Command-line text -> JSON-ish value, leniently: `1,2,3`, `true`, `none`, bare strings."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    is_list = origin is list or any(typing.get_origin(a) is list for a in args)
    try:
        value = json.loads(stripped)
        return [value] if is_list and not isinstance(value, list) else value  # `--set grid=1`
    except json.JSONDecodeError:
        pass
    if is_list:
        if stripped in ("", "[]"):
            return []
        return [_parse_text(part, str) for part in stripped.strip("[]").split(",")]
    return stripped


def _locate(cfg: Any, key: str) -> tuple[Any, dataclasses.Field, Any]:
    node = cfg
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = _fields(type(node))
        if part not in fields:
            raise KeyError(key)
        field, tp = fields[part]
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise KeyError(key)
            return node, field, tp
        if not dataclasses.is_dataclass(tp):
            raise KeyError(key)
        node = getattr(node, field.name)
    raise KeyError(key)


def _unknown_key(cfg: Any, key: str, source: str) -> UsageError:
    keys = valid_keys(type(cfg))
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UsageError(f"unknown config key '{key}' in {source}",
                      f"{hint}valid keys: {', '.join(keys)}")


def set_value(cfg: Any, key: str, value: Any, source: str) -> None:
    try:
        node, field, tp = _locate(cfg, key)
    except KeyError:
        raise _unknown_key(cfg, key, source) from None
    try:
        setattr(node, field.name, _coerce(value, tp, key))
    except ValueError:
        raise UsageError(f"bad value {json.dumps(value)} for '{key}' in {source}",
                         f"expected {_type_name(tp)}") from None


def apply_overrides(cfg: Any, assignments: list[str]) -> Any:
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            example = "=".join(describe(cfg)[0][:2])  # a key this method has, with its value
            raise UsageError(f"malformed --set '{assignment}'", f"write --set key=value, e.g. --set {example}")
        try:
            _, _, tp = _locate(cfg, key)
        except KeyError:
            raise _unknown_key(cfg, key, "--set") from None
        value = _parse_text(text, tp)
        if not isinstance(value, str) and value is not None and _accepts_str(tp):
            try:
                _coerce(value, tp, key)
            except ValueError:
                value = text.strip()  # e.g. a name field set to `1e3`: keep the text as written
        set_value(cfg, key, value, "--set")
    return cfg


def _accepts_str(tp: Any) -> bool:
    return tp is str or str in typing.get_args(tp)


def apply_tree(cfg: Any, tree: dict, source: str, prefix: str = "") -> Any:
    if not isinstance(tree, dict):
        raise UsageError(f"{source}: expected a JSON object of config keys", "see config.json of any run")
    for key, value in tree.items():
        full = prefix + key
        try:
            _locate(cfg, full)
            is_leaf = True
        except KeyError:
            is_leaf = False
        if is_leaf:
            set_value(cfg, full, value, source)
        elif isinstance(value, dict) and any(k.startswith(full + ".") for k in valid_keys(type(cfg))):
            apply_tree(cfg, value, source, prefix=full + ".")
        else:
            raise _unknown_key(cfg, full, source)
    return cfg


def read_json_file(path: Path, what: str) -> Any:
    """Read a JSON file or raise a one-line error naming the file and the problem."""
    if not path.exists():
        raise UsageError(f"{what} '{path}' does not exist", "check the path")
    if path.is_dir():
        raise UsageError(f"{what} '{path}' is a directory", "pass a JSON file")
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise UsageError(f"{what} '{path}' is not a text file", "pass a JSON file") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} '{path}' is not valid JSON (line {exc.lineno}: {exc.msg})",
                         "fix or regenerate the file") from None
    except OSError as exc:
        raise UsageError(f"{what} '{path}' cannot be read ({exc.strerror})", "check its permissions") from None


def load_config_file(path: Path) -> tuple[dict, dict]:
    """Return (config tree, run defaults such as preset and seed) from a --config file.

    Accepts a run's config.json ({method, preset, seed, config}) or a bare config tree.
    """
    data = read_json_file(path, "config file")
    if isinstance(data, dict) and "config" in data and isinstance(data["config"], dict):
        defaults = {k: data[k] for k in ("method", "preset", "seed") if k in data}
        return data["config"], defaults
    return data, {}


def field_comments(cls: type) -> dict[str, str]:
    """field name → the comment at the end of its line in the class's source (its one-line meaning):
    the config dataclasses are the one place where a key's meaning is written."""
    import inspect
    import io
    import tokenize

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments, line_field = {}, {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and token.string in names:
            line_field.setdefault(token.start[0], token.string)  # `    name: type = default`
        elif token.type == tokenize.COMMENT and token.start[0] in line_field:
            comments[line_field[token.start[0]]] = token.string.lstrip("# ").strip()
    return comments


def describe(cfg: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, value as --set takes it, meaning) of every key of a config instance, sections flattened."""
    rows = []
    comments = field_comments(type(cfg))
    for key, (field, _) in _fields(type(cfg)).items():
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, f"{prefix}{key}.")
            continue
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else "none" if value is None else str(value)
        rows.append((prefix + key, text, comments.get(field.name, "")))
    return rows
