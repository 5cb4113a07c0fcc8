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
shares draw what one process draws.  The in-process engine keeps each live rollout's cache from one
turn to the next (rollout/turns.py; `turn_cache`), so a later turn runs only the observation and
what follows it; vLLM finds the history in its prefix cache.

An observation is rendered by the chat template: the text the template puts between the model's
turn and the next assistant turn when the observation is a message (role "tool" for tool results,
falling back to a user message in <tool_response> tags where the template refuses that role).
Where the tool format needs it (Llama's, Mistral's: tool_formats.py), the model's turn is given to
the template as an assistant message with a tool call and the result as a tool message with a
`tool_call_id`, as those templates require.  With raw text prompts, or a tokenizer without a chat
template, it is that tag block.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlvr.chat import render_prompt, to_messages, tokenize_prompts
from rlvr.rollout import RolloutError
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.turns import TurnCaches
from rlvr.types import Rollout

if TYPE_CHECKING:
    from rlvr.config import DataSettings, RolloutSettings

log = logging.getLogger(__name__)
_HOLE = "\u2063rlvr-turn\u2063"  # stands for the model's text while the template is probed
_CALL_ID = "rlvrcall0"  # the probe's tool call id: 9 alphanumerics, as Mistral's templates require
TOOLS_PROMPT = (
    "You can call these tools (JSON schemas):\n{schemas}\n"
    "To call one, write\n<tool_call>\n{{\"name\": \"<tool name>\", \"arguments\": {{<its arguments>}}}}\n</tool_call>\n"
    "and stop: its result comes back in the next message. When you know the answer, write it without a tool call."
)


class EnvironmentFailed(RolloutError):
    """An environment could not be made or started, or broke its protocol (reset or step returned what no
    rollout can use): the run ends with one line naming it and what it did."""


class TimedOut(Exception):
    """A call given to `bounded` did not return in time."""


class InThread:
    """fn(*args) running in a daemon thread of its own: Python cannot stop a thread, so one that runs on
    past its caller's bound is left to end by itself (it never holds the process; what it returns later
    is not used).  `done` is set once it has returned or raised."""

    def __init__(self, fn, *args, name: str):
        self.done = threading.Event()
        self.value, self.error = None, None
        threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True).start()

    def _run(self, fn, args) -> None:
        try:
            self.value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()

    def result(self):
        """Once done: its value, or its error raised here."""
        if self.error is not None:
            raise self.error
        return self.value


def bounded(seconds: float, fn, *args):
    """fn(*args) in a thread of its own (InThread), waited for at most `seconds` (None: here, without a
    bound).  Its error is raised here; TimedOut when it runs past the bound."""
    if seconds is None:
        return fn(*args)
    call = InThread(fn, *args, name="rlvr-env-call")
    if not call.done.wait(seconds):
        raise TimedOut()
    return call.result()


def bounded_all(seconds: float | None, calls: list[tuple]) -> list:
    """Each fn(arg) of `calls`, all at once, each in a thread of its own, waited for until one deadline
    `seconds` from now (None: one after another in this thread, without a bound).  Per call its result,
    the exception it raised, or TimedOut (its thread left to end by itself, as in `bounded`)."""
    if seconds is None:
        out = []
        for fn, arg in calls:
            try:
                out.append(fn(arg))
            except Exception as e:  # noqa: BLE001 - the caller decides what an error means
                out.append(e)
        return out
    started = [InThread(fn, arg, name="rlvr-env-step") for fn, arg in calls]
    deadline = time.monotonic() + seconds
    for call in started:
        call.done.wait(max(0.0, deadline - time.monotonic()))
    return [_outcome(call) if call.done.is_set() else TimedOut() for call in started]


def _outcome(call: InThread):
    """A finished call's value or the exception it raised (an exit or Ctrl-C in it as a RuntimeError)."""
    if call.error is None:
        return call.value
    return call.error if isinstance(call.error, Exception) else RuntimeError(f"{type(call.error).__name__}: {call.error}")


