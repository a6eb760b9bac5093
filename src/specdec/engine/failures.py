"""A failure is contained to the sequence it concerns: an exception in a sequence's own part of a step
(prefilling it, judging its draft, appending, detokenizing, advancing its grammar) ends that sequence alone,
with finish_reason "abort" and `RequestOutput.error`, while the rest of the batch goes on as if it had never
been there. Only the shared target pass and the proposer, where no one sequence can be blamed, fail the
whole step."""

from __future__ import annotations

import logging

from specdec.engine.outputs import RequestOutput
from specdec.engine.sequence import Sequence

logger = logging.getLogger("specdec.engine.engine")  # (where these were always logged)


class Failures:
    """The sequences that failed in this step, reported at its end (`reports`)."""

    def __init__(self) -> None:
        self.failed: list[Sequence] = []

    def isolated(self, seq: Sequence, fn, *args):
        """`fn(*args)`, a part of the step that concerns `seq` alone; None if it raised: then `seq` fails
        (finish_reason "abort", `error` set; reported and released at the end of the step) and the others
        go on. Example: a NaN in one sequence's probabilities makes its draw raise; only it ends."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed in the engine; the other requests go on", seq.request_id)
            seq.output.abort()
            seq.error = f"{type(e).__name__}: {e}"
            self.failed.append(seq)
            return None

    def reports(self) -> list[RequestOutput]:
        """The outputs of this step's failed sequences (emptied for the next)."""
        outputs = [seq.report([]) for seq in self.failed]
        self.failed.clear()
        return outputs
