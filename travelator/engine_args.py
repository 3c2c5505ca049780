"""Engine settings as ``LLM`` keywords and command-line flags, read from the config sections.

Every engine setting is one field of a section of ``EngineConfig`` (config.py), declared there
once with its help text. This module lays them out flat, one name each, so that:

- ``engine_config(model, **kwargs)`` builds the nested configs by keyword (``LLM`` does this);
  an unknown keyword fails with the list of valid ones, and a former name still works, with a
  DeprecationWarning;
- ``add_engine_args(parser)`` gives ``generate``, ``serve`` and every ``bench`` command the same
  flags, ``engine_kwargs(args)`` reads them back as keywords, and ``engine_argv(args)`` turns
  the ones a user changed back into flags (``bench serve`` hands them to the server it starts).

Torch-free, so that building the command line costs nothing.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from travelator.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    Setting,
    field_choices,
    setting_of,
)

# EngineConfig attribute -> (section class, title of its group in --help).
_SECTIONS: dict[str, tuple[type, str]] = {
    "model": (ModelConfig, "engine: model"),
    "cache": (CacheConfig, "engine: KV cache"),
    "scheduler": (SchedulerConfig, "engine: scheduling"),
    "parallel": (ParallelConfig, "engine: parallelism"),
}


@dataclass(frozen=True, slots=True)
class EngineSetting:
    name: str  # the LLM keyword, the config field and the argparse dest
    section: str  # the EngineConfig attribute that holds it
    value_type: type  # int, float, str or bool
    default: Any  # None for the model, which the command line resolves (see default_model)
    choices: tuple[Any, ...] | None
    info: Setting

    @property
    def flag(self) -> str:
        return self.info.flag or "--" + self.name.replace("_", "-")


def _value_type(hint: Any) -> type:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):  # X | None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value_type(inner)
    return hint


def _collect() -> tuple[EngineSetting, ...]:
    settings = []
    for section, (cls, _) in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        choices = field_choices(cls)
        for f in fields(cls):
            settings.append(EngineSetting(
                f.name, section, _value_type(hints[f.name]),
                None if f.default is MISSING else f.default, choices.get(f.name),
                setting_of(cls, f.name)))
    return tuple(settings)


ENGINE_SETTINGS: tuple[EngineSetting, ...] = _collect()
_BY_NAME = {s.name: s for s in ENGINE_SETTINGS}
_FORMER_NAMES = {old: s.name for s in ENGINE_SETTINGS for old in s.info.old_keywords}


# ---- keywords --------------------------------------------------------------------------
def engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """The nested engine configuration from flat settings (the keywords of ``LLM``).

    Raises TypeError for a keyword that is no engine setting, listing the valid ones.
    """
    per_section: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    per_section["model"]["model"] = model
    for key, value in kwargs.items():
        s = _BY_NAME[_current_name(key)]
        if s.name in per_section[s.section]:
            raise TypeError(f"the engine setting {s.name!r} is given twice")
        per_section[s.section][s.name] = value
    sections = {section: cls(**per_section[section]) for section, (cls, _) in _SECTIONS.items()}
    return EngineConfig(**sections)


def _current_name(key: str) -> str:
    if key in _BY_NAME and key != "model":
        return key
    if key in _FORMER_NAMES:
        new = _FORMER_NAMES[key]
        warnings.warn(f"the engine setting {key!r} is deprecated; use {new!r}",
                      DeprecationWarning, stacklevel=4)
        return new
    valid = ", ".join(s.name for s in ENGINE_SETTINGS if s.name != "model")
    raise TypeError(f"unknown engine setting {key!r}; the engine settings are: {valid}")


# ---- the command line ------------------------------------------------------------------
class _FormerFlag(argparse.Action):
    """A flag that was renamed: it still works, and says what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, new_flag: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"warning: {option_string} is deprecated; use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _in_unit(name: str, factor: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return int(float(text) * factor)

    parse.__name__ = name  # argparse names it in "invalid GiB value"
    return parse


def _value_options(s: EngineSetting) -> dict[str, Any]:
    """type, choices and metavar of a setting's flag."""
    if s.info.cli_unit is not None:
        unit, factor = s.info.cli_unit
        return {"type": _in_unit(unit, factor), "metavar": unit}
    options: dict[str, Any] = {"type": s.value_type}
    if s.choices is not None:
        options["choices"] = s.choices
    return options


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine setting as a flag, grouped by section."""
    groups = {section: parser.add_argument_group(title) for section, (_, title) in _SECTIONS.items()}
    for s in ENGINE_SETTINGS:
        group = groups[s.section]
        flags = [s.flag] + ([s.info.short_flag] if s.info.short_flag else [])
        help_text = s.info.help.replace("%", "%%")
        if s.value_type is bool:
            action = "store_false" if s.default else "store_true"
            group.add_argument(*flags, dest=s.name, action=action, help=help_text)
            continue
        if s.default is not None:
            help_text += " (default: %(default)s)"
        group.add_argument(*flags, dest=s.name, default=s.default, help=help_text,
                           **_value_options(s))
        for old in s.info.old_flags:
            group.add_argument(old, dest=s.name, action=_FormerFlag, new_flag=s.flag,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS, **_value_options(s))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings of parsed arguments as ``LLM`` keywords (all but the model)."""
    return {s.name: getattr(args, s.name) for s in ENGINE_SETTINGS if s.name != "model"}


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine settings of parsed arguments that differ from their defaults, as flags."""
    argv: list[str] = []
    for s in ENGINE_SETTINGS:
        value = getattr(args, s.name)
        if value == s.default:
            continue
        if s.value_type is bool:
            argv.append(s.flag)
        elif s.info.cli_unit is not None:
            argv += [s.flag, repr(value / s.info.cli_unit[1])]
        else:
            argv += [s.flag, str(value)]
    return argv
