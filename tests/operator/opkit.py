"""Small helpers shared by the operator tests (a uniquely named module: `conftest` is ambiguous on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

GROUP, VERSION = "serving.shoal.dev", "v1alpha1"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError, AttributeError):
            last = None
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def condition(isvc: dict | None, type_: str) -> dict | None:
    for c in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def isvc_body(name: str, spec: dict | None = None) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec or {}}
