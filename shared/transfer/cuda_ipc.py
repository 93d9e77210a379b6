"""Same-host fast path: the decode rank's KV storage shared through CUDA IPC.

The decode rank exports its whole KV storage once (``export_storage``, at receiver
start) with torch's own mechanism (``torch.multiprocessing.reductions.reduce_tensor``);
the fields travel explicitly in the descriptor (``schemas.transfer.CudaIpcExport``),
never pickled. A prefill rank on the same host (same boot id and hostname) that sees
the exporting GPU opens it once (``open_export``: ``rebuild_cuda_tensor`` on the
prefill's own GPU, so the peer memory is reached over NVLink with lazily enabled peer
access) and caches the mapping per export. The sender then writes each layer group
straight from its own KV pages into the reserved pages (``direct_write``: one copy
kernel per group, no local pack, no staging), records an interprocess event after the
writes (``landing_event``) and announces the cells with a small UCX message sent right
away; the receiver counts them landed once that event completed
(``open_landing_event``). UCX stays the cross-host path and the control channel.

Safety: the decode rank never hands pages to another request while a direct writer
may still write them.

* A sender enqueues a layer's writes as the layer is reported, on a high-priority side
  stream behind the layer's CUDA event, so they may wait there for the prefill's compute.
  It enqueues nothing once its own deadline passed (never later than the reservation's
  lease), and the copy kernel checks a deadline itself as it starts: the lease deadline
  + ``WRITE_GUARD_AFTER_LEASE_S`` on the GPU's ``%globaltimer`` (related to the host clock
  within tens of microseconds, ``kernels.kv_copy.device_time_ns``). A write that starts later
  writes nothing (and the sender fails with ``TransferTimeout``); one that started in time
  ends within milliseconds (a whole 32k-token request is ~6 GB, ~16 ms at NVLink speed),
  well inside the receiver's grace below. On failure or cancel the sender enqueues
  nothing more, waits for the writes it enqueued to run or be skipped, then sends a
  ``"stopped"`` header for its heads.
* The receiver counts a sender's cells landed when its landing event (recorded after all
  its writes) completed, but only if it sees that before the lease deadline: a write
  skipped by the guard started after the deadline, so its event completes after it, and
  skipped cells are never counted as landed.
* A receiver whose reservation may have a direct writer (it exported its storage)
  frees the pages of a cancelled / expired / failed reservation only when every head
  is quiet (all its layers landed, its sender said ``"stopped"``, or its sender sent a
  chunk over UCX: one sender per head range, one path per sender), or else at the
  lease deadline + ``receiver.DIRECT_WRITE_GRACE_S``; until then they are quarantined.
* A killed prefill: the lease expires, the pages are freed after the grace. A prefill
  killed after announcing its writes but before they ran never completes their
  landing event (its record never executes), so the cells are never counted
  landed and the request is not completed (seen on 2x H200 in
  ``tests/transfer/test_transfer_gpu.py``, writes held behind a GPU sleep).
* A killed decode: the prefill's UCX message (its one header, after the last layer)
  fails with an endpoint error (``PeerFailed``) once UCX detects the peer's death, and
  the sender stops; it never touches the mapping again (the cached mapping is dropped,
  not written). Writes it enqueued before that land in the dead process's memory. What CUDA
  does there: the importer's ``cudaIpcOpenMemHandle`` mapping keeps the exporter's
  allocation referenced by the driver until the importer closes it, so a write
  already in flight lands in memory nobody reads instead of faulting; this is driver
  behaviour we do not rely on for correctness (torch itself only warns, at the
  decode's exit, "Producer process has been terminated before all shared CUDA tensors
  released": seen on 2x H200 when the decode process ends while a prefill still holds
  its cached mapping; ``tests/transfer/test_transfer_gpu.py`` kills a decode during
  direct writes). If the decode dies after the sender's last message was buffered
  (eager sends complete locally), the sender reports success: the scheduler learns of
  the dead decode from its heartbeats.

Not offered on CPU, and not when ``MOEBUS_KV_CUDA_IPC=0`` or ``KVReceiver(cuda_ipc=False)``.
Measured on 2x H200: see README's KV transfer section and bench/results/kv_transfer.jsonl.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections import OrderedDict
from functools import cache

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from schemas.transfer import CudaIpcExport, KVTransferLayout
from shared.transfer.streams import made_event

ENV_SWITCH = "MOEBUS_KV_CUDA_IPC"
# A direct write whose kernel starts later than this after the lease deadline writes nothing
# (module doc). Below the receiver's DIRECT_WRITE_GRACE_S (2 s) by more than a write lasts and
# far above the error of the GPU clock's calibration (tens of microseconds, redone each minute).
WRITE_GUARD_AFTER_LEASE_S = 0.5
_OPENED_KEPT = 8  # mappings of distinct decode exports kept open per process
_LANDING_EVENTS = 16  # interprocess events a sending process cycles through, per device
_OPENED_EVENTS_KEPT = 256  # other processes' landing events kept open by a receiver

# Storage tensors this process exported (a sender in the same process uses them directly:
# CUDA refuses to open an IPC handle in the process that made it).
_exported: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()
_opened: OrderedDict[tuple[str, int, bytes, int], torch.Tensor] = OrderedDict()
_landing: dict[torch.device, list[tuple[torch.cuda.Event, bytes]]] = {}
_landing_next: dict[torch.device, int] = {}
_own_events: dict[bytes, torch.cuda.Event] = {}  # handle -> this process's landing event
_opened_events: OrderedDict[tuple[int, bytes], torch.cuda.Event] = OrderedDict()


class CudaIpcUnavailable(Exception):
    """The export cannot be used from here (reason in the message); fall back to UCX."""


def enabled_by_env() -> bool:
    """False when ``MOEBUS_KV_CUDA_IPC=0`` (the switch for the same-host fast path)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


