"""How a model family writes a tool call, and where its call turn ends.

Three formats, one per family of chat templates with tool calling:

    tags      Qwen, Hermes, and every template without tool support (SmolLM2, the default model),
              for which rlvr describes this format in a system message (multiturn.TOOLS_PROMPT):
                  <tool_call>
                  {"name": "calculator", "arguments": {"expression": "12 * 34"}}
                  </tool_call>
              The turn ends at the closing tag (a stop string).
    llama     Llama 3.1 and later: a JSON object, {"name": ..., "parameters": {...}}, alone in the turn or
              after the <|python_tag|> token; several may follow one another, separated by ";".  The turn
              ends at <|eom_id|> or <|eot_id|>, tokens the sampler stops at as EOS.
    mistral   Mistral: the [TOOL_CALLS] token, then a JSON list [{"name": ..., "arguments": {...}}, ...]
              (v3 and Nemo templates), or name[ARGS]{...} per call (newer templates, with an optional
              [CALL_ID]id).  The turn ends at </s>, the EOS.

The format is the chat template's family (`format_for`: by the markers the template contains), or
the one `tool_call_format` names.  The markers <|python_tag|>, [TOOL_CALLS], [ARGS] and [CALL_ID]
are special tokens, which decoding with skip_special_tokens drops: `ToolFormat.decode` keeps them,
so the parser sees them.  Reading is forgiving as tools.parse_tool_calls is: a call that cannot be
read becomes a ToolCall with an error, which the model reads back as one `Error:` line and which
is counted; text that plainly starts a call is never taken for an answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from rlvr.tools import ToolCall, call_from_data, parse_tool_calls

_DECODER = json.JSONDecoder()
_LLAMA_START = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')
_MISTRAL_LIST = re.compile(r'\s*\[\s*\{\s*"name"\s*:')  # a v3 call list whose [TOOL_CALLS] was not written
_MISTRAL_NAMED = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?\[ARGS\]")


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format: how its calls are read and where its call turn ends."""

    name: str
    parse: Callable[[str], list[ToolCall]]  # a model turn's text (decoded by `decode`) -> its calls, in order
    stop_strings: tuple = ()  # text that ends a call turn, for the tool to answer
    end_tokens: tuple = ()  # special tokens that end a call turn (the family's EOS): the sampler must stop at them
    markers: tuple = ()  # special tokens the parser reads, kept by `decode`
    call_probe: bool = False  # the template renders a tool result only after an assistant message with tool_calls

    def decode(self, tokenizer, ids: list[int]) -> str:
        """The text of `ids` as skip_special_tokens=True decodes it, but with this format's markers kept."""
        keep = set(self.token_ids(tokenizer, self.markers))
        if not keep.intersection(ids):
            return tokenizer.decode(ids, skip_special_tokens=True)
        pieces, start = [], 0
        for i, token in enumerate(ids):
            if token in keep:
                pieces += [tokenizer.decode(ids[start:i], skip_special_tokens=True), tokenizer.convert_ids_to_tokens(token)]
                start = i + 1
        pieces.append(tokenizer.decode(ids[start:], skip_special_tokens=True))
        return "".join(pieces)

    @staticmethod
    def token_ids(tokenizer, tokens) -> list[int]:
        """The ids of those of `tokens` that are single tokens of `tokenizer`."""
        ids = []
        for token in tokens:
            i = tokenizer.convert_tokens_to_ids(token)
            if isinstance(i, int) and i != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(i) == token:
                ids.append(i)
        return ids


