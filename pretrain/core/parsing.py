"""Typed dataclasses from YAML files and dotted overrides: the parsing every config kind shares (runs, ablations,
fine-tuning, evaluation, objectives' options) and the command line's defaults and help.

Unknown keys and wrong types fail with the key, the value and the nearest valid key; errors from a file name the
file (and, for bad YAML or bytes, the line). `pretrain.core.config` is the run's schema on top of it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from pretrain.core.errors import ConfigError


def doc(default: Any = dataclasses.MISSING, text: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its one-line documentation (`describe_fields`: --help, `pretrain objectives`)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


CONFIG_DIR = Path(__file__).resolve().parent.parent / "presets"
"""The presets: package data (pyproject.toml), so an installed package has them; `configs/` links here. A `base:`
may name one."""


# ----------------------------------------------------------------------------------------------
# The typed-parsing API: any tree of (frozen) dataclasses, not only RunConfig.
#
#     @dataclass(frozen=True)
#     class ProbeConfig:
#         mode: Literal["probe", "full"] = doc("probe", "What to train.")
#         seeds: list[int] = doc(factory=lambda: [1, 2, 3], text="Fine-tuning seeds.")
#
#     data = load_yaml_with_base(Path("probe.yaml"))  # `base: other.yaml` (or a preset name) resolved
#     data = apply_overrides(data, ["mode=full", "seeds=[1, 2]"])
#     cfg = from_dict(ProbeConfig, data, source="probe.yaml")
#     # unknown key: "probe.yaml: unknown config key 'mdoe' (did you mean 'mode'?)"
#     # wrong value: "probe.yaml: mode: value 'ful' is not one of probe, full (did you mean 'full'?)"
#
# `field_default(cls, name)` and `field_doc(cls, name)` let a command-line option take its default and help from
# the field it mirrors, so a default is declared once.


def nearest(key: str, options: typing.Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the option close to `key`, to append to an error; "" when none is (below a 0.6
    similarity: 'roberta' for 'parent.yaml' helped no one)."""
    match = difflib.get_close_matches(str(key), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """One value checked against the annotation `tp` as a field of that type is (a setting kept in a mapping, e.g.
    an ablation arm's `pretrain:`); a ConfigError names `where`."""
    return _coerce(value, tp, where)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` (containers here, scalars in `_coerce_scalar`)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} options, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if isinstance(value, str):  # `a.b=x` for a one-item list
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {value!r}")
            return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        items = [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else list(value)
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is Any:
        if origin is dict and not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            names = [str(a) for a in allowed]
            raise ConfigError(f"{where}: value '{value}' is not one of {', '.join(names)}{nearest(value, names)}")
        return value
    return _coerce_scalar(value, tp, where)


def _coerce_scalar(value: Any, tp: Any, where: str) -> Any:
    """bool, int, float and str, allowing int -> float and str -> scalar (what an override gives)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            for base in (10, 0):  # "1_000", "010" (ten); then "0x40", "0o17", "0b101" as Python writes them
                try:
                    return int(value, base)
                except ValueError:
                    pass
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):  # nan passes every `<` check downstream
            raise ConfigError(f"{where}: value {value!r} is not a finite number")
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, float):  # `name: 1.10` was run '1.1' (and 1e3 '1000.0'): the text is not YAML's number
            raise ConfigError(
                f"{where}: value {value!r} is not a valid str: YAML reads an unquoted number such as 1.10 as a number "
                "(1.1); quote the text (e.g. '1.10')"
            )
        if isinstance(value, bool):  # `mode: off`, a tokenizer named `no`: "value False" did not say why
            raise ConfigError(
                f"{where}: value {value!r} is not a valid str: YAML reads an unquoted yes, no, on, off, true or "
                f"false as a boolean; quote the text (e.g. '{'on' if value else 'off'}')"
            )
    else:
        return value
    raise ConfigError(f"{where}: value {value!r} is not a valid {_type_name(tp)}")


def from_dict(cls: type, data: dict | None, where: str = "", *, source: str | os.PathLike | None = None) -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrong types with a clear message.

    `where` is the dotted key path of `data` inside a larger config ("objectives.mlm"); `source` (a file name)
    prefixes every error, so it names the file and the key: "ablation.yaml: eval.mode: value 'ful' ..."."""
    if source is not None:
        try:
            return from_dict(cls, data, where)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of {cls.__name__} options, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (data or {}).items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'{nearest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field `name` (its factory called); KeyError naming the nearest field if absent."""
    f = _field(cls, name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def field_doc(cls: type, name: str) -> str:
    """The one-line documentation `doc(...)` gave field `name` ("" if none)."""
    return _field(cls, name).metadata.get("doc", "")


def field_type(cls: type, name: str) -> Any:
    """The resolved annotation of field `name` (strings of `from __future__ import annotations` evaluated)."""
    _field(cls, name)
    return typing.get_type_hints(cls)[name]


def _field(cls: type, name: str) -> dataclasses.Field:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise KeyError(f"{cls.__name__} has no field '{name}'{nearest(name, fields)}")
    return fields[name]


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# YAML presets and overrides


class _KeyTwice(yaml.constructor.ConstructorError):
    pass


class _Loader(yaml.SafeLoader):
    """YAML as `yaml.safe_load` reads it, but for the numbers YAML 1.1 reads where a person sees text: `010` (octal,
    8), `0x1F` (31), `1_000`, `1:30` (sexagesimal, 90) and `2024-01-01` (a date) stay the text written. A string
    setting given one (a run's name `007`, a source named `01`) took the number's digits (`7`, `1`), with no word; a
    number setting parses the text itself (`_coerce_scalar`), where `010` is 10, as YAML 1.2 and a reader say.

    A key written twice in one mapping is an error naming both lines: YAML kept the last, so a second `train:` block
    further down a file dropped every setting of the first, with no word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys are meant to be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                line = key_node.start_mark.line + 1
                problem = f"key '{key}' is given twice, at lines {seen[key]} and {line}; YAML would keep the last"
                raise _KeyTwice(None, None, problem, key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    return int(text) if re.fullmatch(r"0|-?[1-9][0-9]*", text) else text  # the number's own text: str(int) == text


def _float_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    return text if ("_" in text or ":" in text) else loader.construct_yaml_float(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _int_or_text)
_Loader.add_constructor("tag:yaml.org,2002:float", _float_or_text)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", lambda loader, node: loader.construct_scalar(node))


def read_yaml(text: str) -> Any:
    """A config's YAML (a file's, or an override's value), numbers read as `_Loader` says."""
    return yaml.load(text, Loader=_Loader)


def _parse_scalar(text: str) -> Any:
    """Override values are YAML scalars/lists: `0.1`, `true`, `[a, b]`, `bf16`."""
    try:
        return read_yaml(text)
    except _KeyTwice as err:  # `{lr: 1, lr: 2}`
        raise ConfigError(f"override value '{text}': {err.problem}") from None
    except yaml.YAMLError:
        return text


def deep_merge(base: dict, extra: dict, replace: tuple[str, ...] = ()) -> dict:
    """`extra` over `base`, mappings merged key by key (new dicts; the inputs are not changed). A key in `replace`
    takes `extra`'s mapping whole, e.g. a preset's objectives; a dotted one, a key inside: an ablation's
    run.objectives."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in replace:
            out[key] = deep_merge(out[key], value, tuple(r[len(key) + 1 :] for r in replace if r.startswith(f"{key}.")))
        else:
            out[key] = value
    return out


def resolve_preset(name_or_path: str, paths: bool = True) -> Path:
    """A config argument is a path, or the name of a preset in configs/ (with or without .yaml); with `paths` false,
    a preset only (a `base:` not found beside its file: the current directory must not decide what it is)."""
    path = Path(name_or_path)
    if paths and path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config '{name_or_path}' not found: not a file, nor a preset{nearest(name_or_path, presets)}; "
        f"presets: {', '.join(presets)}"
    )


def _read_text(path: Path) -> str:
    """A config file's text, read as UTF-8 whatever the locale (YAML's own encoding; a UTF-8 BOM is dropped). An
    unreadable file or a bad byte is a ConfigError naming the file, line and column."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file ({err.strerror or err})") from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")  # not utf-8-sig: its error offsets skip the BOM
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1  # in bytes: the bad one has no character
        raise ConfigError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            "save the file as UTF-8"
        ) from None


def load_yaml_with_base(path: Path, replace: tuple[str, ...] = (), _chain: tuple[Path, ...] = ()) -> dict:
    """A YAML mapping, any kind of config; `base: other.yaml` inherits from another file (relative to this one) or a
    preset, recursively, the file's keys merged over its base's (`deep_merge`, `replace` as there)."""
    path = Path(path)
    if path.resolve() in _chain:
        loop = " -> ".join(str(p) for p in (*_chain, path.resolve()))
        raise ConfigError(f"{path}: base: presets inherit from each other in a loop ({loop})")
    try:
        data = read_yaml(_read_text(path)) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return merge_base(data, path, replace, (*_chain, path.resolve()))


def merge_base(block: dict, path: Path, replace: tuple[str, ...] = (), _chain: tuple[Path, ...] = ()) -> dict:
    """`block` (a mapping read from file `path`, or a section of it) over the config its `base:` names, if any: a
    file relative to `path`, or a preset. The base's own `base:` is followed with the same `replace`."""
    block = dict(block)
    base = block.pop("base", None)
    if not base:
        return block
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a preset name or a file path, got {base!r}")
    base_path = (Path(path).parent / base) if not Path(base).is_absolute() else Path(base)
    if not base_path.is_file():
        try:
            base_path = resolve_preset(base, paths=Path(base).is_absolute())
        except ConfigError as err:
            beside = "" if Path(base).is_absolute() else f" (a relative base is read beside its file: {base_path})"
            raise ConfigError(f"{path}: base: {err}{beside}") from None
    return deep_merge(load_yaml_with_base(base_path, replace, _chain), block, replace=replace)


def apply_overrides(data: dict, overrides: typing.Iterable[str], replace: tuple[str, ...] = ()) -> dict:
    """`data` with dotted `a.b.c=value` overrides applied (a new dict); values are YAML: `0.1`, `true`, `[a, b]`. A
    mapping is merged over the one it overrides, as a file's over its base's (`train={lr: 0.1}` is train.lr=0.1, not
    every other train setting back at its default); at or under a key in `replace` it is taken whole, as a file
    takes it (`objectives={...}`, `objectives.mlm={...}`: those options, no others), as is such a key within a
    merged mapping (an ablation's `run={objectives: {...}}`, where `replace` holds run.objectives)."""
    data = copy.deepcopy(data)  # deep_merge({}, data) shared the nested mappings, which the overrides then changed
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. model.hidden_size=128)")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node.get(part), list):  # data.sources.0.weight=2 was "expected a list, got {'0': ...}"
                listed = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override '{item}': {listed} is a list, whose items cannot be set one by one; give the whole "
                    f"list ({listed}=[...])"
                )
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        value = _parse_scalar(raw)
        whole = any(parts[: len(r.split("."))] == r.split(".") for r in replace)
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) and not whole:
            # a key in `replace` inside the mapping is still taken whole: an ablation's run={objectives: {...}}
            prefix = ".".join(parts) + "."
            inside = tuple(r[len(prefix) :] for r in replace if r.startswith(prefix))
            value = deep_merge(node[parts[-1]], value, replace=inside)
        node[parts[-1]] = value
    return data


def load_typed(cls: type, path: Path | None, overrides: typing.Iterable[str] = (), replace: tuple[str, ...] = ()):
    """The whole API in one call: file (with `base:`) + dotted overrides -> a typed `cls`, errors naming the file."""
    data = load_yaml_with_base(Path(path), replace) if path else {}
    return from_dict(cls, apply_overrides(data, overrides, replace), source=path)


def describe_fields(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field, nested dataclasses expanded; used by `--help`, `pretrain
    objectives` and the README."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe_fields(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, repr(default), f.metadata.get("doc", "")))
    return rows
