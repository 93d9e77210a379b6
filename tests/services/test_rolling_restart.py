"""Rolling restarts under load: every replica of a stack with two of each (gateway, scheduler,
prefill instance, decode instance) stopped with SIGTERM (its drain) and started again, one replica
of each role at a time, while clients keep sending streamed and unary requests over NATS and
through `moebus openai`. No request may fail or lose a token, the KV pages all come back, and the
gateways' logs and heartbeat counters account for exactly what the clients saw."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pytest

from schemas.api import GenerateRequest
from services.client import Client, GenerateError
from services.launch import LocalStack, Replica

from services_helpers import HeartbeatWatch, all_kv_free, frontend_address, health, log_events, run, session, stack_fixture

pytestmark = pytest.mark.slow

ROLES = ("gateway", "scheduler", "prefill", "decode")
stack = stack_fixture("single-node.yml", {**{role: 2 for role in ROLES}, "metrics": 0})

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Mixture-of-experts models route each token to"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def frontend(stack: LocalStack) -> tuple[str, int]:
    """The stack's `moebus openai` (the compose file's `openai` service, on a free port)."""
    return frontend_address(stack)


@dataclass
class Load:
    """What the clients saw: the requests answered in full, and every other outcome."""

    reference: dict[str, tuple[list[int], str]]  # prompt -> (token ids, text) of an undisturbed greedy run
    answered: list[str] = field(default_factory=list)  # request ids of complete, correct answers over NATS
    http_answered: int = 0  # complete, correct answers through `moebus openai`
    failures: list[str] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end), monotonic, of every request

    def check(self, prompt: str, token_ids: list[int], text: str, finish_reason: str | None, how: str) -> bool:
        if (token_ids, text, finish_reason) == (*self.reference[prompt], "length"):
            return True
        self.failures.append(f"{how} {prompt!r}: {finish_reason} {token_ids} {text!r}, expected {self.reference[prompt]}")
        return False


async def native_worker(client: Client, load: Load, worker: int, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        prompt, streamed = PROMPTS[(worker + n) % len(PROMPTS)], (worker + n) % 2 == 0
        n += 1
        req = GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        started = time.monotonic()
        try:
            if streamed:
                chunks = [c async for c in client.stream(req)]
                ids, text, finish, request_id = [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason, chunks[-1].request_id
            else:
                resp = await client.generate(req)
                ids, text, finish, request_id = resp.token_ids, resp.text, resp.finish_reason, resp.request_id
        except GenerateError as e:
            load.failures.append(f"{'stream' if streamed else 'unary'} {prompt!r}: {e.code}: {e.message}")
            continue
        load.spans.append((started, time.monotonic()))
        if load.check(prompt, ids, text, finish, "stream" if streamed else "unary"):
            load.answered.append(request_id)


def openai_completion(addr: tuple[str, int], prompt: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


async def health_fails(addr: tuple[str, int], within_s: float) -> tuple[int, str]:
    """`moebus openai`'s /health, asked until it fails or ``within_s`` passed: its last answer."""
    until = time.monotonic() + within_s
    while True:
        status, body = await asyncio.to_thread(health, addr)
        if status != 200 or time.monotonic() > until:
            return status, body
        await asyncio.sleep(0.05)


