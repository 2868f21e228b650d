"""The context head (head=context): layer-E state of the newest token + the verified context's full-depth states.

Its per-generation state keeps verified features apart from predicted ones; training-time test computes, in one
batched pass, exactly what decoding computes draft by draft (checked against a literal simulation of the engine's
rounds); it trains, saves and loads, and drafts losslessly through today's engine.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.errors import SelfSpecError
from selfspec.heads.context import ttt_mask


def _model(arch="llama", E=2, seed=0, **head):
    m = make_tiny(arch)
    m.set_head("context", exit_layer=E, **head)
    randomize_head(m.head, seed=seed, std=0.1)  # non-trivial weights: every path of the head matters
    return m


def _states(m, text="The quick brown fox jumps over the lazy dog again and again"):
    """(h (1, T, H) layer-E states, f (1, T, k*H) the states at the head's context depths: the final layer's before
    the final norm, or several depths side by side) of a text."""
    bb = m.backbone
    ids = torch.tensor([m.encode(text)])
    with torch.no_grad():
        h = bb.run_layers(bb.embed(ids), 0, m.head.exit_layer)
        f, states = bb.run_capturing(bb.embed(ids), 0, bb.num_layers, m.head.context_depths[:-1])
    return h, torch.cat([*states, f], dim=-1)


@pytest.mark.parametrize("arch, E", [("llama", 0), ("llama", 2), ("gemma3_text", 0), ("qwen2", 3)])
def test_shapes_and_the_untrained_head_is_the_lens(arch, E):
    m = make_tiny(arch)
    bb = m.backbone
    m.set_head("context", exit_layer=E, context_layers=2, mlp_ratio=1.5)
    assert m.head.exit_layer == E and m.head.reads_context and m.head.training_input == "context"
    assert m.head.layers[0].gate.out_features == 96  # 1.5 x 64
    h, f = _states(m)
    T = h.shape[1]
    with torch.no_grad():
        state = m.head.new_state(bb, T + 4)
        assert state.feats.shape == (1, T + 4, bb.hidden_size) and state.real_upto == state.exact_upto == 0
        logits = m.head(h, bb, state)
        assert logits.shape == (1, T, bb.vocab_size)
        # fc passes norm(h) through and the layers add nothing: the logit lens at E (up to the norms' eps)
        torch.testing.assert_close(logits, bb.logits(bb.norm(h)), rtol=1e-3, atol=1e-3)
        assert [x.shape for x in m.head.train_steps(h, f, bb, 2)] == [h.shape, h.shape]


def test_exit_layer_zero_is_for_the_context_head_only():
    m = make_tiny("llama")
    m.set_head("context", exit_layer=0)
    with pytest.raises(SelfSpecError, match=r"head.exit_layer=0: must be an integer in \[1, 6\]"):
        m.set_head("medusa", exit_layer=0)
    with pytest.raises(SelfSpecError, match=r"head.exit_layer=7: must be an integer in \[0, 6\]"):
        m.set_head("context", exit_layer=7)


@pytest.mark.parametrize("key, value, message", [
    ("context_layers", 3, "head.context_layers=3: must be 1 or 2"),
    ("mlp_ratio", 0, "head.mlp_ratio=0: must be a number in (0, 16]"),
    ("ttt_steps", 9, "head.ttt_steps=9: must be an integer in [1, 8]"),
    ("ttt_decay", 1.5, "head.ttt_decay=1.5: must be a number in (0, 1]"),
    ("feature_loss", -1, "head.feature_loss=-1: must be a number >= 0"),
    ("context_source", "mid", "head.context_source='mid': allowed final, fused"),
    ("fuse_depths", [3, 6], "head.fuse_depths=[3, 6]: only with head.context_source=fused"),
    ("own_precision", "int4", "head.own_precision='int4': allowed full, int8"),
])
def test_bad_settings_are_one_line_errors(key, value, message):
    from selfspec.heads import make_head_config

    with pytest.raises(SelfSpecError) as info:
        make_head_config("context", **{key: value})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_ttt_mask():
    torch.testing.assert_close(ttt_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())
    m = ttt_mask(5, 3)  # (5, 15): keys of step 1 | step 2 | step 3
    s1, s2, s3 = m[:, :5], m[:, 5:10], m[:, 10:]
    # row 4 at step 3 drafts from a round starting at row 2: step-1 keys <= 2, then step 2 at 3, step 3 at 4
    assert s1[4].tolist() == [True, True, True, False, False]
    assert s2[4].tolist() == [False, False, False, True, False]
    assert s3[4].tolist() == [False, False, False, False, True]
    assert (m.sum(-1) == torch.arange(1, 6)).all()  # every row sees one key per position <= its own


def test_cached_pieces_equal_the_whole_without_verified_features():
    """Without observe every feature is the head's own prediction; feeding in pieces changes nothing."""
    m = _model("mistral", E=2, context_layers=2)
    bb, head = m.backbone, m.head
    h, _ = _states(m)
    with torch.no_grad():
        whole = head(h, bb)  # a fresh state of its own
        state = head.new_state(bb, 64)
        parts = [head(h[:, :4], bb, state, pos0=0), head(h[:, 4:5], bb, state, pos0=4), head(h[:, 5:], bb, state, pos0=5)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-4, atol=1e-5)
    assert state.real_upto == 0 and state.exact_upto == 1  # only row 0 (zeros before it) read no prediction


