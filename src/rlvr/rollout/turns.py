"""The keys and values of multi-turn rollouts, kept between their turns (rollout/multiturn.py), and of
partial rollouts, kept between their rounds (rollout/stage.py).

Why: each later turn of a rollout continues its whole history (the prompt, the turns so far, the
observations between them).  Prefilled again every turn, the history is read once per turn; kept,
a turn runs only what is new: the last token of the turn before (sampled, never run), the
observation, the next assistant header.

How: MultiTurn makes one TurnCaches per `generate` call and gives the in-process sampler
(rollout/engine.py) a key per rollout.  A row the sampler stops at the end of a turn (EOS or a stop
string) leaves its cache here under its rollout's key: every token run so far, its keys and values in
the sampler's own layout, one copy per rollout (a group's rows hold the prompt's each).  The next call
takes the caches of the rollouts it continues (`take`, which checks that they are a prefix of the
history given) and runs only the rest on them.  A rollout that ends is dropped (`keep`), and all of
them when MultiTurn.generate returns (`clear`): at most one turn's caches of the live rollouts are held.

Partial rollouts (partial_rollout_tokens) keep them the same way from one round to the next: the
rollout stage holds one TurnCaches for the run and keys each completion by its group's token and its
place in the group (PartialGroup.key).  A row the round cuts short leaves its cache (the sampler's
`resume`); the next round takes it and runs only the token sampled last.  A row that finishes leaves
none; before each round the caches of groups no longer carried (dropped as too old) are let go
(`keep`), and all of them when the carried groups are put back (a rewind, a checkpoint: `clear`).
Newer weights loaded between two rounds do not compute a kept cache again: its keys and values stay
those of the weights that ran them, as a decode loop's cache stays over an in-flight load
(rollout/producer.py) and vLLM's over a pause with mode=keep.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Held:
    """One rollout's cache between two turns: the keys and values of `ids` (its history so far, less the
    last token sampled), in the sampler's layout: the fast sampler's one tensor each over all layers
    (DecodeState.held), the generic sampler's a list with a tensor per layer."""

    ids: list[int]
    keys: object
    values: object


class TurnCaches:
    """The Held caches of rollouts continued by a later call, by the key their caller gives each rollout."""

    def __init__(self):
        self.held: dict = {}
        self.last_turn = False  # True: no call follows the next one, whose rows that stop leave nothing here

    def __len__(self) -> int:
        return len(self.held)

    def put(self, key, held: Held) -> None:
        self.held[key] = held

    def take(self, key, history: list[int]) -> Held | None:
        """The cache kept for `key` (None: none), no longer held here.  `history`: the whole prompt the
        rollout goes on from, which must begin with the cache's tokens and add at least one."""
        held = self.held.pop(key, None)
        if held is not None and (len(history) <= len(held.ids) or history[: len(held.ids)] != held.ids):
            raise ValueError(f"rollout {key!r}: its kept cache of {len(held.ids)} tokens is not a prefix of the "
                             f"{len(history)} tokens it is to continue from (turn_cache=false samples without it)")
        return held

    def keep(self, keys) -> None:
        """Drop the caches of every rollout not in `keys` (those that ended)."""
        keys = set(keys)
        self.held = {k: h for k, h in self.held.items() if k in keys}

    def clear(self) -> None:
        self.held.clear()
