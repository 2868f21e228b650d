"""Every bad input gets one clear line naming the parameter and what is allowed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from selfspec.errors import SelfSpecError
from selfspec.model.loading import ModelConfig, load_model


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft_len=0), r"decode.draft_len=0: must be an integer >= 1"),
        (dict(temperature=-0.5), r"decode.temperature=-0.5: must be >= 0"),
        (dict(top_p=0.0), r"decode.top_p=0.0: must be in \(0, 1\]"),
        (dict(top_p=1.5), r"decode.top_p=1.5"),
        (dict(top_k=-1), r"decode.top_k=-1: must be an integer >= 0"),
        (dict(draft_threshold=1.5), r"decode.draft_threshold=1.5"),
        (dict(draft_continue=1.0), r"decode.draft_continue=1.0: must be in \(0, 1\) or null"),
        (dict(draft_continue=0.5, tree="static"), r"decode.draft_continue=0.5: not supported with decode.tree=static"),
        (dict(strategy="beam"), r"decode.strategy='beam': allowed autoregressive, selfspec"),
        (dict(max_new_tokens=600), r"exceeds the model's context \(512\)"),
    ],
)
def test_decode_errors(tiny_llama, kwargs, match):
    tiny_llama.set_head("lens", exit_layer=2)
    with pytest.raises(SelfSpecError, match=match):
        tiny_llama.generate("hello", **kwargs)


def test_prompt_and_head_errors(tiny_llama):
    m = tiny_llama
    for prompt in ("", "   ", [], [{"role": "user", "content": ""}]):
        with pytest.raises(SelfSpecError, match="prompt|messages"):
            m.generate(prompt)
    for E in (0, 7, 10, -1):
        with pytest.raises(SelfSpecError, match=rf"head.exit_layer={E}: must be an integer in \[1, 6\]"):
            m.set_head("medusa", exit_layer=E)
    with pytest.raises(SelfSpecError, match="head='nonsense'"):
        m.set_head("nonsense")


def test_model_errors(tmp_path):
    with pytest.raises(SelfSpecError, match="model.gguf_file='missing.gguf': file not found"):
        load_model(ModelConfig(name_or_path=str(tmp_path), gguf_file="missing.gguf"))
    with pytest.raises(SelfSpecError, match="unsupported architecture 'gpt2'; supported: llama, qwen2, mistral, gemma3_text"):
        load_model(ModelConfig(random_init={"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(SelfSpecError, match="model.dtype='int3'"):
        ModelConfig(random_init={}, dtype="int3")
    with pytest.raises(SelfSpecError, match="model.name_or_path='/no/such/dir': directory not found"):
        load_model(ModelConfig(name_or_path="/no/such/dir"))


def test_unsupported_architecture_from_directory(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(SelfSpecError, match="unsupported architecture 'gpt2'"):
        load_model(ModelConfig(name_or_path=str(tmp_path)))


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cases = [
        (["head.exit_layer=9"], "head.exit_layer=9: must be an integer in [1, 4]"),
        (["decode.draft_len=0"], "decode.draft_len=0"),
        (["prompt=''"], "prompt: must not be empty"),
        (["head.path=" + str(tmp_path / "nope")], "directory not found"),
    ]
    for extra, expected in cases:
        out = subprocess.run(
            [sys.executable, "-m", "selfspec.generate", "model=tiny", "prompt=hello", *extra],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert out.returncode == 2, (extra, out.stderr)
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert lines == [f"error: {lines[0][7:]}"] and expected in lines[0], out.stderr
        assert "Traceback" not in out.stderr


def test_an_unusable_cache_dir_in_training_is_one_error_line_and_one_warning(tmp_path):
    """SELFSPEC_CACHE that cannot be written: the CPU kernels fall back to torch with one warning line, and the
    data cache is one error line with exit status 2 (it used to be chained tracebacks)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "SELFSPEC_CACHE": str(blocker / "cache")}
    env.pop("SELFSPEC_CPU_KERNELS", None)
    out = subprocess.run(
        [sys.executable, "-m", "selfspec.train", "experiment=tiny", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().splitlines() == [
        f"error: data cache {blocker}/cache/data/" + out.stderr.split("/cache/data/")[1].split(":")[0]
        + ": Not a directory (SELFSPEC_CACHE must name a writable directory)"]
    kernel_lines = [l for l in out.stdout.splitlines() if "CPU kernels" in l]
    assert len(kernel_lines) <= 1 and all("run on torch" in l for l in kernel_lines)
