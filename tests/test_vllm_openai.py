"""The trainer against vLLM's own server (rollout/vllm_openai.py through rollout/vllm_client.py), on a
stand-in that answers vLLM's routes as vLLM 0.32 answers them (their shapes copied from a real
`vllm serve` of the default model): one request per group, all in flight at once; weights in chunks
through vLLM's weight-update routes; a restarted server sent the weights before it samples; a server
that cannot take weights refused with what to do.  tests/test_vllm_layouts.py trains against the
real server."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlvr.errors import VLLMError
from rlvr.rollout import SamplingParams, vllm_openai
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.vllm_client import VLLMServers
from rlvr.rollout.vllm_request import request_seeds
from rlvr.rollout.weights import decode

pytestmark = pytest.mark.unit


class FakeVLLM(ThreadingHTTPServer):
    """vLLM's OpenAI server in dev mode with the rlvr weight-transfer engine, on a free port.  `wait_for`
    requests to /v1/completions are held until that many have arrived (to see them in flight together)."""

    daemon_threads = True

    def __init__(self, wait_for: int = 1, dev_mode: bool = True, engine: str | None = "rlvr", port: int = 0, lora: bool = False):
        super().__init__(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.dev_mode, self.engine, self.lora = dev_mode, engine, lora
        self.adapters = {}  # name -> (tensors, its adapter_config), as the rlvr engine writes them for vLLM's resolver
        self.version, self.weights, self.calls, self.completions = "default", {}, [], []
        self.open_update, self.fail_chunk = None, None  # fail_chunk: answer 500 to that /update_weights (0-based)
        self.barrier = threading.Barrier(wait_for, timeout=60)
        self.running = 0  # requests being decoded (holding cache blocks)
        self.unpaused = threading.Event()  # cleared by /pause?mode=keep: requests in flight wait for /resume
        self.unpaused.set()
        self.hold = None  # an Event: requests to /v1/completions wait for it (to load weights while they are out)
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: FakeVLLM

    def do_GET(self):
        s = self.server
        if self.path == "/health":
            return self._send(200, b"")
        if self.path == "/v1/models":
            return self._json({"object": "list", "data": [{"id": "/models/stand-in", "object": "model", "max_model_len": 512}]})
        if not s.dev_mode:
            return self._json({"detail": "Not Found"}, 404)
        if self.path == "/server_info":
            return self._json({"vllm_config": "model='/models/stand-in', dtype=torch.bfloat16, max_seq_len=512", "vllm_env": {}})
        if self.path == "/weight_info":
            return self._json({"weight_version": s.version})
        self._json({"detail": "Not Found"}, 404)

    def do_POST(self):
        s = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        req = json.loads(body) if body else {}
        with s.lock:
            s.calls.append(self.path)
        if self.path == "/v1/completions":
            with s.lock:
                s.completions.append(req)
            s.barrier.wait()
            with s.lock:
                s.running += 1
            if s.hold is not None:
                assert s.hold.wait(timeout=60)
            assert s.unpaused.wait(timeout=60)  # a paused server decodes nothing
            with s.lock:
                s.running -= 1
            seed, n = req["seed"], req["n"]
            choices = [{"index": k, "text": f"c{seed % 100}", "token_ids": [seed % 1000, k], "finish_reason": "stop" if k else "length",
                        "logprobs": {"token_logprobs": [-0.25, -0.5], "tokens": ["a", "b"]}} for k in reversed(range(n))]
            return self._json({"object": "text_completion", "choices": choices})
        if not s.dev_mode:
            return self._json({"detail": "Not Found"}, 404)
        if self.path == "/collective_rpc":  # list_loras: a worker method that fails without a LoRA slot
            return self._json({"results": [[]]}) if s.lora else self._json({"error": "LoRA is not enabled."}, 500)
        if self.path == "/v1/unload_lora_adapter":
            return self._send(200, b"Success: LoRA adapter removed successfully.")  # plain text, as vLLM's
        if self.path == "/init_weight_transfer_engine":
            if s.engine != "rlvr":  # vLLM's nccl engine refuses rlvr's empty init info
                return self._json({"error": "Invalid init_info for NCCLWeightTransferEngine"}, 500)
            return self._json({"message": "Weight transfer initialized"})
        if self.path == "/start_weight_update":
            s.open_update = {}
            return self._json({"message": "Weight update started"})
        if self.path == "/update_weights":
            chunk = sum(1 for c in s.calls if c == "/update_weights") - 1
            if chunk == s.fail_chunk:
                return self._json({"error": "worker died"}, 500)
            meta, tensors = decode(io.BytesIO(base64.b64decode(req["update_info"]["stream"])).read)
            if meta.get("adapter") is not None:
                s.adapters[meta["adapter_name"]] = ({k: t.clone() for k, t in tensors},
                                                    {**meta["adapter"], "base_model_name_or_path": meta["base_model"]})
                return self._json({"message": "Weights updated"})
            for name, t in tensors:
                s.open_update[name] = t.clone()
            for alias, source in (meta.get("aliases") or {}).items():
                s.open_update[alias] = s.open_update[source]
            return self._json({"message": "Weights updated"})
        if self.path == "/finish_weight_update":
            s.weights.update(s.open_update)
            s.open_update = None
            if req.get("weight_version") is not None:
                s.version = req["weight_version"]
            return self._json({"message": "Weight update finished"})
        if self.path == "/pause?mode=keep":
            s.unpaused.clear()
            return self._json({"status": "paused"})
        if self.path == "/resume":
            s.unpaused.set()
            return self._json({"status": "resumed"})
        if self.path == "/reset_prefix_cache":  # vLLM resets it only when no request holds blocks
            return self._json({"success": s.running == 0})
        self._json({"detail": "Not Found"}, 404)

    def _json(self, payload, code=200):
        self._send(code, json.dumps(payload).encode())

    def _send(self, code, data):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fakes():
    made = []

    def make(**kw):
        made.append(FakeVLLM(**kw))
        return made[-1]

    yield make
    for f in made:
        f.stop()


TOKENIZER = type("Tokenizer", (), {"pad_token_id": 0})()


class Policy(torch.nn.Module):
    """A model whose output layer is its embedding (tied), plus one more weight."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"tie_word_embeddings": True})()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.Parameter(torch.arange(3, dtype=torch.float32))


