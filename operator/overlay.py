"""A strategic-merge overlay on a rendered pod template: the escape hatch behind spec.pod.template.

The semantics are Kubernetes' strategic merge patch for the pod template fields (what `kubectl patch` and
Kustomize do), so a user's overlay means the same here as anywhere else:

* maps merge key by key; ``null`` deletes a key; ``{"$patch": "replace"}`` in a map replaces it whole;
* lists with a merge key (containers and volumes by ``name``, volumeMounts by ``mountPath``, ports by
  ``containerPort``, ...) merge item by item, an item ``{"<key>": ..., "$patch": "delete"}`` removes one;
* every other list (args, command, tolerations, capabilities) is replaced.

Pure functions, no I/O. Unknown ``$`` directives are refused with the path, so a typo never passes silently.
"""

from __future__ import annotations

import copy
from typing import Any

# field name -> merge key, as in the Kubernetes API's patchMergeKey for the lists of a pod template
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "env": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "ports": "containerPort", "imagePullSecrets": "name", "topologySpreadConstraints": "topologyKey",
    "hostAliases": "ip", "resourceClaims": "name", "readinessGates": "conditionType",
}
DIRECTIVES = {"$patch"}


class OverlayError(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def strategic_merge(base: Any, overlay: Any, path: str = "") -> Any:
    """`base` with `overlay` merged in (neither is modified)."""
    if not isinstance(overlay, dict):
        return copy.deepcopy(overlay)
    unknown = [k for k in overlay if k.startswith("$") and k not in DIRECTIVES]
    if unknown:
        raise OverlayError(f"{path}.{unknown[0]}".lstrip("."), "unsupported directive (only $patch is)")
    patch = overlay.get("$patch")
    if patch not in (None, "replace", "merge"):
        raise OverlayError(f"{path}.$patch".lstrip("."), f"{patch!r} is not allowed on a map (replace or merge)")
    result = {} if patch == "replace" or not isinstance(base, dict) else copy.deepcopy(base)
    for key, value in overlay.items():
        if key in DIRECTIVES:
            continue
        where = f"{path}.{key}".lstrip(".")
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and MERGE_KEYS.get(key):
            result[key] = _merge_list(result.get(key) or [], value, MERGE_KEYS[key], where)
        else:
            result[key] = strategic_merge(result.get(key), value, where)
    return result


def _merge_list(base: list[Any], overlay: list[Any], key: str, path: str) -> list[Any]:
    result = copy.deepcopy(base)
    for i, item in enumerate(overlay):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or key not in item:
            raise OverlayError(where, f"items of {path.rsplit('.', 1)[-1]} are merged by {key!r}: it is required")
        at = next((j for j, have in enumerate(result) if isinstance(have, dict) and have.get(key) == item[key]),
                  None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append(strategic_merge({}, item, where))
        else:
            result[at] = strategic_merge(result[at], item, where)
    return result
