"""The precision rule every entry point shares (`dflash.devices.resolve_dtype`)."""
import pytest
import torch

from dflash.devices import resolve_dtype


def test_auto_is_bf16_on_a_gpu_and_fp32_on_the_cpu_and_a_name_is_kept():
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16 and resolve_dtype("fp32", "cuda") is torch.float32


def test_another_name_is_refused_naming_it():
    with pytest.raises(ValueError, match="dtype must be auto, bf16 or fp32, got 'fp16'"):
        resolve_dtype("fp16", "cpu")