def short(value) -> str:
    """repr(value), cut to 80 characters for an error message."""
    text = repr(value)
    return f"{text[:80]}..." if len(text) > 80 else text


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    env: object
    name: str = "environment"  # what errors call its environment
    start: object = None  # the first messages, where they are this rollout's own (TRL's reset may sample a task per rollout)
    start_text: str | None = None
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
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (the turn's last token, its step's reward)

    def rollout(self, expose: bool) -> Rollout:
        """`expose`: give the reward functions the environment (TRL's `environments`), until they have scored."""
        env = self.env
        info = {"turns": self.turns, "env_reward": self.env_reward, "env_error": self.env_error,
                "tool_calls": getattr(env, "calls", 0), "tool_errors": getattr(env, "errors", 0),
                "turn_rewards": list(self.turn_rewards)}
        if expose:
            info["environment"] = getattr(env, "env", env)  # TRL's environment itself, not its adapter
        if self.start is not None:
            info.update(prompt=self.start, prompt_text=self.start_text)
        return Rollout(self.prompt_ids, self.ids, self.logprobs, self.finish, self.text, mask=self.mask,
                       messages=self.messages, info=info, versions=self.versions)


@dataclass
class Kind:
    """One environment of a run (TRL's dict of factories gives several): how one is made, what its errors
    call it, and its tools as the prompt shows them (in the template's `tools`, or described in a system message)."""

    name: str
    factory: object
    template_kwargs: dict
    tools_text: str | None = None
    trl: bool = False  # TRL's protocol: a group's completions may start apart (its reset may sample a task each)


