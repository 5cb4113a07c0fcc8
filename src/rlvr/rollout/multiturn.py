"""Multi-turn rollouts: the model writes a turn, an environment (tools, a game, a user) answers,
and the model goes on, until the environment is done, `max_turns` model turns, or the token budget.

One rollout is still one Rollout: the prompt, then every turn's tokens in order.  The tokens the
policy wrote have mask True; the observations between turns (a tool's output, with the chat
template's message markers around it) have mask False, so the loss, the log-probs compared with
the sampler's and the importance weights cover only what the policy wrote (types.Batch).
`max_completion_length` bounds all of it together: the model's turns and the observations.

The first turn samples G completions of each prompt as a single-turn rollout does (one prefill
per prompt); later turns sample one continuation of each live rollout, from its whole history.
Any sampler works (the in-process engine, vLLM in this process or as a server), since each turn is
one call of its `generate`; seeded per rollout and turn, so that several processes sampling their
shares draw what one process draws.

An observation is rendered by the chat template: the text the template puts between the model's
turn and the next assistant turn when the observation is a message (role "tool" for tool results,
falling back to a user message in <tool_response> tags where the template refuses that role).
With raw text prompts, or a tokenizer without a chat template, it is that tag block.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlvr.chat import render_prompt, to_messages, tokenize_prompts
from rlvr.rollout import RolloutError
from rlvr.rollout.sampling import GroupGenerators
from rlvr.types import Rollout

if TYPE_CHECKING:
    from rlvr.config import DataSettings, RolloutSettings

log = logging.getLogger(__name__)
_HOLE = "\u2063rlvr-turn\u2063"  # stands for the model's text while the template is probed
TOOLS_PROMPT = (
    "You can call these tools (JSON schemas):\n{schemas}\n"
    "To call one, write\n<tool_call>\n{{\"name\": \"<tool name>\", \"arguments\": {{<its arguments>}}}}\n</tool_call>\n"
    "and stop: its result comes back in the next message. When you know the answer, write it without a tool call."
)


class EnvironmentFailed(RolloutError):
    """An environment's reset failed: the prompt cannot be started."""


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    env: object
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)  # each token's weight version (None: a turn did not say)
    messages: list[dict] = field(default_factory=list)
    text: str = ""
    finish: str = "stop"
    turns: int = 0
    env_reward: float | None = None
    env_error: bool = False
    done: bool = False

    def rollout(self) -> Rollout:
        env = self.env
        info = {"turns": self.turns, "env_reward": self.env_reward, "env_error": self.env_error,
                "tool_calls": getattr(env, "calls", 0), "tool_errors": getattr(env, "errors", 0)}
        return Rollout(self.prompt_ids, self.ids, self.logprobs, self.finish, self.text, mask=self.mask,
                       messages=self.messages, info=info, versions=self.versions)


