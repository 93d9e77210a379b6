"""A prefill forward's layer reports, fanned out to KV senders built while it runs.

A batch's senders cost ~0.2-0.4 ms each to build on a cold path (2x H200, bench/results/
kv_transfer.jsonl: opening the peer's storage, planning and uploading the page tables;
300-381 us at 6k tokens at a147946f51b4, 264-373 at f4e4232480e1, 233-361 at 0651591c0496, 187-204 at fab377215964).
Built before the forward, that time precedes the batch's compute on every request's
path; built after the forward started, it overlaps the first layers' compute.
``LayerReports`` makes the second order possible: the forward reports each layer to it
(``on_layer_done``, from the forward's thread), it records one CUDA event per layer at
that point of the forward's stream, and every sender attached later (``attach``) first
gets the layers reported so far, with their events, then the later ones as they come.
"""

from __future__ import annotations

import threading

import torch

from shared.transfer.sender import KVSender


class LayerReports:
    """Layer reports of one forward on ``device``; thread-safe."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._reported: list[tuple[int, torch.cuda.Event | None]] = []
        self._senders: list[KVSender] = []

    def on_layer_done(self, layer: int) -> None:
        """Layer ``layer``'s KV is written (or queued on the caller's current CUDA stream)."""
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        with self._lock:  # a sender attached meanwhile gets the layer exactly once
            self._reported.append((layer, event))
            for sender in self._senders:
                sender.on_layer_done(layer, event)

    def attach(self, sender: KVSender) -> None:
        """Report to ``sender`` every layer so far, then every later one."""
        with self._lock:
            for layer, event in self._reported:
                sender.on_layer_done(layer, event)
            self._senders.append(sender)
