"""Building a :class:`~elastic_train.config.job.JobConfig`: defaults, then TOML, then overrides.

Every value is checked against the annotated type of its field, so a typo or
a wrong type fails at start with a :class:`~elastic_train.errors.ConfigError`
naming ``section.key`` and what it accepts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from elastic_train.config.job import SECTIONS, JobConfig
from elastic_train.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib


# -- building from TOML and overrides -----------------------------------------


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Defaults, then ``base`` (``{section: {key: value}}``, a script's own, see
    ``elastic_train.api.fit``), then the TOML file at ``path``, then ``section.key=value``
    overrides."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if base is not None:
        _merge(values, base, source="fit(config=...)")
    if path is not None:
        _merge(values, _read_toml(Path(path)), source=str(path))
    for item in overrides:
        section, key, sub, raw = _split_override(item)
        expected = _field_types(SECTIONS[section])[key]
        value = _parse_override(f"{section}.{key}", raw, expected, sub)
        if sub is None:
            values[section][key] = value
        else:
            values[section].setdefault(key, {})[sub] = value
    return from_dict(values)


def from_dict(values: Mapping[str, Mapping[str, Any]]) -> JobConfig:
    """Build a validated :class:`JobConfig` from ``{section: {key: value}}``."""
    components = {}
    for section, items in values.items():
        cls = _section_class(section)
        types = _field_types(cls)
        checked = {}
        for key, value in items.items():
            if key not in types:
                raise ConfigError(f"unknown key {section}.{key}; known keys: {', '.join(types)}")
            checked[key] = _check_type(f"{section}.{key}", value, types[key])
        components[section] = cls(**checked)
    return JobConfig(**components)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _merge(values: dict[str, dict[str, Any]], data: Mapping[str, Any], *, source: str) -> None:
    for section, items in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {source}; known sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(items, dict):
            raise ConfigError(f"{section} in {source} must be a table [{section}]")
        values[section].update(items)


def _section_class(section: str) -> type:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r}; known sections: {', '.join(SECTIONS)}")
    return SECTIONS[section]


def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _split_override(item: str) -> tuple[str, str, str | None, str]:
    name, sep, raw = item.partition("=")
    parts = name.split(".")
    if not sep or len(parts) not in (2, 3):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    section, key = parts[0], parts[1]
    types = _field_types(_section_class(section))
    if key not in types:
        raise ConfigError(f"unknown key {section}.{key}; known keys: {', '.join(types)}")
    sub = parts[2] if len(parts) == 3 else None
    if sub is not None and get_origin(types[key]) is not dict:
        raise ConfigError(f"{section}.{key} is not a table; use --{section}.{key}=value")
    return section, key, sub, raw


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(expected: Any) -> str:
    if get_origin(expected) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(expected))
    if get_origin(expected) is dict:
        return "a table"
    return _TYPE_NAMES.get(expected, expected.__name__)


def _parse_override(name: str, raw: str, expected: Any, sub: str | None) -> Any:
    if sub is not None or expected is Any:
        # Option tables hold whatever a custom factory takes: read the value as a
        # TOML literal (3, 0.5, true, "x"), and as a plain string otherwise.
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw
    try:
        if expected is bool:
            lowered = raw.strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if expected is int:
            return int(raw)
        if expected is float:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name} = {raw!r}: expected {_describe(expected)}") from None
    if get_origin(expected) is dict:
        raise ConfigError(f"{name} is a table; set its keys with --{name}.KEY=VALUE")
    return raw


def _check_type(name: str, value: Any, expected: Any) -> Any:
    origin = get_origin(expected)
    if origin is Literal:
        ok = value in get_args(expected)
    elif origin is dict:
        ok = isinstance(value, dict)
        value = dict(value) if ok else value
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(f"{name} = {value!r}: expected {_describe(expected)}")
    return value


# -- output -------------------------------------------------------------------


def as_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, dict):
        inner = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + inner + "}" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(cfg: JobConfig) -> str:
    """The effective configuration as TOML that :func:`load_config` reads back."""
    lines: list[str] = []
    for section, items in as_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in items.items())
        lines.append("")
    return "\n".join(lines)
