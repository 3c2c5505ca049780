"""The floors of the house (docs/design.md, "Floors"): a module of travelator/ imports only from
its own floor and the floors below it.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` (a type
is a dependency too). The modules are parsed, not imported, so the check takes milliseconds
and loads nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import travelator

PACKAGE = Path(travelator.__file__).parent
ROOT = "travelator"  # the unit of the package's own __init__.py

# Lowest first. A unit is a subpackage or a top-level module of travelator/; units on one
# floor may import each other.
FLOORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("values", frozenset({"config", "default_model", "engine_args", "errors", "json_grammar",
                          "pooling_params", "prompts", "sampling_params", "strict_schema", "structured"})),
    ("kernels", frozenset({"kernels"})),
    ("model", frozenset({"model"})),
    ("engine", frozenset({"engine"})),
    ("disagg", frozenset({"disagg"})),
    ("fronts", frozenset({"chat", "dashboard", "llm", "scoring", "server"})),
    ("replicas", frozenset({"replicas"})),  # whole servers as processes, behind a front end
    ("bench", frozenset({"bench", "sim"})),
    ("entry", frozenset({"cli", ROOT})),
)
FLOOR_OF = {unit: level for level, (_, units) in enumerate(FLOORS) for unit in units}


def units_in_package() -> set[str]:
    units = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    units |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return units | {ROOT}


def unit_of(target: str) -> str:
    """The unit a dotted import target lies in: ``travelator.engine.engine.LLMEngine`` is in
    ``engine``; ``travelator.LLM`` (the package's lazy export) is in ``llm``."""
    parts = target.split(".")
    if len(parts) == 1:
        return ROOT
    name = parts[1]
    if (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file():
        return name
    export = travelator._EXPORTS.get(name)
    assert export is not None, f"{target}: neither a module of travelator nor one of its exports"
    return unit_of(export)


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of a file of the package, and whether it is a package's __init__."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    if rel.name == "__init__":
        return ".".join(rel.parts[:-1]), True
    return ".".join(rel.parts), False


def imported_targets(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted target) of every import in ``source``, relative ones resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = base + ([node.module] if node.module else [])
            for alias in node.names:
                yield node.lineno, ".".join(base + [alias.name])


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of ``module`` that reaches a higher floor, as ``line: target (floor)``."""
    mine = FLOOR_OF[unit_of(module)]
    found = []
    for line, target in imported_targets(source, module, is_package):
        if target != ROOT and not target.startswith(ROOT + "."):
            continue
        theirs = FLOOR_OF[unit_of(target)]
        if theirs > mine:
            found.append(f"{line}: {target} (floor {FLOORS[theirs][0]}, above {FLOORS[mine][0]})")
    return found


def test_every_unit_has_a_floor():
    """A new package or top-level module must be placed (here and in docs/design.md)."""
    units = units_in_package()
    assert not units - set(FLOOR_OF), f"on no floor: {sorted(units - set(FLOOR_OF))}"
    assert not set(FLOOR_OF) - units, f"gone from travelator/: {sorted(set(FLOOR_OF) - units)}"


def test_no_module_imports_from_a_higher_floor():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = module_name(path)
        problems += [f"{path.relative_to(PACKAGE.parent)}:{p}"
                     for p in upward_imports(path.read_text(), module, is_package)]
    assert not problems, "imports from a higher floor:\n  " + "\n  ".join(problems)


def test_the_check_can_fail():
    """Each kind of import is seen: module level, in a function, under TYPE_CHECKING,
    relative, and through the package's lazy exports."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from travelator.engine.engine import LLMEngine\n"
        "import travelator.server.app\n"
        "if TYPE_CHECKING:\n"
        "    from travelator.disagg import frontend\n"
        "def f():\n"
        "    from ..bench import cli\n"
        "    from travelator import LLM\n"
        "from travelator.model import kv_layout\n"
        "from travelator.kernels import load\n"
    )
    found = upward_imports(source, "travelator.model.example")
    assert [p.split(":")[0] for p in found] == ["2", "3", "5", "7", "8"]
    assert "7: travelator.bench.cli (floor bench, above model)" in found
    assert upward_imports(source, "travelator.cli") == []
