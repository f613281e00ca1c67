"""One schema for every setting: a field of a frozen dataclass is a Python keyword, a YAML key and a CLI flag.

`snake_case` names are the keywords and YAML keys; `--kebab-case` the flags. Each field declares its
parser once (`setting(...)`), so the three spellings cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from jaxserve.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "4GiB", "512MB", "1.5GiB"."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(f"cannot read {value!r} as a size; use bytes or e.g. '4GiB', '512MB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"a size must be positive, got {value!r}")
    return size


def parse_bool(value: Any) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case); a bare CLI flag arrives as "true"."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"cannot read {value!r} as a boolean (true/false)")


def parse_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"expected an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}") from None


_TOKEN_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_token_count(value: Any) -> int:
    """An integer, or vLLM's human-readable count: "32k" = 32,000, "32K" = 32,768, "1m" / "1M" likewise."""
    if isinstance(value, str) and value.strip()[-1:] in _TOKEN_UNITS:
        text = value.strip()
        number = parse_float(text[:-1]) * _TOKEN_UNITS[text[-1]]
        if not number.is_integer():
            raise ConfigError(f"{value!r} is not a whole number of tokens")
        return int(number)
    return parse_int(value)


def parse_positive_int(value: Any) -> int:
    number = parse_int(value)
    if number < 1:
        raise ConfigError(f"must be at least 1, got {number}")
    return number


def parse_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected a number, got {value!r}") from None


def parse_str(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"expected a string, got {value!r}")
    return str(value)


def parse_int_tuple(value: Any) -> tuple[int, ...]:
    """(1, 4), [1, 4] or "1,4" -> (1, 4)."""
    if isinstance(value, str):
        value = [part for part in value.replace("x", ",").split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"expected a list of integers such as 1,4 — got {value!r}")
    return tuple(parse_int(v) for v in value)


def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a parser so that None (YAML null, CLI 'none') passes through."""

    def parse_optional(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        return parse(value)

    parse_optional.inner = parse  # type: ignore[attr-defined]
    return parse_optional


def is_bool_parser(parse: Callable[[Any], Any]) -> bool:
    """parse_bool, or optional(parse_bool): such settings get --flag / --no-flag on the command line."""
    return getattr(parse, "inner", parse) is parse_bool


def choice(*options: str) -> Callable[[Any], str]:
    def parse_choice(value: Any) -> str:
        text = parse_str(value)
        if text not in options:
            raise ConfigError(f"{value!r} is not one of {', '.join(options)}")
        return text

    parse_choice.options = options  # type: ignore[attr-defined]
    return parse_choice


def setting(
    default: Any,
    help: str,
    parse: Callable[[Any], Any],
    group: str = "other",
    short: str | None = None,
    alias_of: tuple[str, int] | None = None,
    nargs: str | None = None,
):
    """A dataclass field that knows how to parse itself from YAML and the CLI.

    `group` titles the section of `--help` the flag is listed in (model, cache, scheduling, ...); `short`
    is an extra spelling of the flag (vLLM's `-tp`). `alias_of=(target, index)` makes the setting another
    spelling of element `index` of the tuple setting `target` (tensor_parallel_size is mesh_shape[1]):
    it defaults to None, is folded into the target when the object is built and reads None afterwards,
    so the target is the one source of truth (`fold_aliases`). `nargs="+"` makes the flag take one or
    more values (a list setting; the default for a setting whose default is an empty tuple: `cli_nargs`)."""
    return dataclasses.field(
        default=default,
        metadata={"help": help, "parse": parse, "group": group, "short": short, "alias_of": alias_of, "nargs": nargs},
    )


def cli_nargs(field: dataclasses.Field) -> str | None:
    """How many values a setting's flag takes: its `nargs`, else "+" for a list setting (one whose
    default is an empty tuple, such as lora_modules: `--lora-modules a=/p b=/q`), else one."""
    nargs = field.metadata.get("nargs")
    if nargs is None and isinstance(field.default, tuple) and not field.default:
        nargs = "+"
    return nargs


def flag_name(name: str) -> str:
    """The command-line spelling of a setting: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


