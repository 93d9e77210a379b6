"""`moebus decode` / `python -m services.decode`: one decode instance of `dp` ranks."""

from __future__ import annotations

import asyncio
import sys

from services.common import freeze_startup_heap, parse_settings, require_bus, stop_event
from services.decode.rank import DecodeRank
from services.model_rank import check_rank_checkpoint, run_threads_on_device, run_until_stopped, start_model_rank
from services.ranks import run_group
from services.warmup import warm_up_decode
from shared.bus import connect
from shared.logging import get_logger
from shared.model.cuda_graphs import graphs_unsupported
from shared.model.runner import ModelRunner
from shared.parallel import Topology
from shared.settings import DecodeSettings
from shared.transfer import KVReceiver, TransferWorker

log = get_logger(__name__)


def run_rank(settings: DecodeSettings, rank: int, world: int, dist_port: int) -> None:
    # A decode step feeds one new token per running sequence: at most max_batch tokens per rank.
    runner = start_model_rank(settings, Topology.decode(world, rank), dist_port, max_tokens_per_rank=settings.max_batch)
    use_cuda_graphs(runner, settings)
    if settings.warmup:
        warm_up_decode(runner, settings, world)  # before the first heartbeat: ready means compiled (and graphs captured)
    asyncio.run(_serve(settings, runner, rank, world))


def use_cuda_graphs(runner: ModelRunner, settings: DecodeSettings) -> None:
    """Decode steps as CUDA-graph replays where the setting asks and the model allows (every
    rank of an instance decides alike: same settings, checkpoint and kernel path)."""
    if not settings.cuda_graphs:
        log.info("decode_graph.off", reason="cuda_graphs setting is false")
        return
    if (reason := graphs_unsupported(runner.model)) is not None:
        log.info("decode_graph.off", reason=reason)
        return
    graphs = runner.use_decode_graphs(settings.max_batch, settings.cuda_graphs_max, log=log)
    log.info("decode_graph.on", batch_buckets=graphs.batch_buckets, page_buckets=graphs.page_buckets,
             max_graphs=settings.cuda_graphs_max, scratch_page=graphs.scratch_page)


async def _serve(settings: DecodeSettings, runner: ModelRunner, rank: int, world: int) -> None:
    run_threads_on_device(runner.cache.device)
    stop = stop_event()
    freeze_startup_heap()
    worker = await TransferWorker.create()
    receiver = KVReceiver(worker, runner.cache)
    try:
        async with connect(settings.nats_url, f"decode-{settings.instance}-{rank}", connect_timeout=settings.connect_timeout_s, drain_timeout=settings.drain_timeout_s) as bus:
            decode = DecodeRank(settings, bus, runner, receiver, rank, world)
            await decode.start()
            log.info("decode_ready", kv_pages=settings.kv_pages, max_batch=settings.max_batch, device=str(runner.cache.device))
            await run_until_stopped(decode, stop)
    finally:
        worker.close()
    log.info("decode_stopped", **(runner.decode_graphs.stats() if runner.decode_graphs is not None else {}))


def main(argv: list[str]) -> int:
    settings = parse_settings("decode", argv, needs_model="the decode ranks run the model", check_model=check_rank_checkpoint)
    assert isinstance(settings, DecodeSettings)
    require_bus("decode", settings)
    return run_group(run_rank, settings, settings.dp, settings.dist_port, settings.drain_timeout_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
