"""`moebus scheduler` / `python -m services.scheduler`."""

from __future__ import annotations

import asyncio
import sys

from services.common import freeze_startup_heap, parse_settings, stop_event
from services.scheduler.service import Scheduler
from shared.bus import connect
from shared.logging import get_logger
from shared.settings import SchedulerSettings

log = get_logger(__name__)


async def serve(settings: SchedulerSettings) -> None:
    stop = stop_event()
    freeze_startup_heap()
    async with connect(settings.nats_url, f"scheduler-{settings.instance}", connect_timeout=settings.connect_timeout_s, drain_timeout=settings.drain_timeout_s) as bus:
        scheduler = Scheduler(settings, bus)
        await scheduler.start()
        log.info("scheduler_ready")
        await stop.wait()
        log.info("scheduler_draining", waiting=len(scheduler.queue))
        await scheduler.stop()
    log.info("scheduler_stopped", placed=scheduler.placed)


def main(argv: list[str]) -> int:
    settings = parse_settings("scheduler", argv)
    assert isinstance(settings, SchedulerSettings)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
