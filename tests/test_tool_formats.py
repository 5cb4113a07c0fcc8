"""Tool-call formats with each family's real chat template (tests/data/chat_templates): the prompt shows
the tools, a hand-written call turn (token ids, special tokens included) is read into the right call,
the sampler stops where the call ends, the observation is exactly what the template renders after
the call, and a malformed call is one Error line.  The tokenizers are the default model's
(SmolLM2) with each family's special tokens added and its template set."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rlvr.config import ConfigError, build_config
from rlvr.environments import ToolEnvironment
from rlvr.rollout import RolloutError, SamplingParams, ends_with_stop
from rlvr.rollout.multiturn import _CALL_ID, make_multiturn
from rlvr.tool_formats import FORMATS, format_for, tool_format
from rlvr.tools import ToolBox, ToolCall
from rlvr.types import Example, Rollout

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]"]
QUESTION = "What is 12 * 34?"
ARGS = '{"expression": "12 * 34"}'
TAG_CALL = '<tool_call>\n{"name": "calculator", "arguments": ' + ARGS + '}\n</tool_call>'
# family: (template file, special tokens added, eos, bos, format, the call turn as the template renders it, its marker in the prompt)
FAMILIES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct", LLAMA, "<|eot_id|>", "<|begin_of_text|>", "llama",
                  '{"name": "calculator", "parameters": ' + ARGS + "}<|eot_id|>", "Environment: ipython"),
    "llama-3.2": ("meta-llama-Llama-3.2-3B-Instruct", LLAMA, "<|eot_id|>", "<|begin_of_text|>", "llama",
                  '{"name": "calculator", "parameters": ' + ARGS + "}<|eot_id|>", "Environment: ipython"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL, "</s>", "<s>", "mistral",
                     f'[TOOL_CALLS][{{"name": "calculator", "arguments": {ARGS}, "id": "{_CALL_ID}"}}]</s>', "[AVAILABLE_TOOLS]"),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506", MISTRAL, "</s>", "<s>", "mistral",
                          f"[TOOL_CALLS]calculator[CALL_ID]{_CALL_ID}[ARGS]{ARGS}</s>", "[AVAILABLE_TOOLS]"),
    "qwen-2.5": ("Qwen-Qwen2.5-7B-Instruct", [], "<|im_end|>", None, "tags", TAG_CALL, "<tools>"),
    "qwen-3": ("Qwen-Qwen3-0.6B", [], "<|im_end|>", None, "tags", TAG_CALL, "<tools>"),
}


@pytest.fixture(scope="module")
def base():
    from transformers import AutoTokenizer

    from rlvr.models import ModelError, default_model_dir

    try:
        return AutoTokenizer.from_pretrained(default_model_dir())
    except ModelError as e:
        pytest.skip(f"the default model's tokenizer is not here: {e}")


def family_tokenizer(base, family: str):
    """The default model's tokenizer with the family's special tokens and its real chat template."""
    from tokenizers import AddedToken

    template, specials, eos, bos = FAMILIES[family][:4]
    tok = copy.deepcopy(base)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials], special_tokens=True)
    tok.eos_token = eos
    if bos:
        tok.bos_token = bos
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def ends_of(tok, fmt) -> set[int]:
    """The sampler's EOS for the family: the tokenizer's, and the end tokens its generation_config lists (Meta's
    list <|eom_id|> and <|eot_id|>)."""
    return {tok.eos_token_id, *fmt.token_ids(tok, fmt.end_tokens)}


def multiturn(tok, fmt_name: str = "auto", **settings):
    cfg = build_config({"tools": ["calculator"], "max_completion_length": 300, "tool_call_format": fmt_name, **settings})
    return make_multiturn(cfg.rollout_settings, cfg.data_settings, tok)


def stops_after(tok, fmt, ids: list[int]) -> int:
    """How many of `ids` a sampler writes before it stops: at an EOS or a stop string (the engine's own check)."""
    for k in range(1, len(ids) + 1):
        if ids[k - 1] in ends_of(tok, fmt) or (fmt.stop_strings and ends_with_stop(ids[:k], fmt.stop_strings, tok)):
            return k
    return len(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_turn_in_each_family_is_read_stopped_and_answered_as_its_template_renders(base, family):
    tok = family_tokenizer(base, family)
    fmt_name, turn, marker = FAMILIES[family][4:]
    multi = multiturn(tok)
    fmt = multi.tool_format
    assert fmt.name == fmt_name and format_for(tok) is fmt
    prompt = multi.render(QUESTION)
    assert marker in prompt and '"name": "calculator"' in prompt  # the template shows the tools itself
    turn_ids = ids_of(tok, turn)
    # the sampler stops at the call's last token: its EOS, or the closing tag
    assert stops_after(tok, fmt, turn_ids + ids_of(tok, "\nmore text")) == len(turn_ids)
    written = fmt.decode(tok, turn_ids)
    assert fmt.parse(written) == [ToolCall("calculator", {"expression": "12 * 34"})]
    env = ToolEnvironment(ToolBox(["calculator"]), fmt)
    step = env.step(written)
    assert (step.observation, step.role, env.calls, env.errors) == ("408", "tool", 1, 0)
    last = turn_ids[-1]
    between = multi.observation_text("tool", step.observation, tok.decode([last]) if last in ends_of(tok, fmt) else None)
    call = {"id": _CALL_ID, "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "408", "tool_call_id": _CALL_ID}]
    full = tok.apply_chat_template(conversation, tools=ToolBox(["calculator"]).schemas, add_generation_prompt=True,
                                   tokenize=False)
    # the prompt, the model's call and the observation are what the template renders for the whole conversation;
    # the observation token by token (the prompt's last tokens may merge with the call's first where tokenized together)
    assert prompt + turn + between == full
    assert ids_of(tok, between) == ids_of(tok, full[len(prompt + turn):])


def test_the_markers_are_special_tokens_that_a_plain_decode_drops(base):
    tok = family_tokenizer(base, "mistral-nemo")
    ids = ids_of(tok, '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1"}}]</s>')
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    assert FORMATS["mistral"].decode(tok, ids) == '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1"}}]'


def test_llama_python_tag_calls_ending_at_eom_are_answered_by_an_ipython_turn(base):
    tok = family_tokenizer(base, "llama-3.1")
    multi, fmt = multiturn(tok), FORMATS["llama"]
    turn_ids = ids_of(tok, '<|python_tag|>{"name": "calculator", "parameters": ' + ARGS + "}<|eom_id|>")
    assert stops_after(tok, fmt, turn_ids + ids_of(tok, "<|eot_id|>")) == len(turn_ids)
    written = fmt.decode(tok, turn_ids)
    assert written.startswith("<|python_tag|>") and fmt.parse(written) == [ToolCall("calculator", {"expression": "12 * 34"})]
    between = multi.observation_text("tool", "408", "<|eom_id|>")
    assert between == '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    two = fmt.parse('{"name": "calculator", "parameters": {"expression": "1"}}; {"name": "python", "parameters": {"code": "2"}}')
    assert [c.name for c in two] == ["calculator", "python"]
    assert fmt.parse("The answer is 408.") == []


def test_mistral_reads_v3_lists_and_named_calls(base):
    parse = FORMATS["mistral"].parse
    assert parse('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1"}}, {"name": "python", '
                 '"arguments": "{\\"code\\": \\"2\\"}"}]') == [ToolCall("calculator", {"expression": "1"}),
                                                              ToolCall("python", {"code": "2"})]
    assert parse('[TOOL_CALLS]calculator[ARGS]{"expression": "1"}[TOOL_CALLS]python[ARGS]{"code": "2"}') == [
        ToolCall("calculator", {"expression": "1"}), ToolCall("python", {"code": "2"})]
    assert parse("408 is the answer.") == [] and parse("[1, 2] are numbers") == []


MALFORMED = {
    "qwen-2.5": ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
                 '<tool_call>["calculator"]</tool_call>'],
    "llama-3.1": ['{"name": "calculator", "parameters": {"expression": "1+', "<|python_tag|>print(6 * 7)<|eom_id|>",
                  "<|python_tag|><|eom_id|>", '{"name": "calculator", "parameters": 12}<|eot_id|>'],
    "mistral-nemo": ['[TOOL_CALLS][{"name": "calculator", "arguments": {"expression"</s>', "[TOOL_CALLS]calculator 12 * 34</s>",
                     '[TOOL_CALLS]calculator[ARGS]{"expression": </s>', "[TOOL_CALLS][]</s>", '[TOOL_CALLS][{"arguments": {}}]</s>'],
}


@pytest.mark.parametrize("family", MALFORMED)
def test_a_malformed_call_in_each_format_is_one_error_line(base, family):
    tok = family_tokenizer(base, family)
    fmt = format_for(tok)
    for text in MALFORMED[family]:
        env = ToolEnvironment(ToolBox(["calculator"]), fmt)
        step = env.step(fmt.decode(tok, ids_of(tok, text)))
        assert not step.done and (env.calls, env.errors) == (1, 1), text
        assert step.observation.startswith("Error: ") and "\n" not in step.observation, (text, step.observation)


class Scripted:
    """Writes the given turns (text with special tokens) in order, whatever the prompt."""

    def __init__(self, tok, turns: list[str], eos: set[int]):
        self.tok, self.turns, self.eos, self.prompts = tok, turns, sorted(eos), []

    def generate(self, prompt_ids, params, generator=None):
        ids = ids_of(self.tok, self.turns[len(self.prompts)])
        self.prompts.append(prompt_ids)
        return [[Rollout(list(p), ids, [-0.5] * len(ids), "stop", "") for _ in range(params.n)] for p in prompt_ids]


@pytest.mark.parametrize("family, call", [
    ("llama-3.1", '<|python_tag|>{"name": "calculator", "parameters": {"expression": "12 * 34"}}<|eom_id|>'),
    ("mistral-nemo", '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12 * 34"}}]</s>'),
])
def test_a_rollout_runs_the_tool_and_masks_all_but_the_model_turns(base, family, call):
    tok = family_tokenizer(base, family)
    multi = multiturn(tok)
    answer = f"12 * 34 = 408{tok.eos_token}"
    sampler = Scripted(tok, [call, answer], ends_of(tok, multi.tool_format))
    texts, groups = multi.generate(sampler, [Example(QUESTION)], [QUESTION], SamplingParams(n=2, max_tokens=300), None)
    r = groups[0][0]
    assert r.info["tool_calls"] == 1 and r.info["tool_errors"] == 0 and r.info["turns"] == 2
    assert [m["role"] for m in r.messages] == ["assistant", "tool", "assistant"] and r.messages[1]["content"] == "408"
    call_ids, answer_ids = ids_of(tok, call), ids_of(tok, answer)
    between = len(r.completion_ids) - len(call_ids) - len(answer_ids)
    assert r.completion_ids[: len(call_ids)] == call_ids and r.completion_ids[-len(answer_ids):] == answer_ids
    assert r.mask == [True] * len(call_ids) + [False] * between + [True] * len(answer_ids)
    assert "408" in tok.decode(r.completion_ids[len(call_ids): len(call_ids) + between])
    assert sampler.prompts[1][0] == r.prompt_ids + r.completion_ids[: len(call_ids) + between]  # turn 2 reads the result


def test_a_sampler_that_does_not_stop_at_the_end_tokens_is_refused(base):
    tok = family_tokenizer(base, "llama-3.1")
    multi = multiturn(tok)
    sampler = Scripted(tok, ["408<|eot_id|>"], {tok.eos_token_id})  # <|eot_id|> only, as a generation_config without eom
    with pytest.raises(RolloutError, match=r"end at <\|eom_id\|>, but the sampler does not stop there"):
        multi.generate(sampler, [Example(QUESTION)], [QUESTION], SamplingParams(n=1, max_tokens=50), None)


def test_the_format_is_the_template_family_unless_the_setting_names_one(base):
    smol = copy.deepcopy(base)  # SmolLM2's own template has no tool calling: the tag format, described in a system message
    assert format_for(smol).name == "tags" and multiturn(smol).kinds[None].tools_text.count("<tool_call>") == 1
    llama = family_tokenizer(base, "llama-3.2")
    assert multiturn(llama, "tags").tool_format.name == "tags"
    with pytest.raises(RolloutError, match=r"^tool_call_format=mistral: the chat template does not show the tools"):
        multiturn(smol, "mistral")
    with pytest.raises(ValueError, match=r"unknown tool_call_format 'hermes'; the formats are auto, tags, llama, mistral"):
        tool_format("hermes")
    with pytest.raises(ConfigError, match=r"tool_call_format must be one of auto, tags, llama, mistral; got 'hermes'"):
        build_config({"tools": ["calculator"], "tool_call_format": "hermes"})
    from rlvr.config.rollout import TOOL_CALL_FORMATS

    assert TOOL_CALL_FORMATS == ("auto", *FORMATS)  # the settings list the formats without importing the registry

