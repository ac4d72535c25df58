"""Shoal's operator (kopf): the InferenceService API, rendering of children, reconciler and autoscaler."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("shoal")  # the distribution's, as the engine's own (the fleet half imports no engine)
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

# The modules whose kopf handlers make up the operator: `shoal-operator` runs `kopf run -m` with each of them, and
# tests import the same list. (A kopf handler registers itself when its module is imported.)
HANDLER_MODULES = ("shoal.operator.handlers", "shoal.operator.autoscaler",
                   "shoal.operator.canary_judge")
