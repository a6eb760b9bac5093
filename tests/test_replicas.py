"""`specdec serve --replicas`: cache-aware routing (pure functions), the metrics merge, and two replicas of a
tiny random model on a local Ray Serve (`specdec.testing.tiny_server`): answers equal to one process's,
/health and /metrics over the replicas, conversations kept on one replica, and a replica killed mid-stream.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections import Counter
from unittest import mock

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from specdec.engine.prefix_cache import block_keys
from specdec.server.app import build_app
from specdec.server.async_engine import AsyncEngine
from specdec.server.cli import add_serve_arguments
from specdec.server.metrics import ServerMetrics
from specdec.server.metrics_merge import merge_metrics
from specdec.server.prompts import chat_prompt_ids
from specdec.server.responses import ResponseStore, owner_of
from specdec.server.routing import KeyOwners, PromptKeys, RouteHint, choose
from specdec.testing import tiny_server
from specdec.testing.byte_tokenizer import ByteTokenizer
from test_server_unit import free_port

CHAT = "/v1/chat/completions"


def chat(messages: list[dict], **kw) -> dict:
    return {"model": tiny_server.NAME, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}


def conversation(i: int, turns: int) -> list[dict]:
    """Turn `turns` of conversation i: its first question (64 bytes: 4 blocks, the first its own), the
    answers so far."""
    messages = [{"role": "user", "content": f"{i:03d} " * 5 + "tell me about routing " * 2}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"and {t}?"}]
    return messages


# ---- routing and merging, without Ray ---------------------------------------------------------------


def test_choose_sends_to_the_replica_holding_most_blocks_unless_it_is_too_busy():
    owners = KeyOwners()
    owners.record((b"k1", b"k2"), "A")
    owners.record((b"k1",), "B")  # a shared first block (a system prompt) on both

    def ranks(keys, lens, imbalance=4):
        return [sorted(rank) for rank in choose(keys, owners, lens, imbalance)]

    assert ranks((b"k1", b"k2", b"k3"), {"A": 3, "B": 1}) == [["A"], ["A", "B"]]
    assert ranks((b"k1", b"k2"), {"A": 9, "B": 1}) == [["A", "B"]]  # A too busy
    assert ranks((b"k1", b"k2"), {"A": None, "B": None}, imbalance=0) == [["A"], ["A", "B"]]
    assert ranks((b"x",), {"A": 0, "B": 0}) == [["A", "B"]]  # nothing held
    assert ranks((), {"A": 0, "B": 0}) == [["A", "B"]]  # no hint
    assert ranks((b"k1", b"k2"), {"B": 0, "C": 0}) == [["B"], ["B", "C"]]  # A is gone: B holds k1
    assert ranks((b"k1", b"k2", b"x", b"y", b"z"), {"A": 1, "B": 0}) == [["A", "B"]]  # A holds 2 of 5: new
    tied = choose((b"k1", b"k9"), owners, {"A": 0, "B": 0}, 4)  # both hold k1: k9's rendezvous order decides
    assert tied[0][0] in "AB" and tied[1][0] == tied[0][0]


def test_key_owners_forget_the_least_recently_routed_keys():
    owners = KeyOwners(capacity=2)
    owners.record((b"a", b"b"), "A")
    owners.record((b"c",), "B")
    assert owners.deepest((b"a",), {"A", "B"}) == (0, set())
    assert owners.deepest((b"b", b"c"), {"A", "B"}) == (2, {"B"}) and owners.deepest((b"b",), {"A"}) == (1, {"A"})


def test_new_conversations_spread_evenly_over_equally_loaded_replicas():
    owners = KeyOwners()
    owners.record((b"system",), "A")
    owners.record((b"system",), "B")
    owners.record((b"system",), "C")
    firsts = Counter(choose((b"system", bytes([i, j])), owners, {"A": 0, "B": 0, "C": 0}, 4)[0][0]
                     for i in range(30) for j in range(10))
    assert set(firsts) == {"A", "B", "C"} and min(firsts.values()) > 60  # 100 each expected; 60 is 4.9 sigma off


def test_prompt_keys_are_the_prefix_cache_block_keys_of_the_prompt():
    tokenizer = ByteTokenizer()
    keys = PromptKeys(tokenizer)
    first, second = conversation(0, 1), conversation(0, 2)
    hint = keys.of(CHAT, json.dumps(chat(first)).encode())
    assert hint.keys == tuple(block_keys(chat_prompt_ids(tokenizer, first), 16)) and len(hint.keys) >= 3
    # the next turn's prompt extends the first's (the answer follows `<assistant>`): its keys extend them
    later = keys.of(CHAT, json.dumps(chat(second)).encode())
    assert later.keys[:len(hint.keys)] == hint.keys and len(later.keys) > len(hint.keys)
    salted = keys.of(CHAT, json.dumps(chat(first, cache_salt="tenant-1")).encode())
    assert salted.keys and not set(salted.keys) & set(hint.keys)
    completion = keys.of("/v1/completions", json.dumps({"prompt": "x" * 40}).encode())
    assert completion.keys == tuple(block_keys(list(b"x" * 40), 16))
    assert keys.of(CHAT, b"{not json") == RouteHint() and keys.of("/tokenize", b"{}") == RouteHint()
    continued = {"input": "and then?", "previous_response_id": "resp_1"}  # not a replica's id: no affinity
    assert keys.of("/v1/responses", json.dumps(continued).encode()) == RouteHint()
    owned = ResponseStore(owner="r2d2").new_id()  # a replica's store: its ids name it
    continued["previous_response_id"] = owned
    assert keys.of("/v1/responses", json.dumps(continued).encode()) == RouteHint(stored_by="r2d2")
    assert keys.of(f"/v1/responses/{owned}", b"") == RouteHint(stored_by="r2d2")


def test_a_stored_response_is_continued_on_the_replica_that_stored_it():
    owners = KeyOwners()
    owners.record((b"k1",), "A")
    assert choose((b"k1",), owners, {"A": 0, "B": 9}, 4, stored_by="B") == [["B"]]  # however busy
    assert sorted(choose((), owners, {"A": 0, "B": 0}, 4, stored_by="C")[0]) == ["A", "B"]  # C restarted: any
    store = ResponseStore(owner="abc123")
    assert owner_of(store.new_id()) == "abc123" and owner_of(ResponseStore().new_id()) is None
    assert owner_of("resp_abc123_" + "0" * 31) is None and owner_of(None) is None
    with pytest.raises(ValueError, match="letters and digits"):
        ResponseStore(owner="a_b")


def test_merged_metrics_are_the_sums_over_replicas():
    a, b = ServerMetrics("m"), ServerMetrics("m")
    a.prompt_tokens.labels("m").inc(10)
    b.prompt_tokens.labels("m").inc(5)
    a.request_finished("stop", 3, 0.1, 0.5)
    b.request_finished("stop", 4, 0.2, 2.0)
    b.request_finished("length", 4, 0.2, 2.0)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(merge_metrics([a.render(), b.render()]).decode())
               for s in f.samples}
    assert samples[("specdec:prompt_tokens_total", (("model_name", "m"),))] == 15
    assert samples[("specdec:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 2
    assert samples[("specdec:e2e_request_latency_seconds_count", (("model_name", "m"),))] == 3
    assert samples[("specdec:e2e_request_latency_seconds_bucket", (("le", "1.0"), ("model_name", "m")))] == 1


# ---- two replicas on Ray Serve ----------------------------------------------------------------------


def serve_args(*flags: str) -> argparse.Namespace:
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(list(flags))


# Ray Serve's own waits are fixed: its controller kills a proxy that does not answer its ready check within 5 s
# (or three health checks in a row within 10 s), and `serve.run` gives the proxies 60 s to serve. On a loaded
# machine the fixture failed on them (the proxy not ready in time, its actor killed). The local Ray started here
# gives those checks a minute, and the fixture waits on readiness itself, up to `READY_WITHIN`: the application
# running, every proxy healthy, /health answering 200.
RAY_SERVE_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
READY_WITHIN = 600.0  # s: starting Ray, its proxy and both replicas, however loaded the machine


@pytest.fixture(scope="module")
def replicas():
    """Two tiny replicas, 2 sequences each and 2 requests at once at most (so that 4 streams take both)."""
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install -e '.[cluster]' (scripts/setup.sh)")
    import ray
    from ray import serve

    from specdec.server.replicas import ReplicaSpec, build_application

    deadline = time.monotonic() + READY_WITHIN
    port = free_port()
    args = serve_args("--replicas", "2", "--max-num-seqs", "2", "--replica-max-ongoing-requests", "2")
    with mock.patch.dict(os.environ, RAY_SERVE_PATIENCE):  # (inherited by the local Ray's processes)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            serve.run(build_application(ReplicaSpec(args, loader="specdec.testing.tiny_server")), name="specdec",
                      route_prefix="/")
        except TimeoutError:  # ("Proxies not available after 60s": a proxy still starting; waited on below)
            pass
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            wait_until(lambda: serving() and healthy(client), "the application running, its proxies healthy and "
                       "both replicas reporting healthy", timeout=deadline - time.monotonic())
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def serving() -> bool:
    """Whether Ray Serve reports the application running and every proxy healthy (a deployment that failed
    for good fails the fixture at once)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus, ProxyStatus

    status = serve.status()
    app = status.applications.get("specdec")
    if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
        raise RuntimeError(f"the replicas' application failed to deploy: {app.message}")
    return app is not None and app.status == ApplicationStatus.RUNNING and bool(status.proxies) and all(
        proxy == ProxyStatus.HEALTHY for proxy in status.proxies.values())


