"""The config tree's leaf fields by flag name, and what every front end does with them: coerce a YAML or CLI value
to a field's type, build a root config from flat values, redact its secrets for logs and checkpoints."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from rlrun.runtime.errors import ConfigError
from rlrun.runtime.secrets import MASK, redact_value

T = TypeVar("T")


def opt(default: Any, help: str, *, secret: bool = False, metavar: str | None = None) -> Any:
    """A config field with its help text (every flag has one)."""
    meta = {"help": help, "secret": secret, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---- YAML read strictly: a key given twice is an error, not the last one silently --------------------------------


class DuplicateKey(yaml.YAMLError):
    """A mapping in the YAML holds `key` twice (lines are 1-based)."""

    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} appears twice (line {first_line} and line {second_line})")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice. Keys merged in with `<<` may still be overridden (the
    merge's own meaning); only keys written out twice in one mapping are refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: Any) -> Any:
    """yaml.safe_load of a string or open file, refusing duplicate keys (DuplicateKey, a yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only


# ---- a section's own rules (its check(), raising ConfigError naming the flag and the value) ----------------------


def positive(name: str, value: int | float | None, *, allow_none: bool = False) -> None:
    """--name must be > 0 (or unset, with allow_none)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"--{name} must be > 0, got {value}")


def non_negative(name: str, value: int | float) -> None:
    if value < 0:
        raise ConfigError(f"--{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class FieldInfo:
    section: str
    name: str
    type: Any
    default: Any
    help: str
    secret: bool
    metavar: str | None


def fields_of(config_cls: type) -> dict[str, FieldInfo]:
    """Every leaf field by its (unique) flag name."""
    out: dict[str, FieldInfo] = {}
    hints = get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        section_cls = hints[section.name]
        section_hints = get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            if f.name in out:
                raise AssertionError(f"config field {f.name} defined twice")
            # every config field has a default or a default_factory (mypy cannot tie the two together)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            out[f.name] = FieldInfo(
                section.name,
                f.name,
                section_hints[f.name],
                default,
                f.metadata["help"],
                f.metadata["secret"],
                f.metadata["metavar"],
            )
    return out


def suggest(name: str, candidates: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def coerce(info: FieldInfo, value: Any, source: str) -> Any:
    """Convert a YAML/CLI value to the field's type, or raise ConfigError naming it."""
    where = f"{info.name} (from {source})"
    tp = info.type
    optional = get_origin(tp) in (typing.Union, __import__("types").UnionType) and type(None) in get_args(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{where} must be one of {', '.join(map(str, choices))}, got "
                f"{value!r}{suggest(str(value), map(str, choices))}"
            )
        return value
    if tp is dict or get_origin(tp) is dict:  # a mapping flag takes JSON (or YAML flow) text: --x '{"a": false}'
        if isinstance(value, str):
            try:
                value = load_yaml_text(value) if value.strip() else {}
            except DuplicateKey as exc:
                raise ConfigError(f"{where}: {value!r} gives {exc.key!r} twice; keep one") from None
            except yaml.YAMLError:
                raise ConfigError(f"{where} must be a JSON object like '{{\"key\": value}}', got {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (a JSON object on the command line), got {value!r}")
        return dict(value)
    if get_origin(tp) is tuple:
        items = value.split(",") if isinstance(value, str) else value
        args = get_args(tp)
        if args[-1] is Ellipsis:  # any number of one type: a list, or one comma-separated string (verl's spelling)
            if isinstance(items, (list, tuple)):  # each item may be comma-separated too: --target_modules q_proj,v_proj
                items = [part for v in items for part in (v.split(",") if isinstance(v, str) else [v])]
            if not isinstance(items, (list, tuple)) or not items:
                raise ConfigError(f"{where} needs at least one value, got {value!r}")
            return tuple(_scalar(args[0], str(v).strip() if isinstance(v, str) else v, where) for v in items)
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"{where} needs {len(args)} values, got {value!r}")
        return tuple(_scalar(a, v, where) for a, v in zip(args, items))
    return _scalar(tp, value, where)


def _scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value)) if not isinstance(value, int) else value
        except ValueError:
            try:  # OpenRLHF scripts pass e.g. --max_samples 1e8
                as_float = float(str(value))
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if tp is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
        if number != number:  # NaN slips through every range check
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {tp} for {where}")


def build_config(values: dict[str, Any], config_cls: type[T]) -> T:
    """A root config (PPO's Config, or a supervised trainer's) from already-coerced flat values keyed by field name."""
    infos = fields_of(config_cls)
    sections: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        sections.setdefault(infos[name].section, {})[name] = value
    hints = get_type_hints(config_cls)
    return config_cls(**{s: hints[s](**kw) for s, kw in sections.items()})


def redacted(config: Any) -> dict[str, Any]:
    """Nested dict of a root config with secrets replaced (rlrun.runtime.secrets): safe to log or save. Fields
    marked secret are masked whole; every other value goes through the one redaction of URLs and tokens."""
    infos = fields_of(type(config))
    out = dataclasses.asdict(config)
    for info in infos.values():
        value = out[info.section][info.name]
        if info.secret and value is not None:
            out[info.section][info.name] = MASK
        else:
            out[info.section][info.name] = redact_value(info.name, value)
    return out
