"""`llm.tokenize` and `llm.detokenize`: the gateway's tokenizer and chat template as a service
(vLLM's ``/tokenize`` and ``/detokenize``, which `moebus openai` serves through them).

A prompt is tokenized by `Admission.prompt_ids`, the path of `llm.generate`'s admission, so the
ids and their count are those a completion of the same prompt or chat is fed (and reports as its
``usage.prompt_tokens``). Text is decoded with its special tokens, as vLLM's ``/detokenize`` gives
it. Like admission, a long prompt (or many ids, or a chat) is handled on a worker thread, so the
gateway keeps relaying tokens meanwhile. Neither is a generation request: they are not counted in
the gateway's request statistics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg

from schemas.api import DetokenizeRequest, DetokenizeResponse, ErrorCode, ErrorInfo, ErrorReply, TokenizeRequest, TokenizeResponse
from services.gateway.admission import Admission, Rejected, cheap
from shared.bus import Bus, PayloadTooLarge, content_type, decode_public, encode_public
from shared.logging import get_logger

log = get_logger(__name__)

Req = TypeVar("Req", TokenizeRequest, DetokenizeRequest)


class Tokenization:
    """Answers `llm.tokenize` and `llm.detokenize` with ``admission``'s tokenizer and model."""

    def __init__(self, bus: Bus, admission: Admission) -> None:
        self.bus = bus
        self.admission = admission

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.admission.check_model(req.model)
        ids = self.admission.prompt_ids(req)
        token_strs = self.admission.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.admission.model.max_context, tokens=ids, token_strs=token_strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``req.tokens``; ids the tokenizer does not know are refused by name (its
        decoder would drop them silently, and a padded vocabulary's extra ids have no text)."""
        self.admission.check_model(req.model)
        vocab = self.admission.tokenizer.vocab_size
        outside = [t for t in req.tokens if not 0 <= t < vocab]
        if outside:
            raise Rejected("invalid_request", f"tokens: {outside[:5]} outside the tokenizer's vocabulary [0, {vocab})"
                                              + (f" ({len(outside)} in all)" if len(outside) > 5 else ""))
        return DetokenizeResponse(prompt=self.admission.tokenizer.decode(req.tokens))

    async def on_tokenize(self, msg: Msg) -> None:
        await self._answer(msg, TokenizeRequest, self.tokenize, lambda req: cheap(req.prompt))

    async def on_detokenize(self, msg: Msg) -> None:
        await self._answer(msg, DetokenizeRequest, self.detokenize, lambda req: cheap(req.tokens))

    async def _answer(self, msg: Msg, kind: type[Req], serve: Callable[[Req], Any], inline: Callable[[Req], bool]) -> None:
        """Decode ``msg`` as ``kind``, answer ``serve(req)`` (on a worker thread unless ``inline(req)``),
        or an `ErrorReply` with the code `llm.generate` gives for the same fault."""
        if not msg.reply:
            return  # published without a reply subject: nobody to answer
        ctype = content_type(msg)
        try:
            req = decode_public(msg.data, kind, ctype)
            answer = serve(req) if inline(req) else await asyncio.to_thread(serve, req)
        except msgspec.ValidationError as e:
            answer = self._refused(msg, "invalid_request", str(e))
        except msgspec.DecodeError as e:
            answer = self._refused(msg, "invalid_request", f"malformed {ctype.split('/')[-1]}: {e}")
        except Rejected as e:
            answer = self._refused(msg, e.code, str(e))
        except Exception as e:  # noqa: BLE001 - a bug: the client still gets an answer
            log.exception("tokenizer_request_failed", subject=msg.subject)
            answer = ErrorReply(error=ErrorInfo("internal", f"{type(e).__name__}: {e}"))
        try:
            await self.bus.publish(msg.reply, encode_public(answer, ctype))
        except PayloadTooLarge as e:  # e.g. the ids of a prompt near the body limit: JSON ids take more bytes than the text
            why = (f"the reply is too large for the bus ({e}); send a shorter prompt, leave out return_token_strs, ask in msgpack, or "
                   "raise the NATS server's max_payload (MOEBUS_NATS_MAX_PAYLOAD, up to 64 MiB)")
            await self.bus.publish(msg.reply, encode_public(self._refused(msg, "invalid_request", why), ctype))

    @staticmethod
    def _refused(msg: Msg, code: ErrorCode, reason: str) -> ErrorReply:
        log.info("tokenizer_request_refused", subject=msg.subject, code=code, reason=reason)
        return ErrorReply(error=ErrorInfo(code, reason))