def parse_llama(text: str) -> list[ToolCall]:
    """Llama 3.1+ calls: JSON objects {"name": ..., "parameters": {...}} from the first one (or from
    <|python_tag|>) on, separated by ";" or ","; what follows the last one is left (the turn ended there)."""
    start = _LLAMA_START.search(text)
    if start is None:
        return []
    body, at, calls = text[start.start():].replace("<|python_tag|>", " "), 0, []
    while True:
        while at < len(body) and body[at] in " \t\r\n;,":
            at += 1
        if at == len(body) or (calls and body[at] != "{"):
            return calls or [ToolCall(None, {}, "<|python_tag|> is followed by no call")]
        try:
            data, at = _DECODER.raw_decode(body, at)
        except ValueError:
            return calls + [ToolCall(None, {}, f'a Llama tool call must be JSON {{"name": ..., "parameters": {{...}}}}; '
                                               f"got {body[at:at + 80]!r}")]
        except RecursionError:
            return calls + [ToolCall(None, {}, "the tool call is nested too deeply to read")]
        calls += [call_from_data(item) for item in data] if isinstance(data, list) and data else [call_from_data(data)]


def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral calls: after each [TOOL_CALLS], a JSON list of {"name": ..., "arguments": {...}} (or one such
    object), or name[ARGS]{...}."""
    if "[TOOL_CALLS]" not in text:
        if not _MISTRAL_LIST.match(text):
            return []
        text = "[TOOL_CALLS]" + text
    calls = []
    for part in text.split("[TOOL_CALLS]")[1:]:
        calls += _mistral_calls(part)
    return calls


def _mistral_calls(part: str) -> list[ToolCall]:
    """The calls of the text after one [TOOL_CALLS]."""
    if part.lstrip()[:1] in ("[", "{"):
        value = _json_at(part, len(part) - len(part.lstrip()))
        if isinstance(value, ToolCall):
            return [value]
        return [call_from_data(item) for item in (value if isinstance(value, list) else [value])] or [
            ToolCall(None, {}, "[TOOL_CALLS] is followed by an empty list of calls")]
    named = _MISTRAL_NAMED.match(part)
    if named is None:
        return [ToolCall(None, {}, 'a Mistral tool call must be [TOOL_CALLS][{"name": ..., "arguments": {...}}] or '
                                   f"[TOOL_CALLS]name[ARGS]{{...}}; got {part[:80]!r}")]
    arguments = _json_at(part, named.end())
    if isinstance(arguments, ToolCall):
        return [ToolCall(named.group(1), {}, f"the arguments of {named.group(1)!r} are not valid JSON: "
                                              f"{part[named.end():named.end() + 80]!r}")]
    return [call_from_data({"name": named.group(1), "arguments": arguments})]


def _json_at(text: str, at: int):
    """The JSON value that starts at text[at:] (what follows it is left), or a ToolCall saying why there is none."""
    try:
        return _DECODER.raw_decode(text, at)[0]
    except ValueError:
        return ToolCall(None, {}, f"the tool call is not valid JSON: {text[at:at + 80]!r}")
    except RecursionError:
        return ToolCall(None, {}, "the tool call is nested too deeply to read")


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def format_for(tokenizer) -> ToolFormat:
    """The format of the tokenizer's chat template family: mistral where the template writes [TOOL_CALLS],
    llama where it writes <|python_tag|> or an ipython turn (Llama 3.1+), else tags (Qwen, Hermes, and
    templates without tool calling, to which rlvr describes the tag format)."""
    template = _template_text(tokenizer)
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "ipython" in template):
        return FORMATS["llama"]
    return FORMATS["tags"]


def tool_format(name: str, tokenizer=None) -> ToolFormat:
    """The format `name` names; "auto": the one the tokenizer's chat template is written for."""
    if name == "auto":
        return format_for(tokenizer)
    if name not in FORMATS:
        raise ValueError(f"unknown tool_call_format {name!r}; the formats are auto, {', '.join(FORMATS)}")
    return FORMATS[name]


FORMATS = {
    "tags": ToolFormat("tags", parse_tool_calls, stop_strings=("</tool_call>",)),
    "llama": ToolFormat("llama", parse_llama, end_tokens=("<|eom_id|>", "<|eot_id|>"), markers=("<|python_tag|>",),
                        call_probe=True),
    "mistral": ToolFormat("mistral", parse_mistral, end_tokens=("</s>",), markers=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                          call_probe=True),
}
