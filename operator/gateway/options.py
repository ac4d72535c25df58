"""Gateway options declared once, as engine options are (shoal.engine.flags): a dataclass field that carries an
`Option` in its metadata is a `shoal-gateway` flag — GatewayConfig's (proxy.py) and the policies it nests
(HealthPolicy, QuotaPolicy), and the process's own (cli.Process: where to listen, where the engines are) — and,
with a `SpecField`, a field of the CRD's spec.gateway that the operator renders back into that flag, and, with a
`ChartValue`, a value of the Helm chart's sharedGateway that its template renders into that flag::

    response_timeout: float = option(3600.0, "reliability", "seconds an engine may take ...",
                                     spec=SpecField("response_timeout_seconds", int, ge=1, le=86400, ...))

From the declaration: the flag's name (`--response-timeout` unless `flag` says otherwise), type, choices, default
and help (`add_flags`), the config's keywords from parsed flags (`config_kwargs`), spec.gateway's fields with
their bounds and descriptions (`spec_fields`, which api.GatewayOptions is made of), the flags a spec renders to
(`to_args`), and the chart's flag template and the values' JSON schema entries (chartgen.py). Standard library
only: api.py builds the CRD from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

MISSING = dataclasses.MISSING
AS_FIELD = "<the field's default>"  # Option.cli_default when the flag's default is the field's


@dataclass(frozen=True)
class SpecField:
    """The option as a field of the InferenceService's spec.gateway (snake case; the CRD has it in camelCase)."""

    name: str
    type: type  # int or str (with the option's choices: an enum)
    description: str
    ge: int | None = None
    le: int | None = None


@dataclass(frozen=True)
class ChartValue:
    """The option as a value of the chart's sharedGateway (values.yaml keeps the default, with its comment)."""

    path: str  # under sharedGateway, dotted: "maxQueued", "tenantQuotas.requestsPerMinute"
    when: str | None = None  # rendered only while this value (same root) is set: "batches.enabled"
    join: str | None = None  # the value is a list, given to the flag joined by this
    maximum: float | None = None  # the chart's bound where it is tighter than the flag's (none above it)
    choices: tuple[str, ...] | None = None  # the chart's choices where they are fewer than the flag's
    schema: tuple[tuple[str, Any], ...] = ()  # JSON-schema keywords of the value's own (a pattern, items)


@dataclass(frozen=True)
class Option:
    group: str  # the --help section
    help: str
    flag: str | None = None  # default: "--" + the field name with dashes
    type: Callable[[str], Any] | None = None  # parser of the text (default: the default value's type); per value
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    spec: SpecField | None = None
    chart: ChartValue | None = None
    aliases: tuple[str, ...] = ()  # more names of the flag ("-A")
    repeat: bool = False  # the flag may be given many times: the field gets them all (`convert` says as what)
    convert: Callable[[Any], Any] | None = None  # the parsed flag -> the field's value (a directory -> its keys);
    # a ValueError it raises is the command line's error
    cli_default: Any = AS_FIELD  # the flag's default where it differs from the field's (which code relies on)


@dataclass(frozen=True)
class Bound:
    kind: type  # int or float
    or_zero: bool  # >= 0, else > 0


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
    parse.bound = Bound(kind, or_zero)  # what the chart's schema says of it (chartgen.py)
    return parse


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return bounded(kind, or_zero=False)


non_negative_int = bounded(int, or_zero=True, noun="whole number")
non_negative = bounded(float, or_zero=True)


def endpoint_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an engine base URL like http://10.0.0.5:8000")
    try:
        parts.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text.rstrip("/")


def kv_events_endpoint(text: str) -> tuple[str, tuple[int, int | None]]:
    """URL=PORT[,REPLAY_PORT] -> (the engine's URL as --endpoint normalises it, (port, replay port or None))."""
    url, sep, ports = text.rpartition("=")
    try:
        port, _, replay = ports.partition(",")
        numbers = (int(port), int(replay) if replay else None)
    except ValueError:
        numbers = None
    if not sep or numbers is None or not all(0 < n < 65536 for n in numbers if n is not None):
        raise argparse.ArgumentTypeError(f"expected URL=PORT[,REPLAY_PORT], got {text!r}")
    return endpoint_url(url), numbers


