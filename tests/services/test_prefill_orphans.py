"""The prefill leader drops the queued tasks of gateways that stopped, and runs the others.

A real `PrefillGroup` on the tiny checkpoint (CPU): heartbeats and tasks reach it as the
NATS messages its subscriptions get; time is real (heartbeat interval 0.05 s, expiry 3
intervals). Silence counts only while the leader hears its own heartbeats (`PeerLiveness`).
"""

from __future__ import annotations

import asyncio
import time

import torch
from nats.aio.msg import Msg

from schemas.internal import Heartbeat, Job, Placement, PrefillTask, SamplingSpec
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.prefill.group import PrefillGroup
from shared.bus import pack
from shared.kvcache import KVLayout, PagedKVCache
from shared.model.model import Qwen3Model
from shared.model.runner import ModelRunner
from shared.settings import PrefillSettings

INTERVAL = 0.05


def _msg(payload: object) -> Msg:
    return Msg(_client=None, subject="test", data=pack(payload))  # type: ignore[arg-type]


def _beat(role: str, instance: str, started_at: float) -> Msg:
    return _msg(Heartbeat(role=role, instance=instance, rank=0, model="tiny", version="test", started_at=started_at))


def _task(request_id: str, gateway: str, layers: int, kv_heads: int, head_dim: int) -> Msg:
    job = Job(request_id=request_id, gateway=gateway, input_ids=[1, 2, 3], max_tokens=4, sampling=SamplingSpec(0.0, 1.0, 0, None),
              stop_token_ids=[], logprobs=False, deadline=time.time() + 60)
    layout = KVTransferLayout(num_layers=layers, page_size=16, kv_heads=kv_heads, head_dim=head_dim, dtype="float32")
    descriptor = KVTransferDescriptor(worker_address=b"", request_id=request_id, transfer_id=1, page_ids=[0], num_tokens=3,
                                      layout=layout, lease_deadline_unix=time.time() + 60, max_chunk_bytes=1 << 20)
    return _msg(PrefillTask(job=job, placement=Placement(decode_instance="d", decode_rank=0, prefill_instance="p"), descriptor=descriptor))


def test_queued_tasks_of_a_stopped_or_restarted_gateway_are_dropped(tiny_model):
    model = Qwen3Model.load(tiny_model)
    c = model.config
    runner = ModelRunner(model, PagedKVCache(KVLayout(c.num_layers, 32, model.local_kv_heads, 16, c.head_dim, torch.float32)))
    settings = PrefillSettings(instance="p", heartbeat_interval_s=INTERVAL, gateway_expiry_s=3 * INTERVAL)

    async def scenario() -> tuple[int, list[str], int]:
        group = PrefillGroup(settings, runner, None, 0, 1, None)  # type: ignore[arg-type]  # the queue needs no transfer worker
        for hb in (_beat("prefill", "p", 1.0), _beat("gateway", "alive", 2.0), _beat("gateway", "dies", 3.0), _beat("gateway", "restarts", 4.0)):
            await group._on_heartbeat(hb)
        for rid, gw in (("r0", "dies"), ("r1", "alive"), ("r2", "restarts"), ("r3", "dies"), ("r4", "alive")):
            await group._on_task(_task(rid, gw, c.num_layers, c.num_kv_heads, c.head_dim))
        group._drop_orphans()
        kept_at_once = len(group.queue)  # nobody has been silent yet
        await group._on_heartbeat(_beat("gateway", "restarts", 5.0))  # a new process under the same id
        until = time.monotonic() + 6 * INTERVAL  # "dies" silent for twice its expiry while we listen
        while time.monotonic() < until:
            for hb in (_beat("prefill", "p", 1.0), _beat("gateway", "alive", 2.0), _beat("gateway", "restarts", 5.0)):
                await group._on_heartbeat(hb)
            await asyncio.sleep(INTERVAL)
        batch = await group._take_batch(None)
        assert batch is not None
        return kept_at_once, [p.task.job.request_id for p in batch], len(group.queue)

    kept_at_once, ran, left = asyncio.run(scenario())
    assert kept_at_once == 5
    assert ran == ["r1", "r4"] and left == 0
