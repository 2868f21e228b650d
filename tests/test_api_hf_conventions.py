"""`SelfSpecModel.generate` with HF's conventions: streamers, seed=None drawing from torch's global generator,
generation_config=, one prompt rule shared with `python -m selfspec.generate`, and a list of prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.model.tokens import chat_template_ids


@pytest.fixture(scope="module")
def m():
    return make_tiny("llama", head="lens", exit_layer=2)


class Recorder:
    """The streamer protocol HF's generate drives: put(tensor) ..., end()."""

    def __init__(self):
        self.calls: list = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", tuple(value.shape), value.tolist()))

    def end(self) -> None:
        self.calls.append(("end",))


# ------------------------------------------------------------------------------------------------ streamer
@pytest.mark.parametrize("mode", [dict(), dict(lookup=True, tree="static", tree_shape=[2, 1])])
def test_streamer_gets_the_prompt_then_each_rounds_commits_then_end(m, mode):
    ids = m.encode("hello there hello there", chat=False)
    rec = Recorder()
    out = m.generate(ids, max_new_tokens=20, draft_len=3, streamer=rec, **mode)
    assert rec.calls[0] == ("put", (1, len(ids)), [ids])  # the prompt first, as a (1, T) batch, as HF does
    assert rec.calls[-1] == ("end",) and sum(c[0] == "end" for c in rec.calls) == 1
    chunks = [c[2] for c in rec.calls[1:-1]]
    assert all(c[0] == "put" and len(c[1]) == 1 for c in rec.calls[1:-1])
    assert [t for chunk in chunks for t in chunk] == out.token_ids  # exactly the committed tokens, in order
    assert len(chunks) == out.stats["verify_steps"]  # one put per round (tokens as soon as a round commits them)
    assert max(len(c) for c in chunks) > 1 or out.stats["accepted"] == 0


def test_streamer_with_a_stop_string_streams_what_is_kept(m):
    ids = m.encode("once upon", chat=False)
    free = m.generate(ids, max_new_tokens=24, draft_len=3)
    stop = m.tokenizer.decode(free.token_ids[5:7])  # a string the greedy answer reaches mid-way
    rec = Recorder()
    out = m.generate(ids, max_new_tokens=24, draft_len=3, stop=stop, streamer=rec)
    assert len(out.token_ids) < len(free.token_ids) and stop in m.tokenizer.decode(out.token_ids)
    assert [t for c in rec.calls[1:-1] for t in c[2]] == out.token_ids


def test_text_iterator_streamer_from_another_thread(m):
    streamer = TextIteratorStreamer(m.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=m.generate("tell me", max_new_tokens=16, streamer=streamer)))
    worker.start()
    text = "".join(streamer)  # HF's pattern: generate in a thread, iterate here
    worker.join()
    assert text == m.tokenizer.decode(result["out"].token_ids, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------ seeds
def test_seed_none_draws_from_the_global_generator_and_an_explicit_seed_leaves_it_alone(m):
    kw = dict(max_new_tokens=16, draft_len=3, temperature=1.0)
    torch.manual_seed(11)
    a = m.generate("sample me", **kw)
    after_a = torch.rand(3)
    torch.manual_seed(11)
    b = m.generate("sample me", **kw)
    assert a.token_ids == b.token_ids and a.decode.seed == b.decode.seed  # torch.manual_seed makes it reproducible
    torch.manual_seed(11)
    torch.randint(2**63 - 1, ())  # exactly one draw: the global generator is advanced, never reseeded
    assert torch.equal(torch.rand(3), after_a)
    c = m.generate("sample me", **kw)  # a second call without manual_seed: another seed, another sample
    assert c.decode.seed != a.decode.seed and c.token_ids != a.token_ids
    assert m.generate("sample me", seed=a.decode.seed, **kw).token_ids == a.token_ids  # the seed it reports replays it
    state = torch.get_rng_state()
    one = m.generate("sample me", seed=5, **kw)
    assert torch.equal(torch.get_rng_state(), state)  # an explicit seed does not touch the caller's generator
    assert m.generate("sample me", seed=5, **kw).token_ids == one.token_ids and one.decode.seed == 5
    greedy = m.generate("sample me", max_new_tokens=8)
    assert torch.equal(torch.get_rng_state(), state) and greedy.decode.seed is None  # greedy draws nothing


# ------------------------------------------------------------------------------------------------ generation_config
def test_generation_config_maps_onto_our_keys(m):
    ids = m.encode("config me", chat=False)
    greedy = m.generate(ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=7))
    assert greedy.decode.temperature == 0 and greedy.token_ids == m.generate(ids, max_new_tokens=7).token_ids
    gc = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=9)
    sampled = m.generate(ids, generation_config=gc, seed=4)
    d = sampled.decode
    assert (d.temperature, d.top_k, d.top_p, d.max_new_tokens) == (0.7, 50, 0.9, 9)  # top_k: HF's default when sampling
    assert sampled.token_ids == m.generate(ids, temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=9, seed=4).token_ids
    assert len(m.generate(ids, generation_config=gc, max_new_tokens=3, seed=4).token_ids) == 3  # explicit wins, as in HF
    eos = greedy.token_ids[2]  # the generation config's eos_token_id ends the generation, as in HF
    assert m.generate(ids, generation_config=GenerationConfig(max_new_tokens=7, eos_token_id=eos)).token_ids == greedy.token_ids[:3]
    with pytest.raises(SelfSpecError, match=r"generation_config: num_beams=4, repetition_penalty=1.3 not supported"):
        m.generate(ids, generation_config=GenerationConfig(num_beams=4, repetition_penalty=1.3))
    with pytest.raises(SelfSpecError, match="inside decode=DecodeConfig"):
        m.generate(ids, generation_config=gc, decode=greedy.decode)


