"""Medusa and EAGLE heads: files, the target check, and training end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from specdec.heads.files import load_heads, save_heads
from specdec.heads.modules import EagleHead, HeadsConfig, HeadsMismatchError, MedusaHeads
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


def test_the_target_returns_the_feature_layers_before_its_final_hidden_states():
    target = tiny_model("qwen2", seed=0)
    ids = torch.tensor([[3, 9, 27, 81, 5]])
    H = target.config.hidden_size
    _, final = target(ids, torch.arange(5)[None], target.new_cache(1, 8), return_hidden=True)
    _, fused = target(ids, torch.arange(5)[None], target.new_cache(1, 8), return_hidden=True, feature_layers=(0,))
    assert fused.shape == (1, 5, 2 * H)
    assert torch.equal(fused[..., H:], final)  # the same bits: the layers' outputs are only returned
    assert not torch.equal(fused[..., :H], final)


def eagle3_head(target, steps_seed: int = 0) -> EagleHead:
    """An EAGLE-3-style head on `target` (layer 0 fused with the final states), random weights."""
    torch.manual_seed(steps_seed)
    config = HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64, feature_layers=(0,))
    head = EagleHead(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return head.attach(target)


def test_an_eagle3_head_fuses_the_target_layers_into_one_feature():
    target = tiny_model("qwen2", seed=0)
    head = eagle3_head(target)
    H = target.config.hidden_size
    assert head.config.feature_layers == (0,)
    assert head.features(torch.randn(7, 2 * H)).shape == (7, H)
    cache = head.new_cache(2, 16)
    out = head(torch.randn(2, 5, H), torch.randint(0, 64, (2, 5)), torch.arange(5).expand(2, 5), cache)
    assert out.shape == (2, 5, H) and head.logits(out).shape == (2, 5, 64)
    plain = EagleHead(HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64)).attach(target)
    x = torch.randn(3, H)
    assert plain.features(x) is x  # EAGLE-1: the final hidden state is the feature


def test_ttt_mask_sees_the_committed_pairs_and_its_own_chain():
    from specdec.training.losses import ttt_mask

    assert ttt_mask(2, 1).int().tolist() == [[1, 0], [1, 1]]
    assert ttt_mask(2, 2).int().tolist() == [[1, 0, 1, 0], [1, 1, 0, 1]]
    assert ttt_mask(3, 3).shape == (3, 9)


def test_a_chain_accepts_the_leading_steps_that_agree():
    from specdec.training.losses import leading_agreement

    rights = [torch.tensor([[True, True, False]]), torch.tensor([[True, False, True]]),
              torch.tensor([[False, True, True]])]
    assert leading_agreement(rights).tolist() == [[2, 1, 0]]


def test_a_walk_visits_the_positions_that_greedy_decoding_passes_start_at():
    from specdec.training.losses import walk

    assert walk([2, 0, 0, 1, 0, 0]) == [2, 1, 0]  # passes at 0, 3 and 5
    assert walk([2, 0, 0, 1, 0, 0], start=1) == [0, 0, 1, 0]  # at 1, 2, 3 and 5
    assert walk([3, 3, 3, 3], start=0) == [3] and walk([], start=0) == []


def test_training_time_test_computes_what_the_head_computes_when_it_drafts():
    """Step 1 of `ttt_losses` at position t is the head's pass over the committed pairs; step 2 at t is the pass
    the proposer makes for a chain's second node: the root's output and the next token at position t + 1,
    seeing the committed pairs 0..t and itself."""
    from specdec.training.losses import _layer_over_steps, ttt_mask

    target = tiny_model("qwen2", seed=0)
    head = eagle3_head(target)
    n = 6
    ids = torch.randint(0, 64, (1, n + 2), generator=torch.Generator().manual_seed(1))
    _, states = target(ids, torch.arange(n + 2)[None], target.new_cache(1, n + 2), return_hidden=True,
                       feature_layers=(0,))
    with torch.no_grad():
        x = head.features(states[:, :n])
        inputs = head.fc(torch.cat([x, head.embed(ids[:, 1:1 + n])], -1))
        out1, kv = _layer_over_steps(head, inputs, torch.arange(n), [], ttt_mask(n, 1))
        pred1 = head.norm(out1)
        inputs2 = head.fc(torch.cat([pred1, head.embed(ids[:, 2:2 + n])], -1))
        pred2 = head.norm(_layer_over_steps(head, inputs2, torch.arange(1, n + 1), [kv], ttt_mask(n, 2))[0])

        cache = head.new_cache(1, n + 4)
        step1 = head(x, ids[:, 1:1 + n], torch.arange(n)[None], cache)
        assert torch.allclose(step1, pred1, atol=1e-5)
        for t in (0, 3, n - 1):
            cache = head.new_cache(1, n + 4)
            root = head(x[:, :t + 1], ids[:, 1:t + 2], torch.arange(t + 1)[None], cache)[:, -1:]
            cache.advance(0, t + 1)
            node = head(root, ids[:, t + 2:t + 3], torch.tensor([[t + 1]]), cache,
                        mask=torch.ones(1, 1, 1, dtype=torch.bool))
            assert torch.allclose(node[0, 0], pred2[0, t], atol=1e-5), t


def test_soft_labels_take_their_share_of_the_loss_against_the_targets_distribution():
    """ttt_losses(soft=s) = (1 - s) x the loss against the target's greedy choices + s x the cross-entropy
    against the target's distribution over the heads' vocabulary (its logits from the stored final states)."""
    from specdec.training.losses import ttt_losses

    target = tiny_model("qwen2", seed=0)
    head = eagle3_head(target)
    n, H = 8, target.config.hidden_size
    ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(3))
    logits, states = target(ids, torch.arange(n).expand(2, n), target.new_cache(2, n), return_hidden=True,
                            feature_layers=(0,))
    batch = {"hidden": states, "tokens": ids, "target_next": logits.argmax(-1)}
    to_reduced = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    to_reduced[head.vocab_ids] = torch.arange(64)
    with torch.no_grad():
        hard, soft, half = (ttt_losses(head, batch, to_reduced, steps=2, soft=s)[0] for s in (0.0, 1.0, 0.5))
        assert torch.allclose(half, (hard + soft) / 2, atol=1e-5) and not torch.allclose(hard, soft)
        # one step by hand: the head's pass over the committed pairs, scored against the target's softmax
        pred = head(head.features(states[:, :n - 1]), ids[:, 1:], torch.arange(n - 1).expand(2, n - 1),
                    head.new_cache(2, n))
        teacher = torch.matmul(states[:, 1:, -H:], target.output_weights(head.vocab_ids).t()).softmax(-1)
        by_hand = -(teacher * head.logits(pred).log_softmax(-1)).sum(-1).mean()
        assert torch.allclose(ttt_losses(head, batch, to_reduced, steps=1, soft=1.0)[0], by_hand, atol=1e-5)


def test_eagle3_training_lowers_the_loss_reports_a_curve_saves_and_resumes(tmp_path):
    target = tiny_model("qwen2", dtype=torch.bfloat16)
    cfg = TrainConfig(method="eagle", out=tmp_path / "heads", corpus_tokens=2048, self_distill_prompts=0,
                      seq_len=64, vocab_size=64, epochs=3, batch_size=4, lr=3e-3, checkpoint_every=5,
                      feature_layers=(0,), ttt_steps=3, curve_every=4)
    report = train_heads(target, ByteTokenizer(), "tiny", cfg)
    assert report["final_loss"] < report["first_loss"]
    assert report["feature_layers"] == [0] and report["ttt_steps"] == 3
    assert len(report["held_out_top1_per_depth"]) == 3
    assert 1 <= report["held_out_chain_tokens_per_pass_estimate"] <= 4
    curve = report["curve"]
    assert [p["step"] for p in curve] == [*range(0, report["steps"], 4), report["steps"]]
    assert curve[0]["held_out_top1"] == report["held_out_top1_before"] and curve[0]["train_tokens_seen"] == 0
    assert all(len(p["held_out_top1"]) == 3 for p in curve)
    assert [p["train_tokens_seen"] for p in curve] == sorted(p["train_tokens_seen"] for p in curve)
    head = load_heads(tmp_path / "heads", target, "eagle")
    assert head.config.feature_layers == (0,)
    assert head.features(torch.zeros(2, 2 * 64, dtype=torch.bfloat16)).shape == (2, 64)
    again = train_heads(target, ByteTokenizer(), "tiny", cfg)
    assert again["train_time_s"] == report["train_time_s"] and again["curve"] == report["curve"]
    # continued with a wider MLP (--init-from, --intermediate-size): the report names its start
    import dataclasses
    wider = dataclasses.replace(cfg, out=tmp_path / "wider", features=tmp_path / "heads" / "features", epochs=1,
                                init_from=tmp_path / "heads", intermediate_size=2 * head.config.intermediate_size,
                                soft_labels=0.5)
    grown = train_heads(target, ByteTokenizer(), "tiny", wider)
    assert grown["init_from"] == str(tmp_path / "heads") and report["init_from"] is None
    assert grown["soft_labels"] == 0.5 and report["soft_labels"] == 0.0
    for bad, message in (({"soft_labels": 2}, "soft_labels is a share of the loss"),
                         ({"feature_layers": ()}, "soft_labels apply to EAGLE-3 heads"),
                         ({"method": "medusa", "soft_labels": 0.0}, "Medusa heads have none")):
        with pytest.raises(ValueError, match=message):
            train_heads(target, ByteTokenizer(), "tiny", dataclasses.replace(wider, out=tmp_path / "y", **bad))
    assert not (tmp_path / "y").exists()
    assert load_heads(tmp_path / "wider", target, "eagle").config.intermediate_size == wider.intermediate_size


def test_held_out_tasks_evaluate_on_humaneval_eval_split_tasks_and_train_on_every_window(tmp_path):
    """--held-out-tasks N: the report's held-out windows are HumanEval tasks 0..N-1 (prompt + reference
    solution, or with --held-out-text answers the target's own greedy answers to their prompts: read by no
    training), and no training window is held back."""
    import dataclasses
    import gzip

    from safetensors.torch import load_file

    from specdec.config import SamplingParams
    from specdec.data import DATA_DIR
    from specdec.engine import Engine
    from specdec.training.train import held_out_windows

    target = tiny_model("qwen2", dtype=torch.bfloat16, max_position_embeddings=1024)  # (whole prompts below)
    cfg = TrainConfig(method="eagle", out=tmp_path / "heads", corpus_tokens=1024, self_distill_prompts=0,
                      seq_len=64, vocab_size=64, epochs=1, batch_size=4, lr=3e-3, feature_layers=(0,),
                      ttt_steps=2, held_out_tasks=3)
    report = train_heads(target, ByteTokenizer(), "tiny", cfg)
    trained = len(list((tmp_path / "heads" / "features").glob("shard_*.safetensors")))
    assert report["windows"]["train"] == trained and report["windows"]["held_out"] == 3
    assert report["windows"]["held_out_from"].startswith("HumanEval tasks 0-2")
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        tasks = [json.loads(next(f)) for _ in range(3)]
    held = sorted((tmp_path / "heads" / "features" / "held_out").glob("shard_*.safetensors"))
    assert [load_file(str(p))["tokens"].tolist() for p in held] == \
        [ByteTokenizer().encode(t["prompt"] + t["canonical_solution"])[-64:] for t in tasks]
    assert len(report["held_out_top1_per_depth"]) == 2
    # the target's own answers instead: the whole prompt + the engine's greedy answer, scored from the position
    # whose pass drafts the answer's second token (the first is the prefill's)
    answers = dataclasses.replace(cfg, out=tmp_path / "answers", features=tmp_path / "heads" / "features",
                                  held_out_text="answers", self_distill_tokens=10, epochs=1)
    report = train_heads(target, ByteTokenizer(), "tiny", answers)
    assert "greedy answers" in report["windows"]["held_out_from"] and report["windows"]["held_out"] == 3
    assert 1 <= report["held_out_chain_tokens_per_pass_walk"] <= 3
    engine = Engine(target, ByteTokenizer(), max_model_len=1024)
    held = held_out_windows(target, ByteTokenizer(), answers)
    for i, (task, w) in enumerate(zip(tasks, held)):
        prompt = ByteTokenizer().encode(task["prompt"])
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=10))
        while engine.has_unfinished_requests():
            for out in engine.step():
                pass
        assert w["tokens"].tolist() == prompt + out.token_ids and w["scored_from"] == len(prompt) - 1
    # more tasks than the eval split holds: refused before any feature is extracted
    with pytest.raises(ValueError, match="held_out_tasks must be 0-100"):
        train_heads(target, ByteTokenizer(), "tiny", dataclasses.replace(cfg, out=tmp_path / "x", held_out_tasks=101))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("feature_layers", [(), (0,)])
def test_an_eagle_head_on_the_block_kernels_runs_its_layer_as_one_op(tmp_path, feature_layers):
    """On a target on the block kernels, the head's layer is one kernel op (Q/K/V and gate/up one Q8_0
    matrix each): its outputs are those of the head run matrix by matrix (within bf16 rounding), and the same
    bits on every run (drafts are deterministic)."""
    from safetensors.torch import load_file
    from test_tokenizer import write_tiny_gguf

    from specdec.api import load_model
    from specdec.heads.files import read_heads_config
    from specdec.heads.modules import _Head
    from specdec.speculative.tree import ancestor_mask

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    target, _, _ = load_model(str(path), torch.bfloat16, torch.device("cpu"), "gguf")
    assert target.on_block_kernels
    head = eagle3_head(target) if feature_layers else EagleHead(
        HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64)).attach(target)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=torch.Generator().manual_seed(3))
    save_heads(head, tmp_path / "heads")
    fused = load_heads(tmp_path / "heads", target, "eagle")
    assert fused.layer.fused_args is not None
    per_matrix = EagleHead(read_heads_config(tmp_path / "heads"))
    per_matrix.load_state_dict(load_file(str(tmp_path / "heads" / "model.safetensors")))
    per_matrix = _Head.to_block_kernels(per_matrix.to(torch.bfloat16).attach(target).eval(), target)
    assert per_matrix.layer.fused_args is None

    H = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(1, 12, H * (len(feature_layers) + 1), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 12), generator=gen)
    parents = [-1, -1, 0, 0, 2]
    mask = ancestor_mask(parents)[1:, 1:][None]
    outs = []
    for h in (fused, fused, per_matrix):
        with torch.no_grad():
            cache = h.new_cache(1, 32)
            feats = h.features(states)
            h(feats[:, :7], ids[:, 1:8], torch.arange(7)[None], cache)
            cache.advance(0, 7)
            nodes = h(feats[:, 7:12], ids[:, 7:12], torch.tensor([[7, 7, 8, 8, 9]]), cache, mask=mask)
            outs.append(h.logits(nodes))
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[2], atol=0.15, rtol=0.05)


def test_heads_in_q4_0_read_half_the_bytes_and_compute_what_the_float_heads_compute(tmp_path):
    """`load_heads(quantization="q4_0")` (`draft_quantization` in a speculative config): every matrix of an
    EAGLE-3 head and of Medusa heads, and the output rows for their vocabulary, in Q4_0 blocks on the block
    kernels; their logits close to the float heads' (Q4_0's rounding), the same bits on every run; fewer bytes
    than in Q8_0. A format heads cannot run in, or Q4_0 beside a float target, is refused."""
    from test_tokenizer import write_tiny_gguf

    from specdec.api import load_model
    from specdec.heads.files import read_heads_config
    from specdec.heads.modules import head_bytes
    from specdec.kernels.qgemm import Q4_0
    from specdec.models.qlinear import QuantLinear

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    target, _, _ = load_model(str(path), torch.bfloat16, torch.device("cpu"), "gguf")
    H = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(1, 9, 2 * H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 9), generator=gen)
    eagle = eagle3_head(target)
    medusa = MedusaHeads(HeadsConfig.for_target("medusa", target, "tiny", vocab_size=64, num_heads=2))
    with torch.no_grad():
        for p in medusa.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=torch.Generator().manual_seed(4))
    save_heads(eagle, tmp_path / "eagle3")
    save_heads(medusa, tmp_path / "medusa")

    def read_bytes(head):
        """The bytes a pass reads: head_bytes less the file-layout copy a QuantLinear keeps beside blocks its
        build lays out 16 channels side by side (the kernels read only those; AVX-512 VNNI's Q4_0 and AVX2's
        Q4_K / Q6_K)."""
        unread = sum(b.numel() for m in head.modules() if isinstance(m, QuantLinear)
                     for b, k in zip(m.blocks, m.kernel_blocks) if b.data_ptr() != k.data_ptr())
        return head_bytes(head) - unread

    def logits(head):
        with torch.no_grad():
            if isinstance(head, MedusaHeads):
                return head(states[0, :, H:]).float()
            return head.logits(head(head.features(states)[:, :8], ids[:, 1:], torch.arange(8)[None],
                                    head.new_cache(1, 16))).float()

    for name in ("eagle3", "medusa"):
        as_float = load_heads(tmp_path / name, target, quantization="none")
        q8, q4 = (load_heads(tmp_path / name, target, quantization=f) for f in ("q8_0", "q4_0"))
        assert as_float.weight_format == "none" and q8.weight_format == "q8_0" and q4.weight_format == "q4_0"
        blocks = [m for m in q4.modules() if isinstance(m, QuantLinear)]
        assert q4.lm_head in blocks and len(blocks) >= (5 if name == "eagle3" else 3)
        assert all(m.types == [Q4_0] * len(m.types) for m in blocks)
        assert not any(isinstance(m, torch.nn.Linear) for m in q4.modules())
        assert read_bytes(q4) < 0.75 * read_bytes(q8)
        reference, got = logits(as_float), logits(q4)
        assert torch.equal(got, logits(q4))
        scale = reference.abs().max()
        assert (got - reference).abs().max() <= 0.2 * scale, name
        assert (logits(q8) - reference).abs().max() <= (got - reference).abs().max()  # Q4_0 rounds more
        assert read_heads_config(tmp_path / name).method == ("eagle" if name == "eagle3" else "medusa")
    with pytest.raises(ValueError, match="heads run their matrices as q8_0, q4_0 or none"):
        load_heads(tmp_path / "eagle3", target, quantization="int8")
    with pytest.raises(ValueError, match="run on the block kernels"):
        load_heads(tmp_path / "eagle3", tiny_model("qwen2"), quantization="q4_0")


def test_an_eagle3_head_started_from_an_eagle_head_computes_what_that_head_computes():
    """`init_from_eagle`: the fusion passes the final hidden state through, the layers' parts weighted 0."""
    target = tiny_model("qwen2", seed=0)
    first = EagleHead(HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64))
    with torch.no_grad():
        for p in first.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=torch.Generator().manual_seed(5))
    first.vocab_ids = torch.arange(10, 74)
    head = eagle3_head(target)
    head.init_from_eagle(first)
    first.attach(target)
    head.attach(target)
    assert torch.equal(head.vocab_ids, first.vocab_ids)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    _, states = target(ids, torch.arange(9)[None], target.new_cache(1, 9), return_hidden=True, feature_layers=(0,))
    H = target.config.hidden_size
    with torch.no_grad():
        assert torch.allclose(head.features(states), states[..., H:], atol=1e-6)
        outs = [h(h.features(s)[:, :8], ids[:, 1:], torch.arange(8)[None], h.new_cache(1, 8))
                for h, s in ((head, states), (first, states[..., H:]))]
    assert torch.allclose(*outs, atol=1e-5)


