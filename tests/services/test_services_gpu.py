"""GPU, end to end: the whole stack as processes on CUDA, against the offline runner on one GPU.

The stack is compose/single-node.yml started by the launcher (`LocalStack`, what `moebus
up` runs): a real nats-server, a gateway, a scheduler, a prefill instance and a decode
instance, plus with two GPUs a second decode instance of DP2 x EP2 and a second prefill
instance of TP2, each over both GPUs. Placement is the services' own settings from the
environment: prefill on cuda:0 (`MOEBUS_PREFILL_DEVICE`), the TP2 prefill on device "cuda"
(rank r on GPU r; each rank sends its KV heads to the decode rank), the first decode
instance on cuda:1, the DP2 one on device "cuda" placed by its `gpus` setting in reverse
(`MOEBUS_DECODE_GPUS=[1, 0]`: rank 0 on GPU 1, rank 1 on GPU 0), so its MoE layers run
`PeerDecodeMoE` (peer-memory dispatch/combine and masked grouped GEMMs) inside the service. The model is a tiny Qwen3-MoE in bf16 with kernel shapes
(hidden 128, 16 experts of intermediate 128, top-4) and the real Qwen3 tokenizer, so the
grouped-GEMM kernels run in prefill and decode; every process logs which paths it took
(`model_loaded`) and the test checks them. Every decode rank (the DP2 ones included) runs
its decode steps as CUDA-graph replays (`decode.cuda_graphs`, on by default): its warm-up
captures the batch buckets (`decode_graph.captured`), and each request's `decode_finished`
counts its steps by path: replays (and the steps that captured a new bucket), no eager one.

Nine concurrent requests (streamed and unary) fill the three decode ranks (max_batch 3
each; on one GPU there is one decode rank, and the scheduler's queue wait is raised so the
others wait for its capacity), are prefilled by both prefill instances, and must all go through the prefill GPU -> decode GPU KV handoff over CUDA IPC
(each request's `kv.received` event says `path: cuda_ipc`); afterwards every decode
rank's heartbeat shows all KV pages back in its pool.

Correctness: the tokens are compared with `shared.model.offline.generate` (greedy, the
same checkpoint, bf16 with the kernels) on one GPU. Exact equality is not a well-posed
demand in bf16 with a 151k vocabulary: logits of magnitude 8..16 come in steps of 1/16,
and along a greedy path the top two are exactly tied about once every 16 tokens (seen on
this checkpoint on the CPU), so any difference in accumulation order (batching, the
DP x EP combine) may pick the other one. So a response must equal the reference up to
the first position where the reference's top-2 logits are within `NEAR_TIE_STEPS` bf16
steps, and every token of the response, before and after that point, must be within
that margin of the reference model's best logit given the response's own prefix
(teacher forcing). A token from wrong or missing KV lands in that set of 1-4 tokens
with odds of a few in 151k per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from schemas.api import GenerateRequest
from services.launch import LocalStack
from shared.model.offline import generate as offline_generate
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.model.tiny import make_tiny
from shared.model.tokenizer import Tokenizer

from services_helpers import all_kv_free, compose_specs, log_events, run, session, start_specs, stream_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KERNEL_SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128)
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
MAX_BATCH = 3  # per decode rank: the nine requests below need every rank
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Mixture-of-experts models route each token to a few experts, which",
    "1, 2, 3, 4,",
    "Once upon a time in a land far away there lived a dragon who loved to read books about " * 3,
    "hi",
    "Prefill and decode run as independent services on a message bus;",
    "KV caches move between GPUs",
    "The quick brown fox",
]
NEAR_TIE_STEPS = 4  # bf16 steps (at the best logit's magnitude) within which two logits count as tied
PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-kernel-moe"), seed=3, **KERNEL_SHAPES)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    specs = compose_specs("single-node.yml", model_dir)
    decode = next(s for s in specs if s.name == "decode")
    prefill = next(s for s in specs if s.name == "prefill")
    device = {decode.name: "MOEBUS_DECODE_DEVICE", prefill.name: "MOEBUS_PREFILL_DEVICE"}
    on = {decode.name: "cuda:1" if TWO_GPUS else "cuda:0", prefill.name: "cuda:0"}
    placed = [dataclasses.replace(s, env={**s.env, device[s.name]: on[s.name]}) if s.name in device else s for s in specs]
    if TWO_GPUS:
        placed.append(dataclasses.replace(decode, name="decode-dp2", env={**decode.env, "MOEBUS_DECODE_DP": "2", "MOEBUS_DECODE_DEVICE": "cuda", "MOEBUS_DECODE_GPUS": "[1, 0]"}))
        placed.append(dataclasses.replace(prefill, name="prefill-tp2", env={**prefill.env, "MOEBUS_PREFILL_TP": "2", "MOEBUS_PREFILL_DEVICE": "cuda"}))
    env = {
        "MOEBUS_DTYPE": "bfloat16",  # the kernels take bf16 (fp32 runs the reference ops)
        "MOEBUS_DECODE_MAX_BATCH": str(MAX_BATCH),
        "MOEBUS_SCHEDULER_LEASE_S": "120",  # the first prefill compiles its kernels inside the lease
        # One GPU: one decode rank of max_batch 3 for nine requests, which wait for its capacity.
        "MOEBUS_SCHEDULER_QUEUE_WAIT_MS": "1000" if TWO_GPUS else "60000",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }
    stack = start_specs(placed, model_dir, tmp_path_factory.mktemp("gpu-stack-logs"), env)
    try:
        yield stack
    finally:
        stack.stop()


def _decode_ranks(stack: LocalStack) -> set[tuple[str, int]]:
    return {(e["replica"], e["rank"]) for e in log_events(stack, "model_loaded") if e["service"] == "decode"}


def _log_tails(stack: LocalStack, role: str, lines: int = 12) -> str:
    """The last lines of the log of each replica of ``role``, for a failure message."""
    return "\n".join(f"--- {r.log_path.name}:\n" + "\n".join(r.log_path.read_text(errors="replace").splitlines()[-lines:])
                     for r in stack.replicas if r.role == role)


def test_services_load_the_kernel_paths_on_their_gpus(stack):
    loaded = {(e["replica"], e["rank"]): e for e in log_events(stack, "model_loaded")}
    expected = {("prefill-0", 0): "cuda:0", ("decode-0", 0): "cuda:1" if TWO_GPUS else "cuda:0"}
    if TWO_GPUS:
        expected |= {("decode-dp2-0", 0): "cuda:1", ("decode-dp2-0", 1): "cuda:0"}  # MOEBUS_DECODE_GPUS=[1, 0]
        expected |= {("prefill-tp2-0", 0): "cuda:0", ("prefill-tp2-0", 1): "cuda:1"}  # device "cuda": rank r on GPU r
    assert {k: e["device"] for k, e in loaded.items()} == expected
    assert all(e["kernels"] and e["moe_kernels"] and e["dtype"] == "bfloat16" for e in loaded.values()), loaded
    assert {k: e["decode_moe"] for k, e in loaded.items()} == {k: "PeerDecodeMoE" if k[0] == "decode-dp2-0" else None for k in expected}
    if TWO_GPUS:
        assert {loaded[("decode-dp2-0", r)]["collectives"] for r in (0, 1)} == {"CudaCollectives"}
    # Every rank compiled its kernels before reporting ready (services/warmup.py).
    warmed = {(e["replica"], e["rank"]): e["steps"] for e in log_events(stack, "warmup.done")}
    assert set(warmed) == set(expected), warmed
    # Decode ranks run CUDA graphs; their warm-up captured (then replayed) every batch bucket.
    decode = {k for k in expected if k[0].startswith("decode")}
    graphs_on = {(e["replica"], e["rank"]): e for e in log_events(stack, "decode_graph.on")}
    assert set(graphs_on) == decode and not log_events(stack, "decode_graph.off"), graphs_on
    assert all(e["batch_buckets"] == [1, 2, MAX_BATCH] for e in graphs_on.values()), graphs_on
    captured: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for e in log_events(stack, "decode_graph.captured"):
        captured.setdefault((e["replica"], e["rank"]), set()).add((e["batch_bucket"], e["page_bucket"]))
        assert e["pool_bytes"] >= 0 and e["seconds"] >= 0, e
    assert {k: {(b, 1) for b in (1, 2, MAX_BATCH)} <= v for k, v in captured.items()} == dict.fromkeys(decode, True), captured
    assert all(f"decode_batch_{b}_replay" in warmed[k] for k in decode for b in (1, 2, MAX_BATCH)), warmed
    # Every prefill rank runs piecewise CUDA graphs (`prefill.cuda_graphs`, on by default), captured and replayed in
    # its warm-up for every token bucket its KV pages hold; the TP2 ranks with their all-reduces inside the pieces.
    prefill = {("prefill-0", 0)} | ({("prefill-tp2-0", 0), ("prefill-tp2-0", 1)} if TWO_GPUS else set())
    prefill_on = {(e["replica"], e["rank"]): e for e in log_events(stack, "prefill_graph.on")}
    assert set(prefill_on) == prefill and not log_events(stack, "prefill_graph.off"), prefill_on
    assert not log_events(stack, "prefill_graph.capture_failed")
    for key, on in prefill_on.items():
        buckets = on["token_buckets"]
        assert buckets[:3] == [16, 32, 64], (key, buckets)
        prefill_captured = {e["token_bucket"] for e in log_events(stack, "prefill_graph.captured") if (e["replica"], e["rank"]) == key}
        assert prefill_captured and prefill_captured <= set(buckets) and {16, 32, 64} <= prefill_captured, (key, prefill_captured)
        assert all(f"prefill_{b}_tokens_replay" in warmed[key] for b in prefill_captured), (key, warmed[key])


def _reference(model_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return offline_generate(str(model_dir), prompt, chat=False, params=params, dtype=torch.bfloat16, device="cuda:0")["token_ids"]


def _teacher_forced_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The reference model's logits after each token of ``ids`` (one prefill forward): ``[len, V]`` fp32."""
    from shared.model.model import ForwardBatch, SequenceChunk

    pages = runner.cache.allocator.alloc(runner.cache.layout.pages_for(len(ids)))
    try:
        batch = ForwardBatch.build([SequenceChunk(ids, 0, pages)], PAGE, runner.cache.device)
        return runner.model.forward(batch, runner.cache, all_logits=True).float().cpu()
    finally:
        runner.cache.allocator.free(pages)


