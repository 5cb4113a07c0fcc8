"""Decoding on a CUDA GPU without launch overhead: the fast path's decode step replayed from CUDA graphs.

Why: one decode step of a 30-layer model is about 600 small kernels.  On a GPU at batch 32-256,
launching them one by one from Python takes longer than running them (an H200 decoded the default
model at about 16 ms a step at batch 32).  A CUDA graph records the step's kernels once and then
launches them all with one call.

A graph replays fixed shapes at fixed addresses, so this is llama.py's decode step with static shapes:
* The cache is the DecodeState's, preallocated by the prefill.  Rows that finish stay in it, computed
  and ignored, until the live rows fit in half as many.  Then the live rows are moved to the front
  of the cache in place, and the step runs on that prefix.  So the row counts are the first one and
  powers of two below it.
* Attention reads a window of the cache whose width is rounded up to `block` columns, masked past
  each row's last key, rather than exactly the columns in use.  Columns not yet written are zeroed
  first, so a masked column cannot carry a NaN into the output.
* The token, its position and its cache column are read from tensors that keep their address;
  they are written before each replay.
One graph is captured for each (rows, window) the first time it is needed.  All of them are dropped
with the state at the end of the generate call: the weights change between calls.

The same static step runs eagerly when graphs are off (tests compare it with llama.py's decode on the
CPU, where the sampler keeps llama.py's own decode).  If capturing fails, the sampler says so once
and decodes eagerly.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from rlvr.llama import DecodeState, LlamaRunner

log = logging.getLogger(__name__)
_FAILED: list[str] = []  # why capturing failed in this process; then no sampler tries again


class StaticDecoder:
    def __init__(self, runner: LlamaRunner, state: DecodeState, graphs: bool, block: int = 256):
        self.runner, self.state, self.block = runner, state, block
        self.graphs = graphs and not _FAILED
        self.used = state.rows  # the cache rows a step runs on: the live ones first, then finished ones
        self.tokens = torch.zeros(state.rows, dtype=torch.long, device=state.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=state.device)
        self.captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        state.k[..., state.length :].zero_()
        state.v[..., state.length :, :].zero_()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per live row -> logits of the next token [live rows, vocab].  With graphs, the
        tensor returned is the graph's output, valid until the next step."""
        state = self.state
        self.tokens[: self.used].index_copy_(0, state.active, tokens)
        self.slot.fill_(state.length)
        window = min(state.k.shape[-1], -(-(state.length + 1) // self.block) * self.block)
        logits = self._run(self.used, window)
        state.advance()  # positions += 1 in place: the graphs read the same tensor
        return logits if len(state.active) == self.used else logits[state.active]

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only `keep` (indices into the live rows, in their order) as live."""
        target = 1 << max(len(keep) - 1, 0).bit_length()  # the next power of two
        if target >= self.used:
            self.state.hold(keep)
        else:
            self.state.move_to_front(keep)
            self.used = target

    def _forward(self, rows: int, window: int) -> torch.Tensor:
        runner, state = self.runner, self.state
        x = runner.inner.embed_tokens(self.tokens[:rows]).float()
        cos, sin = runner._rope(x, state.positions[:rows])
        state.mask[:rows].index_fill_(1, self.slot, True)
        x = runner.decode_layers(x, cos, sin, state, rows, self.slot, window)
        return runner.decode_logits(x, state)

    def _run(self, rows: int, window: int) -> torch.Tensor:
        if not self.graphs:
            return self._forward(rows, window)
        key = (rows, window)
        if key not in self.captured:
            try:
                self.captured[key] = self._capture(rows, window)
            except RuntimeError as e:
                _FAILED.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
                log.warning("CUDA graphs could not be captured (%s); decoding eagerly", _FAILED[0])
                self.graphs = False
                return self._forward(rows, window)
        graph, logits = self.captured[key]
        graph.replay()
        return logits

    def _capture(self, rows: int, window: int):
        # Autocast would cache casted weights inside the graph; the fast path casts explicitly anyway.
        no_autocast = torch.autocast("cuda", enabled=False) if torch.is_autocast_enabled("cuda") else contextlib.nullcontext()
        with no_autocast:
            # A warm-up run on a side stream first (cuBLAS workspaces, the allocator), as torch's
            # documentation of CUDA graphs asks.  It writes what the replay writes.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(rows, window)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(rows, window)
        self.pool = graph.pool()
        return graph, logits