def test_an_eagle3_head_grown_to_a_wider_mlp_starts_out_computing_what_the_narrow_head_computes(tmp_path):
    """--init-from with a wider --intermediate-size: the narrow head's units first, the new units' down
    columns 0 (their gate and up rows as initialized, so they can learn); a narrower head is refused."""
    from specdec.training.train import _eagle_start

    target = tiny_model("qwen2", seed=0)
    narrow = eagle3_head(target, steps_seed=7)
    narrow.vocab_ids = torch.arange(5, 69)
    save_heads(narrow, tmp_path / "narrow")
    width = narrow.config.intermediate_size
    config = HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64, feature_layers=(0,),
                                    intermediate_size=2 * width)
    wide = EagleHead(config)
    start = _eagle_start(tmp_path / "narrow", target, (0,))  # (the narrow head as saved)
    wide.init_from_eagle(start)
    wide.attach(target)
    start.attach(target)
    mlp = wide.layer.mlp
    assert mlp.gate_proj.weight.shape == (2 * width, target.config.hidden_size)
    assert torch.equal(mlp.down_proj.weight[:, width:], torch.zeros_like(mlp.down_proj.weight[:, width:]))
    assert mlp.gate_proj.weight[width:].abs().sum() > 0 and mlp.up_proj.weight[width:].abs().sum() > 0
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    _, states = target(ids, torch.arange(9)[None], target.new_cache(1, 9), return_hidden=True, feature_layers=(0,))
    with torch.no_grad():
        outs = [h(h.features(states)[:, :8], ids[:, 1:], torch.arange(8)[None], h.new_cache(1, 8))
                for h in (wide, start)]
    assert torch.allclose(*outs, atol=1e-5)
    save_heads(wide, tmp_path / "wide")
    config = HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64, feature_layers=(0,))
    with pytest.raises(ValueError, match=f"an MLP of {2 * width} units cannot start one of {width}"):
        EagleHead(config).init_from_eagle(_eagle_start(tmp_path / "wide", target, (0,)))


