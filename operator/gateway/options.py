"""Gateway options declared once, as engine options are (shoal.engine.flags): a GatewayConfig field (proxy.py) that
carries an `Option` in its metadata is a `shoal-gateway` flag, and, with a `SpecField`, a field of the CRD's
spec.gateway that the operator renders back into that flag::

    response_timeout: float = option(3600.0, "reliability", "seconds an engine may take ...",
                                     spec=SpecField("response_timeout_seconds", int, ge=1, le=86400, ...))

From the declaration: the flag's name (`--response-timeout` unless `flag` says otherwise), type, choices, default
and help (`add_flags`), the GatewayConfig keywords from parsed flags (`config_kwargs`), spec.gateway's fields with
their bounds and descriptions (`spec_fields`, which api.GatewayOptions is made of) and the flags a spec renders to
(`to_args`). Standard library only: api.py builds the CRD from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

MISSING = dataclasses.MISSING


@dataclass(frozen=True)
class SpecField:
    """The option as a field of the InferenceService's spec.gateway (snake case; the CRD has it in camelCase)."""

    name: str
    type: type  # int or str (with the option's choices: an enum)
    description: str
    ge: int | None = None
    le: int | None = None


@dataclass(frozen=True)
class Option:
    group: str  # the --help section
    help: str
    flag: str | None = None  # default: "--" + the field name with dashes
    type: Callable[[str], Any] | None = None  # parser of the text (default: the default value's type)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    spec: SpecField | None = None


def bounded(kind: Callable[[str], Any], *, or_zero: bool, noun: str = "number") -> Callable[[str], Any]:
    """A parser of numbers of `kind` (int, float) > 0 (or_zero: >= 0), with the flag's error in words."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {noun}") from None
        if value < 0 or (value == 0 and not or_zero):
            raise argparse.ArgumentTypeError(f"must be {'>=' if or_zero else '>'} 0, got {text}")
        return value
    return parse


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return bounded(kind, or_zero=False)


non_negative_int = bounded(int, or_zero=True, noun="whole number")
non_negative = bounded(float, or_zero=True)


def option(default: Any, group: str, help: str, **kw: Any) -> Any:
    """A GatewayConfig field declared as an option."""
    return dataclasses.field(default=default, metadata={"option": Option(group, help, **kw)})


@dataclass(frozen=True)
class Declared:
    field: str  # the GatewayConfig field
    option: Option
    default: Any

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def declared(config_cls: type) -> list[Declared]:
    return [Declared(f.name, f.metadata["option"], f.default) for f in dataclasses.fields(config_cls)
            if "option" in f.metadata]


def add_flags(config_cls: type, groups: dict[str, argparse._ActionsContainer]) -> None:
    """Each declared option as a flag, in the --help section its group names."""
    for d in declared(config_cls):
        o = d.option
        kwargs: dict[str, Any] = {"default": d.default, "help": f"{o.help} (default: %(default)s)"}
        if o.choices:
            kwargs["choices"] = o.choices
        else:
            kwargs["type"] = o.type or type(d.default)
        if o.metavar:
            kwargs["metavar"] = o.metavar
        groups[o.group].add_argument(d.flag, **kwargs)


def config_kwargs(config_cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """GatewayConfig keywords of the declared options from parsed flags."""
    return {d.field: getattr(args, d.dest) for d in declared(config_cls)}


def spec_fields(config_cls: type) -> list[tuple[Declared, SpecField]]:
    """The declared options that are spec.gateway fields, in declaration order."""
    return [(d, d.option.spec) for d in declared(config_cls) if d.option.spec is not None]


def spec_default(d: Declared) -> Any:
    return d.option.spec.type(d.default)


def to_args(config_cls: type, gateway_spec: Any) -> list[str]:
    """A spec.gateway's options as shoal-gateway flags (every one, defaults included: the pod says what it runs)."""
    out: list[str] = []
    for d, spec in spec_fields(config_cls):
        out += [d.flag, str(getattr(gateway_spec, spec.name))]
    return out
