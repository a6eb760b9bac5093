"""Suffix decoding's data structure (Oliaro et al., arXiv 2411.04975): suffix tries over token sequences,
and the cache of them a server keeps. Nothing here knows the engine; `proposers.SuffixProposer` adapts it.

A `SuffixTrie` holds every substring of length <= `depth` of its sequences, each node counting the occurrences
of its string. Appending a token inserts the suffixes that end at it (O(depth)); removing a sequence subtracts
its counts. `speculate(context)` finds the longest-scoring continuation: for each match length m (the
context's last m tokens, a path of the trie), it follows the most frequent child (ties: the most recently
seen) while the path's empirical probability (the product of count(child) / the children's total count)
stays >= `min_token_prob`, for at most min(max_tokens, m * max_spec_factor, depth - m) tokens; the draft of
the highest score (sum of its path probabilities) wins. With `tree`, the draft is a tree, grown best-first
by path probability.

Example: one sequence [1 2 3 1 2 4 1 2 3], depth 8. Context [.. 1 2]: the match [1 2] has children 3
(count 2) and 4 (count 1): 3 with probability 2/3, then [1 2 3]'s only continuation 1 (2/3), ...

`SuffixCache` keeps one trie per running request (its prompt and output) and global tries of past outputs,
one per `cache_salt`, holding at most `max_cached_requests` outputs in all (the oldest evicted first); a
request drafts from its own trie and from its salt's global trie, whichever scores higher. Requests without
a salt share nothing unless `share_unsalted` says so (a single-user server): how fast a draft is accepted
tells a client whether another's output held the text it guessed, so outputs cross only between requests
that declare they belong together.

The trie is C++ (`suffix_trie.cpp`, built at install as a library of its own, `specdec.kernels.native`, and
loaded with ctypes: about a microsecond per appended token and per drafted token,
`benchmarks/bench_suffix_trie.py`); `PySuffixTrie` is the same algorithm in Python, the reference the tests
check the C++ one against and the fallback where the library cannot be loaded.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import subprocess
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from specdec.kernels import native

logger = logging.getLogger(__name__)

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # parent of token i among them (-1: the context's last token)
    probs: list[float] = field(default_factory=list)  # the empirical probability of the path to token i
    score: float = 0.0  # sum of probs: the expected number of accepted tokens, were the counts right
    match_len: int = 0  # context tokens matched


# ------------------------------------------------------------------------------------------- the C++ trie
def load_library() -> ctypes.CDLL | None:
    """The compiled trie (installed with specdec; in a developer's checkout whose C++ differs, built on first
    use), or None when it cannot be loaded (see `_lib_error`)."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None or _lib_error is not None:
            return _lib
        try:
            lib = ctypes.CDLL(str(native.library_path("specdec_suffix_trie")))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            _lib_error = f"{type(e).__name__}: {detail[-300:]}"
            logger.warning("suffix decoding runs its Python trie (slower): the C++ one did not load: %s", _lib_error)
            return None
        i32p, f64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_double)
        lib.st_new.restype, lib.st_new.argtypes = ctypes.c_void_p, [ctypes.c_int]
        lib.st_free.argtypes = [ctypes.c_void_p]
        lib.st_extend.argtypes = [ctypes.c_void_p, ctypes.c_int, i32p, ctypes.c_int]
        lib.st_remove.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.st_speculate.restype = ctypes.c_int
        lib.st_speculate.argtypes = [ctypes.c_void_p, i32p, ctypes.c_int, ctypes.c_int, ctypes.c_double,
                                     ctypes.c_double, ctypes.c_int, i32p, i32p, f64p, f64p, i32p]
        for name in ("st_count", "st_num_nodes", "st_bytes"):
            getattr(lib, name).restype = ctypes.c_int64
        lib.st_count.argtypes = [ctypes.c_void_p, i32p, ctypes.c_int]
        lib.st_num_nodes.argtypes = lib.st_bytes.argtypes = [ctypes.c_void_p]
        _lib = lib
        return lib


def _ints(values: Sequence[int]):
    return (ctypes.c_int32 * len(values))(*values)


