"""Turning a prompt (plain text or chat messages) into the text the model sees.

The tokenizer's chat template is applied to every prompt, with the config's
chat_template_kwargs as the template's own variables (e.g. enable_thinking for
Qwen3); a plain-text prompt becomes one user message, or with raw=True (text_prompts=raw, TRL's
"standard" format) is the model's input as it is.  A system prompt from the config is put first unless
the prompt already carries its own system message.  A tokenizer without a
chat template gets the messages' contents joined by blank lines.
"""

from __future__ import annotations

from rlvr.types import Message, Prompt

# Our wording of the R1-style instruction: reason inside <think>, answer inside <answer>.
R1_SYSTEM_PROMPT = (
    "You are a careful assistant. First reason about the problem step by step inside "
    "<think> and </think>. Then give only the final answer inside <answer> and </answer>, "
    "like this: <think> your reasoning </think><answer> your answer </answer>"
)
BUILTIN_SYSTEM_PROMPTS = {"r1": R1_SYSTEM_PROMPT}


def resolve_system_prompt(system_prompt: str | None) -> str | None:
    if system_prompt is None:
        return None
    return BUILTIN_SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def to_messages(prompt: Prompt, system_prompt: str | None = None) -> list[Message]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    system = resolve_system_prompt(system_prompt)
    if system and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system}] + messages
    return messages


def render_prompt(tokenizer, prompt: Prompt, system_prompt: str | None = None, template_kwargs: dict | None = None,
                  raw: bool = False) -> str:
    """The prompt text, ending where the assistant's completion begins.  template_kwargs: more
    variables for the chat template (cfg.chat_template_kwargs); raw: a plain-text prompt as it is."""
    if raw and isinstance(prompt, str):
        return prompt
    messages = to_messages(prompt, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def render_prompts(tokenizer, prompts: list[Prompt], system_prompt: str | None,
                   template_kwargs: dict | None = None, raw: bool = False) -> list[str]:
    return [render_prompt(tokenizer, p, system_prompt, template_kwargs, raw) for p in prompts]


def tokenize_prompts(tokenizer, texts: list[str], max_prompt_length: int | None) -> list[list[int]]:
    """Token ids of rendered prompts, cut from the left to max_prompt_length."""
    out = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
        out.append(ids)
    return out


def encode_prompts(tokenizer, prompts: list[Prompt], system_prompt: str | None, max_prompt_length: int | None,
                   template_kwargs: dict | None = None):
    """Token ids of each rendered prompt, cut from the left to max_prompt_length."""
    return tokenize_prompts(tokenizer, render_prompts(tokenizer, prompts, system_prompt, template_kwargs), max_prompt_length)
