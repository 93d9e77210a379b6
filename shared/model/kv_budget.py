"""KV pages from a share of GPU memory: vLLM's ``--gpu-memory-utilization`` for a moebus rank.

A rank given ``gpu_memory_utilization = u`` may use ``u x`` its GPU's total memory for everything
it holds: weights, the largest forward's activations, what CUDA, NCCL and the kernels' modules take
outside torch, and the KV cache, which gets the rest. What the rest is comes from the device, in
this order (`pages_from_memory`), after the weights are loaded and before the cache exists:

1. ``DeviceMemory.measure`` before anything is loaded (the rank's CUDA context already made):
   memory other processes (and this context) use, and what torch in this process already holds
   (nothing in a service's rank process; a test or a second runner in one process: not the
   rank's, after torch's cached free blocks are given back). A GPU whose free memory is below
   the share asked for is refused there, naming both.
2. One forward of the largest batch the rank runs (decode: ``max_batch`` sequences of one token;
   prefill: one prompt of ``max_batch_tokens``) through a throw-away cache, its activations'
   peak read from torch's allocator, counted twice: a decode rank's CUDA graphs hold a pool of
   their own beside the eager steps (a step whose page bucket has no graph), and a prefill
   batch may gather a cached prefix's K/V as well, which the profile's fresh prompt does not.
3. Memory the rank took outside torch since step 1 (NCCL's buffers, CuTeDSL modules): the
   device's used memory minus step 1's, minus what torch's allocator reserved.

Pages = (share - weights and buffers (the allocator segments holding them) - activations - outside
torch - the allocator's rounding of the cache) / bytes of a page, the same
on every rank of a group (the smallest: a prefill TP group shares page ids, and a decode group's
lockstep warm-up must take the same steps). Another process that grows on the same GPU while this
rank sizes its cache counts as this rank's "outside torch", so the cache comes out smaller than it
could be, never larger; start services that share a GPU one after the other to size them exactly.
Prompt logprobs run lm_head a slice of rows at a time and are not in the profile.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shared.kvcache import KVLayout, PagedKVCache
from shared.logging import get_logger
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk

log = get_logger(__name__)

GIB = 2**30
# torch's allocator rounds a large allocation (the cache's one tensor) up to a multiple of 2 MiB.
_CACHE_ROUNDING = 2 * 2**20


class KVBudgetError(ValueError):
    """The share of GPU memory asked for cannot hold this rank and a KV cache; the message has the figures."""


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in use before this rank loaded anything: other processes' and its CUDA context
    (``used``), and torch's segments in this process that hold live tensors (``torch_held``)."""

    device: torch.device
    total: int
    used: int
    torch_held: int = 0

    @classmethod
    def measure(cls, device: torch.device, utilization: float) -> DeviceMemory:
        """Now, on ``device``; refuses a share larger than the memory still free."""
        # Cached free blocks would count as others' memory here and then be reused by the rank (or given back by
        # the empty_cache in pages_from_memory): the cache came out up to their size too small after earlier GPU
        # tests in one process (1 GB short of a 3 GB share, one H200). Unreachable tensors are collected first:
        # freed while the rank loads, they would make its weights look smaller than they are (the cache then
        # outgrew the share in that same run).
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        if utilization * total > free:
            raise KVBudgetError(
                f"gpu_memory_utilization={utilization:g} asks for {utilization * total / GIB:.1f} GiB of {device} "
                f"({total / GIB:.1f} GiB), but only {free / GIB:.1f} GiB are free: other processes and this one's "
                f"CUDA context use {(total - free - held) / GIB:.1f} GiB, torch in this process "
                f"{held / GIB:.1f} GiB. Lower it, or give this rank another GPU")
        return cls(device, total, total - free - held, held)


def dummy_tokens(n: int, vocab: int, offset: int = 0) -> list[int]:
    """``n`` token ids spread over the vocabulary (varied routing, unlike one repeated id): the inputs of profile
    and warm-up forwards."""
    return [(offset + 7919 * i) % vocab for i in range(n)]


def activation_peak(model: Qwen3Model, page_size: int, dtype: torch.dtype, lengths: Sequence[int]) -> int:
    """Peak bytes torch allocates during one forward of fresh sequences of ``lengths`` tokens, beyond
    what was allocated before it (the weights, and the throw-away cache it writes its K/V to)."""
    c, device = model.config, model.device
    layout = KVLayout(c.num_layers, sum(-(-n // page_size) for n in lengths), model.local_kv_heads, page_size,
                      c.head_dim, dtype)
    cache = PagedKVCache(layout, device)
    chunks, first = [], 0
    for n in lengths:
        pages = layout.pages_for(n)
        chunks.append(SequenceChunk(dummy_tokens(n, c.vocab_size), 0, list(range(first, first + pages))))
        first += pages
    batch = ForwardBatch.build(chunks, page_size, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.forward(batch, cache)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def pages_from_memory(model: Qwen3Model, baseline: DeviceMemory, utilization: float, page_size: int, dtype: torch.dtype,
                      profile_lengths: Sequence[int], activation_copies: int) -> int:
    """KV pages of this rank within ``utilization`` of its GPU (module doc); every rank of a torch.distributed
    group must call it (with the same arguments) at the same point."""
    device, c = baseline.device, model.config
    peak = activation_peak(model, page_size, dtype, profile_lengths)
    torch.cuda.empty_cache()  # the profile's blocks go back to the device: the cache allocates afresh
    free, total = torch.cuda.mem_get_info(device)
    # The weights and the model's buffers as the device holds them: torch's segments, whose free space between
    # small tensors no cache page can use (counting allocated bytes instead, the cache overshot a 2.96 GB share by
    # 4 MB on one H200).
    reserved = torch.cuda.memory_reserved(device)
    persistent = max(0, reserved - baseline.torch_held)
    outside_torch = max(0, total - free - baseline.used - reserved)
    share = int(utilization * total)
    kv_bytes = share - persistent - activation_copies * peak - outside_torch - _CACHE_ROUNDING
    page_bytes = KVLayout(c.num_layers, 1, model.local_kv_heads, page_size, c.head_dim, dtype).bytes_per_token * page_size
    pages = max(0, kv_bytes // page_bytes)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([pages], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        pages = int(agreed.item())
    figures = dict(share_gib=round(share / GIB, 2), weights_gib=round(persistent / GIB, 2),
                   activations_gib=round(activation_copies * peak / GIB, 2), outside_torch_gib=round(outside_torch / GIB, 2),
                   page_mib=round(page_bytes / 2**20, 3))
    if pages < 2:  # one page for a sequence, one for the decode graphs' scratch
        raise KVBudgetError(
            f"gpu_memory_utilization={utilization:g} leaves no room for a KV cache on {device}: of its "
            f"{figures['share_gib']} GiB share the weights and buffers take {figures['weights_gib']}, "
            f"activations {figures['activations_gib']} and memory outside torch {figures['outside_torch_gib']} GiB "
            f"(a page is {figures['page_mib']} MiB); raise it")
    log.info("kv_pages_from_memory", pages=pages, tokens=pages * page_size, utilization=utilization, **figures)
    return pages
