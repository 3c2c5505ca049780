"""Tests of CPU-only features pin their engines to the CPU.

On a GPU host ``device="auto"`` picks CUDA, where the native kernels, int8/int4 weights,
batch invariance, the int8 KV cache and tensor parallelism over gloo end in their documented
errors. So every engine a test builds with one of those settings names its device: an
``LLM(...)`` call, or a ``dict(...)``/``{...}`` of engine keywords, that sets one must set
``device`` too, and a list of command-line flags that gives one must give ``--device``.

The check reads the tests' source (nothing runs), and it sees settings written out, not
implied: a test that leans on a default that is CPU-only (``kernels="auto"`` being native,
a GGUF file's quants kept by ``quantization="auto"``) pins its device by hand.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

ENGINE_CALLS = ("LLM", "dict", "engine_config", "ModelConfig")
# keyword -> (which of its values are CPU-only, a test of the value as written)
CPU_ONLY = {
    "batch_invariant": ("anything but False", lambda v: v is not False),
    "quantization": ("int8, int4 or a variable", lambda v: v in ("int8", "int4", _VARIABLE)),
    "kv_cache_dtype": ("int8 or a variable", lambda v: v in ("int8", _VARIABLE)),
    "kernels": ("native or a variable", lambda v: v in ("native", _VARIABLE)),
    "tensor_parallel_size": ("anything but 1", lambda v: v != 1),
}
# flag -> the values that are CPU-only (None: the flag itself)
CPU_ONLY_FLAGS = {"--batch-invariant": None, "--quantization": ("int8", "int4"),
                  "--kv-cache-dtype": ("int8",), "--kernels": ("native",),
                  "--tensor-parallel-size": None, "-tp": None}
_VARIABLE = object()


def _value(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) else _VARIABLE


def _settings(node: ast.AST, named: dict[str, dict[str, object]]) -> dict[str, object] | None:
    """The keywords an engine call, a dict() call or a dict literal sets, with those of the
    dicts it unpacks (``named``: the file's dicts by name); None for other nodes, and for a
    call that unpacks a dict not known here (it may name the device)."""
    if isinstance(node, ast.Call):
        func = node.func.id if isinstance(node.func, ast.Name) else None
        if func not in ENGINE_CALLS:
            return None
        unpacked = [k.value for k in node.keywords if k.arg is None]
        if func == "dict":
            unpacked += node.args
        settings: dict[str, object] = {}
        for source in unpacked:
            if not (isinstance(source, ast.Name) and source.id in named):
                return None
            settings |= named[source.id]
        return settings | {k.arg: _value(k.value) for k in node.keywords if k.arg is not None}
    if isinstance(node, ast.Dict):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return None


def _named_dicts(tree: ast.AST) -> dict[str, dict[str, object]]:
    """``NAME = dict(...)`` or ``NAME = {...}`` anywhere in a file: NAME's settings."""
    named: dict[str, dict[str, object]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            settings = _settings(node.value, named)
            if settings is not None:
                named[node.targets[0].id] = settings
    return named


def _flags(node: ast.AST) -> list[object] | None:
    if isinstance(node, ast.List) and any(isinstance(e, ast.Constant) and e.value in CPU_ONLY_FLAGS
                                          for e in node.elts):
        return [_value(e) for e in node.elts]
    return None


def _cpu_only_flag(flags: list[object]) -> str | None:
    for i, flag in enumerate(flags):
        if flag in CPU_ONLY_FLAGS:
            values = CPU_ONLY_FLAGS[flag]
            following = flags[i + 1] if i + 1 < len(flags) else None
            if values is None or following in values or following is _VARIABLE:
                return str(flag)
    return None


def unpinned(root: Path) -> list[str]:
    """``path:line setting`` for every engine setting of a CPU-only feature, under ``root``,
    whose call, dict or flag list names no device."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # its tables name the settings
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = _named_dicts(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(root).as_posix()}:{getattr(node, 'lineno', 0)}"
            settings = _settings(node, named)
            if settings is not None and "device" not in settings:
                found += [f"{where} {k}" for k, (_, cpu_only) in CPU_ONLY.items()
                          if k in settings and cpu_only(settings[k])]
            flags = _flags(node)
            if flags is not None and "--device" not in flags and (flag := _cpu_only_flag(flags)):
                found.append(f"{where} {flag}")
    return found


def test_every_cpu_only_setting_comes_with_a_device():
    assert unpinned(TESTS) == []


def test_the_check_can_fail_and_passes_when_pinned(tmp_path):
    (tmp_path / "test_a.py").write_text(
        'LLM("m", quantization="int8")\n'
        'LLM("m", quantization="none", kernels="torch", batch_invariant=False)\n'
        'base = dict(batch_invariant=True)\n'
        'LLM("m", kernels=kernels, device="cpu")\n'
        'case = {"kv_cache_dtype": "int8"}\n'
        'FLAGS = ["--dtype", "float32", "--batch-invariant"]\n'
        'FLAGS = ["--kernels", "torch", "--device", "cpu", "--batch-invariant"]\n'
        'LLM("m", tensor_parallel_size=2, device="cuda")\n'
        'LLM("m", **base, device="cpu")\n'
        'PINNED = dict(device="cpu", dtype="float32")\n'
        'LLM("m", **PINNED, kernels="native")\n'
        'LLM("m", **base, kernels="native")\n'
        'LLM("m", **unknown, kernels="native")\n')
    assert sorted(unpinned(tmp_path)) == sorted([
        "test_a.py:1 quantization", "test_a.py:3 batch_invariant", "test_a.py:5 kv_cache_dtype",
        "test_a.py:6 --batch-invariant", "test_a.py:12 batch_invariant", "test_a.py:12 kernels"])
