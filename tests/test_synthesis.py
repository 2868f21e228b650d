"""Batched synthesis (selfspec.training.synthesis.generate): ragged, continuously refilled batches give every
prompt the answer it gets alone, token for token, with the same top-k targets, on all four architectures;
sampled rows do not depend on their batch; limits, stops and callbacks; the bfloat16 copy's refinement."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.training import synthesis as S

STOPS = [7, 9]  # byte tokens the random models emit now and then, so that some answers finish early


def prompts(n: int = 11, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


# A batch of 4 rows and a cache budget that forces the cache to grow twice and rows to be refilled.
SMALL = S.BatchSettings(max_batch=4, token_budget=400, prefill_tokens=48)
ONE = S.BatchSettings(max_batch=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3_text"])
def test_batched_answers_equal_unbatched_token_for_token(arch: str) -> None:
    m = make_tiny(arch)
    ps = prompts()
    batched = S.generate(m.backbone, ps, 24, STOPS, topk=5, batch=SMALL)
    alone = S.generate(m.backbone, ps, 24, STOPS, topk=5, batch=ONE)
    assert [a.response for a in batched] == [a.response for a in alone]
    assert any(a.finished for a in alone) and any(not a.finished for a in alone)  # both ways of ending happen
    for a, b in zip(batched, alone):
        assert a.topk_ids.shape == (len(a.response), 5)
        assert torch.equal(a.topk_ids[:, 0], b.topk_ids[:, 0])
        torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=0)
        assert a.topk_ids[:, 0].tolist() == a.response  # greedy: each token is the top-1 of its position


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_answers_equal_hf_generate(arch: str) -> None:
    m = make_tiny(arch)
    ps = prompts(7, seed=2)
    ours = S.generate(m.backbone, ps, 20, STOPS, topk=4, batch=SMALL)
    hf = S.answer_prompts_hf(m.hf_model, ps, 20, 0.0, 1.0, 4, 0, STOPS, 258, 4)
    assert [a.response for a in ours] == [a.response for a in hf]
    for a, b in zip(ours, hf):
        torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=0)


def test_sampled_rows_do_not_depend_on_the_batch(tiny_llama) -> None:
    ps = prompts(9, seed=3)
    kw = dict(temperature=1.0, top_p=0.9, seed=5)
    a = S.generate(tiny_llama.backbone, ps, 16, STOPS, batch=SMALL, **kw)
    b = S.generate(tiny_llama.backbone, ps, 16, STOPS, batch=ONE, **kw)
    c = S.generate(tiny_llama.backbone, ps, 16, STOPS, batch=SMALL, **{**kw, "seed": 6})
    assert [x.response for x in a] == [x.response for x in b]
    assert [x.response for x in a] != [x.response for x in c]


def test_sampling_stays_on_the_device(tiny_llama, monkeypatch) -> None:
    """Sampled synthesis draws each row with torch.multinomial on the logits' device, from its request's generator
    on that device; no (rows, V) probabilities are copied to the host (issue 23, item 4)."""
    V, dev = tiny_llama.backbone.vocab_size, tiny_llama.backbone.device
    moved, draws = [], []
    for name in ("cpu", "numpy", "tolist"):
        original = getattr(torch.Tensor, name)

        def record(t, *args, __original=original, **kwargs):
            moved.append(tuple(t.shape))
            return __original(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, record)
    to = torch.Tensor.to

    def record_to(t, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            moved.append(tuple(t.shape))
        return to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", record_to)
    multinomial = torch.multinomial

    def record_draw(probs, n, *args, generator=None, **kwargs):
        draws.append((probs.shape, probs.device, generator.device if generator is not None else None))
        return multinomial(probs, n, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch, "multinomial", record_draw)
    out = S.generate(tiny_llama.backbone, prompts(5, seed=4), 6, STOPS, temperature=0.8, top_p=0.9, seed=2, batch=SMALL)
    monkeypatch.undo()
    assert sum(len(a.response) for a in out) == len(draws)  # one draw per sampled token ...
    assert all(shape == (V,) and where.type == gen.type == dev.type for shape, where, gen in draws)  # ... on the device
    assert not [shape for shape in moved if V in shape], moved  # no vocabulary-wide tensor came to the host
    again = S.generate(tiny_llama.backbone, prompts(5, seed=4), 6, STOPS, temperature=0.8, top_p=0.9, seed=2, batch=ONE)
    assert [a.response for a in out] == [a.response for a in again]  # still one generator per request


def test_limits_stops_and_callback(tiny_llama) -> None:
    ps = prompts(8, seed=4)
    limits = [1, 2, 3, 5, 8, 13, 21, 30]
    seen = {}
    out = S.generate(tiny_llama.backbone, ps, limits, STOPS, topk=3, batch=SMALL,
                     on_done=lambda i, a: seen.setdefault(i, a))
    assert sorted(seen) == list(range(len(ps))) and all(seen[i] is out[i] for i in seen)
    for a, limit in zip(out, limits):
        assert 1 <= len(a.response) <= limit
        assert a.finished == (a.response[-1] in STOPS)
        assert all(t not in STOPS for t in a.response[:-1])  # nothing after a stop
        assert a.finished or len(a.response) == limit


def test_bad_arguments_fail_with_one_line(tiny_llama) -> None:
    bb = tiny_llama.backbone
    with pytest.raises(SelfSpecError, match="max_new_tokens"):
        S.generate(bb, [[1, 2]], 0, STOPS)
    with pytest.raises(SelfSpecError, match="exceed the model's"):
        S.generate(bb, [[1] * 500], 100, STOPS)
    with pytest.raises(SelfSpecError, match="max_batch=0"):
        S.BatchSettings(max_batch=0)
    with pytest.raises(SelfSpecError, match="data.synth_dtype"):
        S.synthesis_backbone(bb, "float16")


def test_refining_with_the_exact_head_of_the_same_model_changes_nothing(tiny_llama) -> None:
    bb = tiny_llama.backbone
    ps = prompts(5, seed=6)
    plain = S.generate(bb, ps, 12, STOPS, topk=4, batch=SMALL)
    refined = S.generate(bb, ps, 12, STOPS, topk=4, batch=SMALL, exact_head=bb.lm_head.weight)
    assert [a.response for a in plain] == [a.response for a in refined]
    for a, b in zip(plain, refined):
        torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-5, rtol=0)


def test_bfloat16_copy_writes_with_float32_candidates(tiny_llama) -> None:
    bb = tiny_llama.backbone
    assert S.synthesis_backbone(bb, "float32") == (bb, None)
    bb16, head = S.synthesis_backbone(bb, "bfloat16")
    assert bb16.dtype == torch.bfloat16 and head is bb.lm_head.weight and bb.dtype == torch.float32
    ps = prompts(4, seed=7)
    out = S.generate(bb16, ps[:1], 10, STOPS, topk=4, exact_head=head)
    # The recorded log-probabilities are the float32 head's on the copy's last hidden state: recompute the first.
    p = torch.tensor([ps[0]])
    with torch.inference_mode():
        hn = bb16.norm(bb16.run_layers(bb16.embed(p), 0, bb16.num_layers)[0, -1])
        exact = torch.nn.functional.linear(hn.float(), head)  # (V,)
    top = out[0].topk_ids[0]
    diff = out[0].topk_logprobs[0] - (exact[top] - exact[top[0]])  # log-probability differences are exact
    assert diff.sub(diff[0]).abs().max() < 1e-4
    assert out[0].response[0] == int(exact.argmax())
