"""The memory budget: weights first, then the KV caches of target and draft; refusals carry the numbers."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.memory import GiB, MemoryBudgetError, default_budget, plan_memory
from test_tokenizer import write_tiny_gguf


def test_plan_fits_as_many_sequences_as_the_budget_allows():
    plan = plan_memory(budget=10 * GiB, target_weights=2 * GiB, draft_weights=GiB, target_kv_per_token=28 * 1024,
                       draft_kv_per_token=12 * 1024, max_model_len=4096, max_num_seqs=256)
    per_seq = 4096 * 40 * 1024
    assert plan.max_num_seqs == (7 * GiB) // per_seq == 44
    assert plan.target_kv == 44 * 4096 * 28 * 1024 and plan.draft_kv == 44 * 4096 * 12 * 1024
    assert plan.kv_tokens == 44 * 4096
    report = plan.report()
    for label in ("target weights", "draft weights", "target KV cache", "draft KV cache", "44 sequences"):
        assert label in report
    # asking for fewer sequences than fit reserves only those
    assert plan_memory(10 * GiB, 2 * GiB, GiB, 28 * 1024, 12 * 1024, 4096, max_num_seqs=4).max_num_seqs == 4


def test_weights_that_do_not_fit_are_refused_with_the_numbers():
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(budget=2 * GiB, target_weights=2 * GiB, draft_weights=GiB // 2, target_kv_per_token=1,
                    draft_kv_per_token=1, max_model_len=16, max_num_seqs=1)
    message = str(e.value)
    assert "weights alone do not fit" in message
    assert "2.000 GiB" in message and "0.500 GiB" in message and "2.500 GiB" in message


def test_no_room_for_one_sequence_is_refused():
    with pytest.raises(MemoryBudgetError, match="less than the KV cache of one sequence of 4096 tokens"):
        plan_memory(budget=3 * GiB, target_weights=2 * GiB, draft_weights=GiB - 1024, target_kv_per_token=1024,
                    draft_kv_per_token=1024, max_model_len=4096, max_num_seqs=1)


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_llm_refuses_a_budget_smaller_than_the_weights(tiny_gguf, monkeypatch):
    from specdec import LLM

    monkeypatch.setattr("specdec.api.device_memory", lambda device: 100_000)
    with pytest.raises(MemoryBudgetError, match="weights alone do not fit"):
        LLM(str(tiny_gguf), speculative_model=str(tiny_gguf), quantization="none", dtype="float32",
            memory_utilization=0.5)


def test_a_budget_for_two_sequences_queues_the_rest_and_completes_them_all(tiny_gguf, monkeypatch):
    from specdec import LLM, SamplingParams

    probe = LLM(str(tiny_gguf), speculative_model=str(tiny_gguf), quantization="none", dtype="float32",
                max_model_len=64)
    plan = probe.memory_plan
    per_seq = 64 * (plan.target_kv_per_token + plan.draft_kv_per_token)
    room = plan.target_weights + plan.draft_weights + 2 * per_seq + per_seq // 2  # 2.5 sequences
    monkeypatch.setattr("specdec.api.device_memory", lambda device: room)
    llm = LLM(str(tiny_gguf), speculative_model=str(tiny_gguf), num_speculative_tokens=3, quantization="none",
              dtype="float32", max_model_len=64, max_num_seqs=8, memory_utilization=1.0)
    assert llm.memory_plan.max_num_seqs == 2 and llm.engine.max_batch_size == 2
    assert llm.engine.cache.batch_size == 2 and llm.engine.proposer.cache.batch_size == 2
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3, 1, 4, 1, 5]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(prompts, params)
    alone = [probe.generate([p], params)[0] for p in prompts]  # one sequence at a time
    assert all(out.finish_reason == "length" and len(out.token_ids) == 12 for out in batched)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]


def test_unknown_speculative_config_keys_are_refused():
    from specdec.config import SpeculativeConfig

    with pytest.raises(ValueError, match="unknown speculative config key.*num_speculative_token"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_token": 4})


def test_the_cpu_default_budget_gives_the_caches_4_gib():
    """Issue 36: on CPU the default took 0.9 of RAM, 17.3 GiB of 23.5 for the prefix cache. Now the weights
    plus CPU_CACHE_SPACE (4 GiB) for all K/V, or the running sequences' K/V if more; at most 0.9 of RAM."""
    ram = int(23.5 * GiB)
    budget, space = default_budget(torch.device("cpu"), ram)
    assert (budget, space) == (int(0.9 * ram), 4 * GiB)
    assert default_budget(torch.device("cuda"), ram) == (int(0.9 * ram), None)  # a GPU is the engine's alone
    kv = (28 + 12) * 1024  # bytes a token, target + draft; a sequence of 4096 tokens: 160 MiB
    plan = plan_memory(budget, GiB, GiB // 2, 28 * 1024, 12 * 1024, 4096, max_num_seqs=8, prefix_caching=True,
                       cache_space=space)
    assert plan.budget == GiB + GiB // 2 + 4 * GiB and plan.max_num_seqs == 8
    assert plan.prefix_cache_blocks == (4 * GiB - 8 * 4096 * kv) // (16 * kv)  # 2.75 GiB
    assert "CPU default" in plan.report().splitlines()[0]
    many = plan_memory(budget, GiB, 0, 28 * 1024, 12 * 1024, 32768, max_num_seqs=8, prefix_caching=True,
                       cache_space=space)  # 8 x 1.25 GiB of K/V: more than 4 GiB, all 8 still run
    assert many.max_num_seqs == 8 and many.budget == GiB + 8 * 32768 * kv and many.prefix_cache_blocks == 0
    small = plan_memory(4 * GiB, GiB, 0, 28 * 1024, 12 * 1024, 4096, max_num_seqs=8, cache_space=space)
    assert small.budget == 4 * GiB and small.budget_note == ""  # 0.9 of a small machine stays the cap


