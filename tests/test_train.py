"""selfspec.train: configs compose and validate, the losses and data layout are right, and short training
runs on a tiny random model write heads that load and decode losslessly, resume exactly, and log to W&B.

The runs call `selfspec.training.run.run_training` in-process on configs composed from the real conf/
(like lightning-hydra-template's tests); everything that needs the Hydra CLI is in test_train_cli.py.
One data cache is shared by the whole session, so only the first run pays for synthesis.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from selfspec.errors import SelfSpecError
from selfspec.utils.paths import conf_dir

# The tiny model's default init (0.02) makes it repeat one token forever; a wide one gives it some variety,
# so acceptance is partial and training has something to learn.
TINY = [
    "experiment=tiny",
    "+model.random_init.initializer_range=0.3",
    "data.val_prompts=2",
    "decode.max_new_tokens=8",
    "trainer.max_steps=6",
    "trainer.ckpt_every=3",
]


def compose_train(*overrides: str, hydra_config: bool = False):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_config)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("selfspec_cache")


@pytest.fixture
def cache_env(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SELFSPEC_CACHE", str(shared_cache))
    return shared_cache


def run(tmp_path: Path, *overrides: str, name: str = "run") -> dict:
    from selfspec.cli.train import run_training

    cfg = compose_train(*TINY, "logger=none", *overrides)
    return run_training(cfg, tmp_path / name)


def load_trained(payload: dict, *overrides: str):
    from selfspec.api import SelfSpecModel
    from selfspec.cli.config import model_config

    cfg = compose_train(*TINY, *overrides)
    return SelfSpecModel.from_pretrained(model_config(cfg.model), head=payload["head_dir"])


def assert_lossless(m, prompts=("Hello there", "A story about")) -> None:
    for p in prompts:
        ids = m.encode(p, chat=True)
        spec = m.generate(ids, max_new_tokens=24, draft_len=3)
        ar = m.generate(ids, max_new_tokens=24, strategy="autoregressive")
        assert spec.token_ids == ar.token_ids


# ------------------------------------------------------------------------------------------------ configs
GROUPS = ["model", "head", "data", "trainer", "decode", "logger", "experiment", "hparams_search"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml") if not p.stem.startswith("_"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group: str) -> None:
    for option in _options(group):
        overrides = [f"{group}={option}"]
        if group == "data" and option in ("jsonl", "spec_bench"):
            overrides.append("data.path=prompts.jsonl")
        if group == "model" and option == "hf":
            overrides.append("model.name_or_path=some/dir")
        cfg = compose_train(*overrides, hydra_config=group == "hparams_search")
        assert cfg.model is not None and cfg.trainer is not None


def test_train_configs_build_for_every_experiment_and_train_data_option() -> None:
    from selfspec.cli.train import build_configs

    for exp in _options("experiment"):
        c = build_configs(compose_train(f"experiment={exp}"))
        assert c.trainer.max_steps >= 1 and c.head.type != "lens"
    c = build_configs(compose_train("experiment=default"))
    assert (c.model.name, c.head.type, c.head.exit_layer, c.head.draft_vocab, c.decode.draft_len) == ("smollm2_135m", "medusa", 6, 8192, 4)
    assert c.trainer.compare_lens
    for data in ("selfgen", "jsonl"):
        c = build_configs(compose_train(f"data={data}", "data.path=x.jsonl"))
        assert c.data.source == data
    c = build_configs(compose_train("data=selfgen_tasks"))
    assert c.data.source == "selfgen" and len(c.data.system_prompts) == 6
    # the evaluation prompt sets train as prompt files that the target answers itself
    c = build_configs(compose_train("data=spec_bench", "data.path=question.jsonl", "data.limit=40"))
    assert (c.data.source, c.data.path, c.data.format, c.data.limit) == ("jsonl", "question.jsonl", "spec_bench", 40)
    c = build_configs(compose_train("data=builtin"))
    assert c.data.source == "jsonl" and Path(c.data.path).is_file() and c.data.path.endswith("builtin_prompts.jsonl")
    with pytest.raises(SelfSpecError, match="data.path: required"):
        build_configs(compose_train("data=spec_bench"))
    c = build_configs(compose_train("trainer=gpu"))
    assert c.trainer.precision == "bf16"
    c = build_configs(compose_train("experiment=context_fused"))  # context_selfgen's settings, fused, from the shipped head
    assert (c.head.context_source, c.trainer.init_from, c.trainer.lr, c.data.source, c.data.seed) == (
        "fused", "smollm2_135m+context", 5.0e-4, "mix", 3)


def test_optuna_sweeper_and_slurm_launcher_compose() -> None:
    cfg = compose_train("hparams_search=optuna", hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert "optuna" in sweeper._target_.lower() and sweeper.direction == "maximize"
    assert set(sweeper.params) == {"head.exit_layer", "head.num_blocks", "decode.draft_len"}
    assert cfg.optimized_metric == "val/speedup"
    cfg = compose_train("hydra/launcher=slurm", hydra_config=True)
    assert "submitit" in cfg.hydra.launcher._target_.lower() and cfg.hydra.launcher.timeout_min > 0
    cfg = compose_train(hydra_config=True)
    assert cfg.hydra.callbacks.sweep_summary._target_ == "selfspec.cli.sweep_summary.SweepSummaryCallback"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=0", "trainer.max_steps=0: must be an integer >= 1"),
        ("trainer.precision=fp8", "trainer.precision='fp8'"),
        ("trainer.distill_temperature=0", "trainer.distill_temperature=0"),
        ("data.topk=0", "data.topk=0"),
        ("data.answer_top_p=1.5", "data.answer_top_p=1.5"),
        ("+trainer.max_step=3", "trainer: unknown key(s) max_step"),
        ("data.source=web", "data.source='web'"),
        ("data.system_prompts=[' ']", "data.system_prompts: must be a list of non-empty strings"),
        ("data.also=[{seeed: 1}]", "data.also[0]: unknown key(s) seeed; allowed:"),
        ("data.also=[{num_prompts: 0}]", "data.also[0]: data.num_prompts=0: must be an integer >= 1"),
        ("data.also=[3]", "data.also=[3]: must be a list of mappings of data keys"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(override: str, message: str) -> None:
    from selfspec.cli.train import build_configs

    with pytest.raises(SelfSpecError) as info:
        build_configs(compose_train(override))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_jsonl_needs_a_path() -> None:
    from selfspec.training.config import DataConfig

    with pytest.raises(SelfSpecError, match="data.path: required"):
        DataConfig(source="jsonl")


# ------------------------------------------------------------------------------------------------ pure parts
def test_distill_loss_is_soft_cross_entropy_over_the_kept_vocabulary() -> None:
    from selfspec.training.loss import distill_loss, to_draft_vocab, vocab_index

    torch.manual_seed(0)
    logits = torch.randn(5, 10)
    ids = torch.stack([torch.randperm(10)[:4] for _ in range(5)])  # (5, 4)
    logp = torch.randn(5, 4).log_softmax(-1) - 0.1  # top-k mass a little under 1
    labels = ids[:, 0]
    loss, st = distill_loss(logits, ids, logp, labels)
    p = logp.softmax(-1)
    want = -(p * logits.log_softmax(-1).gather(-1, ids)).sum(-1).mean()
    assert torch.allclose(loss, want, atol=1e-6)
    # temperature: both sides softened, scaled by T^2
    loss_t, _ = distill_loss(logits, ids, logp, labels, temperature=2.0)
    want_t = -((logp / 2).softmax(-1) * (logits / 2).log_softmax(-1).gather(-1, ids)).sum(-1).mean() * 4
    assert torch.allclose(loss_t, want_t, atol=1e-6)
    # hard term is plain cross-entropy on the label
    loss_h, st = distill_loss(logits, ids, logp, labels, hard_weight=0.5)
    assert torch.allclose(loss_h, want + 0.5 * torch.nn.functional.cross_entropy(logits, labels), atol=1e-6)
    # a reduced vocabulary: targets outside it are dropped and the rest renormalised
    vocab = torch.tensor([1, 3, 5, 7])
    index = vocab_index(vocab, 10)
    assert index[3] == 1 and index[2] == -1
    sub_ids = to_draft_vocab(ids, index)
    loss_v, _ = distill_loss(logits[:, vocab], sub_ids, logp, to_draft_vocab(labels, index))
    keep = sub_ids >= 0
    rows = keep.any(-1)
    pv = logp.masked_fill(~keep, float("-inf"))[rows].softmax(-1)
    lq = logits[:, vocab].log_softmax(-1)[rows].gather(-1, sub_ids[rows].clamp(min=0))
    assert torch.allclose(loss_v, -(pv * lq).masked_fill(~keep[rows], 0).sum(-1).mean(), atol=1e-6)


def test_sequences_layout() -> None:
    from selfspec.training.dataset import Sequences

    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10]), ([11], [])]  # the empty response is dropped
    targets = [(torch.tensor([[4, 0], [5, 0]]), torch.zeros(2, 2)), (torch.tensor([[8, 0], [9, 0], [10, 0]]), torch.zeros(3, 2)),
               (torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))]
    d = Sequences.from_pairs(pairs, targets, ["v"], ["a", "b", "c"], {})
    assert d.num_sequences == 2 and d.num_targets == 5 and d.train_prompts == ["a", "b"]
    assert d.target_positions().tolist() == [2, 3, 6, 7, 8]  # the position each target is predicted from
    assert d.labels().tolist() == [4, 5, 8, 9, 10] == d.topk_ids[:, 0].tolist()
    assert d.rows_left().tolist() == [1, 0, 2, 1, 0]
    assert d.token_counts(12)[[4, 9, 1]].tolist() == [1, 1, 0]


def test_a_union_of_datasets_keeps_the_first_ones_validation_prompts_out_and_its_states_in_line(tiny_llama) -> None:
    """data.also: sequences of the later datasets whose prompt is held out by the first are left out; the positions
    it returns gather each part's cached states so that they line up with the union's tokens."""
    from selfspec.training.dataset import Sequences, union
    from selfspec.training.features import compute_hidden

    def seqs(spec, val):  # spec: (prompt, prompt ids, response ids) per sequence
        targets = [(torch.tensor([[t, 0] for t in r]), -torch.rand(len(r), 2)) for _, _, r in spec]
        return Sequences.from_pairs([(p, r) for _, p, r in spec], targets, val, [n for n, _, _ in spec], {"k": 1})

    a = seqs([("a0", [1, 2, 3], [4, 5]), ("a1", [6], [7, 8, 9])], ["held", "held too"])
    b = seqs([("b0", [10, 11], [12]), ("held", [13, 14], [15, 16]), ("b2", [17], [18, 19])], ["other"])
    u, positions = union([a, b])
    assert u.num_sequences == 4 and u.train_prompts == ["a0", "a1", "b0", "b2"] and u.val_prompts == ["held", "held too"]
    assert u.meta["k"] == 1 and u.meta["also"] == [{"sequences": 2, "left_out": 1}]
    assert [u.sequence(i).tolist() for i in range(4)] == [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12], [17, 18, 19]]
    assert u.labels().tolist() == [4, 5, 7, 8, 9, 12, 18, 19] == u.topk_ids[:, 0].tolist()
    assert torch.equal(u.topk_logprobs, torch.cat([a.topk_logprobs, b.topk_logprobs[[0, 3, 4]]]))
    assert u.prompt_lens.tolist() == [3, 1, 2, 1] and positions[1].tolist() == [0, 1, 2, 7, 8, 9]
    bb = tiny_llama.backbone
    gathered = torch.cat([compute_hidden(bb, p, 2, torch.float32, progress=False)[k] for p, k in zip((a, b), positions)])
    assert torch.allclose(gathered, compute_hidden(bb, u, 2, torch.float32, progress=False), rtol=1e-4, atol=1e-3)


def test_magpie_prefix_is_the_user_turn_of_the_chat_template() -> None:
    from selfspec.model.loading import tiny_tokenizer
    from selfspec.model.tokens import user_turn_prefix

    tok = tiny_tokenizer()
    prefix, end = user_turn_prefix(tok)
    assert tok.decode(prefix) == "<|user|>" and end == tok.convert_tokens_to_ids("</s>")
    steered, end2 = user_turn_prefix(tok, system="Ask about maths.")
    assert tok.decode(steered) == "<|system|>Ask about maths.</s><|user|>" and end2 == end
    tok.chat_template = None
    with pytest.raises(SelfSpecError, match="chat template"):
        user_turn_prefix(tok)


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    from selfspec.training.loop import WarmupCosine

    f = WarmupCosine(warmup=4, total=20, min_ratio=0.1)
    assert [round(f(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1) and f(12) == pytest.approx(0.55)


def test_weights_digest_sees_a_one_bit_change(tiny_llama) -> None:
    from selfspec.model.identity import weights_digest

    hf = tiny_llama.hf_model
    before = weights_digest(hf)
    w = hf.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        old = w[0, 0].clone()
        w.view(torch.int32)[0, 0] ^= 1  # flip the lowest mantissa bit
        assert weights_digest(hf) != before
        w[0, 0] = old
    assert weights_digest(hf) == before


# ------------------------------------------------------------------------------------------------ runs
def test_train_run_writes_a_head_that_decodes_losslessly(tmp_path: Path, cache_env: Path, capsys) -> None:
    from selfspec.cli.train import report

    out = run(tmp_path, "trainer.compare_lens=true")
    assert out["status"] == "ok" and out["steps"] == 6 and out["head"] == "medusa" and out["exit_layer"] == 2
    for key in ("val/tau", "val/accept_rate", "val/speedup", "val/accept_rate_per_position", "draft_len", "head_params", "train_time_s"):
        assert key in out
    assert len(out["val/accept_rate_per_position"]) == 3 and out["val/lossless"] == 1.0
    assert [r["name"] for r in out["compare"]] == ["autoregressive (ours)", "lens (untrained)", "medusa (trained)"]
    # the final table also times HF generate, interleaved, and checks every output against it
    assert all(r["val/speedup_hf"] > 0 and r["val/lossless"] == 1.0 for r in out["compare"])
    run_dir = tmp_path / "run"
    assert (run_dir / "result.json").is_file() and (run_dir / "head" / "head.safetensors").is_file()
    cache = Path(out["data"]["cache_dir"])
    assert {p.name for p in cache.iterdir()} >= {"prompts.json", "dataset.pt", "hidden-E2-float16.pt", "config.json"}
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == ["step-0000003.pt", "step-0000006.pt"]
    m = load_trained(out)
    assert m.head.config.type == "medusa" and m.head.vocab_ids.numel() == 128
    assert_lossless(m)
    report(out)
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"head: {out['head_dir']}"


def test_validation_with_lookup_first_shows_lookup_alone_and_the_head_keeps_it(tmp_path: Path, cache_env: Path) -> None:
    """decode.lookup_mode=first in training's validation: the final table adds context lookup without a head (what
    the head adds is the difference), and the saved head carries the lookup settings it was validated with."""
    import json

    out = run(tmp_path, "trainer.compare_lens=true", "decode.lookup=true", "decode.lookup_mode=first",
              "decode.lookup_min_ngram=1", name="lookup")
    assert [r["name"] for r in out["compare"]] == ["autoregressive (ours)", "context lookup alone (no head)",
                                                   "lens (untrained) + lookup (first)", "medusa (trained) + lookup (first)"]
    assert all(r["val/lossless"] == 1.0 for r in out["compare"])
    saved = json.loads((Path(out["head_dir"]) / "head_config.json").read_text())["decode"]
    assert saved["lookup"] is True and saved["lookup_mode"] == "first" and saved["lookup_len"] == 3
    m = load_trained(out)
    got = m.generate("Hello there", max_new_tokens=16)
    assert got.decode.lookup_first and "lookup_mode" in got.tuned_from_head


@pytest.mark.parametrize("head", ["adapter", "lora", "lowbit"])
def test_other_heads_train(tmp_path: Path, cache_env: Path, head: str) -> None:
    out = run(tmp_path, f"head={head}", "head.exit_layer=2", "head.draft_vocab=null", "trainer.max_steps=3", "trainer.ckpt_every=0",
              "trainer.grad_accum=2")
    assert out["status"] == "ok" and out["head"] == head and out["val/lossless"] == 1.0
    assert_lossless(load_trained(out))


def test_context_head_trains_from_the_embeddings(tmp_path: Path, cache_env: Path) -> None:
    """head=context at E = 0 reads the cached embeddings and final-layer states, logs each draft step's agreement."""
    out = run(tmp_path, "head=context", "head.exit_layer=0", "head.ttt_steps=2", "trainer.max_steps=3", "trainer.ckpt_every=0")
    assert out["status"] == "ok" and out["head"] == "context" and out["exit_layer"] == 0 and out["val/lossless"] == 1.0
    assert {"train/acc_step1", "train/acc_step2"} <= set(out)
    cached = {p.name.split("-")[1] for p in Path(out["data"]["cache_dir"]).glob("hidden-E*.pt")}
    assert {"E0", "E4"} <= cached  # the tiny model's 4 layers: E = 0 and E = L
    assert_lossless(load_trained(out))


