"""The trainer's calls to vLLM's own server (`vllm serve`, or `rlvr vllm-serve vllm_server_impl=vllm`),
beside those to rlvr's (rollout/vllm_client.py, which uses these for a server it finds is vLLM's).

Generation.  Each group is one request to /v1/completions (the prompt as token ids, n completions,
its own seed, the sampled tokens' log-probs, return_token_ids), and every group of a call is in
flight at once: vLLM batches them, with the requests of every other trainer process using the same
server.  The server is started with logprobs_mode=processed_logprobs, so the log-probs are those
of the distribution it sampled from, as from rlvr's server.

Weights.  vLLM's own weight-update routes (dev mode): /init_weight_transfer_engine, /start_weight_update,
/update_weights (once per chunk of a few dozen MB: rlvr's weight stream, base64, read by the "rlvr"
engine of rollout/vllm_transfer.py), /finish_weight_update with the trainer's version, then
/reset_prefix_cache, whose entries the old weights computed.  With LoRA, when the server has a LoRA slot,
only the adapter goes: the engine writes it where vLLM's filesystem resolver finds it by name
(adapter_name), and the requests name it.  With async_mode=free a load may come while a generation's
requests decode: the server is then paused with /pause?mode=keep around it and /resume'd (vLLM's own way
to load weights in flight: the requests keep their cache and go on with the new weights).  /weight_info says which version a
server holds: one restarted since ("default", its starting weights) is sent the current weights
before it samples.
"""

from __future__ import annotations

import base64
import contextlib
import re
from concurrent.futures import ThreadPoolExecutor

from rlvr.errors import StaleWeights, VLLMError
from rlvr.rollout.vllm_request import max_tokens_of
from rlvr.rollout.weights import WeightUpdate, encode, nbytes
from rlvr.rollout.weights import describe as describe_stream

CHUNK_BYTES = 64 * 2**20  # the weight stream's bytes per /update_weights request (a larger tensor goes alone)
MAX_IN_FLIGHT = 256  # requests one call keeps open at once


def version_name(version: int) -> str:
    """What /weight_info reports for the trainer's version: vLLM's own name for the weights it started with."""
    return "default" if version == 0 else f"rlvr-{version}"


def describe(server) -> dict:
    """What rollout/vllm_client needs of a vLLM server whose /health had no body: its model's name, its dtype;
    a clear error when it cannot take rlvr's weight updates (not in dev mode, or without the rlvr engine)."""
    models = server.call("GET", "/v1/models").get("data") or [{}]
    try:
        config = str(server.call("GET", "/server_info").get("vllm_config", ""))
    except VLLMError as e:
        raise VLLMError(f"{e}\nvLLM's server at {server.url} takes no weight updates: start it with "
                        f"`rlvr vllm-serve vllm_server_impl=vllm`, or as VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
                        "--weight-transfer-config '{\"backend\": \"rlvr\"}' --logprobs-mode processed_logprobs") from None
    try:  # the rlvr engine takes empty init info; vLLM's own engines (nccl, ...) refuse it, and no engine at all fails
        server.call("POST", "/init_weight_transfer_engine", {"init_info": {}})
    except VLLMError as e:
        raise VLLMError(f"{e}\nvLLM's server at {server.url} was not started with rlvr's weight transfer: start it with "
                        "--weight-transfer-config '{\"backend\": \"rlvr\"}' (rlvr vllm-serve vllm_server_impl=vllm does)") from None
    dtype = re.search(r"dtype=torch\.(\w+)", config)
    try:  # a worker method that fails when the engine has no LoRA slot
        server.call("POST", "/collective_rpc", {"method": "list_loras"})
        adapters = True
    except VLLMError:
        adapters = False
    return {"model": models[0].get("id"), "dtype": dtype.group(1) if dtype else "float32", "adapters": adapters, "stock": True}


def adapter_name(version: int) -> str:
    """The name the adapter of the trainer's `version` has on vLLM's server (and the requests sampling with it)."""
    return f"rlvr-policy-{version}"


def held_version(server) -> str:
    return str(server.call("GET", "/weight_info").get("weight_version"))


