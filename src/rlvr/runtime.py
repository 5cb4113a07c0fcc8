"""Process settings that make training on CPU faster.

glibc returns every large block (above 32 MB by default, adaptively) to the
operating system when it is freed, so each new activation or logits tensor of
that size is mapped afresh and page-faulted in: allocating a 100 MB tensor
then costs more than the arithmetic done on it (measured: a 25M-element fp32
multiply took 31 ms allocating its output and 4 ms writing into an existing
one).  `configure_allocator` tells glibc to serve large blocks from the heap and
keep freed memory for reuse, which is what jemalloc or tcmalloc would do.
The price is that the process keeps its peak memory until it exits; where phases
alternate between large tensors of different sizes (fsdp: the whole weights gathered to
sample, then the update), `release_free_memory` gives the kept pages back between them, and
`map_large_blocks` serves the large blocks of the phases that do not sample from their own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MAPPED_FROM = 1 << 20  # map_large_blocks(True): blocks of 1 MiB or more get their own mapping
_done = False
_libc = None  # glibc, once configure_allocator applied
_heap_when_decoding = False  # map_large_blocks(True) until the next decode loop starts (heap_from_decoding)


def configure_allocator() -> bool:
    """Keep freed memory for reuse (glibc only; elsewhere nothing happens). Returns whether it applied."""
    global _done, _libc
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        _done = False
    _libc = libc if _done else None
    return _done


def map_large_blocks(on: bool) -> bool:
    """Where configure_allocator applied: on, each block of 1 MiB or more gets its own mapping, given
    back to the system the moment it is freed; off, large blocks come from the heap again and stay
    for reuse (configure_allocator's setting).  fsdp on the CPU turns it on for the phases that run
    on the sharded model (log-probs, the update: layers gathered and freed one at a time, gradients,
    AdamW's temporaries) and off while the whole weights are gathered to sample (decoding allocates
    logits-sized blocks every token, where a fresh mapping costs more than the arithmetic).  Kept in
    the heap, the update's blocks of many sizes were freed but not reusable by the next phase, and a
    rank's peak grew past the plan by a quarter to two fifths (docs/scaling.md).  Returns whether it applied."""
    global _heap_when_decoding
    _heap_when_decoding = False
    if _libc is None:
        return False
    if on:
        return bool(_libc.mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM)) and bool(_libc.mallopt(_M_MMAP_MAX, 1 << 16))
    return bool(_libc.mallopt(_M_MMAP_MAX, 0))


def heap_from_decoding() -> None:
    """map_large_blocks(True) until the next decode loop starts (`decoding`), then off.  For fsdp's whole
    weights gathered to sample: the sampler's own copy of them built next (fused, prepacked; with LoRA
    each weight merged first, a temporary of its size) and the KV cache get mappings of their own,
    freed whole, and only the decoding's logits-sized blocks come from the heap.  Built in the heap,
    the copy's temporaries left free blocks the next phases could not reuse: with LoRA a rank's
    second sampling round peaked 120 MiB above its first (docs/scaling.md)."""
    global _heap_when_decoding
    map_large_blocks(True)
    _heap_when_decoding = _libc is not None


def decoding() -> None:
    """A decode loop starts (its first token sampled next): see heap_from_decoding."""
    if _heap_when_decoding:
        map_large_blocks(False)


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system now (glibc's malloc_trim), where
    configure_allocator keeps them.  For a process whose phases hold large tensors of different
    sizes (fsdp: the whole weights while it samples, the update's gathered layers, gradients and
    optimizer state after): the memory one phase freed is mostly not reused by the next one's
    tensors, so without this the phases' peaks add up.  Returns whether it ran."""
    if _libc is None:
        return False
    try:
        _libc.malloc_trim(0)
    except AttributeError:
        return False
    return True


def slow_bf16_note(bf16: bool, device) -> str | None:
    """A line for bf16=true on a CPU that has no bf16 matmul instructions (AVX-512 BF16 or AMX), else None.

    There torch's bf16 matmul takes a slow path: on a 2-core AMD EPYC with AVX2 only, a 2048 x 2048
    bf16 matmul ran at 0.24 GFLOP/s against 58 in fp32 (one run, `a @ b` timed five times), so a
    bf16 run there is hundreds of times slower."""
    if not bf16 or str(device).split(":")[0] != "cpu":
        return None
    import torch

    try:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    except AttributeError:  # another torch: nothing to say
        return None
    if native:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"bf16=true on a CPU without bf16 matmul instructions (torch reports {capability}; no AVX-512 BF16 or AMX): "
            "bf16 matmuls here take a slow generic path, hundreds of times slower than fp32; set bf16=false")
