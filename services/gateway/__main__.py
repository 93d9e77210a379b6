"""`moebus gateway` / `python -m services.gateway`."""

from __future__ import annotations

import asyncio
import sys

from services.common import freeze_startup_heap, parse_settings, stop_event
from services.gateway.admission import Admission, ModelInfo
from services.gateway.chat_template import gateway_tokenizer
from services.gateway.service import Gateway
from shared.bus import connect
from shared.logging import get_logger
from shared.model.config import ConfigError
from shared.model.tokenizer import Tokenizer, TokenizerFilesError
from shared.settings import GatewaySettings, SettingsError

log = get_logger(__name__)


async def serve(settings: GatewaySettings, model: ModelInfo, tokenizer: Tokenizer) -> None:
    stop = stop_event()
    freeze_startup_heap()
    admission = Admission(settings, model, tokenizer)
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
    # Before NATS is dialled: a checkpoint without a readable tokenizer (or generation_config.json), or a
    # chat_template that cannot be read or compiled, is a usage error naming it, not a traceback.
    try:
        tokenizer = gateway_tokenizer(settings)
        model = ModelInfo.load(settings)
    except SettingsError as e:  # the chat_template setting's template
        print(f"moebus gateway: error: {e}", file=sys.stderr)
        return 2
    except (TokenizerFilesError, ConfigError) as e:
        print(f"moebus gateway: error: model {settings.model!r} cannot be served: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(settings, model, tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
