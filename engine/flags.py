"""Command-line flags derived from the config models (like vLLM's flags from its EngineArgs dataclass).

A config field becomes a `shoal-engine serve` flag by carrying a `Flag` in its annotation::

    max_num_seqs: Annotated[int, Flag("engine", "maximum sequences per step")] = Field(default=256, gt=0)

The flag's name (``--max-num-seqs``, unless `Flag.name` says otherwise), default, choices (from a Literal), type
(int, float, a bool switch) and help (with the default appended) all come from the field, so the config is the one
place an option is defined; the operator renders a spec's engine options back into these flags with `to_args`.
Only pydantic and the standard library here: the operator and `shoal-engine --help` import it without torch.
"""

from __future__ import annotations

import argparse
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Flag:
    """Marks a config field as a CLI flag of `group` (the --help section)."""

    group: str
    help: str
    name: str | None = None  # default: "--" + the field name with dashes
    aliases: tuple[str, ...] = ()  # short forms: "-tp"
    type: Callable[[str], Any] | None = None  # parser of the text; default: from the annotation
    metavar: str | None = None
    nargs: str | None = None  # "+": several values after one flag (vLLM's --lora-modules a=p b=q)


# ------------------------------------------------------------------------------------------- value parsers
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '2GiB', '512M' (binary), '2GB' (decimal) -> bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 536870912, 512MiB, 2GiB, 1.5G)")
    num, unit, i, b = m.groups()
    unit = unit.lower()
    base = 1000 if (unit and b and not i) else 1024  # "GB" is decimal; "GiB", "G" are binary
    value = int(float(num) * base ** _POW[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_len(text: str) -> int:
    """An integer with an optional k/m suffix (vLLM's --max-model-len accepts '4k')."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (examples: 4096, 4k)")
    mult = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024}[m.group(2)]
    return int(float(m.group(1)) * mult)


DTYPE_ALIASES = {"auto": "auto", "half": "float16", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
                 "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}


def parse_dtype(text: str) -> str:
    if text not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"invalid dtype {text!r} (choose from {', '.join(DTYPE_ALIASES)})")
    return DTYPE_ALIASES[text]


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer counts: {text!r}") from None


# ------------------------------------------------------------------------------------------- fields -> flags
def flag_of(info: FieldInfo) -> Flag | None:
    return next((m for m in info.metadata if isinstance(m, Flag)), None)


def flag_fields(model: type[BaseModel], group: str | None = None) -> dict[str, Flag]:
    """{field name: Flag} of `model`'s fields that are flags (of `group`), in declaration order."""
    out = {}
    for name, info in model.model_fields.items():
        flag = flag_of(info)
        if flag is not None and (group is None or flag.group == group):
            out[name] = flag
    return out


def flag_name(model: type[BaseModel], field: str) -> str:
    flag = flag_of(model.model_fields[field])
    return (flag.name if flag and flag.name else None) or "--" + field.replace("_", "-")


def dest(model: type[BaseModel], field: str) -> str:
    """The argparse attribute a field's flag parses into."""
    return flag_name(model, field).lstrip("-").replace("-", "_")


def base_type(annotation: Any) -> Any:
    """int | None -> int; Literal[...] | None -> Literal[...]."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _default(info: FieldInfo) -> Any:
    return None if info.is_required() else info.get_default(call_default_factory=True)


def is_switch(info: FieldInfo) -> bool:
    """A bool that defaults to on is a --x/--no-x switch; one that defaults to off is a plain --x."""
    return base_type(info.annotation) is bool and _default(info) is True


def add_flags(group: Any, model: type[BaseModel], section: str) -> None:
    """Add the flags of `model`'s fields marked Flag(section, ...) to an argparse parser or argument group."""
    for field, flag in flag_fields(model, section).items():
        info = model.model_fields[field]
        base, default = base_type(info.annotation), _default(info)
        kw: dict[str, Any] = {"default": default, "dest": dest(model, field)}
        help_text = flag.help.replace("%", "%%")  # argparse formats help with %-interpolation
        if flag.type is parse_len:
            help_text += " (accepts 4k)"
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif flag.type is not None:
            kw["type"] = flag.type
        elif get_origin(base) is Literal:
            kw["choices"] = list(get_args(base))
        elif base in (int, float):
            kw["type"] = base
        if is_switch(info):
            help_text += " (default: on)"
        elif default is not None and default is not False:
            help_text += " (default: %(default)s)"
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if flag.nargs:
            kw["nargs"] = flag.nargs
        group.add_argument(flag_name(model, field), *flag.aliases, help=help_text, **kw)


def values_from_args(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """{field: value} of `model`'s flags that `args` holds (None: left unset, the model's default applies)."""
    out = {}
    for field in flag_fields(model):
        value = getattr(args, dest(model, field), None)
        if value is not None:
            out[field] = value
    return out


def to_args(model: type[BaseModel], field: str, value: Any) -> list[str]:
    """The command-line words that set `field` to `value` (the inverse of parsing; None sets nothing)."""
    info = model.model_fields[field]
    name = flag_name(model, field)
    if value is None:
        return []
    if isinstance(value, bool):
        if is_switch(info):
            return [name if value else "--no-" + name[2:]]
        return [name] if value else []
    if isinstance(value, float):
        return [name, repr(value)]
    if isinstance(value, (list, tuple)) and flag_of(info) is not None and flag_of(info).nargs:
        return [name, *(str(v) for v in value)]
    if isinstance(value, (list, tuple)):
        return [name, ",".join(str(v) for v in value)]
    if isinstance(value, BaseModel):  # a JSON-valued flag (--speculative-config)
        return [name, value.model_dump_json(exclude_defaults=True)]
    if isinstance(value, dict):
        import json

        return [name, json.dumps(value)]
    return [name, str(value)]
