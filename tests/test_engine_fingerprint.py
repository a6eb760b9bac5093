"""The engine's behaviour, bit for bit, against a recording (`engine_fingerprint.py`): tokens, log-probabilities,
metrics, and the cache rows and pages after every step, over batching, speculative methods, prefix-cache hits,
riding prompts and preemption on tiny random models. A refactor must leave every hash as recorded. The hashes
depend on the machine's arithmetic as well: elsewhere than where they were recorded the test is skipped (compare
two checkouts there with `python tests/engine_fingerprint.py` instead)."""

from __future__ import annotations

import json

import pytest

import engine_fingerprint
from fakes import one_intra_op_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

RECORDED = json.loads(engine_fingerprint.REFERENCE.read_text())
SCENARIOS = dict(engine_fingerprint.scenarios())


def test_every_scenario_is_recorded():
    assert sorted(RECORDED["hashes"]) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", sorted(RECORDED["hashes"]))
def test_the_engine_behaves_as_recorded(name):
    if engine_fingerprint.machine() != RECORDED["machine"]:
        pytest.skip(f"recorded on {RECORDED['machine']}, not this machine ({engine_fingerprint.machine()})")
    with engine_fingerprint.torch.no_grad():
        assert SCENARIOS[name]() == RECORDED["hashes"][name], \
            f"{name}: the engine's outputs, metrics or pages changed; a refactor must change none of them (a " \
            "change meant to, a schedule's or a metric's, records them again: python tests/engine_fingerprint.py " \
            "--record, and says so in its commit)"
