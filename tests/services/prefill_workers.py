"""What test_prefill_failures injects, and the rank entry point of its TP=2 group (spawned
processes import it from here)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from nats.aio.msg import Msg

from schemas.internal import Job, Placement, PrefillTask, SamplingSpec
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.prefill.batch import Outcome, Planned
from services.prefill.group import PrefillGroup
from shared.bus import pack
from shared.model.model import LayerCallback
from shared.model.runner import ModelRunner, SequenceState, StepOutput
from shared.model.sampling_params import SamplingParams
from shared.parallel import Topology, init_distributed
from services.ranks import free_port
from shared.settings import PrefillSettings

POISON = [101, 102, 103, 104, 105, 106, 107]  # the prompt whose batch fails
PAGE = 16


def run_tp_pair(target: Callable[..., None], tiny_model: Path, out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``target(rank, 2, port, model, out_dir)`` as a spawned TP=2 gloo group; the (leader, peer) JSON
    each rank wrote to ``out_dir/rank{r}.json``. Fails if a rank hangs (120 s) or exits non-zero."""
    port, ctx = free_port(), mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, 2, port, str(tiny_model), str(out_dir))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    leader, peer = (json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2))
    return leader, peer


class PoisonedRunner(ModelRunner):
    """The real runner, whose `add` raises for the `POISON` prompt."""

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, **kwargs: Any) -> SequenceState:
        if list(prompt_ids) == POISON:
            raise RuntimeError(f"injected: sequence {seq_id} cannot be added")
        return super().add(seq_id, prompt_ids, params, **kwargs)


class FailingForwardRunner(ModelRunner):
    """The real runner, whose prefill forward raises for a batch holding the `POISON` prompt."""

    def prefill(self, seqs: Sequence[SequenceState], on_layer_done: LayerCallback | None = None) -> list[StepOutput]:
        if any(s.token_ids[: s.prompt_len] == POISON for s in seqs):
            raise RuntimeError("injected: the forward failed")
        return super().prefill(seqs, on_layer_done)


def planned(request_id: str, ids: list[int], cached_pages: int = 0) -> Planned:
    """A task the leader plans to reuse ``cached_pages`` cached pages for, whose decode layout is
    refused (another dtype): its forward runs, no KV leaves."""
    job = Job(request_id=request_id, gateway="g", input_ids=ids, max_tokens=4, sampling=SamplingSpec(0.0, 1.0, 0, None), stop_token_ids=[],
              logprobs=False, deadline=time.time() + 60)
    layout = KVTransferLayout(num_layers=2, page_size=PAGE, kv_heads=2, head_dim=32, dtype="bfloat16")
    descriptor = KVTransferDescriptor(worker_address=b"", request_id=request_id, transfer_id=1, page_ids=[0], num_tokens=len(ids), layout=layout,
                                      lease_deadline_unix=time.time() + 60, max_chunk_bytes=1 << 20)
    return Planned(PrefillTask(job=job, placement=Placement(decode_instance="d", decode_rank=0, prefill_instance="p"), descriptor=descriptor), cached_pages)


def summary(outcome: Outcome) -> list[Any]:
    """Whether the task ran (its forward did: no KV leaves here), its code and its error."""
    return [outcome.output is not None, outcome.code, outcome.error]