class MultiTurn:
    """Samples multi-turn rollouts for a run: `make_env()` gives one environment per rollout;
    `tool_schemas` are shown to the model (by the chat template where it knows tools, else in a
    system message that describes the tag format).  Several environments (TRL's dict of factories):
    `make_env` is {its name: (factory, tool_schemas, what errors call it)}, and each example's
    `environment` column picks one."""

    def __init__(self, rollout: RolloutSettings, data: DataSettings, tokenizer, make_env, tool_schemas: list[dict] | None = None,
                 name: str = "environment", expose: bool = False):
        """`name`: the environment's, as errors name it (its class).  `expose`: the reward functions get the
        environments (TRL's `environments`); off for plain tools."""
        self.data, self.tokenizer, self.expose = data, tokenizer, expose
        self.max_turns, self.budget = rollout.max_turns, rollout.max_completion_length
        self.timeout = rollout.env_timeout or None  # seconds an environment's constructor, reset or step may take
        self.per_turn = rollout.turn_advantage == "return"  # a step's reward is credited on its turn, not in env_reward
        self.turn_cache = rollout.turn_cache  # keep each rollout's cache between its turns, where the sampler can
        self.raw = data.text_prompts == "raw" or not getattr(tokenizer, "chat_template", None)
        from rlvr.environments import MethodEnvironment

        several = make_env if isinstance(make_env, dict) else {None: (make_env, tool_schemas, name)}
        self.kinds = {key: self._kind(*spec) for key, spec in several.items()}
        self.template_kwargs = next(iter(self.kinds.values())).template_kwargs  # the probes' (the end of a turn)
        stops, self.tool_format = {}, None
        for kind in self.kinds.values():
            probe = self.make_env(kind)
            kind.trl = isinstance(probe, MethodEnvironment)
            stops.update(dict.fromkeys(stop_strings_of(probe, kind.name)))
            fmt = getattr(probe, "tool_format", None)  # how its calls are written (tool_formats.py)
            self.tool_format = self.tool_format or fmt
            if fmt is not None and kind.tools_text and fmt.name != "tags":
                raise EnvironmentFailed(f"tool_call_format={fmt.name}: the chat template does not show the tools "
                                        "(or the prompts are raw text), and the system message rlvr writes instead describes "
                                        "the tag format; use tool_call_format=auto or tags")
        self.stop_strings = tuple(stops)  # every environment's: one call samples the turns of all
        self._base = None if self.raw else self._apply(_probe(), False)  # a user turn and a model turn, rendered once
        self._end = None if self.raw else self._base.split(_HOLE)[-1]  # what the template writes after a model turn

    def _kind(self, factory, tool_schemas, name) -> Kind:
        kwargs, text = dict(self.data.chat_template_kwargs or {}), None
        if tool_schemas:
            if not self.raw and _template_shows_tools(self.tokenizer, tool_schemas, kwargs):
                kwargs["tools"] = tool_schemas
            else:
                text = TOOLS_PROMPT.format(schemas="\n".join(json.dumps(s) for s in tool_schemas))
        return Kind(name, factory, kwargs, text)

    def kind_of(self, example) -> Kind:
        """The environment `example` is for: the run's one, or the one its `environment` column names."""
        if None in self.kinds:
            return self.kinds[None]
        key = example.columns.get("environment")
        if key not in self.kinds:
            raise EnvironmentFailed(f"a row's environment column is {short(key)}, which is not among the environments "
                                    f"given ({', '.join(map(str, self.kinds))})")
        return self.kinds[key]

    def make_env(self, kind: Kind | None = None):
        """One environment, made within env_timeout; a constructor that raises or hangs ends the run."""
        kind = kind or next(iter(self.kinds.values()))
        return made_within(self.timeout, kind.factory, kind.name)

    # --- prompts -------------------------------------------------------------------------

    def render(self, prompt, kind: Kind | None = None) -> str:
        """The first prompt's text, with the tools described where the template does not show them."""
        kind = kind or next(iter(self.kinds.values()))
        if self.raw:
            text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in to_messages(prompt)) + "\n\n"
            return f"{kind.tools_text}\n\n{text}" if kind.tools_text else text
        messages = to_messages(prompt, self.data.system_prompt)
        if kind.tools_text:
            if messages and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{kind.tools_text}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": kind.tools_text}, *messages]
        return render_prompt(self.tokenizer, messages, None, kind.template_kwargs)

    def _apply(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **self.template_kwargs)

    def observation_text(self, role: str, content: str, after_eos: str | None) -> str:
        """What goes between a model turn and the next: the end of the model's message (less the
        EOS token it already wrote, `after_eos`), the observation as a message, the next assistant header."""
        if self.raw:
            return f"\n<tool_response>\n{content}\n</tool_response>\n" if role == "tool" else f"\n{content}\n"
        end = self._end
        ends = self.tool_format.end_tokens if self.tool_format and after_eos in self.tool_format.end_tokens else ()
        for mark in (after_eos, *ends):  # a call turn may end at any of its family's end tokens (Llama: eom or eot)
            if mark and end.startswith(mark):
                end = end[len(mark) :]
                break
        return end + self._message(role, content)

    def _message(self, role: str, content: str) -> str:
        """The message as the template renders it after the model's turn: from the end of that turn
        (`_end`, left out) to the next assistant header."""
        for turn, message in self._probes(role, content):
            try:
                before = self._apply([_probe()[0], turn], False).split(_HOLE)
                after = self._apply([_probe()[0], turn, message], True).split(_HOLE)[-1]
            except Exception:  # noqa: BLE001 - a template that refuses the role or the probe
                continue
            if len(before) > 1 and after.startswith(before[-1]) and before[-1].endswith(self._end):
                return after[len(before[-1]) :]
        raise EnvironmentFailed(f"the chat template cannot render a {role!r} message after the model's turn")

    def _probes(self, role: str, content: str):
        """(the model's turn, the observation) as messages, in the order tried: with a tool call and its
        tool_call_id where the tool format needs them, then as plain messages, then as a user message."""
        plain, tool_call_id = _probe()[1], {"tool_call_id": _CALL_ID} if role == "tool" else {}
        if role == "tool" and self.tool_format is not None and self.tool_format.call_probe:
            call = {"id": _CALL_ID, "type": "function", "function": {"name": "tool", "arguments": {"input": _HOLE}}}
            yield {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": content, **tool_call_id}
        yield plain, {"role": role, "content": content, **tool_call_id}
        yield plain, {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}

    # --- sampling --------------------------------------------------------------------------

    def generate(self, sampler, examples, prompts, params, generator) -> tuple[list[str], list[list[Rollout]]]:
        """(the first prompts' texts, per example params.n multi-turn Rollouts)."""
        kinds = [self.kind_of(ex) for ex in examples]
        envs = [[self.make_env(kind) for _ in range(params.n)] for kind in kinds]
        starts = [self._start(ex, prompt, group, kind) for ex, prompt, group, kind in zip(examples, prompts, envs, kinds)]
        rendered = [[self.render(first, kind) for first in firsts] for firsts, kind in zip(starts, kinds)]
        flat = tokenize_prompts(self.tokenizer, [text for texts in rendered for text in texts], self.data.max_prompt_length)
        trajectories, at = [], 0
        for g, (group, firsts, texts) in enumerate(zip(envs, starts, rendered)):
            own = len(firsts) > 1  # each completion starts from its own messages
            trajectories.append([_Trajectory(flat[at + m * own], env, kinds[g].name, *((firsts[m], texts[m]) if own else ()))
                                 for m, env in enumerate(group)])
            at += len(texts)
        params = dataclasses.replace(params, stop_strings=tuple(params.stop_strings) + self.stop_strings)
        eos = set(getattr(sampler, "eos", ()))
        self._check_ends(eos)
        seeds = generator.seeds if isinstance(generator, GroupGenerators) else None
        caches = TurnCaches() if self.turn_cache and self.max_turns > 1 and getattr(sampler, "keeps_turns", False) else None
        try:
            self._take(self._first_turns(sampler, trajectories, params, generator, seeds, caches), eos)
            for turn in range(1, self.max_turns):
                live = [(g, m, t) for g, group in enumerate(trajectories) for m, t in enumerate(group) if not t.done]
                if caches is not None:
                    caches.keep((g, m) for g, m, _ in live)  # the rollouts that ended let their caches go
                if not live:
                    break
                room = max(self.budget - len(t.ids) for _, _, t in live)
                streams = generator if seeds is None else GroupGenerators([mix_seed(seeds[g], m, turn) for g, m, _ in live])
                if caches is not None:
                    caches.last_turn = turn == self.max_turns - 1  # no turn follows: the rows that stop keep nothing
                outs = _sample(sampler, [t.prompt_ids + t.ids for _, _, t in live], dataclasses.replace(params, n=1, max_tokens=room),
                               streams, caches, [(g, m) for g, m, _ in live])
                self._take([(t, self._fit(r, self.budget - len(t.ids), params)) for (_, _, t), (r,) in zip(live, outs)], eos)
        finally:
            if caches is not None:
                caches.clear()
        self._score([t for group in trajectories for t in group])
        return [texts[0] for texts in rendered], [[t.rollout(self.expose) for t in group] for group in trajectories]

    def _check_ends(self, eos: set) -> None:
        """Refuse a sampler that does not stop at the tool format's end tokens: its call turns would run on."""
        fmt = self.tool_format
        missing = [t for t in (fmt.end_tokens if fmt and eos else ()) if set(fmt.token_ids(self.tokenizer, [t])) - eos]
        if missing:
            raise RolloutError(f"the chat template writes {fmt.name} tool calls, which end at {', '.join(missing)}, but the "
                               f"sampler does not stop there: add {fmt.token_ids(self.tokenizer, missing)} to eos_token_id "
                               "in the model's generation_config.json")

    def _first_turns(self, sampler, trajectories, params, generator, seeds, caches) -> list[tuple[_Trajectory, Rollout]]:
        """Each rollout's first turn: params.n completions of each group's one prompt (one prefill), and where a
        group's completions start apart (TRL's reset sampling a task each), one of each, from its own stream.
        `caches`: a TurnCaches where the sampler keeps each rollout's cache for its next turn, else None."""
        shared = [g for g, group in enumerate(trajectories) if group[0].start is None]
        apart = [(g, m) for g, group in enumerate(trajectories) if group[0].start is not None for m in range(len(group))]
        turns = []
        if shared:
            streams = generator if seeds is None or len(shared) == len(trajectories) else generator.pick(shared)
            outs = _sample(sampler, [trajectories[g][0].prompt_ids for g in shared], params, streams, caches,
                           [(g, m) for g in shared for m in range(len(trajectories[g]))])
            turns += [(t, r) for g, rollouts in zip(shared, outs) for t, r in zip(trajectories[g], rollouts)]
        if apart:
            streams = generator if seeds is None else GroupGenerators([mix_seed(seeds[g], m, 0) for g, m in apart])
            outs = _sample(sampler, [trajectories[g][m].prompt_ids for g, m in apart], dataclasses.replace(params, n=1), streams,
                           caches, apart)
            turns += [(trajectories[g][m], r) for (g, m), (r,) in zip(apart, outs)]
        return turns

    def _start(self, example, prompt, group, kind: Kind) -> list:
        """The first messages of each completion of a group: its environment's reset, or the example's prompt.
        One list of one where they are all the same; TRL's environments alone may start them apart."""
        firsts = []
        for env in group:
            try:
                first = bounded(self.timeout, env.reset, example)
            except TimedOut:
                raise EnvironmentFailed(f"{kind.name}.reset did not return within env_timeout={self.timeout:g} s") from None
            except Exception as e:  # noqa: BLE001
                raise EnvironmentFailed(f"{kind.name}.reset raised {type(e).__name__}: {e}") from None
            if first is not None and not _is_prompt(first):
                returns = ("None or text (added to the prompt's last user message)" if kind.trl else
                           "None (the row's own prompt), text, or a non-empty list of {'role': ..., 'content': ...} messages")
                raise EnvironmentFailed(f"{kind.name}.reset returned {short(first)} ({type(first).__name__}): return {returns}")
            firsts.append(prompt if first is None else first)
        if all(f == firsts[0] for f in firsts[1:]):
            return firsts[:1]
        if not kind.trl:
            raise EnvironmentFailed("an environment's reset gave the completions of one prompt different first messages; "
                                    "GRPO compares completions of the same start")
        return firsts

    def _score(self, trajectories: list[_Trajectory]) -> None:
        """get_reward() of each finished rollout's environment that has one (TRL's protocol), all at once within
        env_timeout: added to what its steps gave.  One that raises or runs past the bound scores None (env/errors)."""
        asked = [t for t in trajectories if callable(getattr(t.env, "final_reward", None)) and not t.env_error]
        for t, value in zip(asked, bounded_all(self.timeout, [(lambda env: env.final_reward(), t.env) for t in asked])):
            if isinstance(value, Exception):
                what = "did not return within env_timeout" if isinstance(value, TimedOut) else f"raised {type(value).__name__}: {value}"
                log.warning("%s.get_reward %s; the rollout scores None (env/errors)", t.name, what)
                t.env_error, t.env_reward = True, None
                continue
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or value != value:
                raise EnvironmentFailed(f"{t.name}.get_reward returned {short(value)} ({type(value).__name__}): a number, or None")
            t.env_reward = (t.env_reward or 0.0) + float(value)

    def _fit(self, r: Rollout, room: int, params) -> Rollout:
        """A turn cut to its own rollout's remaining budget (the call sampled up to the largest)."""
        if len(r.completion_ids) <= room:
            return r
        ids = r.completion_ids[:room]
        return Rollout(r.prompt_ids, ids, r.logprobs[:room], "length", self.tokenizer.decode(ids, skip_special_tokens=True),
                       versions=r.versions[:room] if r.versions is not None else None)

    def _take(self, turns: list[tuple[_Trajectory, Rollout]], eos: set) -> None:
        """Add one model turn to each trajectory and let the environments answer: their steps run at the same
        time, each environment in a thread of its own, all waited for until one deadline (env_timeout), so
        environments that hang cost the turn env_timeout once, not once each."""
        asked = [(t, r, self._append(t, r)) for t, r in turns]
        asked = [(t, r, written) for t, r, written in asked if written is not None]
        answers = bounded_all(self.timeout, [(t.env.step, written) for t, _, written in asked])
        for (t, r, _), answer in zip(asked, answers):
            self._answer(t, r, answer, eos)

    def _append(self, t: _Trajectory, r: Rollout) -> str | None:
        """Add a model turn to `t`; the text its environment is to answer, or None where the rollout ends here."""
        n = len(r.completion_ids)
        t.ids += r.completion_ids
        t.mask += [True] * n
        t.logprobs += list(r.logprobs[:n]) + [0.0] * (n - len(r.logprobs))
        t.versions = t.versions + list(r.versions[:n]) if t.versions is not None and r.versions is not None else None
        t.turns += 1
        t.text = r.text
        written = (self.tool_format.decode(self.tokenizer, r.completion_ids) if self.tool_format else  # its call markers kept
                   self.tokenizer.decode(r.completion_ids, skip_special_tokens=True))  # with the stop string, if any
        t.messages.append({"role": "assistant", "content": written})
        if r.finish_reason == "length":
            t.finish, t.done = "length", True
            return None
        return written

    def _answer(self, t: _Trajectory, r: Rollout, step, eos: set) -> None:
        """The environment's answer to `t`'s last turn: a Step, the exception its step raised, or TimedOut."""
        if isinstance(step, TimedOut):  # this rollout ends; the call is left to end by itself
            log.warning("%s.step did not return within env_timeout=%g s; the rollout ends there (env/errors)", t.name,
                        self.timeout)
            t.env_error, t.done = True, True
            return
        if isinstance(step, Exception):  # an environment's bug ends this rollout, not the run
            log.warning("%s.step raised %s: %s; the rollout ends there (env/errors)", t.name, type(step).__name__, step)
            t.env_error, t.done = True, True
            return
        problem = step_problem(step)
        if problem:
            raise EnvironmentFailed(f"{t.name}.step returned {problem}")
        if step.reward is not None:
            t.turn_rewards.append((max(len(t.ids) - 1, 0), float(step.reward)))  # the turn's tokens end here
            t.env_reward = (t.env_reward or 0.0) + (0.0 if self.per_turn else float(step.reward))
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


def _sample(sampler, prompt_ids, params, streams, caches: TurnCaches | None, keys: list) -> list[list[Rollout]]:
    """sampler.generate; with `caches`, each rollout (keys: one per completion, (group, member)) goes on from
    the cache kept from its turn before and leaves its own for its next (rollout/turns.py)."""
    if caches is None:
        return sampler.generate(prompt_ids, params, streams)
    return sampler.generate(prompt_ids, params, streams, turns=caches, keys=keys)


def _is_prompt(value) -> bool:
    """Text, or a non-empty list of chat messages ({'role': str, 'content': ...})."""
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)


