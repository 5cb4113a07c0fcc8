"""Objects a run names by text (tools, environments, rollout functions): "package.module:name", or
an object given to GRPOTrainer, registered under a name the Config can hold."""

from __future__ import annotations

import importlib


def load_named(spec, what: str, given: dict, expected: str = "package.module:name"):
    """The callable `spec` names: itself if it is one, a registered object, or module:name imported."""
    if callable(spec):
        return spec
    if spec in given:
        return given[spec]
    module, _, name = str(spec).partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: expected {expected}")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r}: {e}") from None
    if not callable(found):
        raise ValueError(f"{what} {spec!r} is not callable")
    return found


def register(obj, given: dict) -> str:
    """The name an object given to GRPOTrainer is known by in the Config: <its __name__>.  Another
    object of that name takes it over; a trainer puts its own back when it trains (api/inputs.py given_objects)."""
    name = f"<{getattr(obj, '__name__', type(obj).__name__)}>"
    given[name] = obj
    return name
