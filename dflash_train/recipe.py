"""One way from a command line to a typed, validated config, shared by every command.

A command's settings are a dataclass schema (``TrainConfig``, ``DatagenConfig``,
``EvalConfig``, ``ExportConfig``, the benchmark's ``BenchOptions``). ``load_command`` reads
the command line (``--config-name NAME`` and Hydra overrides: ``key=value``,
``+experiment=NAME``, ``target=qwen3_8b``), composes the recipe under recipes/ and hands it
to ``to_config``, which merges it onto the schema, converts it to the dataclasses and runs
the schema's cross-field checks. A config read from elsewhere (a checkpoint's recipe) goes
through ``to_config`` alone. Every mistake is a ValueError of one line naming the key:

    unknown key optim.lrr (did you mean optim.lr?)
    missing value for output_dir: add output_dir=<run folder> to the command
    wrong type for optim.lr='abc': could not be converted to Float
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hydra import compose, initialize_config_module
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

T = TypeVar("T")
RECIPES_MODULE = "dflash_recipes"  # recipes/, installed under this name (see pyproject.toml)
CONFIG_NAME_FLAGS = ("--config-name", "-cn")
HELP_FLAGS = ("-h", "--help")
# Values Hydra's override grammar takes unquoted; others (spaces, commas, brackets) get quoted.
_PLAIN_VALUE = re.compile(r"[\w\-+./:@~%]*", re.ASCII)
_LIST_INDEX = re.compile(r"\[\d+\]")
_MISSING_GROUP = re.compile(r"You must specify '([\w/.]+)'")  # Hydra's words for a `group: ???` default
# A required field's metadata key: what to write after "key=" in the missing-value error,
# e.g. field(default=MISSING, metadata={HINT: "<drafter directory> or random"}).
HINT = "hint"


@dataclass
class CommandLine:
    config_name: str
    overrides: list[str]


def parse_command_line(argv: Sequence[str], config_name: str, doc: str, *,
                       retired: dict[str, str] | None = None,
                       positional: str | None = None) -> CommandLine:
    """Split ``argv`` into the recipe's name and its overrides.

    ``positional`` names the key a bare argument sets (one at most). ``retired`` maps a flag
    the command took before its key=value settings to the setting that replaced it
    (``{"--out": "out=PATH"}``): the refusal names both. ``-h`` prints ``doc`` and exits.
    """
    retired = retired or {}
    overrides, bare = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in HELP_FLAGS:
            print(doc)
            sys.exit(0)
        if not arg.startswith("-"):  # Hydra overrides never start with "-"
            (overrides if "=" in arg or arg.startswith("~") else bare).append(arg)
            continue
        name, eq, inline = arg.partition("=")
        if name in retired:
            raise ValueError(f"{name} is no longer accepted; use {retired[name]}")
        if name not in CONFIG_NAME_FLAGS:
            known = ", ".join(CONFIG_NAME_FLAGS)
            raise ValueError(f"unknown option {name} (options: {known}; settings are key=value)")
        if not eq and not args:
            raise ValueError(f"missing value for {name}: option {name} needs one")
        config_name = inline if eq else args.pop(0)
    if bare and (positional is None or len(bare) > 1):
        at_most = f" (one bare argument at most: {positional})" if positional else ""
        raise ValueError(f"unexpected argument {bare[-1]!r}: settings are key=value{at_most}")
    if bare:
        overrides.append(f"{positional}={quote_value(bare[0])}")
    return CommandLine(config_name, [_quoted_if_needed(o) for o in overrides])


def quote_value(value: str) -> str:
    """``value`` as Hydra's override grammar reads it back unchanged: plain, or quoted.

    Inside quotes Hydra unescapes only backslashes before a quote (``\\'`` is a quote, a
    backslash run before one or before the closing quote is doubled); others stay as written.
    """
    if value and _PLAIN_VALUE.fullmatch(value):
        return value
    escaped = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m[1] * 2, escaped)
    return f"'{escaped}'"


def _quoted_if_needed(override: str) -> str:
    """``key=value`` with the value quoted when Hydra's grammar cannot read it as given (a
    path with non-ASCII letters or brackets), so a path works as typed. A value that is
    quoted or a list already, or that holds '=' (a list of overrides written without its
    quotes, which ``_list_hint`` explains), is left to Hydra."""
    key, eq, value = override.partition("=")
    if not eq or not value or value[0] in "'\"[{" or "=" in value or _parses(override):
        return override
    quoted = f"{key}={quote_value(value)}"
    return quoted if _parses(quoted) else override


def _parses(override: str) -> bool:
    try:
        _override_parser().parse_override(override)
    except HydraException:
        return False
    return True


@functools.cache
def _override_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def compose_recipe(schema: type, config_name: str, overrides: Sequence[str]) -> DictConfig:
    """The recipe ``config_name`` with ``overrides`` applied (Hydra), errors in one line."""
    try:
        with initialize_config_module(RECIPES_MODULE, version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    except MissingConfigException as err:
        if err.missing_cfg_file and err.options:
            raise ValueError(f"no recipe {err.missing_cfg_file!r}; options: {', '.join(err.options)}") from None
        raise ValueError(_first_line(err)) from None
    except OverrideParseException as err:
        hint = _list_hint(err.override)
        raise ValueError(f"cannot parse override {err.override!r}: {_first_line(err)}{hint}") from None
    except HydraException as err:
        key = getattr(err.__cause__, "full_key", None)
        if key and "Could not override" in str(err):  # a key the recipe does not have
            raise ValueError(_unknown_key(schema, key)) from None
        group = _MISSING_GROUP.match(str(err))
        if group:  # a group the recipe leaves to the command line (`- target: ???`)
            options = [line.strip() for line in str(err).splitlines()[2:] if line.strip()]
            raise ValueError(f"missing value for {group[1]}: add {group[1]}=<{' | '.join(options)}> "
                             "to the command") from None
        raise ValueError(_first_line(err)) from None


def recipe_choices(config_name: str, overrides: Sequence[str]) -> dict[str, str]:
    """The option each config group of the composed recipe took (``{"target": "qwen3_8b"}``).
    Call it after ``compose_recipe``, which reports the command line's errors."""
    with initialize_config_module(RECIPES_MODULE, version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    return {group: choice for group, choice in cfg.hydra.runtime.choices.items() if not group.startswith("hydra/")}


def _list_hint(override: str) -> str:
    """Hydra's grammar takes no bare '=' inside a value: a list of overrides (a stage's, for
    dflash-quality and dflash-quickstart) quotes each one."""
    key, _, value = override.partition("=")
    if "=" not in value:
        return ""
    example = f"{key}='[\"optim.lr=1e-3\", \"seed=1\"]'"
    return f" (quote a value holding '=', each item of a list of overrides: {example})"


def to_config(schema: type[T], raw: DictConfig | dict, validate: Callable[[T], None] | None = None,
              prefix: str = "") -> T:
    """Merge ``raw`` onto ``schema``, convert it to dataclasses and run ``validate`` on them.

    Unknown keys, missing required values (``MISSING``/``???``) and values of the wrong
    type raise a one-line ValueError naming the key (``prefix.key`` when ``raw`` is a
    section of a larger command line). ``validate`` raises ValueError for bad values.
    """
    _check_list_items(schema, OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else raw, prefix)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        # Merging ``???`` onto a field with a default keeps the default: a placeholder left
        # unfilled (epochs=???) would run silently on a value nobody chose.
        missing = sorted(OmegaConf.missing_keys(raw if OmegaConf.is_config(raw) else OmegaConf.create(raw)))
        if missing:
            raise ValueError(_missing(schema, missing[0], prefix))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(_describe(schema, err, prefix)) from None
    if validate is not None:
        validate(cfg)
    return cfg


def load_command(schema: type[T], argv: Sequence[str] | None, config_name: str, doc: str,
                 validate: Callable[[T], None] | None = None, **parse_options) -> T:
    """The typed config of one command: parse ``argv``, compose, merge, validate."""
    line = parse_command_line(sys.argv[1:] if argv is None else argv, config_name, doc, **parse_options)
    return to_config(schema, compose_recipe(schema, line.config_name, line.overrides), validate)


def log_to_stdout() -> None:
    """Log records of level INFO and up as plain lines on stdout (the trainer's progress notes)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def _check_list_items(schema: type, raw: Any, prefix: str) -> None:
    """Merge each item of a list of dataclasses on its own: OmegaConf's errors for list items
    lose the path (``pth`` for ``sources[0].pth``), so the path is added here. ``raw`` is
    plain containers, interpolations unresolved."""
    if not isinstance(raw, dict):
        return
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        value, hint = raw.get(f.name), hints[f.name]
        where = ".".join(p for p in (prefix, f.name) if p)
        item = _dataclass_in(hint)
        if item is None or value is None:
            continue
        if dataclasses.is_dataclass(hint):
            _check_list_items(hint, value, where)
        elif isinstance(value, list):
            for i, element in enumerate(value):
                try:
                    OmegaConf.merge(OmegaConf.structured(item), element)
                except OmegaConfBaseException as err:
                    raise ValueError(_describe(item, err, f"{where}[{i}]")) from None


def _describe(schema: type, err: OmegaConfBaseException, prefix: str) -> str:
    key = str(getattr(err, "full_key", None) or getattr(err, "key", None) or "")
    shown = ".".join(p for p in (prefix, key) if p)
    if isinstance(err, ConfigKeyError):
        return _unknown_key(schema, key, prefix)
    if isinstance(err, MissingMandatoryValue):
        return _missing(schema, key, prefix)
    if isinstance(err, ValidationError):
        reason = re.sub(r"^Value '.*?' (of type '\w+' )?", "", _first_line(err))
        return f"wrong type for {shown}={_value(err)!r}: {reason}"
    return f"{shown}: {_first_line(err)}" if shown else _first_line(err)


def _missing(schema: type, key: str, prefix: str) -> str:
    shown = ".".join(p for p in (prefix, key) if p)
    field = _field(schema, key)
    hint = field.metadata.get(HINT, "...") if field else "..."
    return f"missing value for {shown}: add {shown}={hint} to the command"


def _value(err: OmegaConfBaseException) -> Any:
    value = getattr(err, "value", None)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _unknown_key(schema: type, key: str, prefix: str = "") -> str:
    parent, _, name = key.rpartition(".")
    known = _keys_of(schema, parent)
    shown = ".".join(p for p in (prefix, key) if p)
    where = ".".join(p for p in (prefix, parent) if p)
    close = difflib.get_close_matches(name, known, n=1)
    if name in known:  # in the schema, but the composed recipe never sets it
        return f"unknown key {shown}: not in this recipe (+{shown}=... adds it)"
    if close:
        return f"unknown key {shown} (did you mean {'.'.join(p for p in (where, close[0]) if p)}?)"
    listed = ", ".join(known) if known else "none"
    return f"unknown key {shown} ({where or 'the top level'} has: {listed})"


def _keys_of(schema: type, path: str) -> list[str]:
    """The field names of the dataclass at ``path`` (dotted, list indices allowed) in ``schema``."""
    node: Any = schema
    for part in filter(None, _LIST_INDEX.sub("", path).split(".")):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return []
        node = _dataclass_in(typing.get_type_hints(node)[part])
    return sorted(f.name for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) else []


def _field(schema: type, key: str) -> dataclasses.Field | None:
    """The dataclass field ``key`` (dotted) of ``schema``, if there is one."""
    parent, _, name = _LIST_INDEX.sub("", key).rpartition(".")
    if name not in _keys_of(schema, parent):
        return None
    node = schema
    for part in filter(None, parent.split(".")):
        node = _dataclass_in(typing.get_type_hints(node)[part])
    return next(f for f in dataclasses.fields(node) if f.name == name)


def _dataclass_in(hint: Any) -> Any:
    """The dataclass a field holds: itself, or inside list[...] / X | None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) in (typing.Union, list):
        return next((d for d in map(_dataclass_in, typing.get_args(hint)) if d is not None), None)
    return None


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
