"""The native kernels' sources and what Python shares with them, read as text (no build)."""

from __future__ import annotations

import re
from pathlib import Path

from travelator import kernels
from travelator.model.linear_route import LinearRoute

CSRC = Path(kernels.__file__).parent / "csrc"
MAX_LINES = 450


def _header_routes() -> dict[str, int]:
    """linear_route.h's enumerators, kOnednnBf16 spelled as Python spells it: ONEDNN_BF16."""
    text = (CSRC / "linear_route.h").read_text()
    body = re.search(r"enum class LinearRoute : int64_t \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return {re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper(): int(value)
            for name, value in re.findall(r"\bk(\w+)\s*=\s*(\d+)", body)}


def test_the_linear_routes_are_the_headers():
    assert _header_routes() == {route.name: route.value for route in LinearRoute}


def test_the_layer_stack_reads_the_routes_from_the_header():
    """The routed linear layer (streaming_linear.h, which the layer stack and the experts call
    include) takes its route numbers from linear_route.h, not from a copy."""
    assert '#include "linear_route.h"' in (CSRC / "streaming_linear.h").read_text()
    for name in ("layer_stack.cpp", "moe_experts.cpp"):
        text = (CSRC / name).read_text()
        assert '#include "streaming_linear.h"' in text
        assert "enum Route" not in text


def test_every_source_is_built_and_in_the_build_key():
    listed = set(kernels._UNITS) | set(kernels._SOURCES) | set(kernels._HEADERS)
    assert listed == {p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert all(name.endswith(".cpp") for name in kernels._SOURCES + kernels._UNITS)


def test_each_source_is_compiled_in_one_build_unit():
    """A unit is a source itself or a file that includes sources: each source in exactly one."""
    included = [source for unit in kernels._UNITS
                for source in re.findall(r'^#include "(\w+\.cpp)"$', (CSRC / unit).read_text(), re.M)]
    included += [unit for unit in kernels._UNITS if unit in kernels._SOURCES]
    assert sorted(included) == sorted(kernels._SOURCES)


def test_no_kernel_source_is_over_the_line_limit():
    long = {p.name: n for p in CSRC.iterdir() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