def test_llm_on_cpu_states_its_default_budget_and_honours_a_given_fraction(tiny_gguf, monkeypatch):
    from specdec import LLM

    ram = int(23.5 * GiB)
    monkeypatch.setattr("specdec.api.device_memory", lambda device: ram)
    default = LLM(str(tiny_gguf), quantization="none", dtype="float32", max_model_len=64, max_num_seqs=2,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    plan = default.memory_plan
    assert plan.budget == plan.target_weights + plan.draft_weights + 4 * GiB
    assert "the weights + 4.00 GiB for K/V caches, the CPU default" in plan.report()
    given = LLM(str(tiny_gguf), quantization="none", dtype="float32", max_model_len=64, max_num_seqs=2,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2}, memory_utilization=0.95)
    assert given.memory_plan.budget == int(0.95 * ram) and given.memory_plan.budget_note == ""


@pytest.mark.parametrize("quantization", ["auto", "none"], ids=["block kernels", "float"])
def test_a_q8_0_kv_cache_takes_fewer_bytes_a_token_and_drafts_decode_as_plain(tmp_path, quantization):
    """`kv_cache_dtype="q8_0"`: the plan counts 136 bytes a 128-value row (or the model's head size's), and
    greedy decoding with a draft model equals plain decoding on the same 8-bit cache, on the block kernels
    (the C++ layer encodes each token) and on float weights (torch encodes, attention reads the decoded rows),
    also from a prefix-cache hit."""
    from specdec import LLM, SamplingParams

    tiny_gguf = tmp_path / "tiny32.gguf"
    write_tiny_gguf(tiny_gguf, heads=2, kv_heads=1)  # heads of 32 values: Q8_0's block
    kw = dict(quantization=quantization, max_model_len=256)
    if quantization == "none":
        kw["dtype"] = "float32"
    plain16 = LLM(str(tiny_gguf), num_speculative_tokens=0, **kw)
    plain8 = LLM(str(tiny_gguf), num_speculative_tokens=0, kv_cache_dtype="q8_0", **kw)
    spec8 = LLM(str(tiny_gguf), speculative_model=str(tiny_gguf), num_speculative_tokens=3, kv_cache_dtype="q8_0", **kw)
    config = plain8.target.config
    row = config.head_dim + config.head_dim // 32 * 2
    assert plain8.memory_plan.target_kv_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * row
    assert plain8.memory_plan.target_kv_per_token < plain16.memory_plan.target_kv_per_token
    assert spec8.engine.cache.keys[0].dtype == torch.int8
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = list(range(5, 60))
    ref = plain8.generate(prompt, params)[0]
    out = spec8.generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids and out.metrics.num_drafts > 0
    again = spec8.generate(prompt, params)[0]  # its prompt's blocks from the prefix cache, as 8-bit rows
    assert again.metrics.cached_tokens > 0 and again.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        LLM(str(tiny_gguf), kv_cache_dtype="fp8", **kw)
