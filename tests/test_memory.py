"""The memory model's arithmetic against hand-computed cases (reference sections 1 to 4)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autotune.memory import (
    ModelShape,
    activation_bytes_per_token,
    kv_cache_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_per_token,
    model_state_bytes,
)

PSI_7B = 7_615_616_512  # Qwen2.5-7B, counted on the meta device by `autotune models`
QWEN_7B = ModelShape(num_params=PSI_7B, hidden=3584, layers=28, heads=28, kv_heads=4,
                     head_dim=128, intermediate=18944, vocab=152064)


def test_adam_states_of_a_7b_model_on_one_and_eight_gpus():
    one = model_state_bytes(PSI_7B)
    assert one.update_bytes == 16 * PSI_7B == 121_849_864_192  # 121.8 GB: no 80 GB card fits
    assert one.resident_bytes == 12 * PSI_7B and one.host_offload_bytes == 0
    eight = model_state_bytes(PSI_7B, num_gpus=8)
    assert eight.update_bytes == 2 * PSI_7B == 15_231_233_024  # 16 B / 8 GPUs
    assert eight.resident_bytes == 12 * PSI_7B // 8 == 11_423_424_768


def test_offload_frees_the_phases_between_updates_not_the_update():
    both = model_state_bytes(PSI_7B, num_gpus=8, offload_params=True, offload_optimizer=True)
    assert both.update_bytes == 2 * PSI_7B  # states are loaded back for the update
    assert both.resident_bytes == 0  # params (4) and Adam (8) on host, grads freed
    assert both.host_offload_bytes == 12 * PSI_7B // 8
    params_only = model_state_bytes(PSI_7B, num_gpus=8, offload_params=True)
    assert params_only.resident_bytes == 8 * PSI_7B // 8
    assert params_only.host_offload_bytes == 4 * PSI_7B // 8
    with pytest.raises(ValueError, match="num_gpus=0"):
        model_state_bytes(PSI_7B, num_gpus=0)


def test_activations_per_token_with_and_without_checkpointing():
    # 20*3584 + 4*4*128 + 8*18944 + 4*28 = 71680 + 2048 + 151552 + 112 = 225392 (reference 2.2)
    assert layer_activation_bytes_per_token(QWEN_7B) == 225_392
    assert activation_bytes_per_token(QWEN_7B, checkpointing=False) == 28 * 225_392  # 6.31 MB
    # checkpointed: layer inputs 2 * 3584 * 28 = 200704, plus one layer recomputed
    assert activation_bytes_per_token(QWEN_7B, checkpointing=True) == 200_704 + 225_392
    # an 8k-token micro-batch: 51.7 GB without checkpointing, 3.49 GB with it
    assert 8192 * activation_bytes_per_token(QWEN_7B, False) == 51_699_515_392
    assert 8192 * activation_bytes_per_token(QWEN_7B, True) == 3_490_578_432
    assert layer_activation_bytes_per_token(QWEN_7B, bytes_per_element=4) == 2 * 225_392


def test_logits_and_kv_cache():
    assert logits_bytes_per_token(QWEN_7B, backward=False) == 2 * 152064  # 0.304 MB bf16
    assert logits_bytes_per_token(QWEN_7B, backward=True) == 4 * 152064  # + its gradient
    assert kv_cache_bytes(QWEN_7B, tokens=1) == 57_344  # 56 KiB per token (reference 3)
    assert kv_cache_bytes(QWEN_7B, tokens=128 * 1024) == 57_344 * 131_072


def test_shape_from_the_registry_config_and_no_torch_import():
    from autotune.models import load_model_config

    shape = ModelShape.from_config(load_model_config("qwen2.5-vl-7b"), num_params=1)
    assert (shape.hidden, shape.layers, shape.kv_heads, shape.head_dim, shape.vocab) == \
        (3584, 28, 4, 128, 152064)
    code = "import sys, autotune.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
