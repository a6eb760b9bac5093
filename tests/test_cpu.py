"""specdec.models.cpu: oneDNN is turned off exactly where torch would mix two bf16 kernels by row count."""

import pytest
import torch
from conftest import tiny_model

from specdec.models import cpu


@pytest.fixture
def onednn_flag():
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True
    yield
    torch.backends.mkldnn.enabled = before


@pytest.mark.parametrize(
    "onednn_bf16, native_bf16, turned_off",
    [(True, False, True),  # AVX-512 without bf16: one-row matmuls in torch's kernel, the rest in oneDNN's
     (True, True, False),  # native bf16 (AVX-512 BF16, AMX): oneDNN takes every row count
     (False, False, False)],  # AVX2: oneDNN never takes bf16
)
def test_onednn_is_turned_off_only_where_bf16_rows_would_mix_kernels(
    monkeypatch, onednn_flag, onednn_bf16, native_bf16, turned_off
):
    monkeypatch.setattr(cpu, "onednn_takes_bf16", lambda: onednn_bf16)
    monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda: native_bf16)
    assert cpu.use_one_bf16_matmul_kernel() is turned_off
    assert torch.backends.mkldnn.enabled is (not turned_off)
    assert cpu.use_one_bf16_matmul_kernel() is False  # idempotent: nothing more to change


def test_building_a_model_applies_it_on_this_cpu():
    """On the machine running the tests: after a model is built, oneDNN is off exactly when this CPU needs it."""
    tiny_model("qwen2", dtype=torch.bfloat16, num_hidden_layers=1)
    needs_it = cpu.onednn_takes_bf16() and not cpu.cpu_has_native_bf16()
    assert torch.backends.mkldnn.enabled is not needs_it