class MultiTurn:
    """Samples multi-turn rollouts for a run: `make_env()` gives one environment per rollout;
    `tool_schemas` are shown to the model (by the chat template where it knows tools, else in a
    system message that describes the tag format)."""

    def __init__(self, rollout: RolloutSettings, data: DataSettings, tokenizer, make_env, tool_schemas: list[dict] | None = None):
        self.data, self.tokenizer, self.make_env = data, tokenizer, make_env
        self.max_turns, self.budget = rollout.max_turns, rollout.max_completion_length
        self.raw = data.text_prompts == "raw" or not getattr(tokenizer, "chat_template", None)
        self.template_kwargs = dict(data.chat_template_kwargs or {})
        self.tools_text = None
        if tool_schemas:
            if not self.raw and _template_shows_tools(tokenizer, tool_schemas, self.template_kwargs):
                self.template_kwargs["tools"] = tool_schemas
            else:
                self.tools_text = TOOLS_PROMPT.format(schemas="\n".join(json.dumps(s) for s in tool_schemas))
        self.stop_strings = tuple(getattr(make_env(), "stop_strings", ()))
        self._base = None if self.raw else self._apply(_probe(), False)  # a user turn and a model turn, rendered once
        self._end = None if self.raw else self._base.split(_HOLE)[-1]  # what the template writes after a model turn

    # --- prompts -------------------------------------------------------------------------

    def render(self, prompt) -> str:
        """The first prompt's text, with the tools described where the template does not show them."""
        if self.raw:
            text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in to_messages(prompt)) + "\n\n"
            return f"{self.tools_text}\n\n{text}" if self.tools_text else text
        messages = to_messages(prompt, self.data.system_prompt)
        if self.tools_text:
            if messages and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{self.tools_text}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": self.tools_text}, *messages]
        return render_prompt(self.tokenizer, messages, None, self.template_kwargs)

    def _apply(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **self.template_kwargs)

    def observation_text(self, role: str, content: str, after_eos: str | None) -> str:
        """What goes between a model turn and the next: the end of the model's message (less the
        EOS token it already wrote, `after_eos`), the observation as a message, the next assistant header."""
        if self.raw:
            return f"\n<tool_response>\n{content}\n</tool_response>\n" if role == "tool" else f"\n{content}\n"
        end = self._end
        if after_eos and end.startswith(after_eos):
            end = end[len(after_eos) :]
        return end + self._message(role, content)

    def _message(self, role: str, content: str) -> str:
        base = self._base
        for r, c in ((role, content), ("user", f"<tool_response>\n{content}\n</tool_response>")):
            try:
                full = self._apply([*_probe(), {"role": r, "content": c}], True)
            except Exception:  # noqa: BLE001 - a template that refuses the role
                continue
            if full.startswith(base):
                return full[len(base) :]
        raise EnvironmentFailed(f"the chat template cannot render a {role!r} message after the model's turn")

    # --- sampling --------------------------------------------------------------------------

    def generate(self, sampler, examples, prompts, params, generator) -> tuple[list[str], list[list[Rollout]]]:
        """(the first prompts' texts, per example params.n multi-turn Rollouts)."""
        envs = [[self.make_env() for _ in range(params.n)] for _ in examples]
        starts = [self._start(ex, prompt, group) for ex, prompt, group in zip(examples, prompts, envs)]
        texts = [self.render(p) for p in starts]
        prompt_ids = tokenize_prompts(self.tokenizer, texts, self.data.max_prompt_length)
        params = dataclasses.replace(params, stop_strings=tuple(params.stop_strings) + self.stop_strings)
        eos = set(getattr(sampler, "eos", ()))
        trajectories = [[_Trajectory(ids, env) for env in group] for ids, group in zip(prompt_ids, envs)]
        for group, rollouts in zip(trajectories, sampler.generate(prompt_ids, params, generator)):
            for t, r in zip(group, rollouts):
                self._take(t, r, eos)
        seeds = generator.seeds if isinstance(generator, GroupGenerators) else None
        for turn in range(1, self.max_turns):
            live = [(g, m, t) for g, group in enumerate(trajectories) for m, t in enumerate(group) if not t.done]
            if not live:
                break
            room = max(self.budget - len(t.ids) for _, _, t in live)
            streams = generator if seeds is None else GroupGenerators([mix_seed(seeds[g], m, turn) for g, m, _ in live])
            outs = sampler.generate([t.prompt_ids + t.ids for _, _, t in live],
                                    dataclasses.replace(params, n=1, max_tokens=room), streams)
            for (_, _, t), (r,) in zip(live, outs):
                self._take(t, self._fit(r, self.budget - len(t.ids), params), eos)
        return texts, [[t.rollout() for t in group] for group in trajectories]

    def _start(self, example, prompt, group):
        """The group's first messages: the environments' reset, or the example's prompt."""
        firsts = []
        for env in group:
            try:
                first = env.reset(example)
            except Exception as e:  # noqa: BLE001
                raise EnvironmentFailed(f"the environment's reset raised {type(e).__name__}: {e}") from e
            firsts.append(prompt if first is None else first)
        if any(f != firsts[0] for f in firsts[1:]):
            raise EnvironmentFailed("an environment's reset gave the completions of one prompt different first messages; "
                                    "GRPO compares completions of the same start")
        return firsts[0]

    def _fit(self, r: Rollout, room: int, params) -> Rollout:
        """A turn cut to its own rollout's remaining budget (the call sampled up to the largest)."""
        if len(r.completion_ids) <= room:
            return r
        ids = r.completion_ids[:room]
        return Rollout(r.prompt_ids, ids, r.logprobs[:room], "length", self.tokenizer.decode(ids, skip_special_tokens=True),
                       versions=r.versions[:room] if r.versions is not None else None)

    def _take(self, t: _Trajectory, r: Rollout, eos: set) -> None:
        """Add one model turn to `t` and let its environment answer."""
        n = len(r.completion_ids)
        t.ids += r.completion_ids
        t.mask += [True] * n
        t.logprobs += list(r.logprobs[:n]) + [0.0] * (n - len(r.logprobs))
        t.versions = t.versions + list(r.versions[:n]) if t.versions is not None and r.versions is not None else None
        t.turns += 1
        t.text = r.text
        written = self.tokenizer.decode(r.completion_ids, skip_special_tokens=True)  # with the stop string, if any
        t.messages.append({"role": "assistant", "content": written})
        if r.finish_reason == "length":
            t.finish, t.done = "length", True
            return
        try:
            step = t.env.step(written)
        except Exception as e:  # noqa: BLE001 - an environment's bug ends this rollout, not the run
            log.warning("the environment's step raised %s: %s; the rollout ends there (env/errors)", type(e).__name__, e)
            t.env_error, t.done = True, True
            return
        if step.reward is not None:
            t.env_reward = (t.env_reward or 0.0) + float(step.reward)
        if step.done or t.turns >= self.max_turns:
            t.done = True
            return
        ended_with = self.tokenizer.decode(r.completion_ids[-1:]) if r.completion_ids and r.completion_ids[-1] in eos else None
        between = self.observation_text(step.role, str(step.observation or ""), ended_with)
        between_ids = list(self.tokenizer(between, add_special_tokens=False)["input_ids"])
        if len(t.ids) + len(between_ids) >= self.budget:  # no room left to answer the observation
            t.finish, t.done = "length", True
            return
        t.ids += between_ids
        t.mask += [False] * len(between_ids)
        t.logprobs += [0.0] * len(between_ids)
        if t.versions is not None:  # not sampled (masked out of the loss): the version of the turn before
            t.versions += (t.versions[-1:] or [0]) * len(between_ids)
        t.messages.append({"role": step.role, "content": str(step.observation or "")})


