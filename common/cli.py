"""Dataclass -> command line: each field becomes --kebab-case, help from field(metadata={"help": ...}), the
--help section from metadata "group"; the dataclass docstring's first line is the description.
A field's bounds are declared with it (`opt(..., ge=1)`) and checked in one place (`check_bounds`), with one
message format. A subclass may re-declare a field only to change its default (`steps: int = 5`): its help,
group and bounds are the base class's. `apply_preset` fills a named preset into the fields the command line
left alone."""

import argparse
import contextlib
import dataclasses
import io
import math
import os
import shlex
import time
import types
import typing
from typing import Literal, TypeVar

T = TypeVar("T")


def opt(group: str, default, help: str, *, ge=None, gt=None, le=None, lt=None, why: str = "",
        overridden_by: str = ""):
    """A dataclass field of a script's Args: its default, its --help line, the group it is listed under
    (GROUPS), and the values it accepts (>= ge, > gt, <= le, < lt; `why` is added to the refusal).
    overridden_by: another field whose explicit value on the command line beats a preset's value of this
    one (t2po: an explicit --steps beats a preset's --epochs)."""
    bounds = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    return dataclasses.field(default=default, metadata={"help": help, "group": group, "bounds": bounds,
                                                        "why": why, "overridden_by": overridden_by})


def metadata(cls: type, name: str) -> dict:
    """A field's help, group and bounds: from the most derived class that declares them with opt()."""
    for klass in cls.__mro__:
        field = getattr(klass, "__dataclass_fields__", {}).get(name)
        if field is not None and "help" in field.metadata:
            return dict(field.metadata)
    return {}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def bad_flag(script: str, name: str, value, why: str) -> SystemExit:
    """The one format of a refused flag: `loop.py: --group-size 1: must be >= 2 (why)`. Strings are shown as
    repr, so a control character in a value cannot rewrite the terminal line."""
    shown = repr(value) if isinstance(value, str) else value
    return SystemExit(f"{script}: {flag(name)} {shown}: {why}")


_TESTS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
          "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def check_bounds(args, script: str) -> None:
    """Every float flag finite, every number within its bounds; else one line, before anything loads."""
    for field in dataclasses.fields(args):
        value, meta = getattr(args, field.name), metadata(type(args), field.name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_flag(script, field.name, value, "must be a finite number")
        for key, bound in meta.get("bounds", {}).items():
            sign, ok = _TESTS[key]
            if not ok(value, bound):
                why = f" ({meta['why']})" if meta.get("why") else ""
                raise bad_flag(script, field.name, value, f"must be {sign} {bound}{why}")


def _add_field(parser, field: dataclasses.Field, hint, meta: dict) -> None:
    kwargs: dict = {"help": meta.get("help", ""), "dest": field.name}
    if field.default is not dataclasses.MISSING:
        kwargs["default"] = field.default
    elif field.default_factory is not dataclasses.MISSING:
        kwargs["default"] = field.default_factory()
    else:
        kwargs["required"] = True
    origin, type_args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # X | None: parse as X, None stays the default
        hint = next(a for a in type_args if a is not type(None))
        origin, type_args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag
    elif origin is Literal:
        kwargs["choices"] = list(type_args)
        kwargs["type"] = type(type_args[0])
    elif origin is list:
        kwargs["nargs"] = "*"
        kwargs["type"] = type_args[0] if type_args else str
    else:
        kwargs["type"] = hint
    parser.add_argument(flag(field.name), **kwargs)


# --help sections, in this order; a field without a "group" goes under "other"
GROUPS = ("run", "model", "environment", "rollout", "algorithm", "cold start", "optimisation", "torchrun",
          "other")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; the one-line description printed as written."""


def description(cls: type) -> str | None:
    """The docstring's first line. A dataclass without a docstring gets its signature as __doc__: none."""
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(cls.__name__ + "("):
        return None
    return doc.splitlines()[0]


def _parser(cls: type) -> argparse.ArgumentParser:
    # allow_abbrev=False: `--group 4` must not silently mean `--group-size 4` (and slip past a preset).
    # a short usage line: the flags are listed below, by group
    parser = argparse.ArgumentParser(description=description(cls), allow_abbrev=False,
                                     usage="%(prog)s [--flag value ...]", formatter_class=_Formatter)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    metas = {f.name: metadata(cls, f.name) for f in fields}
    for name in GROUPS:
        members = [f for f in fields if metas[f.name].get("group", "other") == name]
        if members:
            group = parser.add_argument_group(name)
            for field in members:
                _add_field(group, field, hints[field.name], metas[field.name])
    return parser


def parse_args(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse argv (default sys.argv[1:]) into an instance of the dataclass `cls`. Writes nothing.

    Bad input (unknown or abbreviated flag, a value outside a Literal's choices, a non-number) ends in
    argparse's one-line error naming the flag, with exit status 2.
    """
    other_rank = int(os.environ.get("RANK", "0")) > 0  # under torchrun rank 0 alone reports a bad flag
    try:
        with contextlib.redirect_stderr(io.StringIO()) if other_rank else contextlib.nullcontext():
            return cls(**vars(_parser(cls).parse_args(argv)))
    except SystemExit as e:
        if other_rank and e.code:  # rank 0 parses the same argv: let it print before torchrun stops all
            time.sleep(10)
        raise


def given_fields(cls: type, argv: list[str]) -> set[str]:
    """The field names that argv sets explicitly (`--x 1`, `--x=1`, `--no-flag`), found by argparse itself,
    so a preset can fill every other field. Call it after parse_args accepted argv."""
    parser = _parser(cls)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # a field that is absent from argv stays absent from the result
        action.required = False
    return set(vars(parser.parse_args(argv)))


def _as_flag(name: str, value) -> str:
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + flag(name)[2:]
    return f"{flag(name)} {shlex.quote(str(value))}"


def apply_preset(args: T, argv: list[str], presets: dict[str, dict], *,
                 overridden_by: dict | None = None) -> T:
    """Fill `presets[args.preset]` into every field argv does not set explicitly (`given_fields`), and
    print one line: the preset in force and the values it set. `--preset auto`: the preset named after
    `--env`, if there is one; `none`: no preset. overridden_by {field: other}: a preset's value of `field`
    is also left out when argv sets `other`, as is a field declared with opt(overridden_by=other)."""
    name = args.preset
    if name == "auto":
        name = args.env if args.env in presets else "none"
    if name != "none" and name not in presets:
        raise SystemExit(f"error: --preset {name}: not one of auto, none, {', '.join(presets)}")
    given = given_fields(type(args), argv)
    declared = {f.name: metadata(type(args), f.name).get("overridden_by") for f in dataclasses.fields(args)}
    overridden_by = {**{k: v for k, v in declared.items() if v}, **(overridden_by or {})}
    values = {k: v for k, v in presets.get(name, {}).items()
              if k not in given and overridden_by.get(k) not in given}
    args = dataclasses.replace(args, preset=name, **values)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: once
        print(f"preset {name}: " + (" ".join(_as_flag(k, v) for k, v in values.items()) or "sets nothing"),
              flush=True)
    return args
