"""`specdec bench serve`: concurrent streaming clients against any OpenAI-compatible server.

For each concurrency level C, `rounds` rounds; in each, C clients at once each send `requests_per_client`
streaming requests in turn (prompt lines to /v1/completions, chats to /v1/chat/completions), new prompts
each round. Per level: output tokens/s (the tokens of the requests that succeeded over the rounds' wall
time), time to first token (TTFT) and time per output token after it (TPOT) at the median, 90th and 99th
percentile, failed requests apart, and the acceptance rate where the server exports the speculative
counters (specdec's and vLLM's `*:spec_decode_num_{draft,accepted}_tokens_total` on /metrics).

Example: one client, a 48-token answer whose first token comes after 0.5 s and the last after 3.0 s: TTFT
0.5 s, TPOT (3.0 - 0.5) / 47 = 53 ms.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np

from specdec.bench.prompts import Prompt

PERCENTILES = (50, 90, 99)


def first_model(url: str, headers: dict) -> str:
    """The first model the server lists (GET /v1/models)."""
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, max_tokens: int,
                      temperature: float) -> dict:
    """One streaming request: its TTFT, TPOT, output tokens (from the usage chunk), end time, error (or None)
    and text."""
    chat = prompt.messages is not None
    body = {"model": model, **prompt.request_body(), "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens, error, parts = None, 0, None, []
    async with client.stream("POST", f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # the server failed the request mid-stream
                error = chunk["error"].get("message", str(chunk["error"]))
            choices = chunk.get("choices") or [{}]
            text = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
            if text and first is None:
                first = time.perf_counter()
            parts.append(text or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens, "end": end,
            "error": error if r.status_code == 200 else f"HTTP {r.status_code}", "text": "".join(parts)}


async def run_round(url: str, model: str, prompts: list[Prompt], concurrency: int, per_client: int,
                    max_tokens: int, temperature: float, timeout: float,
                    headers: dict | None = None) -> tuple[list[dict], float]:
    """`concurrency` clients at once, client c sending prompts[c * per_client:(c + 1) * per_client] in turn: the
    requests' results and the round's wall time."""
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        async def client_loop(c: int) -> list[dict]:
            return [await one_request(client, url, model, prompts[c * per_client + i], max_tokens, temperature)
                    for i in range(per_client)]

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(client_loop(c) for c in range(concurrency))), timeout)
        return [r for rs in results for r in rs], time.perf_counter() - start


def summarize(every: list[dict], elapsed: float) -> dict:
    """Throughput (tokens of the requests that succeeded over all the time) and latency percentiles."""
    ok = [r for r in every if r["error"] is None]
    row: dict = {"requests": len(every), "seconds": round(elapsed, 3),
                 "errors": [r["error"] for r in every if r["error"] is not None],
                 "throughput": sum(r["tokens"] for r in ok) / elapsed}
    for name in ("ttft", "tpot"):
        values = np.percentile([r[name] for r in ok], PERCENTILES) if ok else [float("nan")] * len(PERCENTILES)
        row.update({f"{name}_p{p}": float(v) for p, v in zip(PERCENTILES, values)})
    return row


def spec_counters(url: str, headers: dict | None = None) -> dict[str, float]:
    """The server's speculative counters: drafts (steps that drafted), drafted and accepted tokens (0 where it
    exports none)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "drafted",
             "spec_decode_num_accepted_tokens_total": "accepted"}
    values = dict.fromkeys(names.values(), 0.0)
    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                suffix = sample.name.rpartition(":")[2]  # specdec:..., vllm:...
                if suffix in names:
                    values[names[suffix]] += sample.value
    except (httpx.HTTPError, ValueError):  # no /metrics, or not Prometheus text
        pass
    return values


def load_test(url: str, prompts: list[Prompt], levels: list[int], model: str | None = None,
              api_key: str | None = None, max_tokens: int = 64, temperature: float = 0.0,
              requests_per_client: int = 1, rounds: int = 1, timeout: float = 1800) -> list[dict]:
    """One row per concurrency level (see the module's docstring); the first request, unmeasured, warms
    the server up."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    model = model or first_model(url, headers or {})
    asyncio.run(run_round(url, model, prompts[-1:], 1, 1, min(8, max_tokens), temperature, timeout, headers))
    rows, used = [], 0
    for c in levels:
        n = c * requests_per_client
        every, seconds = [], 0.0
        before = spec_counters(url, headers)
        for _ in range(rounds):
            batch = [prompts[(used + i) % len(prompts)] for i in range(n)]  # new prompts each round
            used += n
            results, elapsed = asyncio.run(run_round(url, model, batch, c, requests_per_client, max_tokens,
                                                     temperature, timeout, headers))
            every += results
            seconds += elapsed
        after = spec_counters(url, headers)
        drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
        row = {"concurrency": c, "rounds": rounds, **summarize(every, seconds),
               "acceptance_rate": round(accepted / drafted, 4) if drafted else None}
        rows.append(row)
    return rows


def serve_table(rows: list[dict]) -> list[str]:
    lines = ["| clients | output tokens/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | "
             "acceptance rate | requests | failed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = " / ".join(f"{r[f'ttft_p{p}']:.2f}" for p in PERCENTILES)
        tpot = " / ".join(f"{1e3 * r[f'tpot_p{p}']:.0f}" for p in PERCENTILES)
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"| {r['concurrency']} | {r['throughput']:.2f} | {ttft} | {tpot} | {rate} | {r['requests']} | "
                     f"{len(r['errors'])} |")
    return lines


def write_serve_report(out_dir: Path, rows: list[dict], info: dict) -> Path:
    """`out_dir/report.md` (returned), `report.json` and the plot `serve.png`."""
    from specdec.bench.plots import write_serve_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps({**info, "results": rows}, indent=1) + "\n")
    sampling = "greedy" if info["temperature"] == 0 else f"temperature {info['temperature']}"
    lines = [f"# specdec bench serve: {info['url']}", "",
             f"Streaming requests ({info['source']}), up to {info['max_tokens']} tokens each, {sampling}. Output "
             "tokens/s counts the requests that succeeded over the wall time of the level's rounds; TTFT is the time "
             "to the first token, TPOT the time per output token after it.", "", *serve_table(rows), ""]
    failed = [e for r in rows for e in r["errors"]]
    if failed:
        lines += [f"{len(failed)} requests failed; the first: {failed[0]}", ""]
    plot = write_serve_plot(out_dir, rows, f"{info['url']}, {info['source']}, {info['max_tokens']} tokens max")
    lines += [f"![{plot.stem}]({plot.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