def step_problem(step) -> str | None:
    """What is wrong with what an environment's step returned (a short phrase), or None for a usable Step."""
    from rlvr.environments import Step

    if not isinstance(step, Step):
        return f"{short(step)} ({type(step).__name__}), not a Step(observation, done, reward)"
    reward = step.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real) or reward != reward):
        return f"a Step whose reward is {short(reward)} ({type(reward).__name__}): a number, or None"
    if step.done not in (True, False):  # a bool, or numpy's
        return f"a Step whose done is {short(step.done)} ({type(step.done).__name__}): True or False"
    if not isinstance(step.role, str) or not step.role:
        return f"a Step whose role is {short(step.role)}: a chat role such as 'user' or 'tool'"
    return None


def stop_strings_of(env, name: str) -> tuple:
    """The environment's stop_strings (where a model turn ends for it to answer): a list of non-empty strings."""
    stops = getattr(env, "stop_strings", ())
    if isinstance(stops, str) or not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        raise EnvironmentFailed(f"{name}.stop_strings is {short(stops)}: a list of non-empty strings, e.g. ['</tool_call>']")
    return tuple(stops)


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
    from rlvr.environments import ToolEnvironment, environment_specs
    from rlvr.tool_formats import tool_format
    from rlvr.tools import ToolBox

    if not rollout.tools and not rollout.environment:
        return None
    toolbox = ToolBox(rollout.tools, rollout.tool_timeout, rollout.max_tool_output_chars)
    fmt = tool_format(rollout.tool_call_format, tokenizer)  # the chat template's family, unless the setting names one
    if rollout.environment:
        kinds = {key: environment_kind(spec, toolbox, rollout.env_timeout or None, fmt)
                 for key, spec in environment_specs(rollout.environment).items()}
        if None not in kinds:  # TRL's dict: each row's `environment` column picks one
            return MultiTurn(rollout, data, tokenizer, kinds, expose=True)
        factory, schemas, name = kinds[None]
        return MultiTurn(rollout, data, tokenizer, factory, schemas, name=name, expose=True)
    return MultiTurn(rollout, data, tokenizer, lambda: ToolEnvironment(toolbox, fmt), toolbox.schemas, name="ToolEnvironment")


