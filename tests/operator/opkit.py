"""Small helpers shared by the operator tests (a uniquely named module: `conftest` is ambiguous on sys.path)."""

from __future__ import annotations

from prockit import wait_for  # noqa: F401  (re-exported: the one wait helper)

GROUP, VERSION = "serving.shoal.dev", "v1alpha1"


def condition(isvc: dict | None, type_: str) -> dict | None:
    for c in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def isvc_body(name: str, spec: dict | None = None) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec or {}}
