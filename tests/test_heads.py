"""Medusa and EAGLE heads: files, the target check, and training end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from specdec.heads.modules import EagleHead, HeadsConfig, HeadsMismatchError, MedusaHeads, load_heads, save_heads
from specdec.training import TrainConfig, train_heads


class ByteTokenizer:
    """Any text -> bytes folded into the tiny vocabulary (enough for training windows)."""

    eos_token_ids = (96,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % 90 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_on_a_tiny_model_lowers_the_loss_saves_and_resumes(tmp_path, method):
    target = tiny_model("qwen2", dtype=torch.bfloat16)
    cfg = TrainConfig(method=method, out=tmp_path / "heads", corpus_tokens=2048, self_distill_prompts=0,
                      seq_len=64, vocab_size=64, num_heads=2, epochs=3, batch_size=4, lr=3e-3,
                      checkpoint_every=5)
    report = train_heads(target, ByteTokenizer(), "tiny", cfg)
    assert report["final_loss"] < report["first_loss"]
    assert report["data_tokens"]["stdlib"] >= 2048
    key = "held_out_top1_per_head" if method == "medusa" else "held_out_top1_per_depth"
    assert len(report[key]) == 2 and all(0 <= a <= 1 for a in report[key])
    assert report["vocab_size"] == 64
    head = load_heads(tmp_path / "heads", target, method)
    assert isinstance(head, MedusaHeads if method == "medusa" else EagleHead)
    assert head.config.training["steps"] == report["steps"]
    saved = json.loads((tmp_path / "heads" / "report.json").read_text())
    assert saved["steps"] == report["steps"]
    # a rerun of the same command resumes from the last checkpoint: nothing left to train
    again = train_heads(target, ByteTokenizer(), "tiny", cfg)
    assert again["train_time_s"] == report["train_time_s"]


def test_heads_for_another_target_are_refused(tmp_path):
    target = tiny_model("qwen2", seed=0)
    other = tiny_model("qwen2", seed=1)
    head = MedusaHeads(HeadsConfig.for_target("medusa", target, "tiny-a", vocab_size=97, num_heads=2))
    save_heads(head, tmp_path)
    load_heads(tmp_path, target)  # the same weights in another dtype are the same target
    load_heads(tmp_path, tiny_model("qwen2", seed=0, dtype=torch.bfloat16))
    with pytest.raises(HeadsMismatchError, match="trained for target 'tiny-a'"):
        load_heads(tmp_path, other)
    with pytest.raises(ValueError, match="holds medusa heads, not eagle"):
        load_heads(tmp_path, target, "eagle")


def test_medusa_heads_asked_for_the_first_n_give_those_heads_logits():
    """A draft k deep runs only heads 0..k-1, their states through the output layer together; each head's
    logits are those it gives when all heads run, and those of running it alone."""
    target = tiny_model("qwen2", seed=0)
    head = MedusaHeads(HeadsConfig.for_target("medusa", target, "tiny-a", vocab_size=64, num_heads=3))
    with torch.no_grad():
        for block in head.blocks:
            block.linear.weight.normal_(0.0, 0.05)
    head.attach(target)
    hidden = torch.randn(target.config.hidden_size)
    every = head(hidden)
    assert every.shape == (3, 64)
    for n in (1, 2, 3):
        assert torch.allclose(head(hidden, n), every[:n], atol=1e-6)
    alone = head.logits(head.blocks[1](hidden))
    assert torch.allclose(every[1], alone, atol=1e-6)
