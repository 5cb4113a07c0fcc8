"""The trainer's side of `rlvr vllm-serve` (rollout/vllm_server.py): one or several servers seen
as one sampler.

Generation.  A call's prompts are split into contiguous shares, one per server that answers, and
sent at once.  A server that refuses the connection, errs or does not answer within
vllm_server_timeout is dropped, reported on stderr and counted (metrics vllm/servers,
vllm/server_failures), and its share goes to a server still there; the call fails only when no
server is left, naming each one and what happened to it.  A group's completions depend on its
seed, not on the server (vllm_request.request_seeds), so a share sampled elsewhere is the same share.
Partial rollouts' `resume` (rollout/vllm_partial.py) sends its requests the same way.

Weights.  After each optimizer step one copy leaves the trainer: rank 0 streams the update
(rollout/weights.py) to the first server, which loads it as it arrives and relays the same bytes
to the next, and so on down the chain.  A server the chain missed gets a copy of its own; a
dropped server that answers again (a preempted node back at its address) is sent the weights and
rejoins.  Each update has a version; a server holding another version (restarted since) answers
409 to a generation, is sent the current weights, and asked again.  With several training
processes the other ranks only count the update, and all wait at a barrier until it has arrived.
With async_mode=free the producer's weight versions (`live`) are asked while a generation waits, and
a newer version is loaded into vLLM's own servers at once, paused with mode=keep (vllm_openai.push).
With LoRA, when the servers take adapters (`rlvr vllm-serve use_peft=true`), only the adapter goes.
With vllm_weight_transfer=collective the copy is a torch.distributed broadcast to every server
instead (rollout/collective.py: NCCL between GPUs), and HTTP again for the rest of the run if it fails.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from rlvr import distributed
from rlvr.config import VLLMSettings
from rlvr.errors import StaleWeights, VLLMError
from rlvr.rollout import SamplingParams, pad_token_id, vllm_openai, vllm_partial
from rlvr.rollout.vllm_request import check_prompts, for_prompts, params_dict, request_seeds
from rlvr.rollout.weights import Relay, encode, weight_update, wire_dtype
from rlvr.types import Rollout


def server_urls(vllm: VLLMSettings) -> list[str]:
    """Where the trainer finds `rlvr vllm-serve`: vllm_server_base_url (one URL, or several separated
    by commas), else vllm_server_host (one host or several, each host or host:port) and
    vllm_server_port.  A server listening on every address, 0.0.0.0, is reached locally."""
    if vllm.vllm_server_base_url:
        return [u.strip().rstrip("/") for u in vllm.vllm_server_base_url.split(",") if u.strip()]
    urls = []
    for host in [h.strip() for h in vllm.vllm_server_host.split(",") if h.strip()] or ["0.0.0.0"]:
        name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
        name = name or host
        name = "127.0.0.1" if name in ("0.0.0.0", "") else name
        if port and not port.isdigit():
            raise VLLMError(f"vllm_server_host: {host!r} is not host or host:port")
        port = int(port) if port else vllm.vllm_server_port
        if port == 0:
            raise VLLMError(f"the trainer needs the port of `rlvr vllm-serve` on {name}: vllm_server_port=0 (any free port) "
                            "is for the server, which prints the port it took; pass that port, or vllm_server_base_url")
        urls.append(f"http://{name}:{port}")
    return urls


class Server:
    """One `rlvr vllm-serve` and the HTTP calls to it; every call waits at most `timeout` seconds."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.https = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), parts.scheme == "https"
        self.failure: str | None = None  # why it was dropped, while it is
        self.stock: dict | None = None  # vLLM's own server: what rollout/vllm_openai.describe found; None: rlvr's

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout or self.timeout)

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None, data: bytes | None = None) -> dict:
        """`body` as JSON, or `data`: JSON already encoded."""
        data = data if body is None else json.dumps(body).encode()
        try:
            conn = self.connect(timeout)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            return self.reply(conn, path)
        except (OSError, http.client.HTTPException) as e:
            raise VLLMError(f"vLLM server {self.url}{path}: {e or type(e).__name__} (waited at most {timeout or self.timeout:g} s)") from None

    def push(self, update, dtype: torch.dtype, forward: list[str]) -> dict:
        """Stream a weight update here, for this server to relay down `forward`."""
        total, pieces = encode(update, dtype)
        try:
            conn = self.start_push(total, forward)
            for piece in pieces:
                conn.send(piece)
            return self.reply(conn, "/update_weights")
        except (OSError, http.client.HTTPException) as e:
            raise VLLMError(f"vLLM server {self.url}/update_weights: {e or type(e).__name__}") from None

    def start_push(self, length: int, forward: list[str]) -> http.client.HTTPConnection:
        """A POST /update_weights of `length` bytes whose headers are sent: the body follows with conn.send."""
        conn = self.connect()
        conn.putrequest("POST", "/update_weights")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(length))
        conn.putheader("X-Rlvr-Forward", ",".join(forward))
        conn.endheaders()
        return conn

    def reply(self, conn, path: str) -> dict:
        """The JSON answer to a request sent on `conn`; StaleWeights on 409, VLLMError on any other failure."""
        try:
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        if resp.status == 409:
            raise StaleWeights(json.loads(payload).get("error", "stale weights"))
        if resp.status != 200:
            raise VLLMError(f"vLLM server {self.url}{path} failed ({resp.status}): {payload.decode(errors='replace')[:2000]}")
        return json.loads(payload) if payload.strip() else {}  # vLLM's /health and some of its routes answer with no body


