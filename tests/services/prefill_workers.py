"""What test_prefill_failures injects, and the rank entry point of its TP=2 group (spawned
processes import it from here)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from schemas.internal import Job, Placement, PrefillTask, SamplingSpec
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.prefill.group import Outcome, Planned, PrefillGroup
from shared.model.runner import ModelRunner, SequenceState
from shared.model.sampling import SamplingParams
from shared.parallel import Topology, init_distributed
from shared.prefix_cache import PrefixCacheMismatch
from shared.settings import PrefillSettings

POISON = [101, 102, 103, 104, 105, 106, 107]  # the prompt whose batch fails
PAGE = 16


class PoisonedRunner(ModelRunner):
    """The real runner, whose `add` raises for the `POISON` prompt."""

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, **kwargs: Any) -> SequenceState:
        if list(prompt_ids) == POISON:
            raise RuntimeError(f"injected: sequence {seq_id} cannot be added")
        return super().add(seq_id, prompt_ids, params, **kwargs)


def planned(request_id: str, ids: list[int]) -> list[Planned]:
    """A batch of one task reusing no cached page (the leader's plan), whose decode layout is
    refused (another dtype): its forward runs, no KV leaves."""
    job = Job(request_id=request_id, gateway="g", input_ids=ids, max_tokens=4, sampling=SamplingSpec(0.0, 1.0, 0, None), stop_token_ids=[],
              logprobs=False, deadline=time.time() + 60)
    layout = KVTransferLayout(num_layers=2, page_size=PAGE, kv_heads=2, head_dim=32, dtype="bfloat16")
    descriptor = KVTransferDescriptor(worker_address=b"", request_id=request_id, transfer_id=1, page_ids=[0], num_tokens=len(ids), layout=layout,
                                      lease_deadline_unix=time.time() + 60, max_chunk_bytes=1 << 20)
    return [Planned(PrefillTask(job=job, placement=Placement(decode_instance="d", decode_rank=0, prefill_instance="p"), descriptor=descriptor), 0)]


def tp_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of a TP group running three batches through `PrefillGroup._prefill` (rank 1's
    runner refuses `POISON`); what each rank saw goes to ``out_dir/rank<r>.json``."""
    topology = Topology.prefill(world, rank)
    comm = init_distributed(topology, torch.device("cpu"), master_port=port)
    seen: dict[str, Any] = {}
    try:
        runner = (PoisonedRunner if rank == 1 else ModelRunner).from_dir(model_dir, num_pages=32, page_size=PAGE, topology=topology, comm=comm,
                                                                          release_finished=False)
        group = PrefillGroup(PrefillSettings(instance="p", tp=world, warmup=False), runner, None, rank, world, None)  # type: ignore[arg-type]  # no KV leaves

        def run(ids: list[int]) -> Outcome:
            ((outcome,), _) = asyncio.run(group._prefill(planned(f"r{len(seen)}", ids)))
            return outcome

        poisoned = run(POISON)  # rank 1 cannot prepare it, rank 0 can
        seen["poisoned"] = [poisoned.code, poisoned.error, group.prefix.allocator.num_free]
        clean = run(list(range(200, 240)))  # the group serves on, in step: 2 full pages computed and cached
        seen["clean"] = [clean.output is not None and clean.code is None, group.prefix.cached_pages]
        diverging = list(range(300, 340))
        if rank == 1:  # rank 1 alone has this prompt's pages cached: its index disagrees with the leader's plan
            group.prefix.release(diverging, group.prefix.alloc(3), 0, computed=True)
        try:
            run(diverging)
        except PrefixCacheMismatch as e:
            seen["diverged"] = str(e)
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
        torch.distributed.destroy_process_group()
