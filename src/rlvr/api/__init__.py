"""TRL's Python API on rlvr: a script that did `from trl import GRPOConfig, GRPOTrainer` runs
with `from rlvr import GRPOConfig, GRPOTrainer` instead, and trains with rlvr; so do TRL's
SFTConfig / SFTTrainer, DPOConfig / DPOTrainer and DistillationConfig / DistillationTrainer.

    args = GRPOConfig(output_dir="my-run", learning_rate=1e-5, max_steps=100)
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_reward, "accuracy"],
                          args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model("my-run/final")

    trainer = SFTTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", train_dataset=dataset,
                         args=SFTConfig(output_dir="sft", max_length=1024, packing=True))
    trainer = DPOTrainer(model="sft", train_dataset=pairs, args=DPOConfig(output_dir="dpo", beta=0.1))

The configs take every TRL setting by its TRL name (trl_settings.py says what each does here; where
SFT or DPO gives a name another meaning, DPO's `beta` and `loss_type`, or another default, SFT's
learning rate, the method's own applies: methods.py) and check them when they are made.  The
trainers take what TRL's take: the model as a name, a path or a loaded model; reward functions as
functions, callable objects, built-in names or `module:function` paths; datasets as
`datasets.Dataset` / `IterableDataset` (or lists of rows); a tokenizer; a peft LoraConfig;
TrainerCallback-like callbacks.  The run itself is rlvr's (run.py), with its run directory,
checkpoints, metrics and report.

    configs.py     GRPOConfig, SFTConfig, DPOConfig, AsyncGRPOConfig, DistillationConfig
    trainers.py    GRPOTrainer, and SFTTrainer / DPOTrainer / AsyncGRPOTrainer / DistillationTrainer on its construction
    inputs.py      the objects a trainer is given, as settings, Examples or rows; RunObjects for run.py
    callbacks.py   transformers' TrainerState, TrainerControl, TrainerCallback, TrainOutput; the callbacks
    trl_fields.py  the fields of TRL's configs (trl_fields.json), which the configs are dataclasses of
    scripts.py     what TRL's training scripts import besides: TrlParser, ScriptArguments, ModelConfig,
                   get_peft_config, get_quantization_config, get_dataset, ... (so trl/scripts/grpo.py runs on rlvr)
"""

from rlvr.api.callbacks import Callbacks
from rlvr.api.configs import AsyncGRPOConfig, DistillationConfig, DPOConfig, GRPOConfig, SFTConfig
from rlvr.api.inputs import RunObjects
from rlvr.api.trainers import AsyncGRPOTrainer, DistillationTrainer, DPOTrainer, GRPOTrainer, SFTTrainer

# scripts.py's names, imported when asked for (it imports transformers' HfArgumentParser)
SCRIPT_NAMES = ("TrlParser", "ScriptArguments", "ModelConfig", "DatasetConfig", "DatasetMixtureConfig", "get_dataset",
                "get_peft_config", "get_quantization_config", "get_kbit_device_map", "init_zero_verbose")

__all__ = ["GRPOConfig", "GRPOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer", "SFTConfig", "SFTTrainer", "DPOConfig", "DPOTrainer", "DistillationConfig",
           "DistillationTrainer", "TrainOutput", "TrainerState",
           "TrainerControl", "TrainerCallback", "Callbacks", "RunObjects", *SCRIPT_NAMES]


def __getattr__(name: str):
    if name in ("TrainOutput", "TrainerState", "TrainerControl", "TrainerCallback"):  # transformers' own, imported when asked for
        from rlvr.api import callbacks

        return getattr(callbacks, name)
    if name in SCRIPT_NAMES:
        from rlvr.api import scripts

        return getattr(scripts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