def environment_kind(spec, toolbox, timeout: float | None, tool_format=None) -> tuple:
    """(factory, tool schemas, name) of the environment `spec` names: rlvr's protocol as it is, TRL's through
    MethodEnvironment, its methods offered as tools beside the run's own (`toolbox`), its calls read in
    `tool_format` (tool_formats.py; None: the tag format).  One is made to see which."""
    from rlvr.environments import MethodEnvironment, checked, is_trl_protocol, load_environment, method_schemas

    factory = load_environment(spec)
    name = environment_name(factory)
    made = checked(factory)
    probe = made_within(timeout, made, name)
    if not is_trl_protocol(probe):
        if toolbox.tools:
            raise EnvironmentFailed(f"environment {name} has step(text) (rlvr's protocol), which runs what the model writes "
                                    "itself: tools=[...] go with TRL's protocol only (methods as tools); give your environment "
                                    "the tools it runs")
        return made, None, name
    return (lambda: MethodEnvironment(made(), toolbox, tool_format)), toolbox.schemas + method_schemas(probe, name), name


def check_environments(environment, tools, timeout: float | None) -> list[str]:
    """The launch check's (before the model loads): each environment of the `environment` setting made as a
    run makes them, its protocol, tool methods and stop_strings checked; what is wrong, a line each."""
    from rlvr.environments import environment_specs, load_environment
    from rlvr.tools import ToolBox, ToolError

    try:
        toolbox = ToolBox(tools)
    except ToolError:  # the tools' own check says why
        toolbox = ToolBox(())
    problems = []
    for spec in environment_specs(environment).values():
        try:
            name = environment_name(load_environment(spec))
            factory, _, name = environment_kind(spec, toolbox, timeout)
            stop_strings_of(made_within(timeout, factory, name), name)
        except ValueError as e:  # it cannot be found, has no reset, or a tool method no docstring
            problems.append(str(e))
        except RolloutError as e:  # its constructor raised or hung, or it broke the protocol
            problems.append(f"environment {e}" if str(e).startswith(name) else str(e))
    return problems


def made_within(timeout: float | None, factory, name: str):
    """factory(), bounded by env_timeout (`timeout`); a constructor that raises or hangs is an EnvironmentFailed
    naming it (what it made that is not an environment: environments.checked's RolloutError)."""
    try:
        return bounded(timeout, factory)
    except TimedOut:
        raise EnvironmentFailed(f"{name}() did not return within env_timeout={timeout:g} s") from None
    except RolloutError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor
        raise EnvironmentFailed(f"{name}() raised {type(e).__name__}: {e}") from None


def environment_name(factory) -> str:
    return getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or type(factory).__name__