class VLLMServers:
    """One or several `rlvr vllm-serve` as one sampler, and a weight subscriber of the trainer."""

    seeds_per_group = True  # takes the per-group streams (RolloutStage._streams)
    # async_mode=free: the producer's rollout.producer.WeightVersions, asked while a generation's requests are
    # out whether newer weights were published; they are then loaded into vLLM's own servers at once (an
    # in-flight update: reloads_in_flight).  None: the weights do not change during a call.
    live = None
    POLL_SECONDS = 0.05  # how often a generation's wait asks `live`
    # Loads come from another thread than the generation's (several processes free-running: the trainers load,
    # rank 0's producer samples), so a generation may start during one: vLLM's own servers are paused for each.
    pause_every_load = False

    @property
    def reloads_in_flight(self) -> bool:
        """Whether newer weights may be loaded while requests are decoded: vLLM's own servers pause with
        mode=keep for it; rlvr's own server answers one call at a time, so its loads wait for the generation."""
        return bool(self.alive) and all(s.stock is not None for s in self.alive)

    def __init__(self, urls: list[str], tokenizer, eos_token_ids: list[int], timeout: float = 240.0,
                 world: distributed.World = distributed.SINGLE, transfer: str = "http"):
        self.servers = [Server(u, timeout) for u in urls]
        self.transfer, self.group = transfer, None  # vllm_weight_transfer; rollout/collective.WeightGroup once built
        self.timeout, self.world = timeout, world
        self.eos, self.tokenizer = list(eos_token_ids), tokenizer
        self.pad_id = pad_token_id(tokenizer, self.eos)
        self.version = 0
        self.failures = 0  # servers dropped since the start
        self.last_sync: tuple[int, float] = (0, 0.0)  # bytes and seconds of the last weight update sent
        self._update = None  # the last weight update, to send to a server that restarted since (none from shards)
        self._adapter = False  # whether the servers hold the policy as an adapter (the last update was one)
        self._decoding = False  # a generation's requests are out (a load now is an in-flight one)
        infos = self._wait_ready()
        self.dtype = wire_dtype(infos[0].get("dtype", "float32"))
        self.adapters = all(i.get("adapters") for i in infos)
        if self.transfer == "collective" and any(s.stock is not None for s in self.servers):
            print("rlvr: vllm_weight_transfer=collective: vLLM's own server takes rlvr's weights over HTTP only "
                  "(rollout/vllm_transfer.py); they go over HTTP", file=sys.stderr, flush=True)
            self.transfer = "http"

    @property
    def alive(self) -> list[Server]:
        return [s for s in self.servers if s.failure is None]

    def _wait_ready(self) -> list[dict]:
        """Every server's /health, each polled until it answers or `timeout` has passed; the run goes on
        with those that answered (the others are reported, and sent the weights once they answer)."""
        deadline = time.monotonic() + self.timeout
        infos = {}
        while True:
            for s in self.servers:
                if s.url not in infos:
                    try:
                        info = s.call("GET", "/health", timeout=min(5.0, self.timeout))
                    except VLLMError as e:
                        s.failure = str(e)
                    else:
                        if "model" not in info:  # vLLM's own server, whose /health has no body (a clear error if it cannot take weights)
                            info = s.stock = vllm_openai.describe(s)
                        infos[s.url], s.failure = info, None
            if len(infos) == len(self.servers) or time.monotonic() + 1.0 > deadline:
                break
            time.sleep(1.0)
        if not infos:
            raise VLLMError(
                f"no vLLM server answered at {', '.join(s.url for s in self.servers)} within vllm_server_timeout="
                f"{self.timeout:g} s; start one with `rlvr vllm-serve model=<the same model> vllm_server_port=<port>` "
                "(or use vllm_mode=colocate)")
        for s in self.servers:
            if s.url not in infos:
                self._drop(s, s.failure or "no answer", share=0)
        return [infos[s.url] for s in self.servers if s.url in infos]

    # --- generation ---------------------------------------------------------------------------

    def generate(self, prompt_ids, params: SamplingParams, generator=None) -> list[list[Rollout]]:
        check_prompts(prompt_ids)
        groups = self._sample(prompt_ids, params_dict(params, self.eos), request_seeds(len(prompt_ids), generator))
        return [[Rollout(**r) for r in group] for group in groups]

    def resume(self, partials: list[Rollout], params: SamplingParams, generator=None) -> list[Rollout]:
        """Partial rollouts: each partly sampled completion goes on for at most params.round_tokens more
        tokens (rollout/vllm_partial.py), its request sent as generate's are (split over the servers, moved
        to another when one is dropped, the adapter named)."""
        return vllm_partial.resume(self._sample, partials, params, generator, self.eos, self.tokenizer)

    def _sample(self, prompt_ids: list[list[int]], params: dict, seeds: list[int]) -> list[list[dict]]:
        """Per prompt, its completions as dicts (Rollout's fields): the prompts split over the servers that
        answer, newer weights loaded into vLLM's own servers while the requests are out (see `live`)."""
        adapter = self._adapter
        body = {"version": self.version,
                "adapter": vllm_openai.adapter_name(self.version) if adapter else None}  # (rlvr's server ignores it)
        alive = self.alive
        if not alive:
            raise self._none_left()
        shares = [s.tolist() for s in torch.tensor_split(torch.arange(len(prompt_ids)), len(alive)) if len(s)]
        groups: list = [None] * len(prompt_ids)

        def run(share: list[int], server: Server):
            while True:
                try:
                    part = self._generate_on(server, {**body, "prompt_ids": [list(prompt_ids[i]) for i in share],
                                                      "params": for_prompts(params, share), "seeds": [seeds[i] for i in share]})
                    break
                except VLLMError as e:
                    self._drop(server, str(e), share=len(share))
                    if not self.alive:
                        raise self._none_left() from None
                    server = self.alive[share[0] % len(self.alive)]
            for i, group in zip(share, part):
                groups[i] = group

        clock = self.live if self.reloads_in_flight else None
        with ThreadPoolExecutor(len(shares)) as pool:
            futures = [pool.submit(run, share, alive[k]) for k, share in enumerate(shares)]
            self._decoding = True
            try:
                while clock is not None and wait(futures, timeout=self.POLL_SECONDS, return_when=FIRST_EXCEPTION).not_done:
                    clock.refresh()  # newer weights published: loaded now, the requests paused meanwhile (in_flight)
            finally:
                self._decoding = False
            for future in futures:
                future.result()
        return groups

    def _generate_on(self, server: Server, body: dict) -> list:
        try:
            return self._ask(server, body)
        except StaleWeights as e:  # restarted since the last update: send it the current weights, then ask again
            if self._update is None:  # none yet, or fsdp's: only every rank together can gather its shards
                raise VLLMError(f"{e}; it is sent the weights at the next update") from None
            self._push_to([server], self._update)
            return self._ask(server, body)

    def _ask(self, server: Server, body: dict) -> list:
        if server.stock is None:
            return server.call("POST", "/generate", body)["groups"]
        return vllm_openai.generate(server, body["adapter"] or server.stock["model"], body["prompt_ids"], body["seeds"],
                                    body["params"], body["version"])

    def _drop(self, server: Server, why: str, share: int) -> None:
        server.failure = why
        self.failures += 1
        left = ", ".join(s.url for s in self.alive) or "none"
        moved = f"; its {share} prompt(s) go to the others" if share else ""
        print(f"rlvr: vLLM server {server.url} dropped: {why}{moved} (servers left: {left})", file=sys.stderr, flush=True)

    def _none_left(self) -> VLLMError:
        return VLLMError("no vLLM server is left: " + "; ".join(f"{s.url}: {s.failure}" for s in self.servers))

    # --- weights --------------------------------------------------------------------------------

    def update_weights(self, model) -> None:
        """A new version of the policy: rank 0 sends it (one copy, relayed by the servers); every
        rank then waits until it is there, so no rank samples from the old weights.  From a sharded
        model (fsdp) each tensor is gathered as rank 0 sends it, the other ranks joining (weights.Relay)."""
        self.version += 1
        update = weight_update(model, self.adapters, self.version)
        self._adapter = update.adapter is not None
        # Kept to resend (it holds the model's own tensors, no copy), but not shards: only every rank
        # together can gather them, so a restarted server waits for the next update.
        self._update = None if update.sharded else update
        relay = Relay(update, self.world) if update.sharded and self.world.enabled else None
        if relay is not None:  # every rank done with its own calls to the servers (the first health wait) before
            distributed.wait_for_all(self.world)  # rank 0's stream holds a server while the others join its gathers
        if self.world.is_main:
            t0 = time.perf_counter()
            if relay is not None:
                relay.lead()
            try:
                targets = self.alive + self._returned()
                sent = self._broadcast_to(targets, update) if self.transfer == "collective" and targets else None
                sent = self._push_to(targets, update) if sent is None else sent
            finally:
                if relay is not None:
                    relay.done()
            self.last_sync = (sent, time.perf_counter() - t0)
        elif relay is not None:
            relay.follow()
        distributed.wait_for_all(self.world)

    def _returned(self) -> list[Server]:
        """Dropped servers that answer again."""
        back = []
        for s in self.servers:
            if s.failure is not None:
                try:
                    s.call("GET", "/health", timeout=2.0)
                except VLLMError:
                    continue
                print(f"rlvr: vLLM server {s.url} answers again; it is sent the weights and rejoins", file=sys.stderr, flush=True)
                back.append(s)
        return back

    def _broadcast_to(self, targets: list[Server], update) -> int | None:
        """Send `update` over the weight group (built again when `targets` are not its members);
        None when that failed: this update and every later one then go over HTTP."""
        from rlvr.rollout.collective import WeightGroup

        try:
            if self.group is None or not self.group.serves(targets):
                self.group = None
                self.group = WeightGroup(targets, next(iter(update.tensors.values())).device, self.timeout)
            sent = self.group.send(update, self.dtype)
        except (RuntimeError, OSError) as e:  # VLLMError, and torch.distributed's own (a store that cannot start)
            print(f"rlvr: vllm_weight_transfer=collective failed, the weights go over HTTP for the rest of the run: {e}",
                  file=sys.stderr, flush=True)
            self.transfer, self.group = "http", None
            return None
        for s in targets:  # a returned server is back
            s.failure = None
        return sent

    def _push_to(self, targets: list[Server], update) -> int:
        """Send `update` to `targets` as a relay chain; a server the chain missed is sent its own copy,
        and one that cannot take it is dropped.  Returns the bytes that left the trainer."""
        size, sent, todo = encode(update, self.dtype)[0], 0, [s for s in targets if s.stock is None]
        for server in [s for s in targets if s.stock is not None]:  # vLLM's own servers: each its own copy, in chunks
            try:
                sent += vllm_openai.push(server, update, self.dtype, in_flight=self._decoding or self.pause_every_load)
            except VLLMError as e:
                self._drop(server, str(e), share=0)
            else:
                server.failure = None
        while todo:
            first, rest = todo[0], todo[1:]
            try:
                reply = first.push(update, self.dtype, [s.url for s in rest])
            except VLLMError as e:
                self._drop(first, str(e), share=0)
                todo = rest
                continue
            sent += size
            first.failure = None
            done = {first.url, *reply.get("updated", [])}
            for url, why in reply.get("failed", {}).items():
                print(f"rlvr: vLLM server {url} did not take the weights from the relay ({why}); sending them directly",
                      file=sys.stderr, flush=True)
            for s in rest:
                if s.url in done:
                    s.failure = None
            todo = [s for s in rest if s.url not in done]
        if not self.alive:
            raise self._none_left()
        return sent

    def metrics(self) -> dict:
        return {"vllm/servers": len(self.alive), "vllm/server_failures": self.failures,
                "vllm/weight_sync_bytes": self.last_sync[0], "vllm/weight_sync_seconds": self.last_sync[1]}

    def close(self) -> None:
        pass
