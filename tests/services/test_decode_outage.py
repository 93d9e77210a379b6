"""A decode rank through a long NATS outage, in process: a real nats-server that is killed, a tiny
CPU model, a real KV receiver over UCX (tcp). While the server is away nats-py holds outgoing
messages in its 2 MiB outbound buffer; once that is full a publish fails. The rank must then
free the requests whose tokens could not go out (their gateways fail them on reconnect) and
keep running, not die with the error (it did: helper 56's review); and a stop (SIGTERM: `drain`)
during the outage must still end its loop: its drain sent a heartbeat that failed the same way, and
the error left the loop running and the process to die with a traceback."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.internal import Job, SamplingSpec
from services.decode.rank import DecodeRank, Running
from services.model_rank import sampling_params
from shared.bus import connect
from shared.model.runner import ModelRunner
from shared.model.tiny import make_tiny
from shared.settings import DecodeSettings
from shared.transfer import KVReceiver, TransferWorker

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_rank_transports")]

REQUESTS = 16
PROMPT = [1, 2, 3, 4]


def _job(i: int) -> Job:
    # Many top logprobs make each token message large, so the outbound buffer fills in tens of steps.
    return Job(request_id=f"r{i}", gateway="gw", input_ids=PROMPT, max_tokens=3000,
               sampling=SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, seed=i), stop_token_ids=[],
               logprobs=True, top_logprobs=20, ignore_eos=True, deadline=time.time() + 600)


def test_a_decode_rank_frees_the_requests_it_cannot_publish_and_keeps_running(tmp_path, nats_server):
    port, procs = nats_server
    model = make_tiny(tmp_path / "tiny", seed=3)
    settings = DecodeSettings(nats_url=f"nats://127.0.0.1:{port}", instance="d0", warmup=False, kv_pages=4096, max_batch=REQUESTS)

    async def scenario() -> tuple[BaseException | None, int, int, int, BaseException | None, bool]:
        async with connect(settings.nats_url, "decode-test") as bus:
            runner = ModelRunner.from_dir(model, num_pages=settings.kv_pages, page_size=settings.page_size, device="cpu")
            worker = await TransferWorker.create()
            rank = DecodeRank(settings, bus, runner, KVReceiver(worker, runner.cache), 0, 1)
            await rank.start()
            free_before = runner.cache.allocator.num_free
            for i in range(REQUESTS):  # running sequences as StartDecode leaves them (no prefill here)
                job = _job(i)
                pages = runner.cache.allocator.alloc(runner.cache.layout.pages_for(len(PROMPT) + job.max_tokens))
                seq = runner.add(job.request_id, job.input_ids, sampling_params(job), page_table=pages, num_cached=len(PROMPT), output_ids=[5])
                rank.running[job.request_id] = Running(job, seq, 0.0)
            loop = asyncio.create_task(rank.run())
            await asyncio.sleep(0.5)
            procs[0].kill()
            procs[0].wait()
            deadline = time.monotonic() + 120
            while rank.running and not loop.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)  # the loop goes on, idle
            error = loop.exception() if loop.done() else None
            left, free_after = len(rank.running), runner.cache.allocator.num_free
            drain_error = None
            try:
                await rank.drain()  # the server still away: the outbound buffer is still full
            except Exception as e:  # noqa: BLE001 - reported below
                drain_error = e
            await asyncio.wait({loop}, timeout=10.0)
            stopped = loop.done()
            loop.cancel()
            await rank.receiver.close()
            worker.close()
            return error, left, free_before, free_after, drain_error, stopped

    error, left, free_before, free_after, drain_error, stopped = asyncio.run(scenario())
    assert error is None, f"the decode loop died during the outage: {error!r}"
    assert left == 0, f"{left} requests still running although their tokens could not be published"
    assert free_after == free_before, "the freed requests' pages did not come back"
    assert drain_error is None, f"the drain failed during the outage: {drain_error!r}"
    assert stopped, "the decode loop did not end after the drain"
