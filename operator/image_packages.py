"""Which part of the one distribution each image installs: rewrites a copy of pyproject.toml in place.

    python operator/image_packages.py operator /src/pyproject.toml   # shoal.operator + the engine's option declarations
    python operator/image_packages.py engine   /src/pyproject.toml   # shoal.engine only

pyproject.toml lists both halves' packages (one distribution, one editable install for development); setuptools
refuses a listed package whose folder is missing, so an image that copies one half first narrows the list (and the
package data and console scripts) to what it copied. The operator image takes from engine/ only the option
declarations its CRD derives from (OPERATOR_ENGINE_FILES: pydantic and the standard library, no torch; the import
boundaries test checks that they import nothing else), never engine code or kernels; the engine image takes no
operator.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# engine/ files the operator image copies, and the packages they make up
OPERATOR_ENGINE_FILES = ("engine/__init__.py", "engine/flags.py", "engine/config.py", "engine/kv_hash.py",
                         "engine/execution/__init__.py", "engine/execution/models/__init__.py",
                         "engine/server/__init__.py", "engine/server/keys.py", "engine/server/gateway_contract.py")
OPERATOR_ENGINE_PACKAGES = ("shoal.engine", "shoal.engine.execution", "shoal.engine.execution.models",
                            "shoal.engine.server")


def keeps(half: str, package: str) -> bool:
    if half == "engine":
        return package == "shoal.engine" or package.startswith("shoal.engine.")
    return package.startswith("shoal.operator") or package in OPERATOR_ENGINE_PACKAGES


def narrow(half: str, text: str) -> str:
    out = []
    section = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("["):
            section = line.strip()
        # a package in `packages = [...]` or a key of [tool.setuptools.package-data]
        listed = re.match(r'\s*"(shoal\.[\w.]+)"\s*(,|=)', line)
        if listed and section == "[tool.setuptools]" and not keeps(half, listed.group(1)):
            continue
        if listed and section == "[tool.setuptools.package-data]" and not listed.group(1).startswith(f"shoal.{half}"):
            continue  # the operator image's engine files are Python only
        # a console script: its module's package must be installed
        script = re.match(r'\s*[\w-]+\s*=\s*"(shoal\.[\w.]+):\w+"', line)
        if script and section == "[project.scripts]" and not script.group(1).startswith(f"shoal.{half}."):
            continue
        out.append(line)
    return "".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("operator", "engine"):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1])
    path.write_text(narrow(argv[0], path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