def test_a_context_head_trains_on_a_union_of_datasets(tmp_path: Path, cache_env: Path) -> None:
    """data.also=[{seed: 1}]: a second dataset (built here into its own cache) trains beside the first, and is part of
    the recipe a checkpoint is resumed under."""
    from selfspec.cli.train import build_configs
    from selfspec.training.run import training_recipe

    one = run(tmp_path, "head=context", "head.exit_layer=1", "trainer.max_steps=2", "trainer.ckpt_every=0", name="one")
    two = run(tmp_path, "head=context", "head.exit_layer=1", "trainer.max_steps=2", "trainer.ckpt_every=0",
              "data.also=[{seed: 1}]", name="two")
    assert two["status"] == "ok" and two["val/lossless"] == 1.0
    assert two["data"]["cache_dir"] == one["data"]["cache_dir"] and len(two["data"]["also"]) == 1
    other = Path(two["data"]["also"][0])
    assert other != Path(one["data"]["cache_dir"]) and {"hidden-E1-float16.pt", "hidden-E4-float16.pt"} <= {p.name for p in other.iterdir()}
    assert one["data"]["sequences"] < two["data"]["sequences"] <= 2 * one["data"]["sequences"]
    recipe = training_recipe(build_configs(compose_train(*TINY, "data.also=[{seed: 1}]")))
    assert recipe["data.also"][0]["seed"] == 1 and recipe["data.seed"] == 0
    assert "data.also" not in training_recipe(build_configs(compose_train(*TINY)))
    assert_lossless(load_trained(two))


