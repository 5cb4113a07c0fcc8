"""rlvr: train language models with reinforcement learning from verifiable rewards.

`from rlvr import GRPOConfig, GRPOTrainer` is TRL's Python API on rlvr (api/), and so are
SFTConfig / SFTTrainer, DPOConfig / DPOTrainer, AsyncGRPOConfig / AsyncGRPOTrainer and
DistillationConfig / DistillationTrainer, and what TRL's training scripts import besides
(TrlParser, ModelConfig, ScriptArguments, get_peft_config, ...); the command line is `rlvr` (cli.py).
"""

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "DPOConfig", "DPOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer",
           "DistillationConfig", "DistillationTrainer",
           # what TRL's training scripts import besides (api/scripts.py)
           "TrlParser", "ScriptArguments", "ModelConfig", "DatasetConfig", "DatasetMixtureConfig", "get_dataset",
           "get_peft_config", "get_quantization_config", "get_kbit_device_map", "init_zero_verbose"]


def __getattr__(name: str):
    if name in __all__:  # imported on first use, so `import rlvr` stays light
        from rlvr import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlvr' has no attribute {name!r}")
