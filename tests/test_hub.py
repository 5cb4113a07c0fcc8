"""push_to_hub: no token fails before the model loads, an upload that fails leaves the run whole
with a way to push it later, and what is uploaded (no checkpoints, no token).  The Hub itself is
never reached: HfApi's methods are replaced."""

from __future__ import annotations

import dataclasses
import json

import huggingface_hub
import pytest
from huggingface_hub import HfApi

from rlvr import run
from rlvr.cli import main
from rlvr.hub import HubPushError
from rlvr.run import train

TOKEN = "hf_not_a_real_token"


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # nor one saved by `hf auth login`


def test_no_token_fails_before_the_model_loads(tiny_model_dir, tmp_path, no_token, monkeypatch, capsys):
    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    code = main(["train", f"model={tiny_model_dir}", "push_to_hub=true", f"output_dir={out}"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "push_to_hub=true needs a Hugging Face token with write access, and none was found" in err
    assert "hub_token=hf_..." in err and "HF_TOKEN" in err and "`hf auth login`" in err
    assert not out.exists()


def test_a_repository_name_the_hub_refuses_fails_before_training(tiny_run_config, tmp_path, no_token):
    from rlvr.config import ConfigError

    with pytest.raises(ConfigError, match=r"push_to_hub: 'my run-\d{8}-\d{6}' \(hub_model_id, else the output_dir's name\) "
                                          r"is not a valid Hub repository name.*hub_model_id=<user>/<name>"):
        train(dataclasses.replace(tiny_run_config(tmp_path, push_to_hub=True, hub_token=TOKEN, run_name="my run"), output_dir=None))


def test_the_config_shows_no_token_and_the_push_still_gets_it(no_token):
    from rlvr.config import build_config
    from rlvr.hub import find_token

    cfg = build_config({"hub_token": TOKEN, "model_init_kwargs": {"token": TOKEN, "revision": "main"}})
    assert not any(TOKEN in text for text in (repr(cfg), str(cfg), json.dumps(cfg.to_dict())))
    assert cfg.to_dict()["hub_token"] == "<HUB_TOKEN>" and cfg.to_dict()["model_init_kwargs"] == {"token": "<TOKEN>", "revision": "main"}
    saved = cfg.without_secrets()  # config.yaml, the loggers, resume's comparison: no token, not even a placeholder
    assert saved.to_dict()["hub_token"] is None and saved.model_init_kwargs == {"revision": "main"}
    assert find_token(cfg.run_settings) == TOKEN and cfg.model_init_kwargs["token"] == TOKEN


class FakeHub:
    """HfApi.create_repo and upload_folder, recorded; `fail` names the one that raises."""

    def __init__(self, monkeypatch, fail: str | None = None):
        self.calls = []

        def create_repo(api, name, private=None, exist_ok=False, **kw):
            self.calls.append(("create_repo", name, {"private": private, "exist_ok": exist_ok, "token": api.token}))
            if fail == "create_repo":
                raise OSError("[Errno -3] Temporary failure in name resolution: huggingface.co")
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{name if '/' in name else f'me/{name}'}")  # the token's user

        def upload_folder(api, repo_id, folder_path, ignore_patterns=None, **kw):
            self.calls.append(("upload_folder", repo_id, {"folder_path": folder_path, "ignore_patterns": ignore_patterns}))
            if fail == "upload_folder":
                raise ConnectionError("Connection reset by peer")

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)


@pytest.mark.trains
def test_the_final_model_and_its_record_are_pushed_without_checkpoints_or_token(tiny_run_config, tmp_path, no_token, monkeypatch):
    hub = FakeHub(monkeypatch)
    out = tmp_path / "grpo-arith"
    summary = train(tiny_run_config(out, push_to_hub=True, hub_token=TOKEN, hub_private_repo=True))
    (_, name, repo), (_, repo_id, upload) = hub.calls
    assert name == "grpo-arith" and repo == {"private": True, "exist_ok": True, "token": TOKEN}  # TRL's default: the dir's name
    assert repo_id == "me/grpo-arith" and summary["hub_url"] == "https://huggingface.co/me/grpo-arith"
    files = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    sent = set(huggingface_hub.utils.filter_repo_objects(files, ignore_patterns=upload["ignore_patterns"]))
    assert {"model.safetensors", "config.json", "tokenizer.json", "config.yaml", "metrics.jsonl", "summary.json"} <= sent
    assert any(f.startswith("checkpoint-") for f in files) and not any(f.startswith(("checkpoint-", ".")) for f in sent)
    assert all(TOKEN not in (out / f).read_text(errors="replace") for f in sent)  # config.yaml has hub_token: null


@pytest.mark.trains
def test_hub_model_id_names_the_repository(tiny_run_config, tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    train(tiny_run_config(tmp_path / "run", push_to_hub=True, hub_model_id="team/grpo-v1", max_steps=1))
    assert hub.calls[0][1] == "team/grpo-v1"


@pytest.mark.trains
@pytest.mark.parametrize("fail", ["create_repo", "upload_folder"])
def test_a_failed_push_says_where_the_model_is_and_how_to_push_it_later(tiny_run_config, tmp_path, monkeypatch, fail, capsys):
    FakeHub(monkeypatch, fail=fail)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: TOKEN)  # from `hf auth login`
    out = tmp_path / "run"
    with pytest.raises(HubPushError) as caught:
        train(tiny_run_config(out, push_to_hub=True, max_steps=2))
    message = str(caught.value)
    assert message.startswith("could not push the model to the Hugging Face Hub (")
    assert ("OSError: [Errno -3] Temporary failure" if fail == "create_repo" else "ConnectionError: Connection reset") in message
    assert f"The model is saved locally at {out}, with the run's summary and logs" in message
    assert f"push it later with: hf upload run {out} . --exclude 'checkpoint-*' --exclude '.*' --exclude 'wandb/*'" in message
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # nothing of the run is lost
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-2").is_dir()
