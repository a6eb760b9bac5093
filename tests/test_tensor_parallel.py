"""Tensor parallelism (`specdec.parallel.tensor`) on 2 CPU processes (gloo): one decoder layer and the whole
tiny model (bf16, the model code of one process) give the same bits as one process, for 1 to 16 rows, and
the sharded KV cache decodes on as the whole one does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_model
from specdec.models.llama import attention_inputs
from specdec.parallel.tensor import gather_last, shard_model
from test_server_unit import free_port

WORLD = 2


CHECKS = ("gather", "one_layer", "whole_model")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str]:
    """Every check run once, in WORLD processes joined by gloo (a start costs seconds): check -> "ok", or
    the first failing rank's error."""
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    found = {}
    for check in CHECKS:
        errors = [(out / f"{check}.{rank}").read_text() for rank in range(WORLD)]
        found[check] = next((e for e in errors if e != "ok"), "ok")
    return found


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for check in CHECKS:
            try:
                globals()[f"check_{check}"](rank)
                outcome = "ok"
            except AssertionError as e:
                outcome = f"rank {rank}: {e}"
            with open(os.path.join(out, f"{check}.{rank}"), "w") as f:
                f.write(outcome)
    finally:
        dist.destroy_process_group()


def models(rank: int):
    """The tiny model (bf16: 4 heads, 2 KV heads, as the engine runs its target on CPU) and this rank's part."""
    whole = tiny_model("qwen2", seed=3, dtype=torch.bfloat16, num_hidden_layers=2, max_position_embeddings=64)
    return whole, shard_model(whole, rank, WORLD)


def check_one_layer(rank: int) -> None:
    whole, part = models(rank)
    for rows in range(1, 17):
        x = torch.randn(1, rows, whole.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        outs = []
        for model in (whole, part):
            cache = model.new_cache(1, 64)
            positions = torch.arange(rows)[None]
            cos, sin, slots, mask, key_index = attention_inputs(cache, positions, None, model.inv_freq, model.dtype)
            outs.append(model.model.layers[0](x, cos, sin, cache, slots, mask, key_index))
        assert torch.equal(outs[0], outs[1]), f"layer output differs at {rows} rows"


def check_whole_model(rank: int) -> None:
    whole, part = models(rank)
    tokens = torch.randint(0, whole.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    for rows in range(1, 17):  # a prefill of `rows` tokens, then one decode step, for a batch of 3
        logits = []
        for model in (whole, part):
            cache = model.new_cache(3, 64)
            prefill = model(tokens[:, :rows], torch.arange(rows).expand(3, rows), cache)
            for row in range(3):
                cache.advance(row, rows)
            decode = model(tokens[:, rows:rows + 1], torch.full((3, 1), rows), cache)
            logits.append((prefill, decode))
        assert torch.equal(logits[0][0], logits[1][0]), f"prefill logits differ at {rows} rows"
        assert torch.equal(logits[0][1], logits[1][1]), f"decode logits differ after {rows} rows"


def check_gather(rank: int) -> None:
    x = torch.full((2, 3), float(rank + 1), dtype=torch.bfloat16)
    assert torch.equal(gather_last(x), torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], -1).bfloat16())


def test_gather_concatenates_in_rank_order(outcomes):
    assert outcomes["gather"] == "ok"


def test_a_tensor_parallel_layer_has_the_bits_of_one_process(outcomes):
    assert outcomes["one_layer"] == "ok"


def test_the_tensor_parallel_model_has_the_logits_of_one_process(outcomes):
    assert outcomes["whole_model"] == "ok"


def test_shapes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_model(tiny_model("qwen2", dtype=torch.bfloat16), 0, 4)
