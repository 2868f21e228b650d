"""Issue 22: concurrent calls on one model, sizes from users and files bounded before allocation, benchmark
prompts excluded by content, checksummed caches, the user's umask, user decode settings over a head's, and the
small ones (cache errors, NaN losses, LoRA targets, SELFSPEC_CACHE="", checkpoint pruning).

Each test fails on the code before its fix."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.errors import SelfSpecError


# ------------------------------------------------------------------------------------------------ LoRA threads
def test_one_threads_lora_drafting_never_changes_another_threads_forward():
    m = make_tiny("llama", seed=3)
    m.set_head("lora", exit_layer=3)
    randomize_head(m.head, seed=1, std=0.1)  # B != 0: the adapter changes the output
    ids = torch.tensor([m.encode("two threads, one model")])
    with torch.no_grad():
        off = m.hf_model(ids).logits
    inside, computed = threading.Event(), threading.Event()
    got: dict = {}

    def drafter():
        with torch.no_grad(), m.head.drafting():
            got["on_before"] = m.hf_model(ids).logits
            inside.set()
            computed.wait(30)  # still drafting while the other thread runs its forward
            got["on_after"] = m.hf_model(ids).logits

    def verifier():
        inside.wait(30)
        with torch.no_grad():
            got["plain"] = m.hf_model(ids).logits
            got["layers"] = m.backbone.run_layers(m.backbone.embed(ids), 0, m.backbone.num_layers)
        computed.set()

    threads = [threading.Thread(target=drafter), threading.Thread(target=verifier)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(got["plain"], off)  # the other thread's plain forward: the adapter was off for it
    with torch.no_grad():
        assert torch.equal(got["layers"], m.backbone.run_layers(m.backbone.embed(ids), 0, m.backbone.num_layers))
    assert not torch.allclose(got["on_before"], off)  # the drafting thread did run with it on, before and after
    assert torch.equal(got["on_before"], got["on_after"])
    with torch.no_grad():
        assert torch.equal(m.hf_model(ids).logits, off)  # and off again once drafting ends


# ------------------------------------------------------------------------------------------------ bounds
def test_decode_sizes_have_upper_limits():
    from selfspec.decoding.config import DecodeConfig

    cases = [
        (dict(draft_len=10**7), r"decode.draft_len=10000000: must be in \[1, 256\]"),
        (dict(lookup_len=10**7), r"decode.lookup_len=10000000: must be in \[1, 256\]"),
        (dict(lookup_branches=10**6), r"decode.lookup_branches=1000000: must be in \[1, 1024\]"),
        (dict(lookup=True, lookup_len=100, lookup_branches=100), r"decode.lookup_branches=100: .* at most 1024"),
        (dict(tree="dynamic", tree_topk=200, draft_len=100), r"decode.tree_topk=200: .* at most 1024"),
        (dict(tree_shape=[1] * 10_000), r"decode.tree_shape=\[10000 levels, up to 1 children\]: must be 1 to 256 levels"),
        (dict(tokens_per_pass=10**6), r"decode.tokens_per_pass=1000000: must be in \[1, 64\]"),
        (dict(lookup_max_ngram=10**6), r"decode.lookup_max_ngram=1000000: must be in \[lookup_min_ngram \(2\), 64\]"),
    ]
    for kw, message in cases:
        with pytest.raises(SelfSpecError, match=message) as info:
            DecodeConfig(**kw)
        assert "\n" not in str(info.value)
    # tied to the model's context: a round's draft and its cache slots fit in it
    DecodeConfig(draft_len=8, lookup=True).check_fits(512)
    with pytest.raises(SelfSpecError, match=r"decode.draft_len=8: must be in \[1, 7\] for this model's context \(8 positions\)"):
        DecodeConfig(draft_len=8).check_fits(8)
    with pytest.raises(SelfSpecError, match=r"decode: a round writes 602 cache slots .* at most the model's context \(512\)"):
        DecodeConfig(draft_len=200, lookup=True, lookup_len=200).check_fits(512)


class _Allocated(Exception):
    pass


def _no_big_linears(monkeypatch, limit=10**6, most=1000):
    """An nn.Linear over `limit` weights, or more than `most` of them, raises _Allocated instead of allocating (so
    the test never eats memory or time)."""
    real = torch.nn.Linear.__init__
    built = []

    def init(self, i, o, *a, **k):
        built.append((i, o))
        if i * o > limit or len(built) > most:
            raise _Allocated(f"a {i} x {o} linear (number {len(built)}) was being built")
        real(self, i, o, *a, **k)

    monkeypatch.setattr(torch.nn.Linear, "__init__", init)


@pytest.mark.parametrize("head_type, key, value, allowed", [
    ("medusa", "intermediate", 10**9, r"\[1, 1024\]"),
    ("medusa", "num_heads", 10**5, r"\[1, 6\]"),
    ("layer", "num_layers", 10**5, r"\[1, 6\]"),
    ("layer", "intermediate", 10**9, r"\[1, 1024\]"),
    ("lora", "lora_rank", 10**6, r"\[1, 64\]"),
    ("adapter", "adapter_heads", 10**6, r"\[1, 16\]"),
])
def test_head_sizes_from_a_file_are_checked_before_anything_is_built(tmp_path, monkeypatch, head_type, key, value, allowed):
    from selfspec.heads import load_head, save_head

    m = make_tiny("llama")
    m.set_head(head_type, exit_layer=2)
    path = save_head(m.head, tmp_path / "head", m.backbone)
    cfg = json.loads((path / "head_config.json").read_text())
    cfg[key] = value
    (path / "head_config.json").write_text(json.dumps(cfg))
    _no_big_linears(monkeypatch)
    fresh = make_tiny("llama")
    with pytest.raises(SelfSpecError, match=rf"head.path=.*head_config.json: head.{key}={value}: must be an integer in {allowed} "
                                            r"for this model") as info:
        load_head(path, fresh.backbone)
    assert "\n" not in str(info.value)
    with pytest.raises(SelfSpecError, match=rf"head.{key}={value}: must be an integer in {allowed}"):  # and from the API
        fresh.set_head(head_type, exit_layer=2, **{key: value})


def test_a_weights_file_bigger_than_its_config_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors.torch import load_file, save_file

    from selfspec.heads import load_head, save_head

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    path = save_head(m.head, tmp_path / "head", m.backbone)
    tensors = load_file(str(path / "head.safetensors"))
    name = next(k for k in tensors if k.endswith("linear.weight"))
    tensors[name] = torch.zeros(64, 5000)  # the config says 64 x 64
    save_file(tensors, str(path / "head.safetensors"))

    def read(*a, **k):
        raise _Allocated("the tensors were read")

    monkeypatch.setattr(safetensors.torch, "load_file", read)
    with pytest.raises(SelfSpecError, match=rf"weights do not fit the config \({name}: \[64, 5000\] in head.safetensors, "
                                            r"\[64, 64\] expected\)"):
        load_head(path, make_tiny("llama").backbone)


def test_a_heads_saved_decode_settings_are_bounded_and_fit_the_model(tmp_path):
    from selfspec.heads import load_head, save_head

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    for block, message in [
        ({"draft_len": 10**7}, r"bad head_config.json 'decode' block: decode.draft_len=10000000: must be in \[1, 256\]"),
        ({"draft_len": 200, "lookup": True, "lookup_len": 200}, r"'decode' block: decode: a round writes 602 cache slots"),
    ]:
        path = save_head(m.head, tmp_path / f"head{len(block)}", m.backbone, extra={"decode": block})
        with pytest.raises(SelfSpecError, match=message):
            load_head(path, m.backbone)


# ------------------------------------------------------------------------------------------------ benchmark prompts
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def _spec_bench_turns() -> list[str]:
    if not SPEC_BENCH.is_file():  # the project ships only hashes of Spec-Bench, never the data (the guide: skip)
        pytest.skip(f"this test reads Spec-Bench's prompts from {SPEC_BENCH} (the project's shared data)")
    return [t for line in SPEC_BENCH.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]


def test_spec_bench_prompts_are_excluded_whatever_the_working_directory(tmp_path, monkeypatch):
    from selfspec.training.mix.build import Excluder, MixConfig

    turns = _spec_bench_turns()
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no ../shared/... from here
    ex = Excluder(MixConfig())
    assert all(ex(t) for t in turns[::7])  # each prompt, verbatim
    long = [t for t in turns if len(t.split()) > 200][:5]
    assert long and all(ex("Summarize this for me:\n" + " ".join(t.split()[: len(t.split()) // 2])) for t in long)
    assert not ex("Tell me about volcanoes and their eruptions in Iceland over the last century.")
    # the package ships hashes only: no prompt's text is in it
    shipped = (Path(__import__("selfspec").__file__).parent / "data" / "excluded" / "spec_bench.json").read_text()
    assert not any(t[:40] in shipped or t[-40:] in shipped for t in turns if len(t) >= 40)


def test_exclude_files_must_exist_and_are_keyed_by_content_not_path(tmp_path, monkeypatch):
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import data_settings, dataset_dir

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    evalfile = tmp_path / "a" / "q.jsonl"
    evalfile.write_text(json.dumps({"turns": ["Describe the rowing club's autumn regatta and the new boathouse in detail."]}) + "\n")

    def settings(cwd, rel):
        monkeypatch.chdir(cwd)
        cfg = DataConfig(source="mix", mix={"exclude": ["spec_bench", rel]})
        return data_settings(cfg), dataset_dir(tmp_path / "root", "m", cfg)

    s1, d1 = settings(tmp_path / "a", "q.jsonl")
    s2, d2 = settings(tmp_path / "a" / "b", "../q.jsonl")
    assert d1 == d2 and "q.jsonl" not in json.dumps(s1)  # the same file from another directory: the same dataset
    evalfile.write_text(json.dumps({"turns": ["Another question entirely, about volcanoes."]}) + "\n")
    _, d3 = settings(tmp_path / "a", "q.jsonl")
    assert d3 != d1  # an edited file: another dataset
    with pytest.raises(SelfSpecError, match=r"data.mix.exclude: 'missing.jsonl' is not a file"):
        settings(tmp_path, "missing.jsonl")


def test_prompt_files_given_to_eval_are_excluded_from_later_training_data(tmp_path, monkeypatch):
    from selfspec.training.mix.build import Excluder, MixConfig
    from selfspec.cli.eval import _record_eval_prompts
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import dataset_dir

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    question = "Draft a cheerful newsletter for a rowing club about its autumn regatta, the new boathouse and the volunteers."
    evalfile = tmp_path / "mine.jsonl"
    evalfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [question]}) + "\n")
    before = dataset_dir(tmp_path / "root", "m", DataConfig(source="selfgen"))
    assert not Excluder(MixConfig())(question)
    _record_eval_prompts({"path": str(evalfile)})  # what python -m selfspec.eval prompts=jsonl prompts.path=F does
    evalfile.unlink()  # hashes are kept, not the file or its path
    monkeypatch.chdir(tmp_path / "cache")
    assert Excluder(MixConfig())(f"Context: {question}\n\nSummarize it.")
    assert dataset_dir(tmp_path / "root", "m", DataConfig(source="selfgen")) != before  # sampled prompts get re-filtered
    stored = "".join(p.read_text() for p in (tmp_path / "cache" / "excluded").glob("*.json"))
    assert "rowing" not in stored and "mine.jsonl" not in stored


# ------------------------------------------------------------------------------------------------ torch >= 2.6
def test_torch_must_be_at_least_2_6_to_load_anything(tmp_path, monkeypatch):
    import tomllib

    from packaging.requirements import Requirement

    from selfspec.training.checkpoint import load_checkpoint
    from selfspec.training.dataset import load_checked
    from selfspec.training.sequences import atomic_torch_save

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert "2.5.1" not in torch_req.specifier and "2.6.0" in torch_req.specifier
    path = tmp_path / "x.pt"
    atomic_torch_save({"format": "x", "t": torch.zeros(2)}, path)
    assert load_checked(path, "test") is not None
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    for load in (lambda: load_checkpoint(path), lambda: load_checked(path, "test")):
        with pytest.raises(SelfSpecError, match=r"torch 2.5.1\+cpu cannot load files safely \(CVE-2025-32434"):
            load()


# ------------------------------------------------------------------------------------------------ converted GGUF cache
def test_a_corrupt_converted_model_cache_is_detected_and_rebuilt(tmp_path, monkeypatch, caplog):
    from conftest import tiny_spec
    from selfspec.model import loading

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tiny.gguf").write_bytes(b"GGUF stand-in")  # the conversion itself is stubbed below
    conversions = []

    def convert(root, gguf_file, cfg):
        conversions.append(gguf_file)
        return loading.build_random_model(tiny_spec("llama"), cfg.torch_dtype, seed=1), loading.tiny_tokenizer()

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    cfg = loading.ModelConfig(name_or_path=str(tmp_path / "m"), gguf_file="tiny.gguf")
    first, _ = loading.load_model(cfg)
    assert conversions == ["tiny.gguf"]
    conv = loading._converted_dir(tmp_path / "m" / "tiny.gguf", "float32")
    assert loading.converted_problem(conv) is None
    again, _ = loading.load_model(cfg)  # from the cache
    assert conversions == ["tiny.gguf"]
    weights = conv / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) - 100] ^= 0x40  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert loading.converted_problem(conv) == "model.safetensors: checksum mismatch"
    caplog.clear()
    rebuilt, _ = loading.load_model(cfg)
    assert conversions == ["tiny.gguf", "tiny.gguf"] and "is damaged (model.safetensors: checksum mismatch)" in caplog.text
    assert loading.converted_problem(conv) is None  # replaced by a sound copy
    for (n, p), (_, q) in zip(first.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(p, q), n
    loaded, _ = loading.load_model(cfg)
    assert conversions == ["tiny.gguf", "tiny.gguf"]
    assert all(torch.equal(p, q) for p, q in zip(first.state_dict().values(), loaded.state_dict().values()))


# ------------------------------------------------------------------------------------------------ umask
def test_written_files_and_directories_follow_the_umask(tmp_path):
    from selfspec.utils import io

    old = os.umask(0o077)
    try:
        f = io.atomic_write_json(tmp_path / "private.json", {"a": 1}, checksum=True)
        with io.atomic_dir(tmp_path / "head") as d:
            (d / "w").write_text("x")
    finally:
        os.umask(old)
    assert f.stat().st_mode & 0o777 == 0o600 and io.checksum_path(f).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "head").stat().st_mode & 0o777 == 0o700
    old = os.umask(0o022)
    try:
        g = io.atomic_write_text(tmp_path / "shared.txt", "x")
        with io.atomic_dir(tmp_path / "head2") as d:
            pass
    finally:
        os.umask(old)
    assert g.stat().st_mode & 0o777 == 0o644 and (tmp_path / "head2").stat().st_mode & 0o777 == 0o755


# ------------------------------------------------------------------------------------------------ user settings win
TUNED = {"draft_len": 2, "draft_threshold": 0.5, "lookup_len": 5}


def _keys_and_config(overrides, searchpath=None):
    """Compose conf/generate.yaml as a run would, and what generate/eval then decode with."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from selfspec.cli.config import decode_config
    from selfspec.decoding.config import with_tuned_settings
    from selfspec.cli.hydra_utils import decode_keys_set
    from selfspec.utils.paths import conf_dir

    extra = [f"hydra.searchpath=[file://{searchpath}]"] if searchpath else []
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("generate", overrides=[*overrides, *extra], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        keys = decode_keys_set(cfg.decode)
    finally:
        HydraConfig.instance().cfg = None
    dcfg, taken = with_tuned_settings(decode_config(cfg.decode), TUNED, keys)
    return keys, dcfg, taken


def test_user_decode_settings_win_over_a_heads_through_every_route(tmp_path):
    keys, dcfg, taken = _keys_and_config([])  # nothing set: the head's settings apply
    assert taken == ["draft_len", "draft_threshold", "lookup_len"] and dcfg.draft_len == 2
    # the command line, even with the default's own value
    keys, dcfg, taken = _keys_and_config(["decode.draft_len=4"])
    assert "draft_len" in keys and dcfg.draft_len == 4 and taken == ["draft_threshold", "lookup_len"]
    # an experiment yaml (as conf/experiment/*.yaml: `# @package _global_`, a decode: block), default values included
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndecode:\n  draft_len: 4\n  draft_threshold: 0.6\n  lookup: true\n  lookup_mode: first\n")
    keys, dcfg, taken = _keys_and_config(["+experiment=mine"], searchpath=tmp_path)
    assert {"draft_len", "draft_threshold", "lookup", "lookup_mode"} <= keys
    assert (dcfg.draft_len, dcfg.draft_threshold, taken) == (4, 0.6, ["lookup_len"])
    # a decode= file of the user's (on hydra.searchpath), again with a default value
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "mine.yaml").write_text("defaults:\n  - greedy\n  - _self_\ndraft_len: 4\nlookup_len: 3\n")
    keys, dcfg, taken = _keys_and_config(["decode=mine"], searchpath=tmp_path)
    assert {"draft_len", "lookup_len"} <= keys and (dcfg.draft_len, dcfg.lookup_len, taken) == (4, 3, ["draft_threshold"])