@cache
def host_identity() -> str:
    """Boot id + hostname: two processes with the same identity share one kernel (and GPUs)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{f.read().strip()}/{socket.gethostname()}"


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_storage(storage: torch.Tensor) -> CudaIpcExport:
    """Export a CUDA KV storage tensor ``[layers, pages, 2, heads, page_size, head_dim]``."""
    if storage.device.type != "cuda" or not storage.is_contiguous():
        raise CudaIpcUnavailable(f"KV storage on {storage.device} (contiguous={storage.is_contiguous()}) cannot be exported")
    _, args = reduce_tensor(storage)
    (_, _, _, tensor_offset, _, _, _, handle, size_bytes, offset_bytes, _, rc_handle, rc_offset, event_handle, event_sync) = args
    _exported[bytes(handle)] = storage
    return CudaIpcExport(
        host_id=host_identity(),
        pid=os.getpid(),
        device_uuid=device_uuid(storage.device),
        num_pages=storage.shape[1],
        handle=bytes(handle),
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        tensor_offset=tensor_offset,
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=rc_offset,
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )


def open_export(export: CudaIpcExport, layout: KVTransferLayout, device: torch.device) -> torch.Tensor:
    """The decode rank's KV storage as a tensor the kernels of ``device`` write into.

    Cached per export (a few are kept). Raises ``CudaIpcUnavailable`` with the reason:
    another host, a CPU sender, the exporting GPU not visible here, the open failing.
    """
    if export.host_id != host_identity():
        raise CudaIpcUnavailable(f"decode rank is on host {export.host_id!r}, this is {host_identity()!r}")
    if device.type != "cuda":
        raise CudaIpcUnavailable(f"sender's KV is on {device}")
    key = (export.host_id, export.pid, export.handle, export.storage_offset_bytes)
    storage = _opened.get(key)
    if storage is None:
        storage = _open(export, layout, device)
        _opened[key] = storage
        while len(_opened) > _OPENED_KEPT:
            _opened.popitem(last=False)  # senders still holding it keep it mapped
    _opened.move_to_end(key)
    if storage.device != device:
        raise CudaIpcUnavailable(f"decode storage is on {storage.device} of this very process, the sender on {device}")
    return storage


def forget(export: CudaIpcExport) -> None:
    """Drop the cached mapping of an export whose process is known dead (never written again)."""
    _opened.pop((export.host_id, export.pid, export.handle, export.storage_offset_bytes), None)


def _open(export: CudaIpcExport, layout: KVTransferLayout, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, layout.dtype)
    shape = (layout.num_layers, export.num_pages, 2, layout.kv_heads, layout.page_size, layout.head_dim)
    need = (export.tensor_offset + torch.Size(shape).numel()) * dtype.itemsize
    if need > export.storage_size_bytes:
        raise CudaIpcUnavailable(f"export holds {export.storage_size_bytes} bytes, layout {shape} of {layout.dtype} needs {need}")
    if export.pid == os.getpid():
        local = _exported.get(export.handle)
        if local is None:
            raise CudaIpcUnavailable("export names this process, which did not make it")
        return local
    visible = [i for i in range(torch.cuda.device_count()) if device_uuid(i) == export.device_uuid]
    if not visible:
        raise CudaIpcUnavailable(f"decode GPU {export.device_uuid} is not visible to this process")
    stride = torch.empty(shape, device="meta").stride()
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shape), stride, export.tensor_offset, torch.UntypedStorage, dtype,
            index, export.handle, export.storage_size_bytes, export.storage_offset_bytes, False,
            export.ref_counter_handle, export.ref_counter_offset, export.event_handle, export.event_sync_required,
        )
    except (RuntimeError, OSError) as e:
        raise CudaIpcUnavailable(f"opening the CUDA IPC handle failed: {e}") from e


def landing_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """An interprocess event (and its handle) to record after a group's direct writes.

    A process cycles through a few per device instead of making one per transfer (an
    event's handle is opened once per receiving process). Every record goes on the one
    direct-write stream of the device (``streams.side_stream(device, "peer_write")``), so
    when a reused event is recorded again before a receiver looked, the receiver waits for
    the later record, whose completion implies the earlier one's (a delay of that later
    transfer's writes: a transfer records its event once, after its last layer's write, and
    a prefill rank's transfers of one batch reach their last layer together).
    """
    pool = _landing.setdefault(device, [])
    index = _landing_next.get(device, 0)
    _landing_next[device] = (index + 1) % _LANDING_EVENTS
    if index == len(pool):
        _new_landing_event(device, pool)
    return pool[index]


def prepare_landing_events(device: torch.device) -> None:
    """Make all of ``device``'s landing events now (a CUDA prefill rank's start), so no transfer
    pays an event's creation and handle export on its way to the first write."""
    pool = _landing.setdefault(device, [])
    while len(pool) < _LANDING_EVENTS:
        _new_landing_event(device, pool)


def _new_landing_event(device: torch.device, pool: list[tuple[torch.cuda.Event, bytes]]) -> None:
    event = made_event(device, interprocess=True)  # its handle exists once the driver's event does
    handle = bytes(event.ipc_handle())
    _own_events[handle] = event
    pool.append((event, handle))


def open_landing_event(handle: bytes, pid: int, device: torch.device) -> torch.cuda.Event:
    """A sender's landing event as seen from this process (cached; the process's own events
    are used directly: CUDA does not open a handle in the process that made it)."""
    if pid == os.getpid():
        own = _own_events.get(handle)
        if own is None:
            raise CudaIpcUnavailable("landing event names this process, which did not make it")
        return own
    key = (pid, handle)
    event = _opened_events.get(key)
    if event is None:
        try:
            event = torch.cuda.Event.from_ipc_handle(device, handle)
        except RuntimeError as e:
            raise CudaIpcUnavailable(f"opening the landing event of process {pid} failed: {e}") from e
        _opened_events[key] = event
        while len(_opened_events) > _OPENED_EVENTS_KEPT:
            _opened_events.popitem(last=False)
    _opened_events.move_to_end(key)
    return event