def test_observe_rollback_and_refeed():
    m = _model("llama", E=0, context_layers=2)
    bb, head = m.backbone, m.head
    h, f = _states(m)
    junk = torch.randn_like(f) * 5
    with torch.no_grad():
        a = head.new_state(bb, 32)
        head.observe(a, f[:, :4], 0)
        head.transform(h[:, :5], bb, a, 0)  # rows 0..4 read verified features f_-1 .. f_3: one batch
        assert (a.real_upto, a.exact_upto) == (4, 5)
        torch.testing.assert_close(a.feats[:, :4], f[:, :4])  # a prediction never overwrites a verified feature
        for t in (5, 6, 7):  # drafts: each reads the one before's prediction
            head.transform(h[:, t : t + 1], bb, a, t)
        assert (a.real_upto, a.exact_upto) == (4, 5)
        # verification of rows 4..7; the drafts at 5.. were rejected (their states are junk), one token accepted
        head.observe(a, torch.cat([f[:, 4:5], junk[:, 5:8]], 1), 4)
        assert a.real_upto == 8
        head.rollback(a, 5)
        assert (a.real_upto, a.exact_upto) == (5, 5) and head.refeed_from(a) == 5
        head.observe(a, f[:, 5:7], 5)  # the next round's verification
        again = head(h[:, 5:8], bb, a, pos0=head.refeed_from(a))  # rows 5..7 read f_4 .. f_6: one batch
        assert (a.real_upto, a.exact_upto) == (7, 8)
        fresh = head.new_state(bb, 32)
        head.observe(fresh, f[:, :7], 0)
        want = head(h[:, :8], bb, fresh)
    torch.testing.assert_close(again, want[:, 5:8], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.feats[:, :7], fresh.feats[:, :7])
    torch.testing.assert_close(a.feats[:, 7], fresh.feats[:, 7], rtol=1e-4, atol=1e-5)


def test_observe_needs_every_verified_position():
    m = _model()
    _, f = _states(m)
    state = m.head.new_state(m.backbone, 32)
    with pytest.raises(ValueError, match="observe every verified position"):
        m.head.observe(state, f[:, 3:5], 3)