def test_api_arguments_win_over_a_heads_settings():
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    m.head.decode_settings = dict(TUNED)
    out = m.generate([5, 6, 7], max_new_tokens=4, draft_len=4, lookup_len=3)
    assert (out.decode.draft_len, out.decode.lookup_len, out.tuned_from_head) == (4, 3, ["draft_threshold"])


# ------------------------------------------------------------------------------------------------ the small ones
def test_cache_errors_name_the_real_oserror(tmp_path, monkeypatch):
    import errno

    from selfspec.training import dataset

    for code, text in [(errno.ENOSPC, "No space left on device"), (errno.EIO, "Input/output error"),
                       (errno.ESTALE, "Stale file handle")]:
        def fail(path, code=code, text=text):
            raise OSError(code, text)

        monkeypatch.setattr(dataset, "file_lock", fail)
        with pytest.raises(SelfSpecError) as info:
            with dataset.cache_lock(tmp_path):
                pass
        msg = str(info.value)
        assert text in msg and errno.errorcode[code] in msg and "must name a writable directory" not in msg, msg
    monkeypatch.setattr(dataset, "file_lock", lambda path: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    with pytest.raises(SelfSpecError, match=r"Read-only file system \(SELFSPEC_CACHE must name a writable directory\)"):
        with dataset.cache_lock(tmp_path):
            pass


def test_a_nan_loss_stops_training_and_no_nan_head_is_saved(tmp_path):
    from selfspec.heads import save_head
    from selfspec.training.config import TrainerConfig
    from selfspec.training.dataset import Sequences
    from selfspec.training.loop import Hooks, Trainer

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    pairs = [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10, 11, 12])]
    targets = [(torch.randint(0, 300, (len(r), 4)), torch.log_softmax(torch.randn(len(r), 4), -1)) for _, r in pairs]
    data = Sequences.from_pairs(pairs, targets, [], ["a", "b"], {})
    hidden = torch.randn(int(data.tokens.numel()), m.backbone.hidden_size)
    hidden[2] = float("nan")  # one layer-E state, as a broken feature cache or an overflow would leave it
    before = {k: v.clone() for k, v in m.head.trainable_parameters().items()}
    saved = []

    class Record(Hooks):
        def checkpoint(self, step, state):
            saved.append(step)

    trainer = Trainer(m.backbone, m.head, data, hidden, TrainerConfig(max_steps=5, batch_size=2, ckpt_every=1), progress=False)
    with pytest.raises(SelfSpecError, match=r"training: the loss is nan at step 1; stopped before it reached the weights") as info:
        trainer.fit(Record())
    assert "\n" not in str(info.value) and saved == []
    assert all(torch.equal(p, before[k]) for k, p in m.head.trainable_parameters().items())  # the weights never saw it
    with torch.no_grad():
        next(iter(m.head.trainable_parameters().values())).view(-1)[0] = float("nan")
    with pytest.raises(SelfSpecError, match=r"the head's weights hold NaN or inf .*; not saved"):
        save_head(m.head, tmp_path / "head", m.backbone)
    assert not (tmp_path / "head").exists()


