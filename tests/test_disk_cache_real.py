"""`specdec serve` on the default model keeps its prefix cache on disk: after a restart, a prompt it has read
comes back from disk (usage.prompt_tokens_details.cached_tokens, the disk hits on /metrics) and the answer is
the one the first process gave, token for token; `--no-prefix-cache-disk` keeps none; `--dry-run` prints the
tier's folder and budget."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.bench.prompts import dataset_prompts
from test_server_real import TARGET, free_port

pytestmark = pytest.mark.real


def serve(tmp_path, *flags: str):
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", TARGET, "--port", str(port),
                                 "--prefix-cache-dir", str(tmp_path / "kv"), *flags],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(1)


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def ask(url: str, prompt: str) -> tuple[list[int], int, int]:
    body = {"model": TARGET, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    return out["choices"][0]["token_ids"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), \
        usage["prompt_tokens"]


def disk_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specdec:prefix_cache_disk_hits_total")


def test_a_restarted_server_reads_a_known_prompt_from_disk_and_answers_the_same(tmp_path):
    prompt = "\n\n".join(p.prompt for p in dataset_prompts("humaneval")[:4])  # ~430 tokens
    proc, url, _ = serve(tmp_path)
    try:
        first, cached, length = ask(url, prompt)
        assert cached == 0 and disk_hits(url) == 0 and length > 400
    finally:
        stop(proc)
    proc, url, log = serve(tmp_path)
    try:
        again, cached, _ = ask(url, prompt)
        assert again == first
        # the prompt's whole blocks of 16 but the last token (recomputed for the heads), all from disk: RAM was empty
        assert cached >= (length - 1) // 16 * 16 - 1 and disk_hits(url) == cached
        assert "prefix cache on disk: " in log.read_text()
    finally:
        stop(proc)
    proc, url, _ = serve(tmp_path, "--no-prefix-cache-disk")
    try:
        off, cached, _ = ask(url, prompt)
        assert off == first and cached == 0
    finally:
        stop(proc)


def test_dry_run_prints_the_disk_budget(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", TARGET, "--dry-run", "--prefix-cache-dir",
                          str(tmp_path / "kv"), "--prefix-cache-disk-gb", "3"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"prefix cache on disk: {tmp_path / 'kv'}/" in run.stdout and "up to 3.0 GiB" in run.stdout