def tp_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of a TP group running batches through `BatchRunner.prefill` (rank 1's runner
    refuses `POISON`, once holds pages the leader does not, and once lacks cached pages the
    leader has); what each rank saw goes to
    ``out_dir/rank<r>.json``."""
    topology = Topology.prefill(world, rank)
    comm = init_distributed(topology, torch.device("cpu"), master_port=port)
    seen: dict[str, Any] = {}
    try:
        runner = (PoisonedRunner if rank == 1 else ModelRunner).from_dir(model_dir, num_pages=32, page_size=PAGE, topology=topology, comm=comm,
                                                                          release_finished=False)
        group = PrefillGroup(PrefillSettings(instance="p", tp=world, warmup=False), runner, None, rank, world, None)  # type: ignore[arg-type]  # no KV leaves

        def run(*prompts: list[int]) -> list[Outcome]:
            outcomes, _ = asyncio.run(group.batch_runner.prefill([planned(f"r{len(seen)}-{i}", ids) for i, ids in enumerate(prompts)]))
            return outcomes

        (poisoned,) = run(POISON)  # rank 1 cannot prepare it, rank 0 can
        seen["poisoned"] = [poisoned.code, poisoned.error, group.prefix.allocator.num_free]
        held = group.prefix.alloc(27) if rank == 1 else []  # rank 1 alone: 5 pages left, for the first task's 3 and not the second's
        seen["short"] = [summary(o) for o in run(list(range(500, 540)), list(range(600, 640)))]
        group.prefix.allocator.free(held)
        seen["short"].append([group.prefix.cached_pages, group.prefix.allocator.num_free])  # the first task's 2 full pages cached
        seen["isolated"] = [summary(o) for o in run(POISON, list(range(200, 240)))]  # the second task runs on both ranks
        seen["isolated"].append([group.prefix.cached_pages, group.prefix.allocator.num_free])  # and its 2 full pages are cached
        diverging = list(range(300, 340))
        if rank == 0:  # the leader alone has this prompt's 2 full pages cached, and plans to reuse them: rank 1 finds none
            group.prefix.release(diverging, group.prefix.alloc(3), 0, computed=True)
        (outcome,), _ = asyncio.run(group.batch_runner.prefill([planned("diverging", diverging, cached_pages=2)]))
        seen["diverged"] = [*summary(outcome), outcome.cached_tokens, group.prefix.cached_pages, group.prefix.allocator.num_free]
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
        torch.distributed.destroy_process_group()


def tp_short_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of a TP group (as `tp_rank`) where rank 1 alone is short of pages for a task the
    leader takes, whose allocation evicts a cached page on the leader only; then a request for
    that cached prompt, planned and broadcast as `PrefillGroup.run` does. What each rank saw goes
    to ``out_dir/rank<r>.json``."""
    topology = Topology.prefill(world, rank)
    comm = init_distributed(topology, torch.device("cpu"), master_port=port)
    seen: dict[str, Any] = {}
    try:
        runner = ModelRunner.from_dir(model_dir, num_pages=32, page_size=PAGE, topology=topology, comm=comm, release_finished=False)
        group = PrefillGroup(PrefillSettings(instance="p", tp=world, warmup=False), runner, None, rank, world, None)  # type: ignore[arg-type]  # no KV leaves
        shared = list(range(300, 340))  # 2 full pages and 8 tokens

        def state() -> list[int]:
            return [group.prefix.cached_pages, group.prefix.allocator.num_free, len(group.prefix.match(shared))]

        def run(batch: list[Planned]) -> list[Outcome]:
            outcomes, _ = asyncio.run(group.batch_runner.prefill(batch))
            return outcomes

        run([planned("warm", shared)])  # every rank caches its 2 full pages: 30 pages free, 2 evictable
        seen["warm"] = state()
        held = group.prefix.alloc(27) if rank == 1 else []  # rank 1 alone: 3 free and 2 evictable pages left
        (big,) = run([planned("big", list(range(1000, 1496)))])  # 31 pages: the leader evicts one cached page for them, rank 1 is short
        group.prefix.allocator.free(held)
        seen["big"] = [*summary(big), *state()]

        async def plan_and_broadcast() -> list[Planned] | None:
            batch = None
            if rank == 0:  # the leader plans the request by its own index, as it does for a task from NATS
                request = planned("again", shared).task
                await group._on_task(Msg(_client=None, subject="test", data=pack(request)))  # type: ignore[arg-type]
                batch = await group._take_batch(None)
            return await asyncio.to_thread(group._broadcast, batch)

        again = asyncio.run(plan_and_broadcast())
        assert again is not None
        seen["plan"] = [p.cached_pages for p in again]
        try:
            (outcome,) = run(again)
            seen["again"] = [*summary(outcome), outcome.cached_tokens, *state()]
        except Exception as e:  # what `PrefillGroup.run` would re-raise: the instance stops
            seen["raised"] = f"{type(e).__name__}: {e}"
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
        torch.distributed.destroy_process_group()