def cli_spelling(message: str, names: Sequence[str]) -> str:
    """An error message with setting names as the command line spells them (max_num_seqs -> --max-num-seqs).

    Names with an underscore are unambiguous and replaced wherever they stand alone; one-word names
    (model, seed, dtype) only where the message marks them as a setting (`setting 'model'`, `model=`),
    so that prose such as "the model directory" stays prose."""
    for name in sorted(names, key=len, reverse=True):
        flag = flag_name(name)
        message = re.sub(rf"setting '{name}'", f"{flag}", message)
        if "_" in name:
            message = re.sub(rf"(?<![\w-])'?{name}'?(?![\w-])", flag, message)
        else:
            message = re.sub(rf"(?<![\w-]){name}=", f"{flag}=", message)
    return message


class Settings:
    """Mixin for frozen dataclasses whose fields are declared with `setting(...)`."""

    def __post_init__(self) -> None:
        # Normalise every field through its parser, so LLM(mesh_shape=[1, 4]) and YAML agree.
        for field in dataclasses.fields(self):
            parse = field.metadata.get("parse")
            if parse is None:
                continue
            try:
                object.__setattr__(self, field.name, parse(getattr(self, field.name)))
            except ConfigError as err:
                raise ConfigError(f"setting {field.name!r}: {err}") from None
        self.fold_aliases()
        self.validate()

    def fold_aliases(self) -> None:
        """Write each alias given (not None) into its element of the target setting, then set it to None.

        A target still at its default takes the alias's value; a target set to something else must
        agree with it, or the error names both (tensor_parallel_size=4 against mesh_shape=(2, 2))."""
        given = {target: tuple(getattr(self, target)) for target, _ in self.aliases().values()}
        for alias, (target, index) in self.aliases().items():
            value = getattr(self, alias)
            if value is None:
                continue
            current = tuple(getattr(self, target))
            if given[target] != _field(type(self), target).default and given[target][index] != value:
                raise ConfigError(
                    f"{alias}={value} conflicts with {target}={given[target]} ({target}[{index}] is "
                    f"{given[target][index]}): give one of them, or make them agree"
                )
            object.__setattr__(self, target, current[:index] + (value,) + current[index + 1 :])
            object.__setattr__(self, alias, None)

    def validate(self) -> None:
        """Checks between fields; subclasses override."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def aliases(cls) -> dict[str, tuple[str, int]]:
        """alias name -> (target setting, element index)."""
        return {
            f.name: f.metadata["alias_of"]
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.metadata.get("alias_of")
        }

    @classmethod
    def merge(cls, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """`overrides` over `base` (flags over YAML), alias-aware: an alias in the overrides rewrites its
        element of a target the base sets (YAML mesh_shape [2, 4] with -tp 8 gives [2, 8]), and a target
        in the overrides drops the base's aliases of it (YAML tensor_parallel_size 8 with --mesh-shape 1,4)."""
        merged = {**base, **overrides}
        for alias, (target, index) in cls.aliases().items():
            if alias in overrides and target in base and target not in overrides:
                value, current = (_parsed(cls, alias, overrides[alias]), _parsed(cls, target, base[target]))
                if value is not None:
                    current = list(current)
                    if index < len(current):
                        current[index] = value
                        merged[target] = current
            if target in overrides and alias in base and alias not in overrides:
                merged.pop(alias)
        return merged

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """From YAML-style keys; an unknown key is an error that names it and the known ones."""
        known = set(cls.field_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(map(repr, unknown))}; known settings: {', '.join(sorted(known))}"
            )
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str, overrides: Mapping[str, Any] | None = None):
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path!r} is not valid YAML: {err}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of setting: value")
        try:
            return cls.from_dict(cls.merge(values, overrides or {}))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """YAML-ready values (tuples become lists); aliases are left out, their targets hold their values."""
        out = {}
        aliases = self.aliases()
        for name in self.field_names():
            if name in aliases:
                continue
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any):
        """A copy with `changes`; an alias among them rewrites its element of this object's target
        (cfg.replace(tensor_parallel_size=8) keeps mesh_shape[0])."""
        for alias, (target, _) in self.aliases().items():
            if changes.get(alias) is not None and target not in changes:
                changes = self.merge({target: getattr(self, target)}, changes)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    # ---- command line -------------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, title_prefix: str = "") -> None:
        """One `--kebab-case` flag per field, listed in `--help` under its group; values stay strings and
        are parsed by the dataclass. Boolean settings take `--flag` (true), `--no-flag` (false), or an
        explicit value (`--flag false`, as YAML would say it). A list setting (`cli_nargs`) takes several
        values after its flag, and a repeated flag adds to them (`--lora-modules a=/p --lora-modules b=/q`)."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            parse = field.metadata["parse"]
            title = field.metadata.get("group", "other")
            if title not in groups:
                groups[title] = parser.add_argument_group(f"{title_prefix}{title}")
            group = groups[title]
            options = getattr(parse, "options", None)
            help_text = field.metadata["help"] + f" (default: {field.default!r})"
            flag = flag_name(field.name)
            flags = [flag] + ([field.metadata["short"]] if field.metadata.get("short") else [])
            if is_bool_parser(parse):
                group.add_argument(
                    flag,
                    dest=field.name,
                    default=argparse.SUPPRESS,
                    nargs="?",
                    const="true",
                    metavar="BOOL",
                    help=help_text + f"; {flag} alone means true",
                )
                group.add_argument(
                    "--no-" + flag[2:],
                    dest=field.name,
                    default=argparse.SUPPRESS,
                    action="store_const",
                    const="false",
                    help=f"same as {flag} false",
                )
                continue
            nargs = cli_nargs(field)
            if nargs is not None:
                group.add_argument(
                    *flags,
                    dest=field.name,
                    default=argparse.SUPPRESS,
                    choices=options,
                    help=help_text,
                    nargs=nargs,
                    action="extend",
                )
                continue
            group.add_argument(*flags, dest=field.name, default=argparse.SUPPRESS, choices=options, help=help_text)

    @classmethod
    def cli_values(cls, namespace: argparse.Namespace) -> dict[str, Any]:
        """The fields given on the command line, as raw values (for merging over YAML)."""
        return {name: getattr(namespace, name) for name in cls.field_names() if hasattr(namespace, name)}

    @classmethod
    def from_cli(cls, argv: Sequence[str]):
        """From command-line flags (and `--config FILE`); errors name the flags as they are spelled there."""
        parser = argparse.ArgumentParser()
        parser.add_argument("--config", default=None, help="YAML file of settings; flags override it")
        cls.add_cli_arguments(parser)
        namespace = parser.parse_args(list(argv))
        return cls.from_namespace(namespace, namespace.config)

    @classmethod
    def from_namespace(
        cls, namespace: argparse.Namespace, config: str | None = None, defaults: Mapping[str, Any] | None = None
    ):
        """From parsed flags over `config` (YAML) over `defaults`; a ConfigError spells settings as flags."""
        values = cls.merge(defaults or {}, cls.cli_values(namespace))
        try:
            if config:
                return cls.from_yaml(config, overrides=values)
            return cls.from_dict(values)
        except ConfigError as err:
            raise ConfigError(cls.cli_message(str(err))) from None

    @classmethod
    def cli_message(cls, message: str) -> str:
        """`message` with this class's setting names spelled as flags."""
        return cli_spelling(message, cls.field_names())


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _parsed(cls: type, name: str, value: Any) -> Any:
    try:
        return _field(cls, name).metadata["parse"](value)
    except ConfigError as err:
        raise ConfigError(f"setting {name!r}: {err}") from None