def test_a_fused_context_head_trains_on_the_states_of_its_depths(tmp_path: Path, cache_env: Path) -> None:
    """head.context_source=fused: the states after E, L/2 and L layers are cached (the layer-E one shared with the
    head's own input) and read side by side; training moves the fusion off the final state alone."""
    out = run(tmp_path, "head=context", "head.exit_layer=1", "head.context_source=fused", "head.ttt_steps=2",
              "trainer.max_steps=3", "trainer.ckpt_every=0")
    assert out["status"] == "ok" and out["head"] == "context" and out["val/lossless"] == 1.0
    cached = {p.name.split("-")[1] for p in Path(out["data"]["cache_dir"]).glob("hidden-E*.pt")}
    assert {"E1", "E2", "E4"} <= cached  # the tiny model's 4 layers: depths 1, 2 and 4
    m = load_trained(out)
    assert m.head.context_depths == (1, 2, 4) and m.head.config.fuse_depths == [1, 2, 4]
    assert m.head.fuse.weight[:, :128].abs().sum() > 0  # it reads the shallower states now
    assert_lossless(m)


def test_a_fused_head_starts_from_a_final_source_head(tmp_path: Path, cache_env: Path) -> None:
    """trainer.init_from: a fresh fused context head takes a trained final-source head's weights and draft vocabulary
    (the fusion at its initialisation); with head.path, or from another head type, it is a one-line error."""
    import torch

    donor = run(tmp_path / "a", "head=context", "head.exit_layer=1", "head.draft_vocab=200", "trainer.max_steps=2",
                "trainer.ckpt_every=0", "trainer.lr=0.05")
    out = run(tmp_path / "b", "head=context", "head.exit_layer=1", "head.context_source=fused",
              f"trainer.init_from={donor['head_dir']}", "trainer.max_steps=1", "trainer.ckpt_every=0", "trainer.lr=1e-9",
              "trainer.warmup_steps=0")
    a, b = load_trained(donor).head, load_trained(out).head
    assert b.context_depths == (1, 2, 4) and torch.equal(a.vocab_ids, b.vocab_ids) and a.vocab_ids.numel() == 200
    torch.testing.assert_close(b.fc.weight, a.fc.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.layers[0].down.weight, a.layers[0].down.weight, rtol=0, atol=1e-6)
    assert b.fuse.weight[:, :128].abs().max() < 1e-6  # the fusion at its start: the final state alone
    for args, message in [(("head.path=" + donor["head_dir"],), "give it or head.path"),
                          (("head=medusa",), "a context head; head.type is medusa")]:
        with pytest.raises(SelfSpecError, match=message):
            run(tmp_path / "c", "head.exit_layer=1", f"trainer.init_from={donor['head_dir']}", *args)


