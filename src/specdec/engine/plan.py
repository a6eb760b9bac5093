"""A step's plan, between the planner (who runs, what each reads) and the engine (the passes), and its report.

As in vLLM v1, where the scheduler returns a `SchedulerOutput` and the model runner executes it: before the
decoding pass, `StepPlanner.plan` decides what the step does (who stepped out, the running sequences and
the K each may draft, a joining prompt's rows to ride in their pass) and the engine runs it. Prompt chunks
read in passes of their own are read while planning (the next joining sequence's admission depends on what
the last one's prompt left in the pools); the plan records how many.

Example: a, b decoding, c's 60-token prompt joining with a chunk budget of 8 -> StepPlan(preempted=[],
decoding=[a, b], ks=[4, 4], riding=Riding(c, rows of c's tokens 0..7), fed=PromptsRead(0, 0.0)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.engine.sequence import Sequence
from specdec.engine.target_pass import PromptRows
from specdec.engine.verification import Judged
from specdec.speculative.controller import StepReport
from specdec.speculative.proposers import Draft, Joining, Proposal


@dataclass
class Riding:
    """A joining sequence's next prompt tokens, read in the running sequences' verification pass."""

    seq: Sequence
    rows: PromptRows
    batch: Joining  # what the proposer is told of the batch it joins
    hidden: torch.Tensor | None = None  # [len(rows.tokens), F] the pass's states for the rows
    seconds: float = 0.0  # the pass's time spent on them (their share of its rows)

    def took(self, hidden: torch.Tensor, seconds: float, drafts: list[Draft]) -> None:
        """The pass ran: `hidden` [T, F] its states for this row (the batch's last), `seconds` its time, of
        which these rows' share (by rows: theirs against the running ones' `[last, *draft]`)."""
        read = len(self.rows.tokens)
        self.hidden = hidden[:read]
        self.seconds = seconds * read / (read + sum(1 + len(d.tokens) for d in drafts))


@dataclass
class PromptsRead:
    """Prompt tokens read in passes of their own in a step that others decode in, and their seconds (the
    chunk budget counts them as if they rode: `ChunkBudget.record`)."""

    tokens: int = 0
    seconds: float = 0.0


@dataclass
class StepPlan:
    """What one step does. `decoding` is the scheduler's running list itself (row b holds decoding[b])."""

    decoding: list[Sequence]
    ks: list[int]  # the most tokens each of `decoding` may draft (`SpeculationController.choose`)
    riding: Riding | None = None  # a joining prompt's rows, read in the decoding pass as its last row
    fed: PromptsRead = field(default_factory=PromptsRead)
    preempted: list[Sequence] = field(default_factory=list)  # stepped out before it (pools outgrown)

    @property
    def read(self) -> int:
        """Prompt tokens that ride in the decoding pass."""
        return 0 if self.riding is None else len(self.riding.rows.tokens)


def step_report(plan: StepPlan, proposal: Proposal, drafts: list[Draft], judged: list[Judged | None],
                done: list[int], pass_seconds: float) -> StepReport:
    """What the controller is told of a decoding step: the pass's rows and time (not a measure of the
    running rows alone where a prompt rode in it: then `ride`, all the rows it computed, the running ones
    padded to the prompt's chunk and the prompt's), and each sequence's outcome (`done`: those that were
    judged and emitted)."""
    seqs, read = plan.decoding, plan.read
    width = 1 + max(len(d.tokens) for d in drafts)  # each running row's, in the pass
    return StepReport(
        batch_size=len(seqs), k=max(plan.ks), forward_seconds=proposal.forward_seconds,
        rows=len(seqs) * width, verify_seconds=None if read else pass_seconds,
        outcomes=[(seqs[b].estimate, drafts[b].depth, judged[b].verdict.num_accepted) for b in done],
        kinds=[(seqs[b].estimate, drafts[b].kinds, judged[b].verdict.num_accepted) for b in done if drafts[b].kinds],
        ride=((len(seqs) + 1) * max(read, width), pass_seconds) if read else None)
