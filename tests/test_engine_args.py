"""Every engine setting is defined once (a config field) and reachable everywhere: the flags of
generate, serve and the bench commands, and the keywords of LLM."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from travelator import LLM
from travelator.cli import build_parser
from travelator.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from travelator.engine_args import ENGINE_SETTINGS, engine_argv, engine_config, engine_kwargs

COMMANDS = [["generate"], ["serve"], ["bench", "throughput"], ["bench", "serve"], ["bench", "compare"]]
SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "parallel": ParallelConfig}


def other_value(s):
    """A valid value of the setting other than its default: (command-line text, config value)."""
    if s.name == "model":
        return "dummy:tiny", "dummy:tiny"
    if s.choices is not None:
        value = [c for c in s.choices if c != s.default][-1]
        return value, value
    if s.info.cli_unit is not None:
        return "0.5", (1 << 30) // 2
    if s.value_type is str:
        return "cpu", "cpu"
    value = 3 if s.default is None else s.default + 2
    return str(value), value


def test_every_config_field_is_a_setting():
    fields = {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert {(s.section, s.name) for s in ENGINE_SETTINGS} == fields
    assert all(s.info.help for s in ENGINE_SETTINGS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("setting", ENGINE_SETTINGS, ids=lambda s: s.name)
def test_a_flag_reaches_the_config(command, setting):
    if setting.name == "batching" and command == ["bench", "compare"]:
        # There --batching lists the modes to compare; each engine gets one of them.
        args = build_parser().parse_args([*command, "--batching", "static", "orca"])
        assert args.batching_modes == ["static", "orca"] and engine_kwargs(args)["batching"] == "iteration"
        assert engine_argv(args) == []
        return
    if setting.value_type is bool:
        argv, want = [setting.flag], not setting.default
    else:
        text, want = other_value(setting)
        argv = [setting.flag, text]
    args = build_parser().parse_args([*command, *argv])
    config = engine_config(args.model or "dummy:tiny", **engine_kwargs(args))
    assert getattr(getattr(config, setting.section), setting.name) == want
    assert engine_argv(args) == argv  # and back to the same flags, for a server bench starts


@pytest.mark.parametrize("setting", [s for s in ENGINE_SETTINGS if s.name != "model"],
                         ids=lambda s: s.name)
def test_a_keyword_reaches_the_config(setting):
    want = not setting.default if setting.value_type is bool else other_value(setting)[1]
    config = engine_config("dummy:tiny", **{setting.name: want})
    assert getattr(getattr(config, setting.section), setting.name) == want


def test_help_shows_every_flag(capsys):
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*command, "--help"])
        assert exited.value.code == 0
        text = capsys.readouterr().out
        for s in ENGINE_SETTINGS:
            assert s.flag in text, (command, s.flag)


def test_an_unknown_keyword_lists_the_valid_ones():
    with pytest.raises(TypeError) as info:
        LLM("dummy:tiny", max_overtake=3)
    message = str(info.value)
    assert "unknown engine setting 'max_overtake'" in message
    for s in ENGINE_SETTINGS:
        if s.name != "model":
            assert s.name in message


def test_max_overtakes_reaches_the_scheduler_from_llm_and_the_command_line():
    llm = LLM("dummy:tiny", max_overtakes=3, num_kv_blocks=16)
    assert llm.engine.scheduler.config.max_overtakes == 3
    args = build_parser().parse_args(["generate", "--max-overtakes", "5"])
    assert engine_kwargs(args)["max_overtakes"] == 5


def test_former_keywords_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'scheduler' is deprecated; use 'batching'"):
        config = engine_config("dummy:tiny", scheduler="static")
    assert config.scheduler.batching == "static"
    with pytest.warns(DeprecationWarning, match="'scheduling_order' is deprecated"):
        config = engine_config("dummy:tiny", scheduling_order="priority")
    assert config.scheduler.scheduling_policy == "priority"
    with warnings.catch_warnings(), pytest.raises(TypeError, match="given twice"):
        warnings.simplefilter("ignore", DeprecationWarning)
        engine_config("dummy:tiny", scheduler="static", batching="iteration")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_the_former_scheduler_flag_still_works_with_a_warning(command, capsys):
    args = build_parser().parse_args([*command, "--scheduler", "static"])
    assert args.batching == "static"
    assert "--scheduler is deprecated; use --batching" in capsys.readouterr().err
    assert engine_argv(args) == ["--batching", "static"]


def test_a_bad_choice_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="batching must be one of iteration, orca, dynamic, static; got 'chunky'"):
        LLM("dummy:tiny", batching="chunky")