def test_medusa_extra_heads_learn_later_tokens(tmp_path: Path, cache_env: Path) -> None:
    out = run(tmp_path, "head.num_heads=3", "trainer.max_steps=3", "trainer.ckpt_every=0")
    head = load_trained(out, "head.num_heads=3").head
    assert len(head.heads) == 3
    for stack in head.heads:  # zero-initialised: every head, the extra ones too, got gradients
        assert stack[0].linear.weight.abs().sum() > 0


def test_lens_only_validates(tmp_path: Path, cache_env: Path) -> None:
    out = run(tmp_path, "head=lens", "head.exit_layer=2")
    assert out["status"] == "ok" and out["steps"] == 0 and out["head_params"] == 0 and "val/tau" in out


def test_stop_and_resume_continues_exactly(tmp_path: Path, cache_env: Path) -> None:
    from selfspec.training.checkpoint import load_checkpoint

    straight = run(tmp_path, "trainer.max_steps=8", name="straight")
    stopped = run(tmp_path, "trainer.max_steps=8", "trainer.stop_after=4", name="resumed")
    assert stopped["status"] == "stopped" and stopped["steps"] == 4
    ckpts = sorted((tmp_path / "resumed" / "checkpoints").glob("*.pt"))
    assert [p.name for p in ckpts] == ["step-0000003.pt", "step-0000004.pt"]
    assert not (tmp_path / "resumed" / "head").exists()
    resumed = run(tmp_path, "trainer.max_steps=8", "trainer.resume=true", name="resumed")
    assert resumed["status"] == "ok" and resumed["steps"] == 8
    for p in (tmp_path / "resumed" / "checkpoints").iterdir():
        assert load_checkpoint(p)["step"] in (6, 8)  # every file there is a complete checkpoint
    a, b = (load_checkpoint(Path(r) / "checkpoints" / "step-0000008.pt") for r in (tmp_path / "straight", tmp_path / "resumed"))
    for name, t in a["params"].items():  # same batches, same optimizer state: the same weights, bit for bit
        assert torch.equal(t, b["params"][name]), name
    assert resumed["train/loss"] == straight["train/loss"]


