"""A step's plan, between the planner (who runs, what each reads) and the engine (the passes), and its report.

As in vLLM v1, where the scheduler returns a `SchedulerOutput` and the model runner executes it: before the
decoding pass, `StepPlanner.plan` decides what the step does (who stepped out, the running sequences and
the K each may draft, a joining prompt's rows to ride in their pass, and the K/V pages each of those rows may
take in the pass) and the engine runs it. Prompt chunks read in passes of their own are read while planning
(the next joining sequence's admission, its prefix-cache hit and whether it rides depend on what the last
one's prompt left in the pools and the prefix cache, and on what its pass cost); the plan records how many.

Pages: vLLM's scheduler allocates the blocks of the tokens it schedules (and of the drafts' lookahead) before
the model runs. Here the drafts are proposed after planning, so the plan gives each row of the pass the most
pages it may take (`pages`: for rows `width` wide, the widest draft its ks allow, or the riding chunk), room
the scheduler made (`Scheduler.victim`); once the drafts are known the engine takes each row's pages for the
pass's actual width (`StepPlan.take_pages`, at most the plan's, else `PlanBroken`) before the pass, which then
finds its slots writable. (Taking the most at planning would hold pages the pass may not write, and under a
full pool evict prefix-cache blocks that the exact take keeps.)

Example: a, b decoding (lengths 30 and 40), c's 60-token prompt joining with a chunk budget of 8, pages of 16
-> StepPlan(preempted=[], decoding=[a, b], ks=[4, 4], riding=Riding(c, rows of c's tokens 0..7, pages=1),
fed=PromptsRead(0, 0.0), width=8, pages=[1, 1]): rows padded to 8 slots write a's 30..37 (a new page from 32)
and b's 40..47 (within its third page: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.engine.sequence import Sequence
from specdec.engine.target_pass import PromptRows
from specdec.engine.verification import Judged
from specdec.models.kv_cache import KVCache
from specdec.speculative.controller import LabelledOutcome, Outcome, PassRows, StepReport
from specdec.speculative.proposers import Draft, Joining, Proposal


@dataclass
class Riding:
    """A joining sequence's next prompt tokens, read in the running sequences' verification pass."""

    seq: Sequence
    rows: PromptRows
    batch: Joining  # what the proposer is told of the batch it joins
    pages: int = 0  # the most pages of the target's pool its row takes in the pass (`StepPlan.pages`)
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
    width: int = 1  # the widest rows the pass may have: 1 + the widest draft `ks` allow, or the riding chunk
    pages: list[int] = field(default_factory=list)  # the most pages of the target's pool each of `decoding` takes

    @property
    def read(self) -> int:
        """Prompt tokens that ride in the decoding pass."""
        return 0 if self.riding is None else len(self.riding.rows.tokens)

    def take_pages(self, cache: KVCache, drafts: list[Draft]) -> None:
        """Give each row of the pass (`decoding`'s, then the riding one's) the pages of the slots it writes, before
        the pass: up to the pass's width, the widest of `[last, *draft]` and the riding chunk (`target_pass.verify`
        pads every row to it). A row that would take more than the plan gave it raises `PlanBroken` (a proposer
        drafting wider than its K allows)."""
        width = max(1 + max(len(d.tokens) for d in drafts), self.read)
        rows = [*zip(self.decoding, self.pages), *([(self.riding.seq, self.riding.pages)] if self.riding else [])]
        for seq, most in rows:
            slots = cache.lengths[seq.row] + width
            if width > self.width or cache.pages_to_take(seq.row, slots) > most:
                raise PlanBroken(f"request {seq.request_id}: the pass's rows are {width} wide, taking "
                                 f"{cache.pages_to_take(seq.row, slots)} pages; the plan allows {self.width} "
                                 f"and {most} pages")
            cache.reserve(seq.row, slots)


class PlanBroken(RuntimeError):
    """A pass would take pages its step's plan did not give."""


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
        outcomes=[Outcome(seqs[b].estimate, drafts[b].depth, judged[b].verdict.num_accepted) for b in done],
        kinds=[LabelledOutcome(seqs[b].estimate, drafts[b].kinds, judged[b].verdict.num_accepted)
               for b in done if drafts[b].kinds],
        ride=PassRows((len(seqs) + 1) * max(read, width), pass_seconds) if read else None)