def namespace_bound(text: str) -> tuple[str, int]:
    """NAMESPACE=N -> (namespace, N)."""
    namespace, _, value = text.partition("=")
    try:
        if namespace.strip():
            return namespace.strip(), int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE=N")


def option(default: Any, group: str, help: str, *, factory: Callable[[], Any] | None = None, **kw: Any) -> Any:
    """A config field declared as an option (`factory` instead of a default: a new dict per config)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"option": Option(group, help, **kw)})
    return dataclasses.field(default=default, metadata={"option": Option(group, help, **kw)})


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def nested(policy: type) -> Any:
    """A config field holding a policy whose own fields are declared options (their flags are the config's)."""
    return dataclasses.field(default_factory=policy, metadata={"options": policy})


@dataclass(frozen=True)
class Declared:
    field: str  # the config's field
    option: Option
    default: Any  # the field's default

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def flag_default(self) -> Any:
        return self.default if self.option.cli_default is AS_FIELD else self.option.cli_default

    @property
    def boolean(self) -> bool:  # a switch: given or not
        return isinstance(self.flag_default, bool)


def declared(config_cls: type) -> list[Declared]:
    """Every declared option of config_cls and of the policies it nests, in declaration order."""
    out: list[Declared] = []
    for f in dataclasses.fields(config_cls):
        if "options" in f.metadata:
            out += declared(f.metadata["options"])
        elif "option" in f.metadata:
            out.append(Declared(f.name, f.metadata["option"], _default(f)))
    return out


def add_flags(config_cls: type, groups: dict[str, argparse._ActionsContainer]) -> None:
    """Each declared option as a flag, in the --help section its group names."""
    for d in declared(config_cls):
        o = d.option
        default = d.flag_default
        shown = "" if default is None or default is False or default == "" or o.repeat else " (default: %(default)s)"
        kwargs: dict[str, Any] = {"help": o.help + shown, "dest": d.dest}
        if d.boolean:
            kwargs["action"] = "store_true"
        else:
            kwargs["default"] = [] if o.repeat else default
            if o.repeat:
                kwargs["action"] = "append"
            if o.choices:
                kwargs["choices"] = o.choices
            if o.type or not o.choices:
                kwargs["type"] = o.type or (str if default is None else type(default))
            if o.metavar:
                kwargs["metavar"] = o.metavar
        groups[o.group].add_argument(d.flag, *o.aliases, **kwargs)


def config_kwargs(config_cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """config_cls's keywords from parsed flags: its declared options, converted, and its policies built of theirs."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if "options" in f.metadata:
            out[f.name] = f.metadata["options"](**config_kwargs(f.metadata["options"], args))
        elif "option" in f.metadata:
            d = Declared(f.name, f.metadata["option"], _default(f))
            value = getattr(args, d.dest)
            if d.option.convert is not None and value is not None:
                value = d.option.convert(value)
            elif d.option.repeat:
                value = tuple(value)
            out[f.name] = value
    return out


def spec_fields(config_cls: type) -> list[tuple[Declared, SpecField]]:
    """The declared options that are spec.gateway fields, in declaration order."""
    return [(d, d.option.spec) for d in declared(config_cls) if d.option.spec is not None]


def chart_values(config_cls: type) -> list[tuple[Declared, ChartValue]]:
    """The declared options that are values of the chart's sharedGateway, in declaration order."""
    return [(d, d.option.chart) for d in declared(config_cls) if d.option.chart is not None]


def spec_default(d: Declared) -> Any:
    return d.option.spec.type(d.default)


def to_args(config_cls: type, gateway_spec: Any) -> list[str]:
    """A spec.gateway's options as shoal-gateway flags (every one, defaults included: the pod says what it runs)."""
    out: list[str] = []
    for d, spec in spec_fields(config_cls):
        out += [d.flag, str(getattr(gateway_spec, spec.name))]
    return out
