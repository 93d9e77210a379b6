"""LayerReports: senders built before, during and after a forward all get every layer once
(the forward reports from its own thread, as services/prefill/batch.py runs it), and their
KV lands exactly (real UCX worker in this process; on CUDA with the forward's events)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import KVReceiver, KVSender, LayerReports, StagingPool, kv_head_shard
from shared.transfer.shard import chunk_nbytes

from local_worker import local_worker

if not torch.cuda.is_available():
    os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_senders_attached_before_during_and_after_the_forward_all_send_every_layer(device):
    async def main():
        async with local_worker() as worker:
            layers, heads, tokens, dim = 6, 2, 19, 8
            ref = torch.randn(layers, 2, heads, tokens, dim, device=device).to(torch.bfloat16)
            decode = PagedKVCache(KVLayout(layers, 24, heads, 4, dim, torch.bfloat16), device)
            rx = KVReceiver(worker, decode, staging=StagingPool(1 << 20, 2, device), cuda_ipc=False)
            local = PagedKVCache(KVLayout(layers, 8, heads, 8, dim, torch.bfloat16), device)
            table = [6, 1, 4]
            pages, offsets = local.slots(torch.tensor(table, device=device), torch.arange(tokens, device=device))
            reports = LayerReports(torch.device(device))
            halfway, resume = threading.Event(), threading.Event()

            def forward() -> None:
                for layer in range(layers):
                    local.write(layer, pages, offsets, ref[layer, 0].transpose(0, 1), ref[layer, 1].transpose(0, 1))
                    reports.on_layer_done(layer)
                    if layer == 2:
                        halfway.set()
                        resume.wait(5.0)

            def sender(request_id: str) -> KVSender:
                desc = rx.reserve(request_id, tokens, 5.0)
                one_layer = chunk_nbytes(1, heads, tokens, dim, torch.bfloat16)
                return KVSender(worker, local, desc, table, kv_head_shard(0, 1, heads), timeout_s=5.0, chunk_bytes=one_layer)

            senders = {"before": sender("before")}
            reports.attach(senders["before"])
            running = asyncio.ensure_future(asyncio.to_thread(forward))
            await asyncio.to_thread(halfway.wait, 5.0)
            senders["during"] = sender("during")
            reports.attach(senders["during"])  # layers 0-2 replayed, 3-5 as they come
            resume.set()
            await running
            senders["after"] = sender("after")
            reports.attach(senders["after"])  # every layer replayed
            for request_id, s in senders.items():
                record = await s.finish()
                assert record.nbytes == chunk_nbytes(layers, heads, tokens, dim, torch.bfloat16), request_id
                assert [layer for group in s.layer_groups for layer in group] == list(range(layers)), (request_id, s.layer_groups)
                got = torch.tensor(await rx.wait_complete(request_id, 5.0), device=device)
                for layer in range(layers):
                    k, v = decode.read(layer, got, tokens)
                    assert torch.equal(k, ref[layer, 0]) and torch.equal(v, ref[layer, 1]), (request_id, layer)

    asyncio.run(main())
