"""What every settings section shares: its value rules, collected from each part it is made of."""

from __future__ import annotations

import dataclasses
from typing import Any


class Section:
    """A frozen dataclass of one part's settings.  Each section writes its fields (TRL's names,
    defaults and comments) once, and beside them `_rules`: the problems of its own values.  A
    section made of others (RolloutSettings) and the whole Config have every rule of their parts."""

    def problems(self) -> list[str]:
        """Every value rule of the sections this one is made of, in field order."""
        out: list[str] = []
        for cls in reversed(type(self).__mro__):
            rules = cls.__dict__.get("_rules")
            if rules is not None:
                out += rules(self)
        return out

    def section(self, cls: type) -> Any:
        """This object's values of section `cls` (a part of it), as a `cls` of their own: what a
        part is given, so it cannot read another part's settings.  Made once per object."""
        cache = self.__dict__.setdefault("_sections", {})
        if cls not in cache:
            cache[cls] = cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})
        return cache[cls]


def choices(section: Any, **allowed: tuple) -> list[str]:
    """The problems of settings that take one of a few names."""
    return [f"{name} must be one of {', '.join(options)}; got {getattr(section, name)!r}"
            for name, options in allowed.items() if getattr(section, name) not in options]
