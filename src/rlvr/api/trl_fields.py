"""The fields of TRL 1.16's GRPOConfig, SFTConfig, DPOConfig, AsyncGRPOConfig and DistillationConfig
(name, type, default, help), from
trl_fields.json, which benchmarks/trl_fields.py writes from the installed TRL; rlvr never imports
TRL.  tests/test_trl_scripts.py compares the table with the installed TRL when there is one.

Types are spelled with builtins and Literal only (`Literal['no', 'steps', 'epoch'] | str`,
`list[str] | None`, `dict | str | None`), so that transformers' HfArgumentParser reads a command
line for these classes as it does for TRL's own."""

from __future__ import annotations

import copy
import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

__all__ = ["table", "annotation", "dataclass_fields", "takes_mapping"]

_NAMES = {"Literal": Literal, "None": None, "bool": bool, "int": int, "float": float, "str": str, "list": list, "dict": dict}


@cache
def table() -> dict[str, Any]:
    return json.loads((Path(__file__).with_name("trl_fields.json")).read_text())


def annotation(spelled: str):
    """The type a spelling in the table stands for: an expression over builtins and Literal, from
    rlvr's own data file (no names beyond _NAMES can be reached)."""
    return eval(spelled, {"__builtins__": {}}, dict(_NAMES))  # noqa: S307 - see the docstring


def takes_mapping(spelled: str) -> bool:
    """A field that takes a mapping, which a command line gives as a JSON string (as transformers reads it)."""
    return spelled.split(" | ")[0] == "dict"


def dataclass_fields(config: str, defaults: dict[str, Any]) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) for make_dataclass: TRL's fields of `config` ("GRPOConfig"), each with its
    TRL default unless `defaults` gives rlvr's, and TRL's help."""
    helps = {**table()["help"], **table().get("help_of", {}).get(config, {})}
    out = []
    for name, row in table()[config].items():
        default = defaults.get(name, row["default"])
        metadata = {"help": helps.get(name, "")}
        if isinstance(default, (list, dict)):
            spec = dataclasses.field(default_factory=lambda value=default: copy.deepcopy(value), metadata=metadata)
        else:
            spec = dataclasses.field(default=default, metadata=metadata)
        out.append((name, annotation(row["type"]), spec))
    return out
