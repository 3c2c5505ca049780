"""Fail unless every package installed in this environment is pinned, at its version, in the lock.

README's commands take the lock as constraints, and pip still installs a package the lock lacks,
at whatever version is newest that day. CI runs this in its fresh virtualenv after them.
"""

import re
import sys
from importlib.metadata import distributions

NOT_LOCKED = {"pip", "travelator"}  # the venv's own installer, and the project itself


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


lock_path = sys.argv[1]
with open(lock_path) as f:
    pins = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", f.read(), flags=re.M))
pins = {canonical(name): version for name, version in pins.items()}

installed = {canonical(d.metadata["Name"]): d.version for d in distributions()}
checked = {name: version for name, version in installed.items() if name not in NOT_LOCKED}
wrong = [f"{name}=={version} (lock: {pins.get(name, 'not there')})"
         for name, version in sorted(checked.items()) if pins.get(name) != version]
if wrong:
    print(f"CI: installed, but not as pinned in {lock_path}:", *wrong, sep="\n  ")
    sys.exit(1)
print(f"CI: all {len(checked)} installed packages are as pinned in {lock_path}")