def _probe() -> list[dict]:
    return [{"role": "user", "content": "?"}, {"role": "assistant", "content": _HOLE}]


def _template_shows_tools(tokenizer, schemas: list[dict], kwargs: dict) -> bool:
    """Whether the chat template puts the tools into the prompt (Qwen's does; SmolLM2's ignores them)."""
    messages = [{"role": "user", "content": "?"}]
    try:
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        with_tools = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=schemas,
                                                   **kwargs)
    except Exception:  # noqa: BLE001
        return False
    return plain != with_tools


def mix_seed(seed: int, member: int, turn: int) -> int:
    """A seed for one rollout's turn, from its group's seed: the same wherever the group is sampled."""
    return (seed * 1_000_003 + member * 10_007 + turn * 101) % (2**62)


def make_multiturn(rollout: RolloutSettings, data: DataSettings, tokenizer):
    """The run's MultiTurn, or None for single-turn rollouts."""
    if not rollout.tools and not rollout.environment:
        return None
    from rlvr.environments import ToolEnvironment, checked, load_environment
    from rlvr.tools import ToolBox

    if rollout.environment:
        factory = load_environment(rollout.environment)
        return MultiTurn(rollout, data, tokenizer, checked(factory))
    toolbox = ToolBox(rollout.tools, rollout.tool_timeout, rollout.max_tool_output_chars)
    return MultiTurn(rollout, data, tokenizer, lambda: ToolEnvironment(toolbox), toolbox.schemas)
