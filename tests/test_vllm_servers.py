"""Several `rlvr vllm-serve` seen as one sampler (rollout/vllm_client.py), on real HTTP servers
(rollout/vllm_server.py) whose engine is a stand-in that records what it is sent: the weight
stream and its relay, the split of prompts, a server that stops answering, one that restarts
with old weights, and none left.  These run without vLLM; tests/test_vllm.py runs the real one."""

from __future__ import annotations

import threading

import pytest
import torch

from rlvr.rollout import SamplingParams, vllm_server
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.vllm import VLLMError
from rlvr.rollout.vllm_client import VLLMServers, server_urls
from rlvr.rollout.vllm_server import VLLMServer
from rlvr.rollout.weights import WeightUpdate, decode, encode, weight_update


class RecordingEngine:
    """VLLMEngine's interface: keeps the weights it loads; a completion is [the request's seed % 1000]."""

    def __init__(self, dtype="float32"):
        self.model_path, self.dtype, self.adapters, self.version = "stand-in", dtype, False, 0
        self.weights: dict = {}
        self.prompts_seen = 0

    def load(self, meta, tensors) -> int:
        self.weights = dict(tensors)
        self.version = meta["version"]
        return len(self.weights)

    def generate(self, prompt_ids, params, seeds):
        self.prompts_seen += len(prompt_ids)
        return [[{"prompt_ids": p, "completion_ids": [s % 1000 + k], "logprobs": [-0.5], "finish_reason": "stop", "text": "x"}
                 for k in range(params["n"])] for p, s in zip(prompt_ids, seeds)]