@pytest.mark.parametrize("kernels", ["block", "float"])
def test_an_eagle_head_writes_a_prompts_kv_alone_and_attends_what_its_mask_names(tmp_path, kernels):
    """`write_kv` writes the K/V that a pass writes without computing its predictions, and a pass given cache
    `slots` and a mask over the cache's slots predicts what the causal pass predicts for the same pair: what
    the EAGLE proposer does with a prompt (K/V alone, then its last pair) and with drafted nodes (their K/V
    kept past the committed pairs). On the block kernels the same bits; in float within rounding."""
    from test_tokenizer import write_tiny_gguf

    from specdec.api import load_model

    if kernels == "block":
        write_tiny_gguf(tmp_path / "tiny.gguf")
        target = load_model(str(tmp_path / "tiny.gguf"), torch.bfloat16, torch.device("cpu"), "gguf")[0]
    else:
        target = tiny_model("qwen2", seed=0, dtype=torch.bfloat16)
    head = EagleHead(HeadsConfig.for_target("eagle", target, "tiny", vocab_size=64))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=torch.Generator().manual_seed(3))
    save_heads(head, tmp_path / "heads")
    head = load_heads(tmp_path / "heads", target, "eagle")
    assert (head.layer.fused_args is not None) == (kernels == "block")
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 10, target.config.hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 11), generator=gen)
    causal, alone = head.new_cache(1, 64), head.new_cache(1, 64)
    full = head(feats, ids[:, 1:], torch.arange(10)[None], causal)  # [1, 10, H]
    head.write_kv(feats[:, :9], ids[:, 1:10], torch.arange(9)[None], alone, torch.arange(9)[None])
    last = head(feats[:, 9:], ids[:, 10:], torch.tensor([[9]]), alone, torch.arange(64)[None, None] <= 9,
                torch.tensor([[9]]))  # [1, 1, H]
    for a, b in zip(causal.keys + causal.values, alone.keys + alone.values):  # the row's slots 0..9
        assert torch.equal(causal.gather(a, 1, 10), alone.gather(b, 1, 10))
    if kernels == "block":
        assert torch.equal(last[0, 0], full[0, 9])
    else:
        assert torch.allclose(last[0, 0].float(), full[0, 9].float(), atol=2e-2)
    # the token rows kept for the head are the target's lookup, bit for bit
    assert torch.equal(head.embed(ids), target.embed(ids).to(head.embed(ids).dtype))


