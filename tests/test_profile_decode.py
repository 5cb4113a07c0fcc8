"""benchmarks/profile_decode.py's ablation: each stand-in runs in the real decode step, and the runner
is exactly itself again afterwards (a stand-in left behind would make every later number wrong)."""

import importlib.util
from pathlib import Path

import torch

from rlvr.llama import LlamaRunner

_SPEC = importlib.util.spec_from_file_location("profile_decode", Path(__file__).resolve().parents[1] / "benchmarks" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(profile_decode)


def decode_logits(runner, ids, steps=3):
    with torch.inference_mode():
        logits, state = runner.prefill(ids, 2, steps, torch.float32)
        out = [logits]
        for step in range(steps):
            out.append(runner.decode(torch.full((len(ids) * 2,), 5 + step, dtype=torch.long), state))
    return out


def same(a, b, exact=False):
    close = torch.equal if exact else torch.allclose
    return len(a) == len(b) and all(x.shape == y.shape and close(x, y) for x, y in zip(a, b))


def test_every_stand_in_runs_and_the_runner_is_restored(tiny):
    model, _ = tiny
    runner = LlamaRunner(model)
    ids = [[1, 7, 8, 9], [1, 10, 11]]
    before = decode_logits(runner, ids)
    methods = {method: LlamaRunner.__dict__[method] for method, _ in profile_decode.STAND_INS.values()}

    times = profile_decode.ablate(runner, ids, 2, torch.float32, steps=2, rounds=1)

    assert set(times) == {"full", *profile_decode.STAND_INS}
    assert all(0 < t < float("inf") for t in times.values())
    assert {method: LlamaRunner.__dict__[method] for method in methods} == methods
    assert same(decode_logits(runner, ids), before, exact=True)


def test_each_stand_in_replaces_a_piece_the_decode_step_uses(tiny, monkeypatch):
    """A stand-in whose method the step no longer calls would report that its piece costs nothing."""
    model, _ = tiny
    runner = LlamaRunner(model)
    ids = [[1, 7, 8, 9], [1, 10, 11]]
    before = decode_logits(runner, ids)
    for name, (method, stand_in) in profile_decode.STAND_INS.items():
        monkeypatch.setattr(LlamaRunner, method, stand_in)
        after = decode_logits(runner, ids)
        monkeypatch.undo()
        assert not same(after, before), name