def _near_tie(logits: torch.Tensor) -> float:
    """NEAR_TIE_STEPS bf16 steps (8 significant bits) at the magnitude of the best logit."""
    _, exponent = math.frexp(float(logits.abs().max()))  # |best| in [2^(exponent-1), 2^exponent)
    return NEAR_TIE_STEPS * 2.0 ** (exponent - 1 - 7)


def _check_against_reference(runner: ModelRunner, prompt_ids: list[int], got: list[int], expected: list[int]) -> str:
    """Assert `got` is the reference's greedy output up to near ties (see the module doc); say how it compared."""
    logits = _teacher_forced_logits(runner, prompt_ids + got)[len(prompt_ids) - 1 : -1]  # row i chose got[i]
    for i, (token, row) in enumerate(zip(got, logits)):
        tol = _near_tie(row)
        close = int((row >= row.max() - tol).sum())
        assert close <= 32, f"{close} tokens within {tol:.3g} of the best logit: the reference is degenerate"
        assert row[token] >= row.max() - tol, (
            f"token {i} ({token}) is {float(row.max() - row[token]):.3g} below the reference's best logit "
            f"({int(row.argmax())}), more than a near tie ({tol:.3g}); got {got}, offline reference {expected}")
    parted = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if parted is None:
        assert len(got) == len(expected), f"got {got}, offline reference {expected}"
        return "equal to the offline reference"
    # Up to `parted` both sequences share the prefix, so this row is the reference's choice there too.
    margin = float(logits[parted][expected[parted]] - logits[parted][got[parted]])
    assert margin <= _near_tie(logits[parted]), f"parted from the offline reference at token {parted} (margin {margin:.3g}): got {got}, reference {expected}"
    return f"parted from the offline reference at token {parted} of {len(got)} at a near tie (margin {margin:.3g})"