def test_self_distillation_resumes_from_the_answers_it_kept(tmp_path, monkeypatch):
    """The target's answers are kept as they finish: a run interrupted after 2 of 5, one of them kept for
    another prompt (not taken), and a line cut short, asks the other 4 again and gives the same windows as a
    run that was not interrupted; answers kept for another length are not taken either."""
    from specdec.engine import Engine
    from specdec.training.features import self_distilled

    target = tiny_model("qwen2", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (12,), generator=gen).tolist() for _ in range(5)]
    path = tmp_path / "self_distill.jsonl"
    whole = self_distilled(target, ByteTokenizer(), prompts, 6, 32, batch_size=2, done_path=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and sorted(json.loads(line)["i"] for line in lines) == list(range(5))
    kept = [json.loads(line) for line in lines[:2]]
    other = dict(kept[0], prompt=[1, 2, 3])  # another prompt under the same index: not taken
    path.write_text("\n".join(json.dumps(row) for row in [kept[1], other]) + "\n" + lines[2][:10])
    asked = []
    add = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, rid, *a, **kw: (asked.append(rid), add(self, rid, *a, **kw))[1])
    assert self_distilled(target, ByteTokenizer(), prompts, 6, 32, batch_size=2, done_path=path) == whole
    assert sorted(asked) == sorted(str(i) for i in range(5) if i != kept[1]["i"])
    asked.clear()
    assert self_distilled(target, ByteTokenizer(), prompts, 7, 32, batch_size=2, done_path=path) != whole
    assert len(asked) == 5  # kept for 6 tokens, asked for 7: all asked again


