"""transformers' TrainerState, TrainerControl and TrainOutput, the parts a script reads, and the
TrainerCallback-like objects given to a trainer, called where the run's loop (loop.py) calls them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainerState:
    """TRL's (transformers') TrainerState, the parts a script reads."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """Set `should_training_stop` in a callback to end training after this step (it is saved)."""

    should_training_stop: bool = False
    should_save: bool = False
    should_log: bool = False
    should_evaluate: bool = False


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


class Callbacks:
    """transformers TrainerCallback-like objects, called with (args, state, control, **kwargs) at the
    points rlvr has: on_train_begin, on_step_end, on_log, on_save, on_evaluate, on_train_end."""

    def __init__(self, callbacks: list, trainer):
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
        self.trainer = trainer

    def call(self, event: str, **kwargs) -> None:
        t = self.trainer
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(t.args, t.state, t.control, model=t.model, processing_class=t.processing_class, **kwargs)

    # what loop.py calls
    def begin(self, step: int, total: int) -> None:
        self.trainer.state.global_step, self.trainer.state.max_steps = step, total
        self.call("on_train_begin")

    def step_end(self, step: int, epoch: float, logged: dict | None) -> bool:
        """After each step; True when a callback asked training to stop."""
        state = self.trainer.state
        state.global_step, state.epoch = step, epoch
        if logged is not None:
            state.log_history.append(logged)
            self.call("on_log", logs=logged)
        self.call("on_step_end")
        return self.trainer.control.should_training_stop

    def saved(self, path) -> None:
        self.call("on_save", checkpoint=str(path))

    def end(self) -> None:
        self.call("on_train_end")