class SuffixTrie:
    """The C++ trie (see the module's docstring); sequences are named by int ids."""

    def __init__(self, depth: int, lib: ctypes.CDLL) -> None:
        self.depth = depth
        self._lib = lib
        self._handle = lib.st_new(depth)
        self._grow(32)

    def _grow(self, n: int) -> None:
        """Output buffers for drafts of n tokens, kept between calls (the ctypes calls cost more than the work)."""
        self._tokens, self._parents, self._probs = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_double * n)()
        self._score, self._match = ctypes.c_double(), ctypes.c_int32()

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.st_free(self._handle)
            self._handle = None

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        if len(tokens):
            self._lib.st_extend(self._handle, seq_id, _ints(tokens), len(tokens))

    def remove(self, seq_id: int) -> None:
        self._lib.st_remove(self._handle, seq_id)

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> SuffixDraft:
        context = context[-self.depth:]
        if max_tokens <= 0 or not len(context):
            return SuffixDraft()
        if max_tokens > len(self._tokens):
            self._grow(max_tokens)
        n = self._lib.st_speculate(self._handle, _ints(context), len(context), max_tokens, max_spec_factor,
                                   min_token_prob, int(tree), self._tokens, self._parents, self._probs,
                                   ctypes.byref(self._score), ctypes.byref(self._match))
        if n == 0:
            return SuffixDraft()
        return SuffixDraft(self._tokens[:n], self._parents[:n], self._probs[:n], self._score.value, self._match.value)

    def count(self, s: Sequence[int]) -> int:
        return int(self._lib.st_count(self._handle, _ints(s), len(s)))

    @property
    def num_nodes(self) -> int:
        return int(self._lib.st_num_nodes(self._handle))

    @property
    def memory_bytes(self) -> int:
        return int(self._lib.st_bytes(self._handle))


# ------------------------------------------------------------------------------------------- the reference
class _Node:
    __slots__ = ("token", "count", "stamp", "children")

    def __init__(self, token: int) -> None:
        self.token, self.count, self.stamp, self.children = token, 0, 0, {}


