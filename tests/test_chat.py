"""chat_template_kwargs reach the chat template wherever a prompt is rendered: sampling for
training, evaluation, and the rendering functions themselves."""

import pytest
import torch

from rlvr.chat import encode_prompts, render_prompt, render_prompts
from rlvr.rewards import RewardSet
from rlvr.types import Example, Rollout, TrainerState

# Like Qwen3's template: with enable_thinking=false the assistant turn starts with an empty think block.
# (No blank line: the tiny test tokenizer has no token for "\n\n".)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think>\n{% endif %}{% endif %}"
)
NO_THINKING = "<|im_start|>assistant\n<think> </think>\n"


@pytest.fixture
def thinking_tokenizer(tiny):
    model, tokenizer = tiny
    tokenizer.chat_template = TEMPLATE
    return model, tokenizer


def test_template_variables_reach_the_template(thinking_tokenizer):
    _, tokenizer = thinking_tokenizer
    assert not render_prompt(tokenizer, "what is 2+2?").endswith(NO_THINKING)
    assert render_prompt(tokenizer, "what is 2+2?", None, {"enable_thinking": True}).endswith("assistant\n")
    off = {"enable_thinking": False}
    assert render_prompt(tokenizer, "what is 2+2?", "be brief", off).endswith(NO_THINKING)
    assert all(t.endswith(NO_THINKING) for t in render_prompts(tokenizer, ["a", "b"], None, off))
    ids = encode_prompts(tokenizer, ["a"], None, None, off)[0]
    assert tokenizer.decode(ids).endswith(NO_THINKING)


def test_training_rollouts_are_sampled_from_prompts_rendered_with_them(thinking_tokenizer, tiny_run_config, tmp_path):
    from rlvr.trainer import rollout_stage

    model, tokenizer = thinking_tokenizer
    cfg = tiny_run_config(tmp_path, chat_template_kwargs={"enable_thinking": False})
    stage = rollout_stage(cfg, model, model, tokenizer)
    sampled = stage.sample([Example("what is 1+1?", "2"), Example("what is 2+3?", "5")], torch.Generator().manual_seed(0),
                           TrainerState(0, 4))
    prompts = [tokenizer.decode(r.prompt_ids) for group in sampled.groups for r in group]
    assert len(prompts) == 8 and all(p.endswith(NO_THINKING) for p in prompts)


class RecordingSampler:
    """Answers every prompt with "2" and keeps the prompts it was given, decoded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def generate(self, prompt_ids, params, generator=None):
        self.prompts += [self.tokenizer.decode(ids) for ids in prompt_ids]
        return [[Rollout(list(ids), [5], [0.0], "stop", "\\boxed{2}")] for ids in prompt_ids]


def test_evaluation_renders_prompts_with_them(thinking_tokenizer, tiny_run_config, tmp_path):
    from rlvr.loop import evaluate_run as evaluate

    _, tokenizer = thinking_tokenizer
    cfg = tiny_run_config(tmp_path, chat_template_kwargs={"enable_thinking": False})
    sampler = RecordingSampler(tokenizer)
    result = evaluate(sampler, tokenizer, [Example("what is 1+1?", "2")], RewardSet(["accuracy"]), "accuracy", cfg)
    assert result.accuracy == 1.0
    assert sampler.prompts and all(p.endswith(NO_THINKING) for p in sampler.prompts)