def test_concurrent_requests_match_the_offline_reference_over_cuda_ipc(stack, model_dir):
    max_tokens = [12 + 2 * i for i in range(len(PROMPTS))]
    ids = [f"gpu-e2e-{i}" for i in range(len(PROMPTS))]

    async def go():
        async with session(stack.url) as (client, watch):

            async def one(i: int) -> tuple[list[int], str]:
                req = GenerateRequest(prompt=PROMPTS[i], max_tokens=max_tokens[i], temperature=0, request_id=ids[i], timeout_ms=180_000)
                if i % 2:
                    chunks = await stream_all(client, req)
                    assert chunks[-1].finish_reason is not None
                    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)
                resp = await client.generate(req)
                return resp.token_ids, resp.text

            # Every prefill instance known to the scheduler before the requests come: a heartbeat of
            # each seen here, then a later one (the scheduler had the first by then).
            instances = {"prefill-0", "prefill-tp2-0"} if TWO_GPUS else {"prefill-0"}
            await watch.wait_for(lambda w: {hb.instance for hb in w.live("prefill")} == instances, 30, f"heartbeats of {instances}")
            first = {key: t for key, t in watch.seen_at.items() if key[0] == "prefill"}
            await watch.wait_for(lambda w: all(w.seen_at[key] > t for key, t in first.items()), 5, "a second heartbeat of each prefill instance")
            results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            # Every decode rank alive (heartbeating) with all its pages back: a rank that died or
            # hung would leave `all_kv_free` (which looks at the live ranks) true on its own.
            ranks = _decode_ranks(stack)
            try:
                await watch.wait_for(lambda w: {(hb.instance, hb.rank) for hb in w.live("decode")} == ranks and all_kv_free(w), 10,
                                     "every decode rank heartbeating with its KV pages back in its pool")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{_log_tails(stack, 'decode')}") from None
            return results

    results = run(go())

    tokenizer = Tokenizer.from_dir(model_dir)
    runner = ModelRunner.from_dir(model_dir, num_pages=64, page_size=PAGE, dtype=torch.bfloat16, device="cuda:0")
    for prompt, n, (got, text) in zip(PROMPTS, max_tokens, results):
        expected = _reference(model_dir, prompt, n)
        how = _check_against_reference(runner, tokenizer.encode(prompt), got, expected)
        print(f"{prompt[:30]!r}: {len(got)} tokens, {how}")
        assert text == tokenizer.decode(got, skip_special_tokens=True)

    received = {e["request_id"]: e for e in log_events(stack, "kv.received") if e["request_id"] in ids}
    assert set(received) == set(ids), f"no kv.received for {set(ids) - set(received)}"
    assert {rid: e["path"] for rid, e in received.items()} == dict.fromkeys(ids, "cuda_ipc")
    serving = {(e["replica"], e["rank"]) for e in received.values()}
    assert serving == _decode_ranks(stack), f"requests reached only {serving}"
    # Each prefill rank sends its share of a request's KV (a TP group's ranks their KV heads); with two
    # GPUs both prefill instances served some of the nine.
    prefilled_on = {e["request_id"]: e["prefill"] for e in log_events(stack, "placed") if e["request_id"] in ids and e["replica"].startswith("scheduler")}
    tp = {"prefill-0": 1, "prefill-tp2-0": 2}
    sent = [e for e in log_events(stack, "kv.sent") if e["request_id"] in ids]
    assert sorted(e["request_id"] for e in sent) == sorted(rid for rid in ids for _ in range(tp[prefilled_on[rid]])), (prefilled_on, sent)
    assert {e["path"] for e in sent} == {"cuda_ipc"}
    assert set(prefilled_on.values()) == (set(tp) if TWO_GPUS else {"prefill-0"}), prefilled_on
    # Each prefill instance (its leader logs the batches) ran every batch of them as replays of the pieces its
    # warm-up captured.
    for instance in set(prefilled_on.values()):
        batches = [e for e in log_events(stack, "prefill_batch") if e["replica"] == instance and set(e["request_ids"]) & set(ids)]
        assert batches and {e["forward_path"] for e in batches} == {"graph_replay"}, (instance, [(e["computed_tokens"], e["forward_path"]) for e in batches])

    # Every decode step of every request was a CUDA-graph replay, or the step that captured a
    # bucket first used then (a longer context's page bucket): none ran the eager forward.
    finished = {e["request_id"]: e for e in log_events(stack, "decode_finished") if e["request_id"] in ids}
    assert set(finished) == set(ids)
    for rid, e in finished.items():
        steps = e["steps"]
        assert set(steps) <= {"graph_replay", "graph_capture"} and steps.get("graph_replay", 0) > 0, (rid, e["replica"], e["rank"], steps)
        assert sum(steps.values()) == e["tokens"] - 1, (rid, steps, e["tokens"])  # the first token came from prefill
    print({rid: (e["replica"], e["rank"], e["steps"]) for rid, e in finished.items()})
