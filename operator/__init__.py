"""Shoal's operator (kopf): the InferenceService API, rendering of children, reconciler and autoscaler."""

# The modules whose kopf handlers make up the operator: `shoal-operator` runs `kopf run -m` with each of them, and
# tests import the same list. (A kopf handler registers itself when its module is imported.)
HANDLER_MODULES = ("shoal.operator.handlers", "shoal.operator.autoscaler")
