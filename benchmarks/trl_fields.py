"""Write src/rlvr/api/trl_fields.json: the fields of TRL's GRPOConfig, SFTConfig, DPOConfig,
AsyncGRPOConfig and DistillationConfig (name, type, default, help; `help_of` a class's own help where
it means a shared name otherwise), read from the installed TRL, so that rlvr's configs
have TRL's fields without importing TRL.  AsyncGRPOConfig is TRL's top-level class from 1.18 on and
trl.experimental.async_grpo's before (TRL 1.16, the newest on the package index this was written with).

    python benchmarks/trl_fields.py            # rewrite the table from the installed TRL
    python benchmarks/trl_fields.py --check    # exit 1 when the table is not the installed TRL's

Types are spelled in a small vocabulary that rlvr evaluates with builtins and Literal only
(api/trl_fields.py): an Enum becomes the Literal of its values, a list of enums list[str],
a mapping `dict`, any other class `str`; so HfArgumentParser reads the same command line as
it does for TRL's own class.  Defaults are TRL's, as JSON (an Enum as its value, a factory's product).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import types
import typing
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "src" / "rlvr" / "api" / "trl_fields.json"
CLASSES = ("GRPOConfig", "SFTConfig", "DPOConfig", "AsyncGRPOConfig", "DistillationConfig")
SCALARS = {bool: "bool", int: "int", float: "float", str: "str", type(None): "None"}


def spell(t, in_list: bool = False) -> str:
    """TRL's annotation `t` in the table's vocabulary (see the module docstring)."""
    if t in SCALARS:
        return SCALARS[t]
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        spelled = []
        for a in args:
            s = spell(a, in_list)
            if s not in spelled:
                spelled.append(s)
        return " | ".join(spelled)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is list or t is list:
        return f"list[{spell(args[0], True) if args else 'str'}]"
    if origin is dict or t is dict:
        return "dict"
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return "str" if in_list else f"Literal[{', '.join(repr(m.value) for m in t)}]"
    return "str"


def plain(value):
    """A default as JSON: an Enum as its value, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def field_row(f: dataclasses.Field, hints: dict) -> dict:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None
    return {"type": spell(hints[f.name]), "default": plain(default)}


def table() -> dict:
    import trl

    out: dict = {"trl_version": trl.__version__, "help": {}}
    for name in CLASSES:
        cls = getattr(trl, name, None) or _experimental(name)
        hints = typing.get_type_hints(cls)
        rows = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            rows[f.name] = field_row(f, hints)
            text = " ".join(str(f.metadata.get("help") or "").split())
            if text and f.name not in out["help"]:
                out["help"][f.name] = text
            elif text and text != out["help"][f.name]:  # a field this class means otherwise (DistillationConfig.beta)
                out.setdefault("help_of", {}).setdefault(name, {})[f.name] = text
        out[name] = rows
    return out


def _experimental(name: str):
    """A class TRL had under trl.experimental before it was stable (AsyncGRPOConfig before 1.18)."""
    import os
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental import async_grpo
    return getattr(async_grpo, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the table with the installed TRL, write nothing")
    args = parser.parse_args(argv)
    text = json.dumps(table(), indent=1, sort_keys=False) + "\n"
    if args.check:
        same = TABLE.exists() and TABLE.read_text() == text
        print("trl_fields.json is the installed TRL's" if same else "trl_fields.json differs from the installed TRL: rewrite it")
        return 0 if same else 1
    TABLE.write_text(text)
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