def test_every_group_is_its_own_request_and_all_are_in_flight_at_once(fakes):
    fake = fakes(wait_for=6)  # the stand-in answers none until all six groups have asked
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7, 9], timeout=30)
    assert servers.servers[0].stock == {"model": "/models/stand-in", "dtype": "bfloat16", "adapters": False, "stock": True}
    assert servers.dtype == torch.bfloat16 and not servers.adapters
    prompts = [[1, 2, 3 + i] for i in range(6)]
    params = SamplingParams(n=3, max_tokens=16, temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.1,
                            stop_strings=("###",))
    groups = servers.generate(prompts, params, GroupGenerators([11, 12, 13, 14, 15, 16]))
    seeds = request_seeds(6, GroupGenerators([11, 12, 13, 14, 15, 16]))
    sent = sorted(fake.completions, key=lambda r: r["prompt"])
    assert [r["prompt"] for r in sent] == prompts and [r["seed"] for r in sent] == seeds
    assert sent[0] | {"prompt": None, "seed": None} == {
        "model": "/models/stand-in", "prompt": None, "seed": None, "n": 3, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
        "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1, "stop": ["###"], "stop_token_ids": [7, 9], "logprobs": 0,
        "return_token_ids": True}
    first = groups[0]
    assert [r.completion_ids for r in first] == [[seeds[0] % 1000, k] for k in range(3)]  # in the order of "index"
    assert [r.finish_reason for r in first] == ["length", "stop", "stop"]
    assert first[0].logprobs == [-0.25, -0.5] and first[0].prompt_ids == [1, 2, 3] and first[0].text == f"c{seeds[0] % 100}"