def test_resume_refuses_another_head(tmp_path: Path, cache_env: Path) -> None:
    run(tmp_path, "trainer.stop_after=3", name="r")
    with pytest.raises(SelfSpecError, match="head.exit_layer"):
        run(tmp_path, "head.exit_layer=3", "trainer.resume=true", name="r")


def test_resume_refuses_changed_settings_unless_overridden(tmp_path: Path, cache_env: Path) -> None:
    run(tmp_path, "trainer.stop_after=3", name="r")
    with pytest.raises(SelfSpecError) as info:
        run(tmp_path, "trainer.resume=true", "trainer.lr=0.002", "trainer.max_steps=9", name="r")
    message = str(info.value)
    assert "\n" not in message and "resume_override" in message
    assert "trainer.lr 0.001 -> 0.002" in message and "trainer.max_steps 6 -> 9" in message
    # logging / checkpointing settings are free to change; the override resumes anyway
    out = run(tmp_path, "trainer.resume=true", "trainer.lr=0.002", "trainer.resume_override=true", "trainer.log_every=1", name="r")
    assert out["status"] == "ok" and out["steps"] == 6


def test_a_zero_length_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, cache_env: Path, caplog) -> None:
    import json

    import logging

    caplog.set_level(logging.INFO)
    first = run(tmp_path, name="z")
    assert first["status"] == "ok"
    (tmp_path / "z" / "checkpoints" / "step-0000006.pt").write_bytes(b"")  # a crash left it empty
    out = run(tmp_path, "trainer.resume=true", name="z")
    assert out["status"] == "ok" and out["steps"] == 6 and out["train/loss"] == first["train/loss"]
    assert json.loads((tmp_path / "z" / "result.json").read_text())["status"] == "ok"
    assert "skipping unreadable checkpoint" in caplog.text and "resumed from" in caplog.text
    assert "step-0000003.pt" in caplog.text


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_bad_resume_and_long_validation_prompts_fail_before_anything_slow(tmp_path: Path, cache_env: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    from selfspec.api import SelfSpecModel
    from selfspec.training import dataset

    loads: list = []
    real = SelfSpecModel.from_pretrained.__func__
    monkeypatch.setattr(SelfSpecModel, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(1) or real(cls, *a, **k)))
    monkeypatch.setattr(dataset, "load_or_build", lambda *a, **k: pytest.fail("data synthesis started"))
    with pytest.raises(SelfSpecError, match="trainer.resume='/no/such/run': no checkpoint file there"):
        run(tmp_path, "trainer.resume=/no/such/run")
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    crafted = tmp_path / "step-0000001.pt"
    crafted.write_bytes(pickle.dumps({"format": "selfspec-train-ckpt/2", "step": 1, "x": RunsCode()}))
    with pytest.raises(SelfSpecError, match="cannot read checkpoint"):
        run(tmp_path, f"trainer.resume={crafted}")
    assert not marker.exists() and loads == []  # no code ran, and the model was not even loaded
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(['{"prompt": "short"}'] * 3 + ['{"prompt": "%s"}' % ("x" * 1100)]) + "\n")
    with pytest.raises(SelfSpecError, match=r"validation prompt '3' is \d+ tokens; with decode.max_new_tokens=8 it exceeds the model's context \(1024\)"):
        run(tmp_path, "data=jsonl", f"data.path={prompts}")


