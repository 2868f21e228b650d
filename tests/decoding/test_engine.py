"""The engine's steps and its Drafter interface: reuse of early layers, drafts a drafter declines, any drafter
is lossless, and the stats it returns."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter, EarlyExitDrafter, NoDrafter, OwnCacheDrafter, make_drafter
from selfspec.decoding.engine import Decoder

STATS_KEYS = [
    "strategy", "exit_layer", "draft_len", "new_tokens", "verify_steps", "tau", "drafted", "draft_steps", "accepted",
    "accept_rate", "drafted_per_position", "accepted_per_position", "accept_rate_per_position", "draft_s", "verify_s",
    "seconds", "tokens_per_s", "prompt_tokens", "draft_precision", "draft_bytes",
]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("head_type", ["medusa", "adapter"])
def test_reuse_verify_logits_equal_fresh_forward(arch, head_type):
    """The verifier runs only layers >= E over drafted positions, on early-layer K/V and hidden states the
    draft wrote. Its logits must equal a fresh full forward over the same tokens."""
    m = make_tiny(arch, head=head_type, exit_layer=3)
    randomize_head(m.head, seed=1)
    seen = []
    m.decoder.decode(m.encode("Reuse check: a longer prompt"), DecodeConfig(draft_len=4, max_new_tokens=30),
                     observer=lambda ids, logits: seen.append((ids, logits.clone())))
    assert len(seen) > 3
    with torch.no_grad():
        for ids, logits in seen:
            fresh = m.hf_model(torch.tensor([ids], device=m.hf_model.device)).logits[0, -logits.shape[0]:]
            torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)


def test_draft_steps_count_declined_drafts():
    """With dynamic K the head runs once per draft attempt; attempts it declines are counted in draft_steps
    (the cost model's c is per exit-head pass) but not in drafted."""
    m = make_tiny("llama", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=3)
    ids = [5, 17, 42, 99, 7, 3]
    fixed = m.generate(ids, max_new_tokens=24, decode=DecodeConfig(draft_len=3, max_new_tokens=24)).stats
    assert fixed["draft_steps"] == fixed["drafted"] > 0
    dyn = m.generate(ids, max_new_tokens=24, decode=DecodeConfig(draft_len=3, draft_threshold=0.99, max_new_tokens=24)).stats
    assert dyn["draft_steps"] >= dyn["verify_steps"] - 1 > dyn["drafted"]


def test_draft_continue_drafts_on_only_while_the_chain_is_confident():
    """decode.draft_continue: every round makes its first draft; the next only while the product of the drafts' top-1
    probabilities so far is at least the threshold. Checked round by round against the head's own probabilities."""
    m = make_tiny("llama", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=3)
    ids = [5, 17, 42, 99, 7, 3]
    fixed = m.generate(ids, decode=DecodeConfig(draft_len=3, max_new_tokens=24)).stats
    assert m.generate(ids, decode=DecodeConfig(draft_len=3, draft_continue=1e-9, max_new_tokens=24)).stats["drafted"] == fixed["drafted"]
    one = m.generate(ids, decode=DecodeConfig(draft_len=3, draft_continue=0.999999, max_new_tokens=24)).stats
    assert one["draft_steps"] == one["drafted"] == one["verify_steps"] > 0  # one draft per round: none is confident
    tau = 0.2
    cfg = DecodeConfig(draft_len=3, draft_continue=tau, max_new_tokens=24)
    st = m.decoder.start(ids, cfg, m.eos_ids)
    counts = []
    with torch.inference_mode():
        while not st.done:
            n0 = st.n
            draft = st.proposer.propose(st)
            k = len(draft.tokens)
            seq = torch.tensor([st.tokens[: n0 + k].tolist()])
            h = m.hf_model(seq, output_hidden_states=True).hidden_states[2]  # layer-E states, E = 2
            # each draft's top-1 probability, from the head on the same tokens (draft i follows position n0 - 1 + i)
            probs = [float(m.head(h[:, n0 - 1 + i : n0 + i], m.backbone)[0, -1].float().softmax(-1).max()) for i in range(k)]
            joint = torch.tensor(probs).cumprod(0)
            want = next((i + 1 for i in range(k) if joint[i] < tau), 3)
            assert k == min(want, st.room), (k, probs)
            counts.append(k)
            draft.commit(st, *draft.accept(st, draft.verify(m.backbone, st)))
            st.proposer.observe(st, n0)
    assert min(counts) == 1 and max(counts) > 1  # the rule stopped some rounds early and let others go on


def test_each_head_gets_its_drafter(tiny_llama):
    m = tiny_llama
    bb = m.backbone
    for head_type, cls in (("lens", EarlyExitDrafter), ("medusa", EarlyExitDrafter), ("adapter", EarlyExitDrafter)):
        m.set_head(head_type, exit_layer=2)
        d = make_drafter(bb, m.head, 64)
        assert type(d) is cls and d.exit_layer == 2
    assert (d.head_state is not None) and make_drafter(bb, None, 64).exit_layer is None
    lora = make_tiny("llama", head="lora", exit_layer=2)
    assert type(make_drafter(lora.backbone, lora.head, 64)) is OwnCacheDrafter
    assert isinstance(make_drafter(bb, None, 64), NoDrafter)


class ScriptedDrafter(Drafter):
    """Drafts a fixed script of tokens (one-hot logits): the engine must stay exact whatever it proposes."""

    exit_layer = 0

    def __init__(self, backbone, script: list[int], prompt_len: int):
        super().__init__(backbone)
        self.script, self.P = script, prompt_len
        self.calls: list[int] = []

    def draft_logits(self, state, pos):
        self.calls.append(pos)
        tok = self.script[pos - self.P] if pos - self.P < len(self.script) else 0
        return torch.nn.functional.one_hot(torch.tensor(tok, device=self.bb.device), self.bb.vocab_size).float() * 30


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_drafter_is_lossless(tiny_llama, temperature):
    """A Drafter plugged in through drafter_factory: drafting the target's own tokens accepts every draft (tau =
    K+1 until the end), drafting garbage accepts none; the output is the target's in both cases."""
    m = tiny_llama
    ids = m.encode("The quick brown fox")
    cfg = DecodeConfig(draft_len=3, max_new_tokens=21, temperature=temperature, seed=5)
    ref = m.generate(ids, decode=DecodeConfig(strategy="autoregressive", max_new_tokens=21, temperature=temperature, seed=5))
    oracle = Decoder(m.backbone, drafter_factory=lambda bb, head, max_len: ScriptedDrafter(bb, ref.token_ids, len(ids)))
    got = oracle.decode(ids, cfg)
    assert len(ref.token_ids) == 21  # no EOS on the way: every round can draft
    if temperature == 0:
        assert got.token_ids == ref.token_ids
        assert got.stats.accepted == got.stats.drafted == 15 and got.stats.verify_steps == 6 and got.stats.tau == 3.5
    else:  # sampled drafts (q is the one-hot-ish script) go through the accept/reject rule
        assert got.stats.drafted > 0 and len(got.token_ids) == 21
    wrong = [(t + 1) % 256 for t in ref.token_ids]
    bad = Decoder(m.backbone, drafter_factory=lambda bb, head, max_len: ScriptedDrafter(bb, wrong, len(ids))).decode(ids, cfg)
    assert bad.stats.drafted > 0
    if temperature == 0:
        assert bad.token_ids == ref.token_ids and bad.stats.accepted == 0 and bad.stats.tau == 1.0


def test_stats_dict_and_merge(tiny_llama):
    m = tiny_llama
    m.set_head("medusa", exit_layer=2)
    randomize_head(m.head, seed=2)
    a = m.decoder.decode(m.encode("First prompt"), DecodeConfig(draft_len=3, max_new_tokens=12))
    b = m.decoder.decode(m.encode("A second one"), DecodeConfig(draft_len=3, max_new_tokens=20))
    d = a.stats.to_dict()
    assert list(d) == STATS_KEYS and d["tau"] == a.stats.new_tokens / a.stats.verify_steps
    assert len(d["drafted_per_position"]) == 3 and d["exit_layer"] == 2 and d["strategy"] == "selfspec"
    assert type(a.stats).from_dict(d) == a.stats
    pooled = type(a.stats).merge([a.stats, b.stats.to_dict()])
    assert pooled.new_tokens == 32 and pooled.verify_steps == a.stats.verify_steps + b.stats.verify_steps
    assert pooled.tau == 32 / pooled.verify_steps
    assert pooled.drafted_per_position == [x + y for x, y in zip(a.stats.drafted_per_position, b.stats.drafted_per_position)]
    assert pooled.accept_rate == (a.stats.accepted + b.stats.accepted) / (a.stats.drafted + b.stats.drafted)
    ar = m.generate("hello", strategy="autoregressive", max_new_tokens=5).stats
    assert list(ar) == STATS_KEYS and ar["exit_layer"] is None and ar["draft_len"] == 0 and ar["accept_rate"] is None


def test_no_decode_function_is_long():
    """The decode loop is a set of named steps: no function in selfspec/decoding/ runs past ~60 lines."""
    import ast
    from pathlib import Path

    import selfspec.decoding.engine

    for name in ("config.py", "drafters.py", "engine.py", "sampling.py", "stats.py"):
        path = Path(selfspec.decoding.engine.__file__).parent / name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 65, f"{path.name}:{node.name}"
