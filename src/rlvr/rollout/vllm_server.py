"""`rlvr vllm-serve`: one vLLM engine behind a small HTTP server (standard library only).

    GET  /health           {"ok": true, "model": ..., "weight_updates": k}
    POST /generate         JSON {"prompt_ids", "params", "seeds"} -> {"groups": [[rollout, ...], ...]}
    POST /update_weights   safetensors bytes of Hugging Face-named weights -> {"ok": true, "tensors": n}

Requests are served one at a time (vLLM's LLM is not thread-safe), so a weight push
waits for a running generation to finish and the next generation sees the new weights.
The trainer's side is rollout/vllm.py (VLLMClient).
"""

from __future__ import annotations

import json
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer

from rlvr.rollout.vllm import engine_args, load_weights, run_generate, start_llm


class _Handler(BaseHTTPRequestHandler):
    server: "VLLMServer"

    def do_GET(self):
        if self.path != "/health":
            return self._reply(404, {"error": f"unknown path {self.path}"})
        self._reply(200, {"ok": True, "model": self.server.model_path, "weight_updates": self.server.weight_updates})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            if self.path == "/generate":
                req = json.loads(body)
                groups = run_generate(self.server.llm, req["prompt_ids"], req["params"], req["seeds"])
                return self._reply(200, {"groups": groups})
            if self.path == "/update_weights":
                from safetensors.torch import load

                weights = load(body)
                load_weights(self.server.llm, weights)
                self.server.weight_updates += 1
                return self._reply(200, {"ok": True, "tensors": len(weights)})
            self._reply(404, {"error": f"unknown path {self.path}"})
        except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
            traceback.print_exc()
            self._reply(500, {"error": f"{e.__class__.__name__}: {e}"})

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
    def __init__(self, llm, model_path: str, host: str, port: int):
        self.llm, self.model_path, self.weight_updates = llm, model_path, 0
        super().__init__((host, port), _Handler)


def serve(cfg, model_path: str) -> None:
    """Start vLLM on model_path and serve until interrupted."""
    llm = start_llm(model_path, **engine_args(cfg))
    server = VLLMServer(llm, model_path, cfg.vllm_server_host, cfg.vllm_server_port)
    print(f"rlvr vllm-serve: {model_path} on http://{cfg.vllm_server_host}:{cfg.vllm_server_port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