def test_wandb_offline_run_in_the_run_dir(tmp_path: Path, cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selfspec.cli.train import run_training

    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc: no key, so offline
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / ".local" / "share" / "wandb"))
    cfg = compose_train(*TINY, "logger=wandb", "trainer.max_steps=4", "trainer.log_every=2")
    out = run_training(cfg, tmp_path / "run", wandb_group="sweep-x", wandb_name="job-0")
    assert out["status"] == "ok"
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert_lossless(load_trained(out))


def test_jsonl_prompts_with_given_answers(tmp_path: Path, cache_env: Path) -> None:
    import json

    from selfspec.training.dataset import Sequences

    path = tmp_path / "mixed.jsonl"
    records = [{"question_id": 9, "turns": ["translate: hallo", "again"], "reference": ["hello", "hi"]}] + [
        {"conversations": [{"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer number {i}."}]} for i in range(4)
    ] + [{"prompt": "held out"}, {"text": "held out too"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    given = run(tmp_path, "data=jsonl", f"data.path={path}", "data.use_given=true", "trainer.max_steps=2", name="given")
    data = Sequences.load(Path(given["data"]["cache_dir"]) / "dataset.pt")
    # 7 prompts, the last 2 held out; the 5 training ones answered by the file (Spec-Bench reference, ShareGPT gpt turn)
    assert data.val_prompts == ["held out", "held out too"] and data.num_sequences == 5
    assert data.meta["given"] == 5 and data.meta["generated"] == 0
    tok = load_trained(given).tokenizer
    response = [tok.decode(data.sequence(b)[int(data.prompt_lens[b]):]) for b in (0, 2)]
    assert response == ["hello</s>", "answer number 1.</s>"]
    own = run(tmp_path, "data=jsonl", f"data.path={path}", "data.limit=4", "trainer.max_steps=2", name="own")
    assert own["status"] == "ok" and own["data"]["sequences"] == 2  # 4 prompts, 2 held out; the target answered


def test_train_head_for_other_tools(tmp_path: Path, cache_env: Path) -> None:
    from selfspec.training import train_head
    from selfspec.cli.train import build_configs

    cfg = compose_train(*TINY, "logger=wandb", "trainer.max_steps=2")  # W&B is the caller's: forced off
    out = train_head(build_configs(cfg), tmp_path / "th")  # a typed recipe (TrainRunConfig)
    assert out == (tmp_path / "th" / "head").resolve() and (out / "head_config.json").is_file()
    assert not (tmp_path / "th" / "wandb").exists()