def _simulate(head, bb, h, f, steps: int, accept) -> dict[tuple[int, int], torch.Tensor]:
    """The engine's chain rounds, literally: a round whose first draft row is c (the last committed token, its
    feature not yet verified) feeds the head every row it must see again, then drafts rows c+1 .. c+steps-1 one at a
    time; verification hands over rows c .. c+steps (observe), `accept(c)` drafts are accepted, the rest rolled
    back. -> {(step j, row t): the head's f̂ there}: row t of the round starting at c is its step t-c+1."""
    T = h.shape[1]
    state = head.new_state(bb, T + steps + 2)
    seen, c, got = 0, 0, {}
    while c < T:
        seen = min(seen, head.refeed_from(state))  # what the drafter will do with the engine wired
        x = head.transform(h[:, seen : c + 1], bb, state, pos0=seen)
        got[(1, c)] = x[0, -1]
        for j in range(2, steps + 1):
            t = c + j - 1
            if t >= T:
                break
            got[(j, t)] = head.transform(h[:, t : t + 1], bb, state, pos0=t)[0, -1]
        seen = min(T, c + steps)
        head.observe(state, f[:, c : c + steps + 1], c)
        keep = min(c + accept(c) + 1, T)  # positions >= keep are stale; keep is the next round's first row
        head.rollback(state, keep)
        seen = min(seen, keep)
        c = keep
    return got


@pytest.mark.parametrize("arch, E, layers, fused", [("llama", 0, 1, None), ("llama", 2, 2, None),
                                                   ("gemma3_text", 1, 2, None), ("llama", 2, 1, [2, 4, 6]),
                                                   ("qwen2", 0, 2, [])])
def test_training_time_test_equals_decoding_draft_by_draft(arch, E, layers, fused):
    """fused: context_source=fused at those depths ([]: the default low/mid/high)."""
    kw = {} if fused is None else dict(context_source="fused", fuse_depths=fused or None)
    m = _model(arch, E=E, context_layers=layers, seed=3, **kw)
    assert m.head.context_depths == ((6,) if fused is None else tuple(fused or (max(E, 1), 3, 6)))
    bb, head, J = m.backbone, m.head, 4
    h, f = _states(m)
    T = h.shape[1]
    with torch.no_grad():
        steps = head.train_steps(h, f, bb, J)
        pattern = torch.Generator().manual_seed(0)
        for accept in (lambda c: 0, lambda c: int(torch.randint(0, J + 1, (1,), generator=pattern))):
            got = _simulate(head, bb, h, f, J, accept)
            assert len(got) >= T
            for (j, t), x in got.items():
                torch.testing.assert_close(x, steps[j - 1][0, t], rtol=1e-4, atol=1e-4, msg=lambda s: f"step {j}, row {t}: {s}")
    assert {j for j, _ in _simulate(head, bb, h, f, J, lambda c: 0)} == set(range(1, J + 1))


@pytest.mark.parametrize("E", [0, 2])
def test_drafts_losslessly_through_todays_engine(E):
    """Without observe (the engine is not wired yet) every feature is predicted: still lossless."""
    m = _model("llama", E=E, context_layers=2)
    ids = m.encode("A story about", chat=True)
    spec = m.generate(ids, max_new_tokens=24, draft_len=3)
    ar = m.generate(ids, max_new_tokens=24, strategy="autoregressive")
    assert spec.token_ids == ar.token_ids and spec.stats["drafted_per_position"][0] > 0


def test_save_and_load_round_trip(tmp_path):
    from selfspec.heads import load_head

    m = _model("llama", E=0, context_layers=2, mlp_ratio=1.5, ttt_steps=5, ttt_decay=0.5, feature_loss=0.1)
    bb = m.backbone
    m.head.save_pretrained(tmp_path / "head")
    loaded = load_head(tmp_path / "head", bb)
    assert loaded.config == m.head.config and loaded.exit_layer == 0
    h, _ = _states(m)
    with torch.no_grad():
        torch.testing.assert_close(loaded(h, bb), m.head(h, bb))