def test_weights_go_in_chunks_through_vllms_update_routes(fakes, monkeypatch):
    monkeypatch.setattr(vllm_openai, "CHUNK_BYTES", 16)  # every tensor a chunk of its own
    fake = fakes()
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    policy = Policy()
    servers.update_weights(policy)
    assert fake.calls == ["/init_weight_transfer_engine", "/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update",
                          "/update_weights", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert fake.version == "rlvr-1"
    embed = policy.model.embed_tokens.weight.detach().to(torch.bfloat16)  # in the server's dtype
    assert torch.equal(fake.weights["model.embed_tokens.weight"], embed)
    assert torch.equal(fake.weights["lm_head.weight"], embed)  # the tied head, sent once, loaded under both names
    assert torch.equal(fake.weights["norm"], policy.norm.detach().to(torch.bfloat16))
    assert servers.metrics()["vllm/weight_sync_bytes"] == servers.last_sync[0] > 0


def test_a_restarted_server_is_sent_the_current_weights_before_it_samples(fakes):
    fake = fakes()
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    policy = Policy()
    servers.update_weights(policy)
    fake.version, fake.weights, fake.calls = "default", {}, []  # restarted: its starting weights
    groups = servers.generate([[1, 2]], SamplingParams(n=2, max_tokens=4), GroupGenerators([3]))
    assert fake.calls.index("/finish_weight_update") < fake.calls.index("/v1/completions")
    assert fake.version == "rlvr-1" and "norm" in fake.weights and len(groups[0]) == 2


def test_a_push_that_fails_midway_is_marked_incomplete_and_the_server_dropped(fakes, monkeypatch, capsys):
    monkeypatch.setattr(vllm_openai, "CHUNK_BYTES", 16)
    broken, good = fakes(), fakes()
    broken.fail_chunk = 1
    servers = VLLMServers([broken.url, good.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    servers.update_weights(Policy())
    assert broken.version == "rlvr-incomplete"  # never the new version with half of its weights
    assert good.version == "rlvr-1"
    assert [s.url for s in servers.alive] == [good.url]
    assert "dropped" in capsys.readouterr().err


def test_weights_published_while_requests_are_out_are_loaded_with_the_server_paused_and_kept(fakes):
    """async_mode=free: the producer's clock is asked while the generation waits; a new version is loaded
    at once, between /pause?mode=keep and /resume (the requests keep their cache), and the prefix cache,
    which vLLM cannot reset while they hold blocks, is reset before the next generation."""
    fake = fakes()
    fake.hold = threading.Event()
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    assert servers.reloads_in_flight  # vLLM's own server
    policy = Policy()

    class Clock:  # rollout.producer.WeightVersions as the sampler sees it: version 1 published once a request is out
        loads = 0

        def refresh(self):
            if self.loads or not fake.running:
                return False
            servers.update_weights(policy)
            self.loads += 1
            fake.hold.set()
            return True

    servers.live = Clock()
    groups = servers.generate([[1, 2], [3, 4]], SamplingParams(n=2, max_tokens=4), GroupGenerators([1, 2]))
    assert servers.live.loads == 1 and len(groups) == 2 and fake.version == "rlvr-1"
    calls = [c for c in fake.calls if c != "/v1/completions"]
    assert calls[calls.index("/pause?mode=keep"):] == ["/pause?mode=keep", "/init_weight_transfer_engine", "/start_weight_update",
                                                       "/update_weights", "/finish_weight_update", "/resume", "/reset_prefix_cache"]
    assert servers.servers[0].prefix_stale  # the requests held their blocks
    servers.live, fake.hold, fake.calls = None, None, []
    servers.generate([[1, 2]], SamplingParams(n=2, max_tokens=4), GroupGenerators([1]))
    assert fake.calls == ["/reset_prefix_cache", "/v1/completions"] and not servers.servers[0].prefix_stale
    servers.update_weights(policy)  # between generations: no pause
    assert "/pause?mode=keep" not in fake.calls and fake.version == "rlvr-2"


def test_a_server_that_cannot_take_weights_is_one_clear_error(fakes):
    with pytest.raises(VLLMError, match="VLLM_SERVER_DEV_MODE=1"):
        VLLMServers([fakes(dev_mode=False).url], TOKENIZER, eos_token_ids=[7], timeout=30)
    with pytest.raises(VLLMError, match=r"weight-transfer-config '\{\"backend\": \"rlvr\"\}'"):
        VLLMServers([fakes(engine="nccl").url], TOKENIZER, eos_token_ids=[7], timeout=30)


def test_vllm_serve_runs_vllms_own_server_with_rlvrs_engine():
    from rlvr.config import VLLMSettings
    from rlvr.rollout.vllm_server import vllm_command

    settings = VLLMSettings(vllm_server_host="127.0.0.1", vllm_server_impl="vllm")
    args = {"dtype": "float32", "seed": 3, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.3, "enforce_eager": True,
            "max_model_len": 512, "kv_cache_memory_bytes": 2**28}
    cmd = vllm_command(settings, "/models/m", args, 8123, cpu=True)
    flags = {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--") and not b.startswith("--")}
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--weight-transfer-config"] == '{"backend": "rlvr"}' and flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--max-model-len"] == "512" and flags["--kv-cache-memory-bytes"] == str(2**28) and flags["--port"] == "8123"
    assert "--enforce-eager" in cmd and "--enable-prefix-caching" in cmd
    assert "--no-enable-chunked-prefill" in cmd and "--no-enable-chunked-prefill" not in vllm_command(settings, "/m", args, 1, cpu=False)
    assert "--enable-lora" not in cmd
    lora = vllm_command(settings, "/m", {**args, "enable_lora": True, "max_loras": 1, "max_lora_rank": 16}, 1, cpu=True)
    assert lora[lora.index("--enable-lora") + 1:lora.index("--enable-lora") + 5] == ["--max-loras", "1", "--max-lora-rank", "16"]
    assert any("vllm_server_impl" in p for p in VLLMSettings(vllm_server_impl="sglang").problems())


def test_collective_transfer_to_vllms_own_server_goes_over_http_and_says_so(fakes, capsys):
    fake = fakes()
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30, transfer="collective")
    assert servers.transfer == "http" and "over HTTP only" in capsys.readouterr().err
    servers.update_weights(Policy())
    assert fake.version == "rlvr-1"


def test_a_server_that_stops_answering_is_dropped_and_rejoins_when_it_is_back(fakes, capsys):
    first, second = fakes(), fakes()
    servers = VLLMServers([first.url, second.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    servers.update_weights(Policy())
    port = second.server_address[1]
    second.stop()
    groups = servers.generate([[1, 2], [3, 4], [5, 6]], SamplingParams(n=2, max_tokens=4), GroupGenerators([1, 2, 3]))
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    assert len(first.completions) == 3  # its own share and the share of the server that went away
    assert servers.metrics()["vllm/servers"] == 1 and "dropped" in capsys.readouterr().err
    back = fakes(port=port)  # restarted at its address, with its starting weights
    servers.update_weights(Policy())
    assert back.version == "rlvr-2" and servers.metrics()["vllm/servers"] == 2
    assert "answers again" in capsys.readouterr().err


class LoraPolicy(torch.nn.Module):
    """A peft model as rollout/weights.weight_update sees it: it has a peft_config."""

    def __init__(self):
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.ones(2, 3))
        self.peft_config = {"default": None}  # (adapter_weights, which reads it, is replaced in the test)


def test_with_a_lora_slot_only_the_adapter_goes_and_requests_name_it(fakes, monkeypatch):
    import rlvr.rollout.weights as weights

    monkeypatch.setattr(weights, "adapter_weights", lambda m: ({"base_model.model.q_proj.lora_A.weight": m.lora_A.detach()},
                                                             {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}))
    fake = fakes(lora=True)
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    assert servers.adapters and servers.servers[0].stock["adapters"]
    policy = LoraPolicy()
    servers.update_weights(policy)
    tensors, config = fake.adapters["rlvr-policy-1"]
    assert torch.equal(tensors["base_model.model.q_proj.lora_A.weight"], torch.ones(2, 3))
    assert config["base_model_name_or_path"] == "/models/stand-in" and config["peft_type"] == "LORA"
    assert fake.weights == {} and fake.version == "rlvr-1"  # the base model untouched
    servers.generate([[1, 2]], SamplingParams(n=1, max_tokens=4), GroupGenerators([3]))
    assert fake.completions[-1]["model"] == "rlvr-policy-1"
    servers.update_weights(policy)
    assert "rlvr-policy-2" in fake.adapters and fake.calls[-1] == "/v1/unload_lora_adapter"  # the one before goes


def test_without_a_lora_slot_a_lora_policy_is_sent_merged(fakes):
    fake = fakes(lora=False)
    servers = VLLMServers([fake.url], TOKENIZER, eos_token_ids=[7], timeout=30)
    assert not servers.adapters
    servers.generate([[1, 2]], SamplingParams(n=1, max_tokens=4), GroupGenerators([3]))
    assert fake.completions[-1]["model"] == "/models/stand-in"
