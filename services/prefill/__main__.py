"""`moebus prefill` / `python -m services.prefill`: one prefill instance of `tp` ranks."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from services.common import freeze_startup_heap, parse_settings, require_bus, stop_event
from services.model_rank import check_rank_checkpoint, run_threads_on_device, run_until_stopped, start_model_rank
from services.prefill.group import PrefillGroup
from services.ranks import run_group
from services.warmup import warm_up_prefill
from shared.bus import connect
from shared.logging import get_logger
from shared.model.prefill_graphs import prefill_graphs_unsupported
from shared.model.runner import ModelRunner
from shared.parallel import Topology
from shared.settings import PrefillSettings
from shared.transfer import TransferWorker, prepare_direct_writes

log = get_logger(__name__)


def run_rank(settings: PrefillSettings, rank: int, world: int, dist_port: int) -> None:
    # release_finished=False: a sequence's pages stay until its KV transfer is done.
    runner = start_model_rank(settings, Topology.prefill(world, rank), dist_port, release_finished=False)
    use_cuda_graphs(runner, settings)
    if settings.warmup:
        warm_up_prefill(runner, settings)  # before the leader's first heartbeat: ready means compiled (and graphs captured)
    asyncio.run(_serve(settings, runner, rank, world))


def use_cuda_graphs(runner: ModelRunner, settings: PrefillSettings) -> None:
    """Prefill forwards as piecewise CUDA graphs where the setting asks and the model allows (every
    rank of an instance decides alike: same settings, checkpoint and kernel path)."""
    if not settings.cuda_graphs:
        log.info("prefill_graph.off", reason="cuda_graphs setting is false")
        return
    if (reason := prefill_graphs_unsupported(runner.model)) is not None:
        log.info("prefill_graph.off", reason=reason)
        return
    graphs = runner.use_prefill_graphs(min(settings.cuda_graph_max_tokens, settings.max_batch_tokens), log=log)
    log.info("prefill_graph.on", token_buckets=graphs.buckets, scratch_page=graphs.scratch_page)


async def _serve(settings: PrefillSettings, runner: ModelRunner, rank: int, world: int) -> None:
    run_threads_on_device(runner.cache.device)
    stop = stop_event()  # peers: the leader decides when the group stops
    freeze_startup_heap()
    worker = await TransferWorker.create()
    layout = runner.cache.layout
    prepare_direct_writes(runner.cache.device, layout.dtype, layout.head_dim)  # the first KV transfer compiles nothing
    try:
        async with contextlib.AsyncExitStack() as stack:
            bus = await stack.enter_async_context(connect(settings.nats_url, f"prefill-{settings.instance}", connect_timeout=settings.connect_timeout_s, drain_timeout=settings.drain_timeout_s)) if rank == 0 else None
            group = PrefillGroup(settings, runner, worker, rank, world, bus)
            if bus is not None:
                await group.start()
            log.info("prefill_ready", tp=world, device=str(runner.cache.device))
            await run_until_stopped(group, stop)
    finally:
        worker.close()
    log.info("prefill_stopped")


def main(argv: list[str]) -> int:
    settings = parse_settings("prefill", argv, needs_model="the prefill ranks run the model", check_model=check_rank_checkpoint)
    assert isinstance(settings, PrefillSettings)
    require_bus("prefill", settings)
    return run_group(run_rank, settings, settings.tp, settings.dist_port, settings.drain_timeout_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
