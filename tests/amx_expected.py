"""Whether the native kernels should hold their AMX routes in this run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def amx_routes_expected() -> bool:
    """This CPU has AMX's bf16 tiles and the kernels were built for a target with them: this
    CPU's (-march=native), or the one TRAVELATOR_KERNEL_MARCH names (travelator/kernels)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if not {"amx_bf16", "amx_tile"} <= set(flags.partition(":")[2].split()):
        return False
    march = os.environ.get("TRAVELATOR_KERNEL_MARCH", "native")
    if march == "native":
        return True
    macros = subprocess.run(["g++", f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True, check=True).stdout
    return "__AMX_BF16__" in macros and "__AMX_TILE__" in macros
