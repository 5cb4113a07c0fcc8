"""push_to_hub: the run's final model, with its record, uploaded to the Hugging Face Hub at the
end of training, as transformers' Trainer does for TRL (huggingface_hub's create_repo, then
upload_folder of the output directory without its checkpoints).

The token and the repository name are checked before the model loads (check_push).  An upload
that fails (no network, a token without write access) leaves the run whole on disk, and its
error says where the model is and how to upload it later with `hf upload`.  huggingface_hub is
imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from rlvr.errors import ConfigError
from rlvr.errors import HubPushError  # noqa: F401 - raised here, defined in the leaf errors.py

if TYPE_CHECKING:
    from rlvr.config import OutputSettings

# What stays local: the checkpoints (with optimizer state, several times the model's size), the
# lock and other hidden files, and wandb's own files.  The rest is the model repository: weights,
# tokenizer, config.yaml, metrics, evaluations, summary, report.
EXCLUDE = ("checkpoint-*", ".*", "wandb/*")


def find_token(settings: OutputSettings) -> str | None:
    """hub_token, else $HF_TOKEN, else the token saved by `hf auth login` (huggingface_hub.get_token)."""
    if settings.hub_token:
        return settings.hub_token
    import huggingface_hub

    return huggingface_hub.get_token()


def repo_name(settings: OutputSettings, output_dir: str | Path) -> str:
    """hub_model_id, else the output_dir's name, which the Hub puts under the token's user (as transformers does)."""
    return settings.hub_model_id or Path(output_dir).absolute().name


def check_push(settings: OutputSettings, default_dir: Path) -> None:
    """Raise ConfigError, before any model loads, when push_to_hub=true cannot push: no token,
    or a repository name the Hub refuses.  default_dir: where the run goes without output_dir
    (rundir.default_output_dir)."""
    if not find_token(settings):
        raise ConfigError("push_to_hub=true needs a Hugging Face token with write access, and none was found: pass "
                          "hub_token=hf_..., set the HF_TOKEN environment variable, or log in once with `hf auth login` "
                          "(or set push_to_hub=false)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name = repo_name(settings, settings.output_dir or default_dir)
    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ConfigError(f"push_to_hub: {name!r} (hub_model_id, else the output_dir's name) is not a valid Hub "
                          f"repository name: {e} Set hub_model_id=<user>/<name>") from None


def push(settings: OutputSettings, output_dir: Path) -> str:
    """Create the repository if it does not exist and upload output_dir without EXCLUDE; returns
    the repository's URL.  Any failure raises HubPushError, which says how to upload it later."""
    from huggingface_hub import HfApi

    name = repo_name(settings, output_dir)
    api = HfApi(token=find_token(settings))
    try:
        repo = api.create_repo(name, private=settings.hub_private_repo, exist_ok=True)
        api.upload_folder(repo_id=repo.repo_id, folder_path=output_dir, ignore_patterns=list(EXCLUDE),
                          commit_message="End of training")
    except Exception as e:  # noqa: BLE001 - network, token or Hub: each leaves the run on disk, with one way on
        raise HubPushError(push_failed_message(settings, output_dir, e)) from e
    return repo.url


def push_failed_message(settings: OutputSettings, output_dir: Path, error: BaseException) -> str:
    reason = f"{error.__class__.__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    command = ["hf", "upload", repo_name(settings, output_dir), str(output_dir), "."]
    command += [arg for pattern in EXCLUDE for arg in ("--exclude", pattern)]
    command += ["--private"] if settings.hub_private_repo else []
    command += ["--token", "<your token>"] if settings.hub_token else []
    return (f"could not push the model to the Hugging Face Hub ({reason}). The model is saved locally at {output_dir}, "
            f"with the run's summary and logs; push it later with: {shlex.join(command)}")
