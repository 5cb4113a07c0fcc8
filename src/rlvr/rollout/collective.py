"""Weights over torch.distributed (vllm_weight_transfer=collective): the trainer's rank 0 and every
`rlvr vllm-serve` form a process group of their own, and each update is one broadcast per tensor.

Joining.  Rank 0 hosts a TCPStore on a free port, at its address on the route to the first server,
and asks each server over HTTP to join as rank 1..n (POST /join_weight_group, in threads: building
a group blocks until every member is there).  The group is built on that store directly
(ProcessGroupGloo / ProcessGroupNCCL), not with init_process_group: under torchrun the trainer
already has its default group, and this one has other members.  NCCL when the trainer's weights
are on a GPU, else gloo.  A first broadcast of one number checks that the group works (NCCL
connects lazily, at its first collective).

Each update.  The weight stream's header (rollout/weights.py `describe`: names, dtypes, shapes,
version, adapter config) goes to every server (POST /receive_weights, in threads: each answers
once it has loaded the update), then rank 0 broadcasts the tensors in the header's order; a server
receives each into an empty tensor on its device and hands the (name, tensor) pairs to its engine
as they arrive.  One copy leaves the trainer.

Failure.  Every wait is bounded by vllm_server_timeout, the group's timeout.  When joining or an
update fails, the trainer (rollout/vllm_client.py) says so on stderr and sends the weights over
HTTP for the rest of the run.  A server whose receive fails (the trainer gone mid-broadcast, a
timeout) answers an error, leaves the group and serves again.  A group's members are the servers
alive when it was built; when they change (one dropped, one back, one restarted) it is built again.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from rlvr.errors import VLLMError
from rlvr.rollout.weights import WeightUpdate, describe, entry_dtype


def new_group(store, rank: int, size: int, backend: str, timeout: float):
    """A process group of `size` members on `store`, beside torch.distributed's default group."""
    limit = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        # A wait past the timeout raises in the waiting thread, instead of NCCL's watchdog ending the process.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, limit)


def broadcast(group, tensor: torch.Tensor, timeout: float) -> None:
    """Rank 0's `tensor` into every member's, waiting at most `timeout` seconds."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = datetime.timedelta(seconds=timeout)
    group.broadcast([tensor], options).wait()


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (no packet is sent): where the servers reach the trainer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


class WeightGroup:
    """The trainer's end: rank 0 of a group with `servers` (vllm_client.Server) as ranks 1..n."""

    def __init__(self, servers: list, device: torch.device, timeout: float):
        self.servers, self.device, self.timeout = list(servers), device, timeout
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.name = uuid.uuid4().hex[:16]
        for s in self.servers:
            if "weight_group" not in s.call("GET", "/health", timeout=min(5.0, timeout)):
                raise VLLMError(f"vLLM server {s.url} cannot join a weight group (an older rlvr?)")
        host = route_address(self.servers[0].host, self.servers[0].port)
        store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
        join = {"store": f"{host}:{store.port}", "name": self.name, "world_size": len(self.servers) + 1,
                "backend": self.backend, "timeout": timeout}
        with ThreadPoolExecutor(len(self.servers)) as pool:
            calls = [pool.submit(s.call, "POST", "/join_weight_group", {**join, "rank": rank}, timeout + 30)
                     for rank, s in enumerate(self.servers, start=1)]
            errors = {}
            try:
                self.group = new_group(dist.PrefixStore(self.name, store), 0, len(self.servers) + 1, self.backend, timeout)
                broadcast(self.group, torch.zeros(1, device=device), timeout)
            except RuntimeError as e:
                errors["the trainer"] = str(e).splitlines()[0]
            errors.update(_failures(self.servers, calls))  # every server's answer, so none is still joining after this
        self.store = store  # the servers' connection to the group: kept as long as the group
        if errors:
            raise VLLMError("could not form the weight group: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))

    def serves(self, servers: list) -> bool:
        """Whether `servers` are this group's members, each still in it (a restarted one is not)."""
        if [s.url for s in servers] != [s.url for s in self.servers]:
            return False
        try:
            return all(s.call("GET", "/health", timeout=min(5.0, self.timeout)).get("weight_group") == self.name
                       for s in servers)
        except VLLMError:
            return False

    def send(self, update: WeightUpdate, dtype: torch.dtype) -> int:
        """Every server loads `update`; returns the bytes broadcast (one copy)."""
        header = describe(update, dtype)
        sent, errors = 0, {}
        with ThreadPoolExecutor(len(self.servers)) as pool:
            calls = [pool.submit(s.call, "POST", "/receive_weights", {"group": self.name, **header}, self.timeout + 30)
                     for s in self.servers]
            try:
                for entry in header["tensors"]:
                    tensor = update.value(entry["name"]).detach().to(self.device, entry_dtype(entry)).contiguous()
                    broadcast(self.group, tensor, self.timeout)
                    sent += tensor.numel() * tensor.element_size()
            except RuntimeError as e:
                errors["the trainer's broadcast"] = str(e).splitlines()[0]
            errors.update(_failures(self.servers, calls))
        if errors:
            raise VLLMError("the weight broadcast failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
        return sent


def _failures(servers: list, calls: list) -> dict[str, str]:
    errors = {}
    for s, call in zip(servers, calls):
        try:
            call.result()
        except VLLMError as e:
            errors[s.url] = str(e)
    return errors


class Member:
    """A server's end of the group, as POST /join_weight_group asks: {"store": "host:port", "name",
    "rank", "world_size", "backend", "timeout"}."""

    def __init__(self, join: dict):
        self.name, self.timeout = join["name"], float(join["timeout"])
        host, _, port = join["store"].rpartition(":")
        self.store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=self.timeout))
        self.device = torch.device("cuda", torch.cuda.current_device()) if join["backend"] == "nccl" else torch.device("cpu")
        self.group = new_group(dist.PrefixStore(self.name, self.store), join["rank"], join["world_size"],
                               join["backend"], self.timeout)
        broadcast(self.group, torch.zeros(1, device=self.device), self.timeout)

    def receive(self, entries: list[dict]):
        """(name, tensor) pairs, each tensor received as the trainer broadcasts it."""
        for entry in entries:
            tensor = torch.empty(entry["shape"], dtype=entry_dtype(entry), device=self.device)
            broadcast(self.group, tensor, self.timeout)
            yield entry["name"], tensor


def join(server, request: dict) -> dict:
    """POST /join_weight_group on `server` (vllm_server.VLLMServer): leave any group held, join this one."""
    server.weight_group = None
    server.weight_group = Member(request)
    return {"ok": True, "group": server.weight_group.name}


def receive(server, request: dict) -> dict:
    """POST /receive_weights: the header of an update whose tensors the trainer broadcasts now."""
    member = server.weight_group
    if member is None or member.name != request.get("group"):
        raise VLLMError(f"this server is not in weight group {request.get('group')}; the trainer must ask it to join again")
    pairs = member.receive(request["tensors"])
    try:
        count = server.engine.load(request["meta"], pairs)
        for _ in pairs:  # an engine that stopped early: still take every broadcast, so the trainer does not wait
            pass
    except Exception:
        server.weight_group = None  # a broken group is left; the trainer builds another or sends over HTTP
        raise
    server.weight_updates += 1
    return {"ok": True, "tensors": count, "version": server.engine.version}