def healthy(client) -> bool:
    """Whether /health answers 200 (not yet: a connection refused while a proxy (re)starts, a timeout)."""
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.2)


def test_replicas_answer_as_one_process_does(replicas):
    body = chat(conversation(7, 2), max_tokens=12)
    engine = AsyncEngine(tiny_server.load_engine(serve_args("--max-num-seqs", "2"))[0])
    with TestClient(build_app(engine, [tiny_server.NAME])) as one_process:
        expected = one_process.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    answer = replicas.post(CHAT, json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == expected
    with replicas.stream("POST", CHAT, json={**body, "stream": True}) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == expected
    assert replicas.post(CHAT, json={**body, "temperature": -1}).status_code == 400  # the replica's own errors


def test_responses_continue_on_the_replica_that_stored_them(replicas):
    """Each replica keeps its own stored responses: a conversation through previous_response_id, and a GET of
    a stored response, reach the replica that stored it, whichever replica the first turn went to."""
    for i in range(3):
        first = replicas.post("/v1/responses", json={"model": tiny_server.NAME, "input": f"conversation {i}",
                                                     "max_output_tokens": 4})
        assert first.status_code == 200, first.text
        stored_on, previous = first.headers["x-specdec-replica"], first.json()["id"]
        for turn in range(3):
            later = replicas.post("/v1/responses", json={"model": tiny_server.NAME, "input": f"turn {turn}",
                                                         "previous_response_id": previous, "max_output_tokens": 4})
            assert later.status_code == 200, later.text
            assert later.headers["x-specdec-replica"] == stored_on
            previous = later.json()["id"]
        got = replicas.get(f"/v1/responses/{previous}")
        assert got.status_code == 200 and got.json()["id"] == previous


def prompt_tokens(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == "specdec:prompt_tokens_total")


def settled(read):
    """`read()` once two reads 1.5 s apart agree."""
    previous, value = None, read()
    while value != previous:
        time.sleep(1.5)
        previous, value = value, read()
    return value


def test_health_replicas_and_metrics_cover_every_replica(replicas):
    listed = replicas.get("/replicas").json()
    assert listed["expected"] == 2 and sorted(r["rank"] for r in listed["replicas"]) == [0, 1]
    before = settled(lambda: prompt_tokens(replicas))  # the replicas report every second
    used = [replicas.post(CHAT, json=chat(conversation(100 + i, 1))) for i in range(4)]
    ranks = {r.headers["x-specdec-replica"] for r in used}
    total = before + sum(r.json()["usage"]["prompt_tokens"] for r in used)
    wait_until(lambda: prompt_tokens(replicas) == total, f"/metrics counting {total} prompt tokens (ranks {ranks})",
               timeout=10)


def test_affinity_keeps_each_conversation_on_one_replica(replicas):
    seen: dict[int, set[str]] = {i: set() for i in range(16)}  # all on one replica: odds 2 ** -15
    for turn in range(1, 4):
        for i in seen:
            answer = replicas.post(CHAT, json=chat(conversation(i, turn)))
            assert answer.status_code == 200
            seen[i].add(answer.headers["x-specdec-replica"])
    assert all(len(ranks) == 1 for ranks in seen.values()), seen
    assert set().union(*seen.values()) == {"0", "1"}  # new conversations went to the less loaded replica


def stream_until_end(client: httpx.Client, i: int, out: dict, first: threading.Event) -> None:
    body = chat(conversation(200 + i, 1), max_tokens=700, ignore_eos=True, stream=True)
    with client.stream("POST", CHAT, json=body) as stream:
        out["rank"] = stream.headers["x-specdec-replica"]
        events = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    out["events"] = events


def test_a_replica_killed_mid_stream_fails_only_its_own_requests(replicas):
    outs = [{} for _ in range(4)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream_until_end, args=(replicas, i, outs[i], started[i])) for i in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    victim = next(r for r in replicas.get("/replicas").json()["replicas"] if r["rank"] == 0)
    os.kill(victim["pid"], signal.SIGKILL)
    # not started yet: served by a live replica, or by the killed one once restarted (whose time is bounded
    # below), so it gets longer than the client's 60 s: on a loaded machine the restart alone took over 60 s
    after_kill = replicas.post(CHAT, json=chat(conversation(300, 1)), timeout=240)
    for t in threads:
        t.join(120)
    assert after_kill.status_code == 200
    assert sorted(o["rank"] for o in outs) == ["0", "0", "1", "1"]
    for o in outs:
        last = json.loads(o["events"][-2])
        if o["rank"] == "0":
            assert last["error"]["code"] == "replica_failed" and o["events"][-1] == "[DONE]"
        else:
            assert last["choices"][0]["finish_reason"] == "length" and o["events"][-1] == "[DONE]"

    def restarted() -> bool:
        listed = replicas.get("/replicas").json()["replicas"]
        return replicas.get("/health").status_code == 200 and victim["pid"] not in {r["pid"] for r in listed}

    wait_until(restarted, "Ray Serve restarting the killed replica", timeout=60)


def test_the_serve_run_application_reads_the_serve_flags():
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install -e '.[cluster]' (scripts/setup.sh)")
    from ray.serve import Application

    from specdec.deploy import app

    assert isinstance(app({"flags": "qwen2.5-coder-0.5b-instruct --replicas 3 --routing default"}), Application)
    with pytest.raises(ValueError, match="flags="):
        app({"replicas": "2"})
    with pytest.raises(ValueError, match="--routing"):
        app({"flags": "--routing nearest"})
    with pytest.raises(ValueError, match="--replicas"):
        app({"flags": "--replicas 0"})


def aborted(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples
               if s.name == "specdec:request_success_total" and s.labels.get("finished_reason") == "abort")


def test_a_client_leaving_mid_stream_aborts_its_request_on_the_replica(replicas):
    before = settled(lambda: aborted(replicas))
    body = chat(conversation(400, 1), max_tokens=700, ignore_eos=True, stream=True)
    with replicas.stream("POST", CHAT, json=body) as stream:
        assert next(stream.iter_lines()).startswith("data: ")
    wait_until(lambda: aborted(replicas) == before + 1, "the replica counting the stream as aborted", timeout=20)
