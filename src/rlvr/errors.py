"""The errors every layer raises, in one leaf module that imports nothing of rlvr, so that the
lowest modules can raise them without importing the highest.  Each is re-exported where it was
first defined (rlvr.config.ConfigError, rlvr.checkpoint.DiskFull, ...) for existing imports."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


class LoggerError(ConfigError):
    """A logger named in report_to cannot start (its package is missing)."""


class DatasetError(ValueError):
    """A dataset or row that cannot be read as prompts (and answers); the message names the row."""


class ModelError(RuntimeError):
    """A model that cannot be found or loaded."""


class LoraError(RuntimeError):
    """A LoRA setup that cannot work (missing peft, target modules not in the model)."""


class ToolError(ValueError):
    """A tool that cannot be used: not found, or its docstring does not describe it."""


class RolloutError(RuntimeError):
    """A rollout the run cannot make: an environment whose reset fails, a rollout_func whose output is malformed."""


class VLLMError(RuntimeError):
    """vLLM missing, or a vLLM server that cannot be reached or fails."""


class StaleWeights(VLLMError):
    """A vLLM server holds another version of the weights than the trainer's latest (restarted since)."""


class RewardError(RuntimeError):
    """A reward function that failed in a way that must stop the run (it raised, or its worker died)."""


class NonFinite(RuntimeError):
    """A loss, gradient, learning rate or weight that is inf or nan: the run stops."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, verified or loaded."""


class DiskFull(CheckpointError):
    """A write failed for want of space; on_save_error says whether the run stops."""


class HubPushError(RuntimeError):
    """The upload failed; the run is saved locally, and the message says how to upload it later."""
