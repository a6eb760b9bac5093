"""Cache-aware routing of requests among engine replicas (`specdec serve --replicas N`).

The ingress turns each generation request into its prompt's block keys: the chain hashes the prefix cache
keys its blocks by (`specdec.engine.prefix_cache.block_keys`, salted with the request's `cache_salt`), computed
with the replicas' own tokenizer and chat template, so that a key names exactly a block a replica may hold.
`BlockAffinityRouter`, a Ray Serve request router, remembers which replicas each key was sent to and sends
a request to the replica holding its longest cached prefix, if that is at least half the prompt and the
replica is not busier than the least-loaded one by more than `imbalance` requests nor full
(`max_ongoing_requests`); otherwise (a new conversation, whose only cached blocks are a shared system
prompt; a body the ingress could not read) to the least-loaded replica. A request naming a stored response (a Responses request's
`previous_response_id`, `GET /v1/responses/{id}`) goes to the replica that stored it, which the id names
(`responses.owner_of`): no other replica has it.

Example (block_size 16): turn 1 of a conversation (a 40-token prompt: keys k1 k2) goes to the least-loaded
replica A, which records k1 k2 -> A. Turn 2 (the same 40 tokens, the answer, a new question: keys k1 k2 k3
k4 k5) matches k2 -> A and goes to A, whose prefix cache holds blocks k1 k2 (and k3 k4 once turn 1's answer
was saved); k1..k5 -> A. A Ray Serve default router (power of two choices) would send turn 2 to A or B at
random, and B would prefill it all.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import ValidationError

from specdec.engine.prefix_cache import BLOCK_SIZE, block_keys
from specdec.server import anthropic
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from specdec.server.responses import ResponsesRequest, owner_of

MAX_REMEMBERED_KEYS = 1 << 20  # block keys the router remembers (about 100 MB), least recently routed dropped
MIN_MATCH = 0.5  # the share of a prompt's blocks a replica must hold to be preferred (SGLang's cache_threshold)


@dataclass(frozen=True)
class RouteHint:
    """What the router reads of a request: its prompt's block keys, first block first (empty: no affinity), or
    the replica holding the stored response it names."""

    keys: tuple[bytes, ...] = field(default_factory=tuple)
    stored_by: str | None = None


class PromptKeys:
    """The block keys of a request body, as the replicas' prefix caches key its prompt.
    `tokenizer` must be the replicas' (with their chat template); `special_text` their
    `--special-tokens-in-messages`."""

    def __init__(self, tokenizer, special_text: bool = False, block_size: int = BLOCK_SIZE):
        self.tokenizer, self.special_text, self.block_size = tokenizer, special_text, block_size

    def of(self, path: str, body: bytes) -> RouteHint:
        """The hint for a request to `path` with JSON `body`; an empty hint for a route that generates nothing,
        a body that does not parse (the replica answers its error); for a request naming a stored response,
        the replica that stored it (its history is there)."""
        from specdec.server.prompts import chat_prompt_ids, completion_prompt_ids

        if path.startswith("/v1/responses/"):
            return RouteHint(stored_by=owner_of(path.removeprefix("/v1/responses/").split("/")[0]))
        try:
            if path == "/v1/responses":
                previous = ResponsesRequest.model_validate_json(body).previous_response_id
                if previous:
                    return RouteHint(stored_by=owner_of(previous))
            if path == "/v1/completions":
                req = CompletionRequest.model_validate_json(body)
                ids = completion_prompt_ids(self.tokenizer, req.prompts()[0])
            else:
                req = self._chat_request(path, body)
                if req is None:
                    return RouteHint()
                ids = chat_prompt_ids(self.tokenizer, req.template_messages(), req.template_tools(),
                                       special_text=self.special_text)
        except (ValidationError, APIError, ValueError, IndexError):
            return RouteHint()
        return RouteHint(tuple(block_keys(ids, self.block_size, req.cache_salt)))

    @staticmethod
    def _chat_request(path: str, body: bytes) -> ChatCompletionRequest | None:
        if path == "/v1/chat/completions":
            return ChatCompletionRequest.model_validate_json(body)
        if path == "/v1/messages":
            return anthropic.MessagesRequest.model_validate_json(body).to_chat()
        if path == "/v1/responses":
            return ResponsesRequest.model_validate_json(body).to_chat([])
        return None


class KeyOwners:
    """Block key -> the replicas requests holding it were sent to (an LRU map of `capacity` keys)."""

    def __init__(self, capacity: int = MAX_REMEMBERED_KEYS):
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def deepest(self, keys: tuple[bytes, ...], live: set[str]) -> tuple[int, set[str]]:
        """How many of `keys` the best live replicas hold (a key's chain hash implies every key before it),
        and which replicas those are; (0, set()) when none holds the first."""
        for depth in range(len(keys), 0, -1):
            holders = self._holders.get(keys[depth - 1], set()) & live
            if holders:
                return depth, holders
        return 0, set()

    def record(self, keys: tuple[bytes, ...], replica: str) -> None:
        for key in keys:
            self._holders.setdefault(key, set()).add(replica)
            self._holders.move_to_end(key)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)


def choose(keys: tuple[bytes, ...], owners: KeyOwners, queue_lens: dict[str, int | None], imbalance: int,
           min_match: float = MIN_MATCH, stored_by: str | None = None) -> list[list[str]]:
    """The ranks of replicas to try (Ray Serve tries a rank's least-loaded replica that is not full, the first
    of equals, then the next rank): the replica holding the most of `keys` first, if it holds at least
    `min_match` of them (less is a new conversation sharing a system prompt: load matters more) and its queue
    is not longer than the shortest by more than `imbalance` (an unknown length counts as 0); then every
    replica. Ties (a prefix several replicas hold; nothing held) are broken by rendezvous hashing on the first
    key past the held ones, so that new conversations spread evenly.
    Example: owners {k1: {A, B}, k2: {A}}, keys (k1, k2, k3), queues {"A": 3, "B": 1}, imbalance 4 ->
    [["A"], [A, B in k3's rendezvous order]] (A holds 2 of 3 keys).
    A request naming a stored response goes to the replica that stored it (`stored_by`) alone, however busy
    (any other would answer 404); if it is gone (restarted: its store went with it), to any replica."""
    if stored_by in queue_lens:
        return [[stored_by]]
    depth, holders = owners.deepest(keys, set(queue_lens))
    tiebreak = keys[min(depth, len(keys) - 1)] if keys else b""
    everyone = sorted(queue_lens, key=lambda replica: hashlib.sha256(tiebreak + replica.encode()).digest())
    best = next((replica for replica in everyone if replica in holders), None)
    if best is None or depth < min_match * len(keys):
        return [everyone]
    lens = {r: n or 0 for r, n in queue_lens.items()}
    if lens[best] - min(lens.values()) > imbalance:
        return [everyone]
    return [[best], everyone]
