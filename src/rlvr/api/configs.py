"""TRL's GRPOConfig, SFTConfig and DPOConfig: rlvr's Config under TRL's names.

Each is the Config of its method (methods.py): the method's defaults where TRL's <Method>Config
has other ones (SFT's learning rate), and its names where it gives a setting another name (DPO's
`beta` and `loss_type` are dpo_beta and dpo_loss_type)."""

from __future__ import annotations

from typing import Any

from rlvr import methods
from rlvr.config import ConfigError, build_config, hide_secret
from rlvr.settings import check_settings
from rlvr.trl_settings import IGNORED, UNSUPPORTED

__all__ = ["GRPOConfig", "SFTConfig", "DPOConfig"]


class GRPOConfig:
    """TRL's GRPOConfig: `GRPOConfig(output_dir=..., **settings)`, attributes read and set by TRL's
    names, `to_dict()`.  Every setting is checked when it is made or set (a ConfigError says what to fix)."""

    _method = "grpo"  # the method whose defaults and names these settings have (methods.py)

    def __init__(self, output_dir: str | None = None, **settings: Any):
        given = {"output_dir": output_dir} if output_dir is not None else {}
        object.__setattr__(self, "_settings", {**given, **settings})
        self._resolve()

    def _resolve(self) -> None:
        ignored: list[str] = []
        method = methods.get(self._method)
        cfg = build_config(method.settings({}), method.settings(self._settings), ignored=ignored)
        # the rules that need a registry, at once too; the functions that reward_weights weigh come with the trainer
        object.__setattr__(self, "_config", check_settings(cfg, rewards_later=True))
        object.__setattr__(self, "_ignored", ignored)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        own = methods.get(self._method).trl_name(name)
        if hasattr(self._config, own):
            return getattr(self._config, own)
        if name in self._settings:
            return self._settings[name]
        if name in IGNORED or name in UNSUPPORTED:
            return None  # a TRL setting without effect here, not given
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        settings = {**self._settings, name: value}
        previous = self._settings
        object.__setattr__(self, "_settings", settings)
        try:
            self._resolve()
        except ConfigError:
            object.__setattr__(self, "_settings", previous)
            raise

    def to_dict(self) -> dict[str, Any]:
        """Every setting, a token as "<HUB_TOKEN>" as in TRL (the attribute holds the token itself)."""
        return self._config.to_dict()

    def __repr__(self) -> str:
        shown = (f"{k}={hide_secret(k, v)!r}" for k, v in self._settings.items())
        return f"{type(self).__name__}({', '.join(shown)})"


class SFTConfig(GRPOConfig):
    """TRL's SFTConfig: max_length, packing, completion_only_loss, and every shared setting."""

    _method = "sft"


class DPOConfig(GRPOConfig):
    """TRL's DPOConfig: beta, loss_type (sigmoid, ipo, hinge), label_smoothing, max_length, ..."""

    _method = "dpo"