def generate(server, model: str, prompt_ids: list[list[int]], seeds: list[int], params: dict, version: int) -> list[list[dict]]:
    """One request per prompt, all at once, to `model` (the served model, or an adapter's name); per prompt its
    n rollouts as dicts (Rollout's fields).  StaleWeights when the server holds another version than `version`."""
    held = held_version(server)
    if getattr(server, "prefix_stale", False):  # a load while requests ran left it; none run now
        server.prefix_stale = server.call("POST", "/reset_prefix_cache").get("success") is False
    if held != version_name(version):
        raise StaleWeights(f"vLLM server {server.url} holds weights {held!r}, not {version_name(version)!r}")
    base = {"model": model, "n": params["n"], "temperature": params["temperature"],
            "top_p": params["top_p"], "top_k": params["top_k"] or -1, "min_p": params["min_p"],
            "repetition_penalty": params["repetition_penalty"], "stop": list(params["stop_strings"]) or None,
            "stop_token_ids": params["eos_token_ids"], "logprobs": 0, "return_token_ids": True}

    def one(i: int, prompt: list[int], seed: int) -> list[dict]:
        reply = server.call("POST", "/v1/completions", {**base, "prompt": list(prompt), "seed": seed,
                                                        "max_tokens": max_tokens_of(params, i)})
        group = []
        for c in sorted(reply["choices"], key=lambda c: c["index"]):
            ids = list(c["token_ids"])
            logprobs = list(c["logprobs"]["token_logprobs"])
            if len(logprobs) != len(ids):
                raise VLLMError(f"vLLM server {server.url}: {len(ids)} tokens but {len(logprobs)} log-probs")
            group.append({"prompt_ids": list(prompt), "completion_ids": ids, "logprobs": logprobs,
                          "finish_reason": "stop" if c["finish_reason"] == "stop" else "length", "text": c["text"]})
        return group

    with ThreadPoolExecutor(min(len(prompt_ids), MAX_IN_FLIGHT)) as pool:
        return list(pool.map(one, range(len(prompt_ids)), prompt_ids, seeds))


def chunks(update: WeightUpdate, dtype, limit: int | None = None):
    """The update as several weight streams of at most about `limit` bytes (CHUNK_BYTES) each (a larger
    tensor alone), each a WeightUpdate of some of the tensors; a tied alias travels with its source."""
    limit = CHUNK_BYTES if limit is None else limit
    aliases = (update.meta or {}).get("aliases") or {}
    part, size = [], 0
    for name, entry in zip(update.tensors, describe_stream(update, dtype)["tensors"]):  # each tensor's bytes on the wire
        n = nbytes(entry)
        if part and size + n > limit:
            yield _part(update, part, aliases)
            part, size = [], 0
        part.append(name)
        size += n
    if part:
        yield _part(update, part, aliases)


def _part(update: WeightUpdate, names: list[str], aliases: dict) -> WeightUpdate:
    held = {alias: source for alias, source in aliases.items() if source in names}
    return update.only(names, {**update.meta, "aliases": held})


def push(server, update: WeightUpdate, dtype, in_flight: bool = False) -> int:
    """Load `update` into the server through vLLM's weight-update routes; the bytes sent.  An adapter is
    written on the server under adapter_name(version), the one before it unloaded.  `in_flight`: requests
    of a generation are being decoded (async_mode=free): the server is paused with mode=keep first, so no
    decode step runs on half-written weights, and resumed after; the requests keep their cache and go on
    with the new weights."""
    if update.adapter is not None:
        update = update.only(update.tensors, {**update.meta, "adapter_name": adapter_name(update.version),
                                              "base_model": server.stock["model"]})
    if in_flight:
        server.call("POST", "/pause?mode=keep")
    try:
        sent = _load(server, update, dtype)
    finally:
        if in_flight:
            server.call("POST", "/resume")
    # The prefix cache holds what the old weights computed; vLLM resets it only when no request holds
    # blocks, so after an in-flight load it is reset before the next generation (generate).
    reset = server.call("POST", "/reset_prefix_cache")
    server.prefix_stale = reset.get("success") is False
    if update.adapter is not None:  # the previous adapter, if a request loaded it (vLLM keeps its name otherwise)
        with contextlib.suppress(VLLMError, ValueError):  # (vLLM answers in plain text)
            server.call("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_name(update.version - 1)})
    return sent


def _load(server, update: WeightUpdate, dtype) -> int:
    server.call("POST", "/init_weight_transfer_engine", {"init_info": {}})  # again: the server may have restarted since
    server.call("POST", "/start_weight_update")
    sent = 0
    try:
        for part in chunks(update, dtype):
            total, pieces = encode(part, dtype)
            sent += total  # the JSON body written around the base64 in place: no second copy of a chunk
            data = b'{"update_info": {"stream": "' + base64.b64encode(b"".join(pieces)) + b'"}}'
            server.call("POST", "/update_weights", data=data)
    except BaseException:  # close the update, marked as incomplete: the server is sent the whole update again before it samples
        with contextlib.suppress(VLLMError):
            server.call("POST", "/finish_weight_update", {"weight_version": "rlvr-incomplete"})
        raise
    server.call("POST", "/finish_weight_update", {"weight_version": version_name(update.version)})
    return sent
