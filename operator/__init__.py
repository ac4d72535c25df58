"""Shoal's operator (kopf): the InferenceService API, rendering of children, reconciler and autoscaler."""


def __getattr__(name: str) -> str:
    """`__version__`, the distribution's (as the engine's own: the fleet half imports no engine), read on first use:
    the pods' short-lived helpers (`shoal-podtools download` before every engine start) import this package and
    never need it, and importlib.metadata's import and scan cost them ~50 ms."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("shoal")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        found = "0+unknown"
    globals()["__version__"] = found
    return found

# The modules whose kopf handlers make up the operator: `shoal-operator` runs `kopf run -m` with each of them, and
# tests import the same list. (A kopf handler registers itself when its module is imported.)
HANDLER_MODULES = ("shoal.operator.handlers", "shoal.operator.autoscaler",
                   "shoal.operator.canary_judge")
