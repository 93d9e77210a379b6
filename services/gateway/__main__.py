"""`moebus gateway` / `python -m services.gateway`."""

from __future__ import annotations

import asyncio
import sys

from services.common import parse_settings, stop_event
from services.gateway.admission import Admission, ModelInfo
from services.gateway.service import Gateway
from shared.bus import connect
from shared.logging import get_logger
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

log = get_logger(__name__)


async def serve(settings: GatewaySettings) -> None:
    stop = stop_event()
    tokenizer = Tokenizer.from_dir(settings.model)
    admission = Admission(settings, ModelInfo.load(settings), tokenizer)
    async with connect(settings.nats_url, f"gateway-{settings.instance}", connect_timeout=settings.connect_timeout_s, drain_timeout=settings.drain_timeout_s) as bus:
        gateway = Gateway(settings, bus, admission, tokenizer)
        await gateway.start()
        log.info("gateway_ready", model=settings.model_name)
        await stop.wait()
        log.info("gateway_draining", in_flight=len(gateway.flights))
        await gateway.drain()
    log.info("gateway_stopped")


def main(argv: list[str]) -> int:
    settings = parse_settings("gateway", argv, needs_model="the gateway tokenizes")
    assert isinstance(settings, GatewaySettings)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