def test_training_improves_every_step_top1():
    """A short run on the tiny model's own teacher-forced data (greedy answers to one-token prompts: targets at every
    position but the first): top-1 agreement of every training-time-test step rises."""
    from selfspec.training.config import TrainerConfig
    from selfspec.training.dataset import Sequences
    from selfspec.training.features import compute_hidden
    from selfspec.training.loop import Hooks, Trainer
    from selfspec.training.synthesis import answer_prompts

    m = make_tiny("llama")
    bb = m.backbone
    m.set_head("context", exit_layer=1, ttt_steps=3, feature_loss=0.1)
    prompts = [[t] for t in range(10, 250, 30)]
    answers = answer_prompts(bb, prompts, 24, 0.0, 1.0, 8, 0, [], 8, progress=False)
    data = Sequences.from_pairs([(p, a.response) for p, a in zip(prompts, answers)],
                                [(a.topk_ids, a.topk_logprobs) for a in answers], [], [], {})
    hidden = compute_hidden(bb, data, 1, torch.float32, progress=False)
    final = compute_hidden(bb, data, bb.num_layers, torch.float32, progress=False)
    logs = []

    class Record(Hooks):
        def log(self, step, metrics):
            logs.append(metrics)

    cfg = TrainerConfig(max_steps=12, batch_size=8, lr=1e-2, warmup_steps=2, log_every=1, ckpt_every=0)
    result = Trainer(bb, m.head, data, hidden, cfg, progress=False, final=final).fit(Record())
    first, last = logs[0], result.metrics
    for j in (1, 2, 3):  # from about 0.05 (the lens at layer 1) to about 0.7
        assert last[f"train/acc_step{j}"] > first[f"train/acc_step{j}"] + 0.3, (j, first, last)
    assert last["train/acc"] == last["train/acc_step1"]


