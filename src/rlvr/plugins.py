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


def settle(value):
    """The value a user function returned, awaited when it is a coroutine or another awaitable (an
    `async def` tool or reward function, as TRL takes them): in a fresh event loop, or in a thread of
    its own where this thread already runs one (a notebook)."""
    import inspect

    if not inspect.isawaitable(value):
        return value
    import asyncio

    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()