class PySuffixTrie:
    """The same trie in plain Python: slow and obviously correct (the tests check the C++ one against it)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(-1)
        self.seqs: dict[int, list[int]] = {}
        self.clock = 0

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        for t in tokens:
            seq.append(int(t))
            self.clock += 1
            self.root.count += 1
            for start in range(max(0, len(seq) - self.depth), len(seq)):  # the suffixes ending at t
                node = self.root
                for u in seq[start:-1]:
                    node = node.children[u]
                child = node.children.setdefault(int(t), _Node(int(t)))
                child.count += 1
                child.stamp = self.clock

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, [])
        self.root.count -= len(seq)
        for start in range(len(seq)):
            node = self.root
            for u in seq[start:start + self.depth]:
                child = node.children[u]
                child.count -= 1
                if child.count == 0:
                    del node.children[u]
                    break
                node = child

    def _find(self, s: Sequence[int]) -> _Node | None:
        node = self.root
        for u in s:
            node = node.children.get(int(u))
            if node is None:
                return None
        return node

    def count(self, s: Sequence[int]) -> int:
        node = self._find(s)
        return 0 if node is None else node.count

    @staticmethod
    def _ranked(node: _Node) -> list[_Node]:
        return sorted(node.children.values(), key=lambda c: (-c.count, -c.stamp))

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> SuffixDraft:
        context = list(context[-self.depth:])
        best = SuffixDraft()
        if max_tokens <= 0:
            return best
        for m in range(1, min(len(context), self.depth - 1) + 1):
            node = self._find(context[-m:])
            if node is None:
                break
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            draft = self._tree(node, m, limit, min_token_prob) if tree else \
                self._path(node, min(limit, self.depth - m), min_token_prob)
            draft.score = sum(draft.probs)
            if draft.tokens and draft.score >= best.score:
                best, best.match_len = draft, m
        return best

    def _path(self, node: _Node, limit: int, min_prob: float) -> SuffixDraft:
        draft, prob = SuffixDraft(), 1.0
        while len(draft.tokens) < limit and node.children:
            ranked = self._ranked(node)
            prob *= ranked[0].count / sum(c.count for c in ranked)
            if prob < min_prob:
                break
            draft.parents.append(len(draft.tokens) - 1)
            draft.tokens.append(ranked[0].token)
            draft.probs.append(prob)
            node = ranked[0]
        return draft

    def _tree(self, node: _Node, m: int, limit: int, min_prob: float) -> SuffixDraft:
        draft, frontier, order = SuffixDraft(), [], 0

        def push_children(source: _Node, prob: float, parent: int, depth: int) -> None:
            nonlocal order
            if m + depth >= self.depth:
                return
            total = sum(c.count for c in source.children.values())
            for c in self._ranked(source):
                p = prob * c.count / total
                if p >= min_prob:
                    heapq.heappush(frontier, (-p, order, c, parent, depth + 1))
                    order += 1

        push_children(node, 1.0, -1, 0)
        while len(draft.tokens) < limit and frontier:
            neg_p, _, child, parent, depth = heapq.heappop(frontier)
            draft.parents.append(parent)
            draft.tokens.append(child.token)
            draft.probs.append(-neg_p)
            push_children(child, -neg_p, len(draft.tokens) - 1, depth)
        return draft

    @property
    def num_nodes(self) -> int:
        stack, n = [self.root], 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n

    @property
    def memory_bytes(self) -> int:
        return self.num_nodes * 200 + sum(len(s) for s in self.seqs.values()) * 8  # rough


def new_trie(depth: int) -> SuffixTrie | PySuffixTrie:
    """The C++ trie, or the Python one where it cannot be built."""
    lib = load_library()
    return SuffixTrie(depth, lib) if lib is not None else PySuffixTrie(depth)


# ------------------------------------------------------------------------------------------- the cache
@dataclass
class _Active:
    trie: SuffixTrie | PySuffixTrie  # the request's own: prompt and output
    prompt_len: int
    consumed: int  # tokens of the request added so far
    salt: str | None
    global_id: int | None  # its output's id in the salt's global trie (None: not cached, or evicted)


class SuffixCache:
    """Tries for running requests (by key) and for past outputs (by salt), as SuffixDecoding keeps them.

    `max_cached_requests` outputs stay in the global tries at most, in all salts together; starting a request
    evicts the oldest beyond that (0: no global tries). A request's output enters its salt's global trie as it
    is generated, so requests running together draft from each other too (n > 1 samples of one prompt).
    Unsalted requests (salt None) have no global trie unless `share_unsalted`: each drafts from its own prompt
    and output only.

        cache = SuffixCache(max_depth=24, max_cached_requests=100)
        cache.start("a", prompt_ids)
        cache.extend("a", new_ids)          # prompt_ids + new_ids: all of request "a" so far
        draft = cache.speculate("a", tokens[-24:], max_tokens=8)
        cache.stop("a")                     # its output stays in the global trie of its salt
    """

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10000, share_unsalted: bool = False) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.share_unsalted = share_unsalted
        self.active: dict[object, _Active] = {}
        self.global_tries: dict[str | None, SuffixTrie | PySuffixTrie] = {}
        self.cached: OrderedDict[int, str | None] = OrderedDict()  # global id -> salt, oldest first
        self._per_salt: Counter = Counter()  # outputs cached per salt
        self._next_id = 0

    def start(self, key, prompt: Sequence[int], salt: str | None = None) -> None:
        if key in self.active:
            raise ValueError(f"request {key!r} is already active")
        trie = new_trie(self.max_depth)
        trie.extend(0, prompt)
        global_id = None
        if self.max_cached_requests > 0 and (salt is not None or self.share_unsalted):
            global_id, self._next_id = self._next_id, self._next_id + 1
            self.cached[global_id] = salt
            self._per_salt[salt] += 1
            while len(self.cached) > self.max_cached_requests:
                self._evict(next(iter(self.cached)))
        self.active[key] = _Active(trie, len(prompt), len(prompt), salt, global_id)

    def extend_prompt(self, key, tokens: Sequence[int]) -> None:
        """Append more of the request's prompt (read chunk by chunk: `start` took its beginning). Only its own
        trie learns them: the global tries hold outputs."""
        state = self.active[key]
        state.trie.extend(0, tokens)
        state.consumed += len(tokens)

    def extend(self, key, tokens: Sequence[int]) -> None:
        """Append tokens of the request's output."""
        state = self.active[key]
        state.trie.extend(0, tokens)
        state.consumed += len(tokens)
        if state.global_id is not None and state.global_id in self.cached:
            trie = self.global_tries.get(state.salt)
            if trie is None:
                trie = self.global_tries[state.salt] = new_trie(self.max_depth)
            trie.extend(state.global_id, tokens)

    def consumed(self, key) -> int:
        return self.active[key].consumed

    def stop(self, key) -> None:
        self.active.pop(key, None)

    def _evict(self, global_id: int) -> None:
        salt = self.cached.pop(global_id)
        trie = self.global_tries.get(salt)
        if trie is not None:
            trie.remove(global_id)
        self._per_salt[salt] -= 1
        if self._per_salt[salt] == 0:
            del self._per_salt[salt]
            self.global_tries.pop(salt, None)

    def speculate(self, key, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> SuffixDraft:
        """The better-scoring draft of the request's own trie and its salt's global trie."""
        state = self.active[key]
        args = (max_tokens, max_spec_factor, min_token_prob, tree)
        best = state.trie.speculate(context, *args)
        trie = self.global_tries.get(state.salt) if state.salt is not None or self.share_unsalted else None
        if trie is not None:
            other = trie.speculate(context, *args)
            if other.score > best.score:
                best = other
        return best

    @property
    def memory_bytes(self) -> int:
        tries = [s.trie for s in self.active.values()] + list(self.global_tries.values())
        return sum(t.memory_bytes for t in tries)