class Running:
    """A VLLMServer on a free port, in a thread."""

    def __init__(self, engine, port: int = 0):
        self.engine = engine
        self.server = VLLMServer(engine, "127.0.0.1", port, relay_timeout=5.0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    running = [Running(RecordingEngine()) for _ in range(3)]
    yield running
    for r in running:
        try:
            r.stop()
        except OSError:
            pass


TOKENIZER = type("Tokenizer", (), {"pad_token_id": 0})()


class Policy(torch.nn.Module):
    """A model as the trainer holds it: two weights, no tied head."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"tie_word_embeddings": False})()
        self.a = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        self.b = torch.nn.Parameter(torch.tensor([0.5, -1.0]))


def test_the_weight_stream_round_trips_and_casts_to_the_engines_dtype():
    update = WeightUpdate({"a": torch.randn(3, 4), "n": torch.tensor([1, 2, 3]), "e": torch.zeros(0)}, version=7)
    total, pieces = encode(update, torch.bfloat16)
    data = b"".join(pieces)
    assert len(data) == total
    view = memoryview(data)
    pos = 0

    def read(n):
        nonlocal pos
        out = bytes(view[pos : pos + min(n, 5)])  # short reads, as a socket gives them
        pos += len(out)
        return out

    meta, tensors = decode(read)
    got = dict(tensors)
    assert meta["version"] == 7 and meta["adapter"] is None
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"], update.tensors["a"].bfloat16())
    assert got["n"].dtype == torch.long and got["n"].tolist() == [1, 2, 3]  # integers keep their type
    assert got["e"].shape == (0,)
    assert pos == total  # read to the end, nothing left over
    assert sum(t.numel() * t.element_size() for t in got.values()) == 12 * 2 + 3 * 8  # bf16 halves float32's 48 bytes


def test_one_copy_leaves_the_trainer_and_the_servers_relay_it(servers):
    pool = VLLMServers([r.url for r in servers], tokenizer=TOKENIZER, eos_token_ids=[2], timeout=5)
    model = Policy()
    pool.update_weights(model)
    for r in servers:  # every server holds the weights, version 1
        assert r.engine.version == 1
        assert torch.equal(r.engine.weights["a"], model.a.detach()) and torch.equal(r.engine.weights["b"], model.b.detach())
    stream = encode(weight_update(model, adapter_only=False, version=1), torch.float32)[0]
    assert pool.last_sync[0] == stream  # the bytes that left the trainer: one stream, not three
    assert pool.metrics()["vllm/weight_sync_bytes"] == stream and pool.metrics()["vllm/servers"] == 3


def test_prompts_are_split_over_the_servers_and_a_groups_completions_do_not_depend_on_the_split(servers):
    pool = VLLMServers([r.url for r in servers], TOKENIZER, [2], timeout=5)
    one = VLLMServers([servers[0].url], TOKENIZER, [2], timeout=5)
    pool.update_weights(Policy())
    one.update_weights(Policy())
    prompts, params = [[1, i] for i in range(7)], SamplingParams(n=2)
    groups = pool.generate(prompts, params, GroupGenerators(list(range(100, 107))))
    assert [r.engine.prompts_seen for r in servers] == [3, 2, 2]
    alone = one.generate(prompts, params, GroupGenerators(list(range(100, 107))))
    assert [[r.completion_ids for r in g] for g in groups] == [[r.completion_ids for r in g] for g in alone]
    assert [g[0].prompt_ids for g in groups] == prompts


def test_a_server_that_stops_answering_is_dropped_and_its_prompts_go_elsewhere(servers, capsys):
    pool = VLLMServers([r.url for r in servers], TOKENIZER, [2], timeout=5)
    pool.update_weights(Policy())
    prompts, params = [[1, i] for i in range(6)], SamplingParams(n=2)
    expected = pool.generate(prompts, params, GroupGenerators(list(range(6))))
    servers[1].stop()
    groups = pool.generate(prompts, params, GroupGenerators(list(range(6))))
    assert [[r.completion_ids for r in g] for g in groups] == [[r.completion_ids for r in g] for g in expected]
    assert pool.metrics()["vllm/servers"] == 2 and pool.metrics()["vllm/server_failures"] == 1
    assert f"vLLM server {servers[1].url} dropped" in capsys.readouterr().err
    # the next weight update skips it (the relay chain is rebuilt from the servers left)
    pool.update_weights(Policy())
    assert servers[0].engine.version == servers[2].engine.version == 2
    servers[0].stop()
    servers[2].stop()
    with pytest.raises(VLLMError, match="no vLLM server is left") as err:
        pool.generate(prompts, params, GroupGenerators(list(range(6))))
    assert all(r.url in str(err.value) for r in servers)


def test_a_restarted_server_gets_the_current_weights_before_it_samples(servers):
    pool = VLLMServers([servers[0].url], TOKENIZER, [2], timeout=5)
    model = Policy()
    pool.update_weights(model)
    pool.update_weights(model)
    port = servers[0].server.server_address[1]
    servers[0].stop()
    fresh = Running(RecordingEngine(), port)  # back at the same address with the weights it starts from
    try:
        groups = pool.generate([[1, 2]], SamplingParams(n=2), GroupGenerators([5]))
        assert len(groups[0]) == 2
        assert fresh.engine.version == 2 and torch.equal(fresh.engine.weights["a"], model.a.detach())
    finally:
        fresh.stop()


def test_an_update_made_of_shards_is_sent_but_not_kept(servers, tmp_path, capsys):
    """fsdp: the update's tensors are shards (with LoRA merged in, a copy of each rank's shards), which only
    every rank together can gather: they are sent, not kept to resend.  A server that restarts is told it
    gets the weights at the next update, and its prompts go to another one."""
    from torch.distributed.fsdp import fully_shard

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = Policy()
        whole = {k: v.detach().clone() for k, v in model.named_parameters()}
        fully_shard(model, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", (1,)))
        assert all(hasattr(p, "full_tensor") for p in model.parameters())
        pool = VLLMServers([servers[0].url, servers[1].url], TOKENIZER, [2], timeout=5)
        pool.update_weights(model)
        assert pool._update is None
        assert servers[0].engine.version == 1 and all(torch.equal(servers[0].engine.weights[k], whole[k]) for k in whole)
        port = servers[0].server.server_address[1]
        servers[0].stop()
        fresh = Running(RecordingEngine(), port)
        try:
            groups = pool.generate([[1, 2], [1, 3]], SamplingParams(n=2), GroupGenerators([1, 2]))
            assert [len(g) for g in groups] == [2, 2] and fresh.engine.version == 0 and fresh.engine.prompts_seen == 0
            assert "it is sent the weights at the next update" in capsys.readouterr().err
        finally:
            fresh.stop()
    finally:
        torch.distributed.destroy_process_group()


def test_a_dropped_server_that_answers_again_rejoins_at_the_next_update(servers):
    pool = VLLMServers([servers[0].url, servers[1].url], TOKENIZER, [2], timeout=5)
    pool.update_weights(Policy())
    port = servers[1].server.server_address[1]
    servers[1].stop()
    pool.generate([[1, 2], [1, 3]], SamplingParams(n=2), GroupGenerators([1, 2]))
    assert pool.metrics()["vllm/servers"] == 1
    back = Running(RecordingEngine(), port)
    try:
        pool.update_weights(Policy())
        assert back.engine.version == 2 and pool.metrics()["vllm/servers"] == 2
    finally:
        back.stop()


def test_the_relay_skips_a_server_that_is_down_in_the_middle_of_the_chain(servers):
    pool = VLLMServers([r.url for r in servers], TOKENIZER, [2], timeout=5)
    servers[1].stop()  # it went away after the pool saw it
    pool.update_weights(Policy())
    assert servers[0].engine.version == servers[2].engine.version == 1
    assert pool.metrics()["vllm/servers"] == 2


def test_no_server_at_start_is_one_clear_error():
    with pytest.raises(VLLMError, match="no vLLM server answered at http://127.0.0.1:9 within vllm_server_timeout=1 s"):
        VLLMServers(["http://127.0.0.1:9"], TOKENIZER, [2], timeout=1)


def test_server_addresses_from_the_settings():
    from rlvr.config import build_config

    assert server_urls(build_config({})) == ["http://127.0.0.1:8000"]
    cfg = build_config({"vllm_server_host": ["10.0.0.1", "10.0.0.2:8001"], "vllm_server_port": 9000})
    assert server_urls(cfg) == ["http://10.0.0.1:9000", "http://10.0.0.2:8001"]
    assert server_urls(build_config({"vllm_server_host": "a,b"})) == ["http://a:8000", "http://b:8000"]
    cfg = build_config({"vllm_server_base_url": ["http://x:1/", "https://y:2"]})
    assert server_urls(cfg) == ["http://x:1", "https://y:2"]
    from rlvr.config import ConfigError

    with pytest.raises(ConfigError, match="got 'y:2'"):
        build_config({"vllm_server_base_url": "http://x:1,y:2"})
    with pytest.raises(ConfigError, match="vllm_server_port must be a port number, 1 to 65535 .*got 70000"):
        build_config({"vllm_server_port": 70000})
    with pytest.raises(VLLMError, match="vllm_server_port=0 \\(any free port\\) is for the server"):
        server_urls(build_config({"vllm_server_port": 0}))
    assert server_urls(build_config({"vllm_server_port": 0, "vllm_server_host": "a:7"})) == ["http://a:7"]
    with pytest.raises(VLLMError, match="'a:b' is not host or host:port"):
        server_urls(build_config({"vllm_server_host": "a:b"}))


def test_vllm_serve_takes_its_port_before_loading_answers_503_meanwhile_then_serves(monkeypatch, capsys):
    """The port is the server's before vLLM starts (vLLM picks free ports for its own sockets while
    it loads, and one of them was once the port the server meant to take); a client waits through
    the 503s; a second server on the same port fails at once with the port in its message."""
    from rlvr.config import build_config
    from rlvr.rollout.vllm_client import Server

    loaded, made = threading.Event(), []

    class SlowEngine(RecordingEngine):
        def __init__(self, model_path, **_):
            assert loaded.wait(20)
            super().__init__()
            self.closed = False

        def close(self):
            self.closed = True

    listen = vllm_server.listen
    monkeypatch.setattr(vllm_server, "VLLMEngine", SlowEngine)
    monkeypatch.setattr(vllm_server, "listen", lambda *a: made.append(listen(*a)) or made[-1])
    cfg = build_config({"vllm_server_port": 0, "vllm_server_host": "127.0.0.1"})
    thread = threading.Thread(target=vllm_server.serve, args=(cfg.rollout_settings, "stand-in", {}), daemon=True)
    thread.start()
    for _ in range(100):
        if made:
            break
        thread.join(0.05)
    port = made[0].server_address[1]
    url = f"http://127.0.0.1:{port}"
    assert port != 0 and f"loading stand-in; {url} answers 503 until it is ready" in capsys.readouterr().out
    with pytest.raises(VLLMError, match="/health failed \\(503\\).*loading the model"):
        Server(url, 5).call("GET", "/health")
    with pytest.raises(VLLMError, match="/generate failed \\(503\\)"):
        Server(url, 5).call("POST", "/generate", {"prompt_ids": [[1]], "params": {}, "seeds": [0]})
    with pytest.raises(VLLMError, match=f"cannot listen on 127.0.0.1:{port}: .*vllm_server_port=<port>"):
        vllm_server.listen("127.0.0.1", port, 5.0)
    threading.Timer(1.5, loaded.set).start()
    pool = VLLMServers([url], TOKENIZER, [2], timeout=20)  # polls through the 503s
    assert pool.metrics()["vllm/servers"] == 1
    out = pool.generate([[5, 6]], SamplingParams(n=2, max_tokens=4), torch.Generator().manual_seed(0))
    assert [len(g) for g in out] == [2]
    assert f"stand-in on {url}" in capsys.readouterr().out
    made[0].shutdown()
    thread.join(10)
    assert not thread.is_alive() and made[0].engine.closed


def test_a_tied_output_layer_travels_once_and_is_loaded_under_both_names():
    from rlvr.rollout.weights import with_aliases

    model = Policy()
    model.config.tie_word_embeddings = True
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(4, 2)
    update = weight_update(model, adapter_only=False)
    assert "lm_head.weight" not in update.tensors and update.meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    loaded = dict(with_aliases(update.tensors.items(), update.meta["aliases"]))
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
    assert sorted(loaded) == ["a", "b", "lm_head.weight", "model.embed_tokens.weight"]


# --- vllm_weight_transfer=collective: a torch.distributed group (gloo here) of the trainer and the servers ---


def test_collective_transfer_broadcasts_one_copy_that_every_server_loads(servers):
    pool = VLLMServers([r.url for r in servers[:2]], TOKENIZER, [2], timeout=10, transfer="collective")
    model = Policy()
    for version in (1, 2):
        with torch.no_grad():
            model.a.add_(1.0)
        pool.update_weights(model)
        for r in servers[:2]:
            assert r.engine.version == version
            assert torch.equal(r.engine.weights["a"], model.a.detach()) and torch.equal(r.engine.weights["b"], model.b.detach())
    assert pool.transfer == "collective" and pool.group is not None  # still the group, not the HTTP fallback
    assert pool.metrics()["vllm/weight_sync_bytes"] == (6 + 2) * 4  # the float32 tensors once, not once per server
    assert [r.server.weight_updates for r in servers[:2]] == [2, 2]


class NoJoinHandler(vllm_server._Handler):
    """A server that cannot join a weight group (it answers 404, as one that cannot reach the trainer errs)."""

    def do_POST(self):
        if self.path == "/join_weight_group":
            return self._reply(404, {"error": "no weight groups here"})
        super().do_POST()


def test_a_server_that_cannot_join_the_group_makes_the_weights_go_over_http(servers, capsys):
    servers[1].stop()
    odd = VLLMServer(RecordingEngine(), "127.0.0.1", 0, relay_timeout=5.0)
    odd.RequestHandlerClass = NoJoinHandler
    threading.Thread(target=odd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    url = f"http://127.0.0.1:{odd.server_address[1]}"
    try:
        pool = VLLMServers([servers[0].url, url], TOKENIZER, [2], timeout=2, transfer="collective")
        model = Policy()
        pool.update_weights(model)  # the group waits 2 s for the missing member, then HTTP
        assert "vllm_weight_transfer=collective failed" in capsys.readouterr().err and pool.transfer == "http"
        pool.update_weights(model)
        for engine in (servers[0].engine, odd.engine):
            assert engine.version == 2 and torch.equal(engine.weights["a"], model.a.detach())
        assert pool.metrics()["vllm/servers"] == 2
    finally:
        odd.shutdown()
        odd.server_close()


def test_a_server_whose_trainer_goes_away_mid_broadcast_times_out_and_serves_again(servers):
    from rlvr.rollout.collective import WeightGroup

    pool = VLLMServers([servers[0].url], TOKENIZER, [2], timeout=2, transfer="collective")
    pool.update_weights(Policy())
    header = {"group": pool.group.name, "meta": {"version": 9}, "tensors": [{"name": "a", "dtype": "float32", "shape": [2]}]}
    with pytest.raises(VLLMError, match="Timed out|timed out|500"):  # the header came, the tensor never does
        pool.servers[0].call("POST", "/receive_weights", header, timeout=20)
    health = pool.servers[0].call("GET", "/health")
    assert health["weight_group"] is None and health["version"] == 1  # it left the group, kept its weights
    assert not pool.group.serves(pool.servers)
    pool.update_weights(Policy())  # the trainer builds a new group with it
    assert servers[0].engine.version == 2 and isinstance(pool.group, WeightGroup) and pool.transfer == "collective"
