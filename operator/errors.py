"""The error of a spec the operator refuses (api.validate, runtimes.spec_errors): one class, below both."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec the operator refuses; `field` is the dotted path (spec.engine.extraArgs[2])."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
