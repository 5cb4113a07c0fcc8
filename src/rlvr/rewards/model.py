"""A learned reward model as a reward function: TRL's `reward_funcs=["<model id or path>"]`.

A sequence-classification model with one label (AutoModelForSequenceClassification, num_labels 1)
scores each prompt + completion, as TRL's GRPOTrainer does:

- a conversation (chat prompts) is the prompt's messages and the completion's, rendered with the
  reward model's own chat template; a text prompt is the prompt and the completion concatenated;
- the texts are tokenized by the reward model's tokenizer (`reward_processing_classes` in
  GRPOTrainer, else the one saved with the model) without added special tokens, padded on the right
  with the tokenizer's pad token (its EOS where it has none), which the model's config is told, so
  the classifier reads each row's last real token;
- the reward is logits[:, 0], in batches of `reward_model_batch_size`, without gradients, on
  `reward_model_device` (auto: the GPU this process trains on, else the CPU).

It runs in the trainer's process, as the built-in rewards do (a forked worker cannot use CUDA).
The model loads at its first call, once per process however many reward sets name it.  What can be
checked without loading it is checked before the run's model loads (`check`): that a Hub id is in
the local cache when the Hub cannot be reached, and that its config is a sequence classifier with
one label; a causal LM's checkpoint is refused, since its score head would be new random weights.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_LOADED: dict = {}  # (path, device) -> (model, tokenizer): loaded once per process


def is_model_reference(name: str) -> bool:
    """A local directory, or something shaped like a Hub id (`org/name`), rather than a function
    (`rewards/mine.py` without its `:function` is a function file missing its name, not a model)."""
    if ":" in name or name.endswith(".py"):
        return False
    return Path(name).expanduser().is_dir() or bool(HUB_ID.fullmatch(name))


def short_name(name: str) -> str:
    """What the metrics call it, as TRL: the last part of its id or path (`rewards/<it>/mean`)."""
    return name.rstrip("/").rpartition("/")[2]


def check(name: str, config=None) -> None:
    """A ValueError saying why `name` (or a loaded model's `config`) cannot be a reward model."""
    if config is None:
        from transformers import AutoConfig

        from rlvr.errors import ModelError
        from rlvr.models import require_hub_model, resolve_model_path

        try:
            require_hub_model(name)
            config = AutoConfig.from_pretrained(resolve_model_path(name))
        except (ModelError, OSError, ValueError) as e:
            raise ValueError(f"reward model {name!r}: {str(e).splitlines()[0]}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward model {name!r} is a {architectures[0]}, not a sequence-classification model: its score "
                         "head would be new random weights. Give a reward model (AutoModelForSequenceClassification with "
                         "num_labels 1, e.g. one trained with TRL's RewardTrainer)")
    if architectures and config.num_labels != 1:
        raise ValueError(f"reward model {name!r} has num_labels={config.num_labels}; a reward model gives one score "
                         "(num_labels 1), as TRL requires")


class RewardModel:
    """A reward function (completions, prompts, **kwargs) -> one float per completion."""

    in_trainer = True  # runs in the trainer's process, as the built-ins (rewards._builtin)

    def __init__(self, name: str | None = None, model=None, tokenizer=None, device: str = "auto", batch_size: int = 32):
        """Either `name` (a Hub id or a local path, loaded at the first call) or a loaded `model`;
        `tokenizer`: TRL's reward processing class (default: the model's own)."""
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.__name__ = short_name(self.name)  # the name it is registered and logged under (rewards.register_reward)
        self.model, self.tokenizer, self.device, self.batch_size = model, tokenizer, device, batch_size
        check(self.name, None if model is None else model.config)  # before anything loads: a ValueError naming it
        self._placed = False

    def __call__(self, completions, prompts=None, **kwargs) -> list[float]:
        if not completions:
            return []
        if prompts is None:
            raise ValueError(f"reward model {self.name!r} scores prompt + completion, and was given no prompts")
        import torch

        model, tokenizer = self._load()
        texts = [self._text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        device = next(model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = tokenizer(text=texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                              padding_side="right", add_special_tokens=False).to(device)
            with torch.inference_mode():
                scores += model(**batch).logits[:, 0].float().tolist()
        return scores

    def _text(self, tokenizer, prompt, completion) -> str:
        if isinstance(prompt, list):  # a conversation: the whole of it, in the reward model's own template
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"reward model {self.name!r}: the prompts are conversations and its tokenizer has no "
                                 "chat template; give one as reward_processing_classes")
            messages = prompt + (completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + (completion if isinstance(completion, str) else completion[-1]["content"])

    def _load(self):
        """(model, tokenizer), loaded at the first call (once per process and device)."""
        if self.model is None:
            device = torch_device(self.device)
            key = (self.name, device)
            if key not in _LOADED:
                _LOADED[key] = _from_pretrained(self.name, device)
            self.model, loaded_tokenizer = _LOADED[key]
            self.tokenizer = self.tokenizer or loaded_tokenizer
        elif not self._placed:  # a model given as an object: onto the device, in eval mode
            self.model = self.model.to(torch_device(self.device)).eval()
        self._placed = True
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.name)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the classifier reads the last non-pad token
        return self.model, self.tokenizer


def torch_device(setting: str) -> str:
    """auto: the GPU this process trains on, else the CPU; any other setting as it is."""
    import torch

    if setting != "auto":
        return setting
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _from_pretrained(name: str, device: str):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlvr.models import resolve_model_path

    path = resolve_model_path(name)  # a local directory expanded, a Hub id as it is
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)