def test_a_rank_context_loss_is_its_share_of_the_batch():
    """Under data parallelism each rank's loss (every step's distillation and feature terms) is its share of the
    micro-batch's mean: the parts add up to the one-process loss and stats."""
    from selfspec.training.config import TrainerConfig
    from selfspec.training.dataset import Sequences
    from selfspec.training.features import compute_hidden
    from selfspec.training.loop import Trainer

    m = _model("llama", E=1, ttt_steps=3, feature_loss=0.5)
    bb = m.backbone
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 250, (p,), generator=g).tolist(), torch.randint(0, 250, (r,), generator=g).tolist())
             for p, r in ((1, 6), (3, 4), (1, 9), (2, 5))]
    targets = [(torch.randint(0, 320, (len(r), 4), generator=g), torch.randn(len(r), 4, generator=g).log_softmax(-1))
               for _, r in pairs]
    data = Sequences.from_pairs(pairs, targets, [], [], {})
    hidden = compute_hidden(bb, data, 1, torch.float32, progress=False)
    final = compute_hidden(bb, data, bb.num_layers, torch.float32, progress=False)
    trainer = Trainer(bb, m.head, data, hidden, TrainerConfig(batch_size=4), progress=False, final=final)
    with torch.no_grad():
        whole, st = trainer.micro_batch_loss([0, 1, 2, 3])
        a, sa = trainer.micro_batch_loss([0, 2], [0, 1, 2, 3])
        b, sb = trainer.micro_batch_loss([1, 3], [0, 1, 2, 3])
    torch.testing.assert_close(a + b, whole)
    assert set(st) == {"soft", "hard", "acc", "acc_step1", "acc_step2", "acc_step3"}
    for key in st:
        torch.testing.assert_close(sa[key] + sb[key], st[key])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_a_draft_runs_the_head_layer_in_the_c_kernel_as_torch_does(arch, monkeypatch):
    """Drafting (no autograd, float32, CPU, a chain) runs each of the head's layers through the target's decoder-layer
    kernel: the same outputs and cache rows as the torch layer, a prompt's rows at once and then one row at a time;
    a changed weight is picked up."""
    from selfspec.model import cpu_kernels

    if cpu_kernels.load_kernel() is None:
        pytest.skip("the C kernels are not available on this machine")
    m = _model(arch, E=2, seed=5, context_layers=2)
    bb, head = m.backbone, m.head
    h, f = _states(m)
    T = h.shape[1]

    def run(kernel: bool):
        monkeypatch.setattr(type(head.layers[0]), "_kernel_applies", lambda self, x, b: kernel)
        state = head.new_state(bb, T + 2)
        head.observe(state, f[:, : T - 3], 0)
        with torch.inference_mode():
            out = [head.transform(h[:, : T - 3], bb, state, pos0=0)]
            out += [head.transform(h[:, t : t + 1], bb, state, pos0=t) for t in range(T - 3, T)]
        return torch.cat(out, dim=1), state.cache.k.clone()

    (a, ka), (b, kb) = run(True), run(False)
    assert ka.abs().sum() > 0
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ka, kb, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        head.layers[0].down.weight.mul_(2.0)
    (c, _), (d, _) = run(True), run(False)
    torch.testing.assert_close(c, d, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(c, a, atol=1e-4)


def _int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w as the int8 kernel reads it: each row rounded to 255 levels of its own scale (quant.quantize, dequantized)."""
    from selfspec.model.quant import quantize

    return quantize(w, "int8").dequantize(torch.float32)


def test_own_precision_int8_drafts_through_the_int8_rows_of_the_heads_matrices():
    """own_precision=int8: a CPU draft step (at most MAX_ROWS rows) reads int8 copies of fc and each layer's matrices,
    a longer pass (the prompt) the float weights. Its features equal the
    float draft of a head whose matrices were rounded to those rows (up to the kernel's 14-bit inputs), differ from
    the float draft of the unrounded head, and for a head stored in int8 (rows already on that grid) the two
    precisions agree; a weight changed since is picked up; training reads the float weights."""
    from selfspec.model import cpu_kernels

    if cpu_kernels.load_kernel() is None:
        pytest.skip("the C kernels are not available on this machine")
    m = _model("llama", E=2, seed=7, context_layers=2)
    bb, head = m.backbone, m.head
    h, f = _states(m)
    T = h.shape[1]

    def draft(hd, chunk=8):
        """The head over the text: its first T - 3 rows in passes of `chunk` rows, then three one-row draft steps."""
        state = hd.new_state(bb, T + 2)
        hd.observe(state, f[:, : T - 3], 0)
        with torch.inference_mode():
            out = [hd.transform(h[:, s : min(s + chunk, T - 3)], bb, state, pos0=s) for s in range(0, T - 3, chunk)]
            out += [hd.transform(h[:, t : t + 1], bb, state, pos0=t) for t in range(T - 3, T)]
        return torch.cat(out, dim=1)

    assert T - 3 > cpu_kernels.MAX_ROWS
    full = draft(head)
    # a pass of more rows than the small-row kernels take (the prompt) runs in torch on the float weights, either setting
    long = slice(0, T - 3)
    torch.testing.assert_close(draft(head.with_settings(own_precision="int8"), chunk=T)[:, long],
                               draft(head, chunk=T)[:, long], rtol=0, atol=0)
    int8 = draft(head.with_settings(own_precision="int8"))
    assert head.config.own_precision == "full"  # with_settings leaves the head itself alone
    assert (int8 - full).abs().max() > 1e-3  # the int8 rows are read: the randomized weights are not on their grid
    matrices = [head.fc.weight] + [getattr(x, n).weight for x in head.layers for n in ("q", "k", "v", "o", "gate", "up", "down")]
    with torch.no_grad():  # the head as it would be stored in int8 (export --dtype int8)
        for w in matrices:
            w.copy_(_int8_rows(w))
    rounded_full = draft(head)
    torch.testing.assert_close(draft(head.with_settings(own_precision="int8")), rounded_full, rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(int8, rounded_full, rtol=1e-3, atol=2e-4)  # the stale copies were made again
    assert (rounded_full - full).abs().max() > 1e-3
    with torch.enable_grad():  # training (autograd on) reads the float weights, in either setting
        a = head.with_settings(own_precision="int8").transform(h, bb)
        b = head.transform(h, bb)
    assert a.requires_grad
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_with_settings_refuses_a_field_the_head_type_lacks():
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    with pytest.raises(SelfSpecError, match="own_precision: not a setting of a medusa head"):
        m.head.with_settings(own_precision="int8")


# ------------------------------------------------------------------------------------------------ fused depths
@pytest.mark.parametrize("depths, E, message", [
    ([1], 0, "head.fuse_depths=[1]: must be 2 to 4 increasing layer depths"),
    ([3, 2, 6], 0, "head.fuse_depths=[3, 2, 6]: must be 2 to 4"),
    ([1, 2, 3, 4, 6], 0, "head.fuse_depths=[1, 2, 3, 4, 6]: must be 2 to 4"),
    ([1, 3, 5], 0, "head.fuse_depths=[1, 3, 5]: must run from at least head.exit_layer=0 to the last layer, 6"),
    ([1, 3, 6], 2, "head.fuse_depths=[1, 3, 6]: must run from at least head.exit_layer=2 to the last layer, 6"),
    (None, 6, "head.context_source=fused: needs two depths or more between head.exit_layer=6 and the last layer, 6"),
])
def test_bad_fuse_depths_are_one_line_errors(depths, E, message):
    m = make_tiny("llama")
    with pytest.raises(SelfSpecError) as info:
        m.set_head("context", exit_layer=E, context_source="fused", fuse_depths=depths)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_fresh_fused_head_reads_the_final_state_and_learns_the_rest():
    """The fused projection starts at the final layer's state alone: a fused head with a final-source head's
    weights computes exactly what that head does, whatever the shallower states hold; its gradient reaches them."""
    final = _model("llama", E=2, seed=5)
    fused = _model("llama", E=2, seed=5, context_source="fused")
    assert fused.head.context_depths == (2, 3, 6) and fused.head.config.fuse_depths == [2, 3, 6]
    assert fused.head.num_params() == final.head.num_params() + 3 * 64 * 64
    with torch.no_grad():
        fused.head.fuse.weight.zero_()
        fused.head.fuse.weight[:, -64:] = torch.eye(64)
    copied, kept = fused.head.load_matching(final.head.trainable_state_dict())  # trainer.init_from's copy
    assert kept == ["fuse.weight"] and "fc.weight" in copied and "vocab_ids" not in copied
    bb = fused.backbone
    h, f3 = _states(fused)
    steps_fused = fused.head.train_steps(h, f3, bb, 2)
    with torch.no_grad():
        steps_final = final.head.train_steps(h, f3[..., -64:], bb, 2)
        for a, b in zip(steps_fused, steps_final):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        noisy = f3.clone()
        noisy[..., :128] += torch.randn_like(noisy[..., :128]) * 3  # the shallower states: no effect yet
        torch.testing.assert_close(fused.head.train_steps(h, noisy, bb, 1)[0], steps_final[0], rtol=1e-5, atol=1e-5)
    steps_fused[1].pow(2).sum().backward()
    assert fused.head.fuse.weight.grad[:, :128].abs().sum() > 0  # it can learn to read them


def test_a_fused_head_saves_and_loads(tmp_path):
    from selfspec.heads import load_head, read_head_config

    m = _model("qwen2", E=1, context_source="fused", fuse_depths=[1, 4, 6], seed=2)
    m.head.save_pretrained(tmp_path / "head")
    assert read_head_config(tmp_path / "head")["fuse_depths"] == [1, 4, 6]
    loaded = load_head(tmp_path / "head", m.backbone)
    assert loaded.config == m.head.config and loaded.context_depths == (1, 4, 6)
    h, f = _states(m)
    with torch.no_grad():
        torch.testing.assert_close(loaded.train_steps(h, f, m.backbone, 2)[1], m.head.train_steps(h, f, m.backbone, 2)[1])
