"""The code's shape, held by tests so that it cannot slip silently.

- no Python file in ``travelator/`` over ``MAX_FILE_LINES`` lines;
- no function in ``engine/``, ``model/`` or ``server/`` over ``MAX_FUNCTION_LINES`` lines;
- no ``getattr``/``hasattr`` probe of the model runner (the engine reaches it through its
  executor protocol, so what it has is known, not probed);
- no benchmark figures or machine names in code comments: they go stale, and they belong in
  docs/benchmarks.md.

Each check is a function over a package folder, so that it also runs on a small synthetic
tree (the tests at the end of this file), where it must both fail and pass: a check that can
never fail holds nothing. A failure lists every offender, ``path:line``, with its size or text.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGE = REPO / "travelator"

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 50
FUNCTION_LIMIT_FOLDERS = ("engine", "model", "server")
CPP_SUFFIXES = (".cpp", ".cc", ".h", ".hpp")

# Conservative on purpose: a comment may say why one path is faster, not by how much on which
# machine. Speed ratios, rates with their number, core counts and machine names. CPU
# families named for the instructions they have ("AVX512-BF16: Zen 4 and later") are allowed,
# so "Zen N" counts only as a machine ("a Zen 5", "on Zen 5").
FIGURE_PATTERNS = [
    re.compile(r"\d(\.\d+)?x (faster|slower)", re.IGNORECASE),
    re.compile(r"\d(\.\d+)?-\d+(\.\d+)?x\b"),
    re.compile(r"\d\s*(tok|tokens|req|GB|MB|GFLOP|TFLOP)/s\b"),
    re.compile(r"\b\d+-core\b"),
    re.compile(r"\bEPYC\b"),
    re.compile(r"\bXeon\b"),
    re.compile(r"Sapphire Rapids", re.IGNORECASE),
    re.compile(r"\b(an?|on) (AMD )?Zen \d"),
]


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root.parent).as_posix()


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


# ---- the checks --------------------------------------------------------------------------
def long_files(root: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path: N lines`` for every Python file under ``root`` longer than ``limit``."""
    return [f"{_relative(p, root)}: {n} lines" for p in _python_files(root)
            if (n := _line_count(p)) > limit]


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(root: Path, folders: tuple[str, ...] = FUNCTION_LIMIT_FOLDERS,
                   limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name: N lines`` for every function (methods and nested ones too) longer
    than ``limit`` in the given folders of ``root``."""
    found = []
    for folder in folders:
        for path in _python_files(root / folder):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for fn in _functions(tree):
                size = fn.end_lineno - fn.lineno + 1
                if size > limit:
                    found.append(f"{_relative(path, root)}:{fn.lineno} {fn.name}: {size} lines")
    return found


def runner_probes(root: Path) -> list[str]:
    """``path:line call`` for every ``getattr``/``hasattr`` call that names a runner."""
    found = []
    for path in _python_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and any("runner" in ast.unparse(arg).lower() for arg in node.args)):
                found.append(f"{_relative(path, root)}:{node.lineno} {ast.unparse(node)}")
    return found


def _python_comments(path: Path) -> Iterator[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _cpp_comments(path: Path) -> Iterator[tuple[int, str]]:
    in_block = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if in_block or "/*" in line:
            in_block = "*/" not in line.split("/*")[-1]
            yield number, line
        elif "//" in line:
            yield number, line[line.index("//"):]


def _comments(root: Path) -> Iterator[tuple[Path, int, str]]:
    for path in sorted(root.rglob("*")):
        if path.suffix == ".py" and "__pycache__" not in path.parts:
            yield from ((path, n, text) for n, text in _python_comments(path))
        elif path.suffix in CPP_SUFFIXES:
            yield from ((path, n, text) for n, text in _cpp_comments(path))


def figures_in_comments(root: Path) -> list[str]:
    """``path:line comment`` for every ``#`` or ``//`` comment that carries a benchmark figure
    or a machine name."""
    return [f"{_relative(path, root)}:{n} {text.strip()}" for path, n, text in _comments(root)
            if any(p.search(text) for p in FIGURE_PATTERNS)]


def _report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n  " + "\n  ".join(offenders)


# ---- the repository ----------------------------------------------------------------------
def test_no_file_in_the_package_is_over_the_line_limit():
    offenders = long_files(PACKAGE)
    assert not offenders, _report(f"files over {MAX_FILE_LINES} lines", offenders)


def test_no_function_in_engine_model_server_is_over_the_line_limit():
    offenders = long_functions(PACKAGE)
    assert not offenders, _report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


def test_nothing_probes_the_model_runner():
    offenders = runner_probes(PACKAGE)
    assert not offenders, _report("getattr/hasattr probes of a runner (use the executor "
                                  "protocol)", offenders)


def test_no_benchmark_figures_in_code_comments():
    offenders = figures_in_comments(PACKAGE)
    assert not offenders, _report("comments with benchmark figures or machine names (they "
                                  "belong in docs/benchmarks.md)", offenders)


# ---- the checks themselves, on a synthetic tree --------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "travelator"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def _function(name: str, body_lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (body_lines - 1) + "    return x\n"


def test_the_file_limit_can_fail_and_passes_at_the_limit(tmp_path):
    root = _tree(tmp_path, {"ok.py": "x = 1\n" * 450, "sub/long.py": "x = 1\n" * 451})
    assert long_files(root) == ["travelator/sub/long.py: 451 lines"]


def test_the_function_limit_can_fail_and_passes_at_the_limit(tmp_path):
    method = "class C:\n" + "".join("    " + line + "\n"
                                    for line in _function("method", 51).splitlines())
    root = _tree(tmp_path, {
        "engine/ok.py": _function("fits", 49),           # 50 lines with its def
        "engine/long.py": "\n" + _function("too_long", 50),
        "model/cls.py": method,
        "server/nested.py": "def outer():\n" + "".join(
            "    " + line + "\n" for line in _function("inner", 50).splitlines()),
        "bench/free.py": _function("anything_goes", 80),   # not a limited folder
    })
    assert long_functions(root) == [
        "travelator/engine/long.py:2 too_long: 51 lines",
        "travelator/model/cls.py:2 method: 52 lines",
        "travelator/server/nested.py:1 outer: 52 lines",
        "travelator/server/nested.py:2 inner: 51 lines",
    ]


def test_the_probe_check_can_fail_and_passes_on_plain_attributes(tmp_path):
    root = _tree(tmp_path, {
        "engine/ok.py": "def f(self, worker, name):\n"
                        "    self.runner.shutdown()\n"
                        "    return getattr(worker, name)\n",
        "engine/probe.py": "def f(self):\n"
                           "    if hasattr(self, 'runner'):\n"
                           "        getattr(self.model_runner, 'states', {})\n",
    })
    assert runner_probes(root) == [
        "travelator/engine/probe.py:2 hasattr(self, 'runner')",
        "travelator/engine/probe.py:3 getattr(self.model_runner, 'states', {})",
    ]


def test_the_figure_check_can_fail_and_passes_on_the_why(tmp_path):
    root = _tree(tmp_path, {
        "model/ok.py": "# Packed once at load: the GEMM reads the weights in its own order.\n"
                       "x = '3x faster'  # strings are not comments\n"
                       "# AVX512-BF16 (Zen 4 and later, Cooper Lake); 2x the rows per call\n"
                       "rate = 0.0  # req/s at the target: a unit, not a figure\n",
        "model/bad.py": "y = 1  # 1.3-2.7x F.linear's\n"
                        "# On a 2-core machine this is 4x slower\n",
        "kernels/csrc/k.cpp": "// Streams the rows in order.\n"
                              "int a; // 19-20 GB/s here\n"
                              "/* measured on an EPYC\n"
                              "   at 900 tok/s */\n",
    })
    assert figures_in_comments(root) == [
        "travelator/kernels/csrc/k.cpp:2 // 19-20 GB/s here",
        "travelator/kernels/csrc/k.cpp:3 /* measured on an EPYC",
        "travelator/kernels/csrc/k.cpp:4 at 900 tok/s */",
        "travelator/model/bad.py:1 # 1.3-2.7x F.linear's",
        "travelator/model/bad.py:2 # On a 2-core machine this is 4x slower",
    ]
