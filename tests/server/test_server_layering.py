"""The server and the live view know engines only through ``EngineClient``: no module under
``travelator/server/`` or ``travelator/dashboard/`` imports a concrete engine (its class or its
module). Read from the source with ``ast``, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "travelator"
CLIENT_SIDE = ("server", "dashboard")
# The concrete engines, and the modules that hold them.
ENGINE_CLASSES = {"LLMEngine", "AsyncEngine", "DisaggregatedFrontEnd"}
ENGINE_MODULES = {"travelator.engine.engine", "travelator.engine.async_engine", "travelator.disagg.frontend"}


def engine_imports(source: str) -> list[str]:
    """Each import of a concrete engine in ``source``, as ``module`` or ``module.name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name in ENGINE_MODULES or a.name.rsplit(".", 1)[-1] in ENGINE_CLASSES]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module in ENGINE_MODULES:
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name in ENGINE_CLASSES or f"{node.module}.{a.name}" in ENGINE_MODULES]
    return found


def client_side_files() -> list[Path]:
    return sorted(p for folder in CLIENT_SIDE for p in (PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("path", client_side_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_concrete_engine_is_imported(path):
    assert engine_imports(path.read_text()) == []


def test_the_check_can_fail():
    """Each way of naming a concrete engine is seen."""
    source = """
from travelator.engine.async_engine import AsyncEngine
from travelator.engine import engine
from travelator.disagg.frontend import DisaggConfig
import travelator.engine.engine

def later():
    from travelator.somewhere import LLMEngine
"""
    assert engine_imports(source) == [
        "travelator.engine.async_engine", "travelator.engine.async_engine.AsyncEngine",
        "travelator.engine.engine", "travelator.disagg.frontend", "travelator.engine.engine",
        "travelator.somewhere.LLMEngine"]


def test_the_seam_itself_is_allowed():
    assert engine_imports("from travelator.engine.client import EngineClient, RequestSpec") == []
