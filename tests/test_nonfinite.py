"""Non-finite values stop the run with a message, and leave a checkpoint from before they appeared."""

import pytest
import torch
from safetensors.torch import load_file

from rlvr import cli
from rlvr.checkpoint import verify
from rlvr.config import ConfigError, build_config


def _args(model, out, lr):
    return ["train", f"model={model}", "task_args.num_train=50", "task_args.num_test=8", "reward_funcs=[boxed_format]",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=6", f"learning_rate={lr}",
            "max_steps=5", "save_steps=1", "max_grad_norm=0", "eval_on_start=false", "eval_on_end=false", f"output_dir={out}"]


@pytest.fixture(autouse=True)
def every_group_has_signal(monkeypatch):
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])


def _check_stopped(out, capsys, what):
    err = capsys.readouterr().err
    assert what in err and err.count("\n") == 1, err  # one line, no traceback
    kept = sorted(out.glob("checkpoint-*"))
    assert kept, "the steps before the non-finite value are saved"
    for checkpoint in kept:
        assert verify(checkpoint) is None
        assert all(torch.isfinite(t).all() for t in load_file(str(checkpoint / "model.safetensors")).values())
    return [int(p.name.split("-")[1]) for p in kept]


@pytest.mark.trains
def test_a_non_finite_gradient_stops_the_run_before_the_update(tiny_model_dir, tmp_path, capsys):
    """A huge learning rate: the weights blow up (finite) after step 1, step 2's gradient is nan."""
    out = tmp_path / "run"
    assert cli.main(_args(tiny_model_dir, out, 1e30)) == 2
    steps = _check_stopped(out, capsys, "the update was not applied, so the weights are those of step")
    assert steps[-1] >= 1


@pytest.mark.trains
def test_weights_made_non_finite_by_an_update_are_never_saved(tiny_model_dir, tmp_path, capsys, monkeypatch):
    original, calls = torch.optim.AdamW.step, {"n": 0}

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:  # step 3's update overflows one weight
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out = tmp_path / "run"
    assert cli.main(_args(tiny_model_dir, out, 1e-3)) == 2
    assert _check_stopped(out, capsys, "step 3's update made weights non-finite") == [1, 2]


@pytest.mark.parametrize("lr", [".inf", "nan", "0", "-1e-5"])
def test_the_learning_rate_must_be_finite_and_positive(lr):
    with pytest.raises(ConfigError, match="learning_rate must be a finite number > 0"):
        build_config(cli.parse_overrides([f"learning_rate={lr}"]))
