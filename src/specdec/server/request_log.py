"""`serve --log-requests`: a line per finished request with where its time went, so that a slow answer can be
read off the log (a prompt computed, or restored from RAM or disk; its first token; the decoding after it).

Example line (the time it finished, then):

    00:21:30 request msg-3f2a: prompt 21597 tokens (21584 cached, 21584 from disk; restored in 0.41 s, 13 computed in
    0.62 s), first token at 1.30 s; 12 tokens in 3.05 s (3.9 tokens/s, 9 passes, drafts 0.02 s), stop
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from specdec.engine.outputs import RequestOutput


class RequestLog:
    """A step listener (`AsyncEngine.add_step_listener`) writing a line per finished request to `out`."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out

    def on_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                print(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {describe(out)}", file=self.out or sys.stderr, flush=True)


def describe(out: RequestOutput) -> str:
    m = out.metrics
    prompt = len(out.prompt_token_ids)
    decode = max(0.0, m.total_time - m.first_token_time) if m.first_token_time else 0.0
    n = len(out.token_ids)
    rate = f"{(n - 1) / decode:.1f} tokens/s after the first, " if decode > 0 and n > 1 else ""
    return (f"request {out.request_id}: prompt {prompt} tokens ({m.cached_tokens} cached, {m.disk_cached_tokens} from "
            f"disk; restored in {m.restore_time:.2f} s, {prompt - m.cached_tokens} computed in {m.prefill_time:.2f} s),"
            f" first token at {m.first_token_time:.2f} s; {n} tokens in {m.total_time:.2f} s ({rate}{m.target_passes}"
            f" passes, drafting {m.draft_time:.2f} s, target {m.target_time:.2f} s), {out.finish_reason}")
