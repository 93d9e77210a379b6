"""The decode instance's lockstep: every rank takes part in every step.

Experts are sharded over all ranks (EP = DP), so each MoE layer is an all-to-all in
which every rank must participate, also a rank with no sequences. Before each step
the ranks agree, with one small all-reduce, on whether there is any work anywhere
and whether all of them want to exit; then they all run the forward or all skip it.
With CUDA graphs (`shared.model.cuda_graphs`) a rank replays its own bucket's graph, a
rank with no sequences the smallest one: each still runs one forward, so one round of
the expert all-to-all, per step.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shared.model.runner import ModelRunner, SequenceState, StepOutput


class GroupState(enum.Enum):
    STEPPED = "stepped"
    IDLE = "idle"  # no rank has a sequence: nobody ran the forward
    EXIT = "exit"  # every rank asked to exit


@dataclass
class StepResult:
    state: GroupState
    outputs: list[StepOutput]
    compute_ms: float = 0.0
    path: str = "eager"  # how this rank ran the forward: a `ForwardPath` value with graphs on


class Lockstep:
    def __init__(self, runner: ModelRunner, world: int) -> None:
        self.runner = runner
        self.world = world

    def step(self, seqs: Sequence[SequenceState], want_exit: bool) -> StepResult:
        """One group step (blocking: run it off the event loop)."""
        if self.world > 1:
            flags = torch.tensor([len(seqs), int(want_exit)], dtype=torch.int64, device=self.runner.cache.device)
            dist.all_reduce(flags)
            active, exiting = flags.tolist()
        else:
            active, exiting = len(seqs), int(want_exit)
        if exiting == self.world:
            return StepResult(GroupState.EXIT, [])
        if active == 0:
            return StepResult(GroupState.IDLE, [])
        start = time.perf_counter()
        outputs = self.runner.decode(seqs)
        graphs = self.runner.decode_graphs
        # Only read for this rank's sequences: with any, `decode` ran a forward and set last_path.
        path = graphs.last_path.value if graphs is not None and graphs.last_path is not None else "eager"
        return StepResult(GroupState.STEPPED, outputs, (time.perf_counter() - start) * 1000, path)
