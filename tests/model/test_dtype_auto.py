"""model.dtype=auto (issue 23, item 4): the checkpoint's own dtype on a GPU, float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from selfspec.errors import SelfSpecError
from selfspec.model.loading import ModelConfig, checkpoint_dtype, load_model, resolve_dtype
from conftest import DEVICE, tiny_spec


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("saved", ["bfloat16", "float16", "float32", torch.bfloat16, torch.float16])
def test_auto_takes_the_checkpoint_dtype_on_a_gpu(device, saved):
    assert resolve_dtype("auto", device, saved) == str(saved).removeprefix("torch.")


@pytest.mark.parametrize("saved", [None, "int8", "uint8", "float8_e4m3fn", "bogus"])
def test_auto_without_a_float_checkpoint_dtype_is_float32_on_a_gpu(saved):
    assert resolve_dtype("auto", "cuda", saved) == "float32"


@pytest.mark.parametrize("saved", ["bfloat16", "float16", None])
def test_auto_is_float32_on_the_cpu(saved):
    assert resolve_dtype("auto", "cpu", saved) == "float32"


@pytest.mark.parametrize("named", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept_everywhere(named):
    assert resolve_dtype(named, "cuda", "bfloat16") == named and resolve_dtype(named, "cpu", "float16") == named


def test_checkpoint_dtype_reads_config_json(tmp_path):
    from transformers import AutoConfig

    spec = tiny_spec("llama")
    AutoConfig.for_model(spec.pop("model_type"), **spec, dtype="bfloat16").save_pretrained(tmp_path)
    assert checkpoint_dtype(ModelConfig(name_or_path=str(tmp_path))) == "bfloat16"
    assert checkpoint_dtype(ModelConfig(random_init={**tiny_spec("llama"), "dtype": "float16"})) == "float16"
    assert checkpoint_dtype(ModelConfig(random_init=tiny_spec("llama"))) is None


def test_auto_loads_the_checkpoint_dtype_on_a_gpu_and_float32_on_the_cpu_and_bad_values_name_auto():
    """On the test device (SELFSPEC_TEST_DEVICE; eval/gpu_check.sh runs this on cuda): a bfloat16 checkpoint loads in
    bfloat16 on a GPU and in float32 on the CPU."""
    hf, _ = load_model(ModelConfig(random_init={**tiny_spec("llama"), "dtype": "bfloat16"}, dtype="auto", device=DEVICE))
    want = torch.bfloat16 if DEVICE.startswith("cuda") else torch.float32
    assert next(hf.parameters()).dtype == want and next(hf.parameters()).device.type == DEVICE.split(":")[0]
    with pytest.raises(SelfSpecError, match=r"model.dtype='half': allowed float32, bfloat16, float16, auto"):
        ModelConfig(random_init=tiny_spec("llama"), dtype="half")
