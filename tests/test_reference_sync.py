"""sync_ref_model (TR-DPO, TRL's SyncRefModelCallback): every ref_model_sync_steps optimizer steps
the reference becomes alpha x policy + (1 - alpha) x reference; it is refused where there is no
reference of its own, and a resumed run continues with the moved reference."""

import copy
import json
import zlib

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_model
from rlvr.checkpoint import STATE_FILE
from rlvr.config import ConfigError, KLSettings, build_config
from rlvr.reference import KLReference
from rlvr.run import train


def _filled(model, value: float):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_the_reference_moves_toward_the_policy_every_sync_steps():
    """alpha 0.6, every 2 steps; policy 1 and reference 0 (every weight):
    step 2: 0.6 x 1 + 0.4 x 0 = 0.6;  then policy 2, step 4: 0.6 x 2 + 0.4 x 0.6 = 1.44."""
    policy = _filled(make_tiny_model(60), 1.0)
    reference = _filled(copy.deepcopy(policy), 0.0)
    buffers = {k: v.clone() for k, v in reference.named_buffers()}
    kl = KLReference(KLSettings(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.6), policy, reference, logprobs=None)

    def reference_values() -> set[float]:
        return {round(v, 6) for p in reference.parameters() for v in p.unique().tolist()}

    kl.after_step({})
    assert reference_values() == {0.0}
    kl.after_step({})
    assert reference_values() == {0.6}
    assert reference.lm_head.weight is reference.model.embed_tokens.weight  # tied: mixed once, not twice
    _filled(policy, 2.0)
    kl.after_step({})
    assert reference_values() == {0.6}
    kl.after_step({})
    assert reference_values() == {1.44}
    assert all(torch.equal(v, buffers[k]) for k, v in reference.named_buffers())  # rotary frequencies untouched
    assert {p.unique().item() for p in policy.parameters()} == {2.0}  # the policy is only read


def test_the_moved_reference_is_checkpoint_state():
    policy = _filled(make_tiny_model(60), 1.0)
    settings = KLSettings(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    kl = KLReference(settings, policy, _filled(copy.deepcopy(policy), 0.0), logprobs=None)
    kl.after_step({})
    assert "ref_model" not in kl.state_dict()  # not moved yet: a resumed run starts from the same model
    kl.after_step({})
    state = copy.deepcopy(kl.state_dict())
    assert state["steps"] == 2
    fresh = KLReference(settings, policy, _filled(copy.deepcopy(policy), 0.0), logprobs=None)
    fresh.load_state_dict(state)
    assert {p.unique().item() for p in fresh.ref_model.parameters()} == {0.5}
    fresh.after_step({})
    fresh.after_step({})  # the 4th step syncs, as it would have without the interruption: 0.5 x 1 + 0.5 x 0.5
    assert {p.unique().item() for p in fresh.ref_model.parameters()} == {0.75}


@pytest.mark.parametrize("settings,message", [
    ({"beta": 0.0}, "beta=0 loads no reference"),
    ({"beta": 0.04, "use_peft": True}, "not supported with use_peft"),
    ({"beta": 0.04, "ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha must be in [0, 1]"),
    ({"beta": 0.04, "ref_model_sync_steps": 0}, "ref_model_sync_steps must be at least 1"),
])
def test_sync_ref_model_is_refused_without_a_reference_of_its_own(settings, message):
    with pytest.raises(ConfigError) as error:
        build_config({"sync_ref_model": True, **settings})
    assert message in str(error.value)


def _text_reward(completions, **kwargs):
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


@pytest.mark.trains
def test_a_run_resumed_after_a_sync_is_the_run_without_the_interruption(tiny_run_config, tmp_path, monkeypatch):
    """A sync after every step (alpha 0.5, beta 0.5): the KL of steps 3 and 4 is measured against a
    reference moved at steps 1 and 2, which the resumed run reads from checkpoint-2."""
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", _text_reward)  # rewards that differ: every step updates
    settings = {"beta": 0.5, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5,
                "lr_scheduler_type": "constant"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_run_config(straight, **settings))
    train(tiny_run_config(resumed, **settings, max_steps=2))
    assert "ref_model" in torch.load(resumed / "checkpoint-2" / STATE_FILE, weights_only=False)["kl"]
    train(tiny_run_config(resumed, **settings, resume=True))

    def rows(out):
        keep = ("loss", "kl", "grad_norm", "reward")
        return [{k: r[k] for k in keep} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    assert rows(resumed) == rows(straight)
    assert all(r["kl"] > 0 for r in rows(straight)[1:])
    a, b = load_file(str(resumed / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
