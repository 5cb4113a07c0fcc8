"""transformers' TrainerState, TrainerControl, TrainerCallback and TrainOutput, which the Python API
uses as they are (imported when first asked for: transformers' trainer modules take a second or two
to import), and Callbacks: a trainer's callbacks with the run's state and control (events.py)."""

from __future__ import annotations

from rlvr.events import TrainerEvents as Callbacks

__all__ = ["Callbacks", "TrainerCallback", "TrainerControl", "TrainerState", "TrainOutput"]


def __getattr__(name: str):
    if name in ("TrainerState", "TrainerControl", "TrainerCallback"):
        from transformers import trainer_callback

        return getattr(trainer_callback, name)
    if name == "TrainOutput":
        from transformers.trainer_utils import TrainOutput

        return TrainOutput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
