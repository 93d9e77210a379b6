"""`services.openai.server._unless_ended` when the task of its connection is cancelled: the answer
ends with it and the cancel is raised, once the answer ended.

At stop, `http.Server.drain` cuts the requests that outlast its timeout (their answers are
cancelled, then end with a 503) and, `CUT_S` later, cancels the connections still running. A
handler still waiting then for its cut answer to end handed that cancel on to the answer with a
plain ``await``, took the answer's CancelledError for the answer's own and swallowed it: the
handler went on as if only cut (cancelling its choices at the stack, writing its 503) past the
stop's last resort. And a cancel while the answer ran left the answer running, awaited by nobody.

A real `http.Server` on a real socket and the frontend's own `_unless_ended`; the answer is a
stand-in whose end takes four times `CUT_S` (a pure control-flow contract: what the answer does
is beside the point)."""

from __future__ import annotations

import asyncio

from services import http
from services.openai.server import _unless_ended

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"


class Scene:
    """A server whose one handler answers with a stand-in that, cancelled, takes 4 x `CUT_S` to end
    unless cancelled again."""

    def __init__(self) -> None:
        self.outcome: list[object] = []  # what _unless_ended returned, or "cancelled"
        self.answering = asyncio.Event()
        self.answer_ending = asyncio.Event()  # the answer was cancelled and is in its (slow) end
        self.answer_ended = False
        self.server = http.Server(self.handle, http.KeepAlive(5.0, 100), send_timeout_s=30.0)

    async def answer(self) -> int:
        self.answering.set()
        try:
            await asyncio.sleep(3600)  # a request outlasting the drain
        finally:
            self.answer_ending.set()
            try:
                await asyncio.sleep(4 * http.CUT_S)  # its end, e.g. a cancel at a stack slow to answer
            finally:
                self.answer_ended = True
        return 200

    async def handle(self, conn: http.Connection) -> None:
        await http.read_request(conn, 1 << 10)
        try:
            self.outcome.append(await _unless_ended(conn, self.answer()))
        except asyncio.CancelledError:
            self.outcome.append("cancelled")
            raise

    async def connect(self) -> tuple[asyncio.Server, asyncio.StreamWriter]:
        listening = await asyncio.get_running_loop().create_server(self.server.protocol, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await self.answering.wait()
        return listening, writer


def test_the_drains_last_cancel_of_a_cut_request_still_ending_is_raised() -> None:
    async def go() -> Scene:
        scene = Scene()
        listening, writer = await scene.connect()
        listening.close()
        await scene.server.drain(0.05)  # cut at 0.05 s; the answer's end outlasts CUT_S: the connection is cancelled
        writer.close()
        return scene

    scene = asyncio.run(go())
    assert scene.answer_ended
    assert scene.outcome == ["cancelled"], f"the handler went on as if only cut: {scene.outcome}"


def test_a_cancel_while_the_answer_runs_ends_the_answer_before_it_is_raised() -> None:
    async def go() -> tuple[Scene, bool]:
        scene = Scene()
        listening, writer = await scene.connect()
        [task] = scene.server.connections.values()
        task.cancel()
        ending = asyncio.ensure_future(scene.answer_ending.wait())
        await asyncio.wait({task, ending}, return_when=asyncio.FIRST_COMPLETED)
        answer_cancelled_first = ending.done() and not task.done()
        task.cancel()  # the stand-in answer's end takes a second cancel
        await asyncio.wait({task}, timeout=10.0)
        ending.cancel()
        listening.close()
        writer.close()
        return scene, answer_cancelled_first

    scene, answer_cancelled_first = asyncio.run(go())
    assert answer_cancelled_first, "the connection's task ended with its answer still running, awaited by nobody"
    assert scene.answer_ended
    assert scene.outcome == ["cancelled"], scene.outcome