# ------------------------------------------------------------------------------------------------ prompts
def test_one_prompt_rule_and_lists_of_prompts(m):
    tok = m.tokenizer
    templated = chat_template_ids(tok, [{"role": "user", "content": "hi there"}])
    raw = tok("hi there")["input_ids"]
    # the tokenizer has a chat template: a string is one user message, unless chat=False (raw text to continue)
    assert m.generate("hi there", max_new_tokens=5).token_ids == m.generate(templated, max_new_tokens=5).token_ids
    assert m.generate("hi there", max_new_tokens=5, chat=False).token_ids == m.generate(raw, max_new_tokens=5).token_ids
    assert m.generate("hi there", max_new_tokens=5).token_ids != m.generate(raw, max_new_tokens=5).token_ids
    no_template = make_tiny("llama", head="lens", exit_layer=2)
    no_template.tokenizer.chat_template = None  # no template: raw text
    assert no_template.generate("hi there", max_new_tokens=5).token_ids == no_template.generate(raw, max_new_tokens=5).token_ids
    with pytest.raises(SelfSpecError, match="chat=True: this tokenizer has no chat template"):
        no_template.generate("hi there", chat=True)
    # a list of prompts: a list of results, each what the prompt gives alone
    prompts = ["first prompt", [{"role": "user", "content": "second"}], m.encode("third", chat=False)]
    for batch in (prompts[:1] * 2, [prompts[1]] * 2, [prompts[2], prompts[2]], prompts[:1] + ["other"]):
        outs = m.generate(batch, max_new_tokens=6)
        assert isinstance(outs, list) and [o.token_ids for o in outs] == [m.generate(p, max_new_tokens=6).token_ids for p in batch]
    rec = Recorder()
    m.generate(["a b", "c d"], max_new_tokens=4, streamer=rec)  # each prompt streamed in turn
    assert [c[0] for c in rec.calls].count("end") == 2 and rec.calls[0][1][0] == 1
    with pytest.raises(SelfSpecError, match="holds several prompts; give a list of prompts"):
        m.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=2)


def test_the_cli_follows_the_same_prompt_rule(tmp_path):
    """`python -m selfspec.generate` and the API give the same tokens for the same strings (through the chat template:
    the tiny tokenizer has one), and a list of prompts gives a list of records."""
    from selfspec.api import SelfSpecModel

    api = SelfSpecModel.from_pretrained("tiny")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "selfspec.generate", "model=tiny", "prompt=[hello,good day]",
                           "decode.max_new_tokens=6", f"output={out}"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())
    want = api.generate(["hello", "good day"], max_new_tokens=6)
    assert [r["token_ids"] for r in records] == [w.token_ids for w in want]
    assert want[0].token_ids != api.generate("hello", max_new_tokens=6, chat=False).token_ids  # the template mattered