def test_a_bad_lora_target_is_one_line_and_leaves_the_model_untouched():
    from selfspec.model.lora import has_lora

    m = make_tiny("llama")
    for targets in (["nope_proj"], ["q_proj", "nope_proj"]):
        with pytest.raises(SelfSpecError, match=r"head.lora_targets=.*'nope_proj' names no linear layer in this model's "
                                                r"decoder layers \[0, 2\); allowed: down_proj, gate_proj, k_proj") as info:
            m.set_head("lora", exit_layer=2, lora_targets=targets)
        assert "\n" not in str(info.value) and not has_lora(m.hf_model)
    m.set_head("lora", exit_layer=2, lora_targets=["self_attn.q_proj"])  # peft's suffix form works
    assert has_lora(m.hf_model)


def test_an_empty_selfspec_cache_means_the_default(tmp_path, monkeypatch):
    from selfspec.utils.paths import cache_dir

    monkeypatch.chdir(tmp_path)
    default = Path.home() / ".cache" / "selfspec"
    for value in ("", "   "):
        monkeypatch.setenv("SELFSPEC_CACHE", value)
        assert cache_dir() == default  # not the working directory
    monkeypatch.delenv("SELFSPEC_CACHE")
    assert cache_dir() == default
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def test_keep_checkpoints_keeps_this_runs_newest_not_a_stale_higher_step(tmp_path):
    from selfspec.training.checkpoint import checkpoint_files, load_resume_checkpoint, save_checkpoint

    d = tmp_path / "checkpoints"
    save_checkpoint(d, 9000, {"w": torch.zeros(1)}, keep=1)  # left by an earlier run in the same directory
    save_checkpoint(d, 100, {"w": torch.ones(1)}, keep=1)
    assert [p.name for p in checkpoint_files(d)] == ["step-0000100.pt"]
    save_checkpoint(d, 200, {"w": torch.ones(1)}, keep=1)
    assert [p.name for p in checkpoint_files(d)] == ["step-0000200.pt"]
    save_checkpoint(d, 300, {"w": torch.ones(1)}, keep=2)
    assert [p.name for p in checkpoint_files(d)] == ["step-0000200.pt", "step-0000300.pt"]
    assert load_resume_checkpoint(True, tmp_path)[0].name == "step-0000300.pt"