class CharTokenizer:
    """Text <-> code points (lossless), for checking what a prompt's text was."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _parsed(source: str):
    import ast

    try:
        return ast.parse(source).body[0]
    except SyntaxError:
        return None


def test_function_prompts_are_standard_library_defs_through_their_docstrings():
    """`function_prompts`: a public function's def line through its docstring (80 characters at least),
    dedented, a seeded choice whose first `count` do not depend on how many are asked for."""
    import ast

    from specdec.training.features import function_prompts

    prompts = ["".join(map(chr, ids)) for ids in function_prompts(CharTokenizer(), 40, seed=3)]
    assert len(prompts) == 40 and len(set(prompts)) == 40
    for text in prompts:
        assert text.startswith("def ") and not text.split("(")[0][4:].startswith("_"), text
        # the def and its docstring, nothing after them: a statement at the body's indent completes it
        indents = {line[: len(line) - len(line.lstrip())] for line in text.splitlines()[1:] if line.strip()}
        nodes = [_parsed(text + indent + "pass\n") for indent in indents]
        node = next(n for n in nodes if n is not None)
        assert isinstance(node, ast.FunctionDef) and len(node.body) == 2 and isinstance(node.body[1], ast.Pass)
        assert len(ast.get_docstring(node)) >= 80
    assert ["".join(map(chr, ids)) for ids in function_prompts(CharTokenizer(), 10, seed=3)] == prompts[:10]
    assert ["".join(map(chr, ids)) for ids in function_prompts(CharTokenizer(), 10, seed=4)] != prompts[:10]


def test_the_targets_answers_to_library_functions_grow_in_stages_after_the_other_windows(tmp_path):
    """--distill-functions N: the target's greedy answers to N of `function_prompts` are windows after the
    others; a later run asking more answers only the new prompts and adds their shards after the existing
    ones, which stay as they were."""
    import dataclasses

    from safetensors.torch import load_file

    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.training.features import function_prompts

    target = tiny_model("qwen2", dtype=torch.bfloat16)
    cfg = TrainConfig(method="eagle", out=tmp_path / "a", features=tmp_path / "features", corpus_tokens=256,
                      self_distill_prompts=0, seq_len=48, vocab_size=64, epochs=1, batch_size=2,
                      distill_functions=2, self_distill_tokens=5)
    first = train_heads(target, ByteTokenizer(), "tiny", cfg)
    assert first["data_tokens"]["stdlib_functions"] == 2 * 48
    shards = sorted((tmp_path / "features").glob("shard_*.safetensors"))
    before = {p.name: p.read_bytes() for p in shards}
    second = train_heads(target, ByteTokenizer(), "tiny", dataclasses.replace(cfg, out=tmp_path / "b", distill_functions=4))
    assert second["data_tokens"] == {**first["data_tokens"], "stdlib_functions": 4 * 48}
    after = sorted((tmp_path / "features").glob("shard_*.safetensors"))
    assert len(after) == len(shards) + 2 and all(before[p.name] == p.read_bytes() for p in shards)
    answers = (tmp_path / "features" / "distill_functions.jsonl").read_text().splitlines()
    assert len(answers) == 4  # the first two were not asked again
    engine = Engine(target, ByteTokenizer(), max_model_len=1024)
    for i, (prompt, path) in enumerate(zip(function_prompts(ByteTokenizer(), 4, seed=0), after[-4:])):
        tail = prompt[-(48 - 5):]
        engine.add_request(str(i), tail, SamplingParams(temperature=0, max_tokens=5))
        while engine.has_unfinished_requests():
            for out in engine.step():
                pass
        assert load_file(str(path))["tokens"].tolist() == (tail + out.token_ids)[-48:]


def test_an_eagle3_head_continues_from_an_eagle3_head_over_the_same_layers(tmp_path):
    """--init-from an EAGLE-3 head: training starts from all of it; one over other layers is refused."""
    from safetensors.torch import load_file

    from specdec.training.train import _eagle_start

    target = tiny_model("qwen2", seed=0)
    trained = eagle3_head(target, steps_seed=7)
    trained.vocab_ids = torch.arange(5, 69)
    save_heads(trained, tmp_path / "eagle3")
    head = eagle3_head(target, steps_seed=8)
    head.init_from_eagle(_eagle_start(tmp_path / "eagle3", target, (0,)))
    assert torch.equal(head.vocab_ids, trained.vocab_ids)
    saved = load_file(str(tmp_path / "eagle3" / "model.safetensors"))  # (as stored)
    for name, value in head.state_dict().items():
        assert torch.equal(value, saved[name].to(value.dtype)), name
    assert not torch.equal(head.fc.weight, eagle3_head(target, steps_seed=8).fc.weight)
    with pytest.raises(ValueError, match="nor an EAGLE-3 head over layers 1"):
        _eagle_start(tmp_path / "eagle3", target, (1,))