async def openai_worker(addr: tuple[str, int], load: Load, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        prompt = PROMPTS[n % len(PROMPTS)]
        n += 1
        started = time.monotonic()
        status, answer = await asyncio.to_thread(openai_completion, addr, prompt)
        if status != 200:
            load.failures.append(f"openai {prompt!r}: HTTP {status} {answer}")
            continue
        load.spans.append((started, time.monotonic()))
        choice = answer["choices"][0]
        # The frontend does not return token ids: the text and the token count stand for them.
        ids = load.reference[prompt][0] if answer["usage"]["completion_tokens"] == MAX_TOKENS else []
        if load.check(prompt, ids, choice["text"], choice["finish_reason"], "openai"):
            load.http_answered += 1


def serving_again(watch: HeartbeatWatch, replicas: list[Replica], since: float) -> bool:
    """Whether every replica started again heartbeats as a new process (ready: the model ranks warmed up)."""
    return all(any(hb.instance == r.instance and hb.started_at >= since and not hb.draining for hb in watch.live(r.role)) for r in replicas)


def test_rolling_restart_of_every_role_under_load_loses_no_request(stack: LocalStack, frontend: tuple[str, int]):
    """Two waves: the first replica of every role is stopped (SIGTERM), started again and serving before
    the second ones go. A drain that dropped work (a request routed to a stopping gateway, a submit to a
    stopping scheduler, a task to a stopping prefill instance, a reservation on a stopping decode rank)
    shows as a failed or incomplete answer here."""
    began = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # as the services' logs write time

    async def go() -> tuple[Load, list[int], list[float], dict[str, tuple[dict[str, int] | None, int]]]:
        async with session(stack.url) as (client, watch):
            reference = {}
            for prompt in PROMPTS:
                resp = await client.generate(GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
                reference[prompt] = (resp.token_ids, resp.text)
            load = Load(reference)
            stop = asyncio.Event()
            workers = [asyncio.ensure_future(native_worker(client, load, i, stop)) for i in range(6)]
            workers.append(asyncio.ensure_future(openai_worker(frontend, load, stop)))
            exit_codes, sigterms = [], []
            await asyncio.sleep(1.0)
            for index in (0, 1):
                victims = [r for r in stack.replicas if r.role in ROLES and r.index == index]
                sigterms.append(time.monotonic())
                exit_codes += await asyncio.gather(*(asyncio.to_thread(stack.stop_replica, r) for r in victims))
                since = time.time()
                restarted = [stack.restart_replica(r) for r in victims]
                await watch.wait_for(lambda w: serving_again(w, restarted, since), 120, f"replicas {index} serving again")
                await asyncio.sleep(1.0)  # load on the new replicas before the next wave
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 60)
            await watch.wait_for(all_kv_free, 10, "every decode rank's KV pages free")
            with contextlib.suppress(AssertionError):  # judged below, after what the clients saw
                await watch.wait_for(lambda w: counts_agree(gateway_counts(stack, w)), 5, "the gateways' counters")
            return load, exit_codes, sigterms, gateway_counts(stack, watch)

    load, exit_codes, sigterms, counted = run(go())
    assert not load.failures, f"{len(load.failures)} requests failed during the rolling restart:\n" + "\n".join(load.failures[:20])
    assert exit_codes == [0] * 8, exit_codes  # every replica drained and exited by itself, none was killed
    for sigterm in sigterms:  # the load ran through each wave's drain, not around it
        assert any(start < sigterm < end for start, end in load.spans), "no request was in flight at a SIGTERM"
    assert len(load.answered) > 20 and load.http_answered > 0, (len(load.answered), load.http_answered)
    # The gateways account for every request once: each completed one in its log (both processes of
    # each instance write to the same file), and nothing failed.
    completed = [e for e in log_events(stack, "completed") if e["timestamp"] >= began]
    served_ids = Counter(e["request_id"] for e in completed)
    assert all(served_ids[request_id] == 1 for request_id in load.answered)
    assert len(completed) == len(load.answered) + load.http_answered + len(PROMPTS), (len(completed), len(load.answered), load.http_answered)
    assert not [e for e in log_events(stack, "request_failed") if e["timestamp"] >= began]
    # Each serving gateway's heartbeat counts what its process logged, and nothing else.
    assert counts_agree(counted), counted


def gateway_counts(stack: LocalStack, watch: HeartbeatWatch) -> dict[str, tuple[dict[str, int] | None, int]]:
    """Each serving gateway's requests by outcome as its heartbeat counts them, and how many its current
    process (since its latest `gateway_ready`) logged as completed."""
    ready = {e["replica"]: e["timestamp"] for e in log_events(stack, "gateway_ready")}  # the latest per instance
    completed = Counter(e["replica"] for e in log_events(stack, "completed") if e["timestamp"] >= ready[e["replica"]])
    return {hb.instance: (hb.requests.outcomes if hb.requests else None, completed[hb.instance]) for hb in watch.live("gateway")}


def counts_agree(counts: dict[str, tuple[dict[str, int] | None, int]]) -> bool:
    return len(counts) == 2 and all(outcomes == ({"length": n} if n else {}) for outcomes, n in counts.values())


BURST = 100


def test_a_gateway_behind_on_its_socket_still_answers_every_request_routed_to_it_when_stopped(stack: LocalStack):
    """SIGTERM reaches a gateway whose queue-group subscription still has requests the server routed
    to it but the process has not read (here: it was stopped for 1 s, as a busy event loop would
    lag). Its drain must answer them: before, it unsubscribed, which discards such messages, and
    each of those clients waited for an answer nobody was writing (30-40 of these 100 requests failed
    `unavailable` once the client's keepalive wait ran out)."""
    victim = next(r for r in stack.replicas if r.role == "gateway" and r.index == 0)

    async def go() -> tuple[Counter[str], list[str], int]:
        async with session(stack.url) as (client, watch):
            outcomes: Counter[str] = Counter()
            errors: list[str] = []

            async def one(i: int) -> None:
                # Long stop strings make each request ~6.5 KB, so that those routed to the stopped
                # gateway fill several reads of its socket (nats-py reads 32 KB at a time).
                req = GenerateRequest(prompt=f"request {i}", max_tokens=1, temperature=0, stop=["x" * 400] * 16)
                try:
                    await client.generate(req)
                    outcomes["ok"] += 1
                except GenerateError as e:
                    outcomes[e.code] += 1
                    errors.append(f"{e.code}: {e.message}")

            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                requests = [asyncio.ensure_future(one(i)) for i in range(BURST)]
                await asyncio.sleep(1.0)
                victim.proc.send_signal(signal.SIGTERM)
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
            await asyncio.wait_for(asyncio.gather(*requests), 60)
            exit_code = await asyncio.to_thread(victim.proc.wait, 30)
            since = time.time()
            restarted = stack.restart_replica(victim)
            await watch.wait_for(lambda w: serving_again(w, [restarted], since), 60, "the gateway serving again")
            return outcomes, errors, exit_code

    outcomes, errors, exit_code = run(go())
    assert exit_code == 0
    # Every request answered: served, or refused `overloaded` by a scheduler whose queue is full (an
    # answer too); one left without an answer fails `unavailable`.
    assert sum(outcomes.values()) == BURST and set(outcomes) <= {"ok", "overloaded"}, f"{outcomes}: {Counter(errors).most_common(5)}"


def decoding(watch: HeartbeatWatch, since: float) -> int:
    """The requests the decode ranks hold by the heartbeats heard from them after ``since`` (monotonic)."""
    return sum(hb.batch_size for key, hb in watch.latest.items() if key[0] == "decode" and watch.seen_at[key] > since)


# What a new request gets once no replica of a role is left: the gateway's `unavailable` error with this reason.
NO_REPLICA = {"gateway": "no responder on llm.generate", "scheduler": "no scheduler is running",
              "prefill": "no prefill instance is registered", "decode": "no decode instance is registered"}


@dataclass
class Drained:
    """What the drain of a role's last replicas looked like from outside."""

    finished: list[list[int]]  # the tokens of the requests in flight at SIGTERM, streamed and unary
    health: tuple[int, str]  # `moebus openai`'s /health once they drain
    refused: tuple[str, str]  # (code, message) of a new request meanwhile, over NATS
    http_status: int  # the same through `moebus openai`
    exit_codes: list[int]


def test_the_last_replicas_of_a_role_finish_their_requests_and_new_ones_get_unavailable(stack: LocalStack, frontend: tuple[str, int]):
    """Both replicas of a role stopped together (SIGTERM), so none is left to take over, while requests
    run: /health fails at once, those requests finish in full during the drain, and a new one is
    refused `unavailable` naming what is missing (HTTP 503 through `moebus openai`): at once, never at a
    deadline. Each role's replicas are started again before the next role's go (decode last: the
    stack ends there). Before the draining heartbeats of the gateway and the scheduler, /health
    answered 200 while they drained (a gateway beat on as serving; a scheduler just went silent,
    which /health notices once its last beat is `health_expiry_s` old)."""
    long = GenerateRequest(prompt=PROMPTS[2], max_tokens=200, temperature=0, ignore_eos=True)

    async def go() -> tuple[list[int], dict[str, Drained]]:
        seen = {}
        async with session(stack.url) as (client, watch):
            reference = (await client.generate(long)).token_ids

            first_token = asyncio.Event()

            async def streamed() -> list[int]:
                tokens = []
                async for c in client.stream(long):
                    tokens += c.token_ids
                    first_token.set()
                return tokens

            async def unary() -> list[int]:
                return (await client.generate(long)).token_ids

            for role in ROLES:
                first_token.clear()
                running = [asyncio.ensure_future(streamed()), asyncio.ensure_future(unary())]
                # Both decoding, by heartbeats heard once the streamed one decodes: the latest ones before could still
                # count the last role's requests (a rank beats every 0.5 s; restarted schedulers are back in less), and
                # the victims were then stopped before these two were placed.
                decodes = asyncio.ensure_future(first_token.wait())
                await asyncio.wait([decodes, running[0]], timeout=20, return_when=asyncio.FIRST_COMPLETED)
                decodes.cancel()
                if running[0].done():
                    running[0].result()  # it failed before its first token: its error
                decoding_from = time.monotonic()
                await watch.wait_for(lambda w: decoding(w, decoding_from) >= 2, 20, "both requests decoding")
                victims = [r for r in stack.replicas if r.role == role]
                for r in victims:
                    r.proc.send_signal(signal.SIGTERM)
                healthy = await health_fails(frontend, 1.0)
                await asyncio.sleep(0.2)  # the schedulers have the draining heartbeats too
                try:
                    await client.generate(GenerateRequest(prompt="new", max_tokens=4, temperature=0))
                    refused = ("ok", "")
                except GenerateError as e:
                    refused = (e.code, e.message)
                http_status, _ = await asyncio.to_thread(openai_completion, frontend, "new")
                finished = list(await asyncio.gather(*running))
                exit_codes = [await asyncio.to_thread(r.proc.wait, 30) for r in victims]
                seen[role] = Drained(finished, healthy, refused, http_status, exit_codes)
                if role != ROLES[-1]:
                    since = time.time()
                    restarted = [stack.restart_replica(r) for r in victims]
                    await watch.wait_for(lambda w: serving_again(w, restarted, since), 120, f"the {role}s serving again")
        return reference, seen

    reference, seen = run(go())
    for role, drained in seen.items():
        assert drained.health[0] == 503 and f"no {role} heard" in drained.health[1], (role, drained.health)
        assert drained.finished == [reference, reference], f"{role}: a request in flight at SIGTERM did not finish in full"
        assert drained.exit_codes == [0, 0], (role, drained.exit_codes)
        # The stack's own answer, not the client giving up on silence (also `unavailable`, another message).
        code, message = drained.refused
        assert code == "unavailable" and NO_REPLICA[role] in message, (role, code, message)
        assert drained.http_status == 503, (role, drained.http_status)
