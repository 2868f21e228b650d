"""Issue 12: no code runs from a file, no silent wrong result, no lost run.

Each test here fails on the code before its fix (see the report in the issue thread): crafted checkpoints,
damaged caches, model identity, cache paths, run directories, the converted-model cache, prompt files read
only as far as needed, and the one module that writes files (selfspec/utils/io.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.utils import io


# ------------------------------------------------------------------------------------------------ io utility
def test_atomic_write_fsyncs_and_leaves_nothing_behind_on_failure(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = io.atomic_write_json(tmp_path / "r.json", {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and synced  # the bytes reached the disk before the rename

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        io.atomic_write(tmp_path / "r.json", boom)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # and no temp file is left


def test_checksum_tells_a_damaged_file(tmp_path):
    path = io.atomic_write_bytes(tmp_path / "blob", os.urandom(4096), checksum=True)
    assert io.checksum_problem(path) is None
    data = bytearray(path.read_bytes())
    data[100] ^= 1  # one bit
    path.write_bytes(bytes(data))
    assert io.checksum_problem(path) == "checksum mismatch"
    path.write_bytes(b"")
    assert "0 bytes" in io.checksum_problem(path)
    io.checksum_path(path).unlink()
    assert "no checksum" in io.checksum_problem(path)


def test_atomic_dir_replaces_or_keeps(tmp_path):
    target = tmp_path / "d"
    with io.atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    with io.atomic_dir(target) as tmp:
        (tmp / "a").write_text("2")
    assert (target / "a").read_text() == "2"
    with io.atomic_dir(target, replace=False) as tmp:
        (tmp / "a").write_text("3")
    assert (target / "a").read_text() == "2"  # the existing one wins
    with pytest.raises(ValueError), io.atomic_dir(target) as tmp:
        (tmp / "a").write_text("4")
        raise ValueError("failed half way")
    assert (target / "a").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["d"]


def _make_unique(base: str, barrier, out) -> None:
    barrier.wait()  # all at once: the same second, the same instant
    out.put(str(io.unique_dir(base)))


def test_unique_dirs_for_concurrent_runs(tmp_path):
    ctx = mp.get_context("fork")
    n = 6
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_make_unique, args=(str(tmp_path / "2026-01-01_12-00-00"), barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    dirs = sorted(out.get(timeout=10) for _ in range(n))
    assert len(set(dirs)) == n and all(Path(d).is_dir() for d in dirs)
    assert Path(dirs[0]).name == "2026-01-01_12-00-00" and Path(dirs[1]).name == "2026-01-01_12-00-00_1"


def test_train_run_dirs_come_from_unique_dir(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from selfspec.cli import hydra_utils
    from selfspec.utils.paths import conf_dir

    from omegaconf import OmegaConf

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    for node in ("run", "sweep"):
        assert OmegaConf.to_container(cfg.hydra[node], resolve=False)["dir"].startswith("${unique_dir:")
    # two runs "in the same second" (the same base): two directories
    monkeypatch.setattr(hydra_utils, "_RUN_DIRS", {})
    a = hydra_utils.unique_run_dir(str(tmp_path / "t"))
    monkeypatch.setattr(hydra_utils, "_RUN_DIRS", {})
    b = hydra_utils.unique_run_dir(str(tmp_path / "t"))
    assert a != b and Path(a).is_dir() and Path(b).is_dir()


def test_safe_names_stay_inside_the_cache(tmp_path):
    from selfspec.model.loading import ModelConfig
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import dataset_dir, model_key

    for name in ("../../../etc", "..", "a/b", "/abs/path", "x\x00y"):
        key = model_key(name, {"fp": 1}, "float32")
        d = dataset_dir(tmp_path, key, DataConfig()).resolve()
        assert d.is_relative_to(tmp_path.resolve() / "data") and "/" not in key and not key.startswith(".")
        assert "/" not in ModelConfig(name=name, random_init={}).cache_name


def test_hf_models_are_named_by_their_path(tmp_path):
    from selfspec.model.loading import ModelConfig

    a, b = tmp_path / "merged-a", tmp_path / "merged-b"
    a.mkdir(), b.mkdir()
    na, nb = (ModelConfig(name="hf", name_or_path=str(p)).cache_name for p in (a, b))
    assert na != nb and "merged-a" in na and "merged-b" in nb and na != "hf"
    assert ModelConfig(name="hf", name_or_path="org/model").cache_name != ModelConfig(name="hf", name_or_path="org/other").cache_name
    assert ModelConfig(name="smollm2_135m", random_init={}).cache_name == "smollm2_135m"


# ------------------------------------------------------------------------------------------------ checkpoints
class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # unpickling this calls open(marker, "w"): code from the file would run
        return (open, (str(self.marker), "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    from selfspec.training.checkpoint import load_checkpoint

    marker = tmp_path / "pwned"
    bad = tmp_path / "step-0000001.pt"
    torch.save({"format": "selfspec-train-ckpt/2", "step": 1, "x": _RunsCode(marker)}, bad)
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"x": _RunsCode(marker)}, f)
    for path in (bad, tmp_path / "plain.pkl"):
        with pytest.raises(SelfSpecError) as info:
            load_checkpoint(path)
        assert not marker.exists(), "loading the checkpoint ran code from it"
        assert "\n" not in str(info.value) and "trainer.resume" in str(info.value)


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    from selfspec.training.checkpoint import rng_state, set_rng_state

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.randn(), torch.rand(1)
    path = tmp_path / "rng.pt"
    torch.save(rng_state(), path)
    want = (random.random(), float(np.random.randn()), float(torch.rand(1)))
    set_rng_state(torch.load(path, weights_only=True))
    assert (random.random(), float(np.random.randn()), float(torch.rand(1))) == want


def test_no_unsafe_unpickling_anywhere():
    root = Path(__file__).resolve().parents[1] / "selfspec"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "weights_only=False" not in text and "pickle.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line.strip()}"


# ------------------------------------------------------------------------------------------------ model identity
def _copy_model():
    return make_tiny("llama")


def test_fingerprint_sees_layer_weights_and_output_config(tiny_llama):
    from selfspec.model.backbone import Backbone, fingerprints_match
    from selfspec.training.dataset import model_key

    fp = tiny_llama.backbone.fingerprint()
    finetune = _copy_model()
    with torch.no_grad():  # a "merged fine-tune": same sizes, same embedding, one deep layer nudged by 1%
        finetune.hf_model.model.layers[4].self_attn.v_proj.weight.mul_(1.01)
    other = finetune.backbone.fingerprint()
    assert not fingerprints_match(fp, other)
    assert model_key("tiny", fp, "float32") != model_key("tiny", other, "float32")  # no shared data cache
    for field, value in (("rms_norm_eps", 1e-5), ("rope_parameters", {"rope_theta": 50000.0, "rope_type": "default"})):
        m = _copy_model()
        setattr(m.hf_model.config, field, value)
        assert not fingerprints_match(fp, Backbone(m.hf_model).fingerprint()), field
    for dtype in (torch.bfloat16, torch.float16):  # the same model in another dtype is the same model
        m = _copy_model()
        m.hf_model.to(dtype)
        assert fingerprints_match(fp, Backbone(m.hf_model).fingerprint()), dtype
    assert fingerprints_match(fp, json.loads(json.dumps(fp)))  # as stored in head_config.json


def test_a_head_is_refused_on_a_merged_finetune_and_old_heads_still_load(tmp_path, tiny_llama):
    from selfspec.heads import load_head, save_head

    m = _copy_model()
    m.set_head("medusa", exit_layer=2)
    path = save_head(m.head, tmp_path / "head", m.backbone)
    finetune = _copy_model()
    with torch.no_grad():
        finetune.hf_model.model.layers[3].mlp.down_proj.weight.mul_(1.02)
    with pytest.raises(SelfSpecError, match="saved for another model"):
        load_head(path, finetune.backbone)
    assert load_head(path, _copy_model().backbone).exit_layer == 2
    # a head saved before the fingerprint covered every tensor (sizes + embedding probe) still loads
    cfg = json.loads((path / "head_config.json").read_text())
    cfg["base_model"] = {k: cfg["base_model"][k] for k in ("model_type", "num_layers", "hidden_size", "vocab_size", "weight_probe")}
    (path / "head_config.json").write_text(json.dumps(cfg))
    assert load_head(path, _copy_model().backbone).exit_layer == 2


def test_fingerprint_ignores_an_attached_lora():
    m = _copy_model()
    before = m.backbone.fingerprint()
    m.set_head("lora", exit_layer=2)
    assert m.backbone.fingerprint() == before


# ------------------------------------------------------------------------------------------------ damaged caches
def _tiny_sequences():
    from selfspec.training.dataset import Sequences

    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
    targets = [(torch.tensor([[4, 0], [5, 0]]), torch.zeros(2, 2)), (torch.tensor([[8, 0], [9, 0], [10, 0]]), torch.zeros(3, 2))]
    return Sequences.from_pairs(pairs, targets, ["v"], ["a", "b"], {})


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "zero":
        data = bytearray()
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "random":
        data = bytearray(os.urandom(len(data)))
    else:  # one flipped bit in the middle of the tensor data: torch would load it silently
        data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["zero", "truncated", "random", "bitflip"])
def test_a_damaged_dataset_cache_is_rebuilt_with_one_warning(tmp_path, monkeypatch, caplog, tiny_llama, how):
    from selfspec.training import dataset
    from selfspec.training.config import DataConfig

    builds = []
    monkeypatch.setattr(dataset, "build_sequences", lambda *a, **k: builds.append(1) or _tiny_sequences())
    cfg = DataConfig()
    data, directory, cached = dataset.load_or_build(tiny_llama, cfg, tmp_path, "tiny", progress=False)
    assert not cached and (directory / "dataset.pt.sum").is_file()
    assert dataset.load_or_build(tiny_llama, cfg, tmp_path, "tiny", progress=False)[2] and len(builds) == 1
    _damage(directory / dataset.DATASET_FILE, how)
    caplog.clear()
    again, _, cached = dataset.load_or_build(tiny_llama, cfg, tmp_path, "tiny", progress=False)
    assert not cached and len(builds) == 2 and torch.equal(again.tokens, data.tokens)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "rebuilding" in warnings[0] and "\n" not in warnings[0]


def test_a_damaged_hidden_state_cache_is_recomputed(tmp_path, monkeypatch, caplog, tiny_llama):
    from selfspec.training import features

    data = _tiny_sequences()
    calls = []

    def fake_compute(backbone, d, E, dtype, progress=True):
        calls.append(E)
        return torch.ones(d.tokens.numel(), backbone.hidden_size, dtype=dtype)

    monkeypatch.setattr(features, "compute_hidden", fake_compute)
    h, cached = features.load_or_compute_hidden(tiny_llama.backbone, data, tmp_path, 2, "float16", False)
    assert not cached and features.load_or_compute_hidden(tiny_llama.backbone, data, tmp_path, 2, "float16", False)[1]
    _damage(features.hidden_path(tmp_path, 2, "float16"), "bitflip")
    caplog.clear()
    h2, cached = features.load_or_compute_hidden(tiny_llama.backbone, data, tmp_path, 2, "float16", False)
    assert not cached and calls == [2, 2] and torch.equal(h, h2)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_damaged_sampled_prompts_are_sampled_again(tmp_path, caplog):
    from selfspec.training.dataset import _read_saved_prompts

    path = tmp_path / "prompts.json"
    path.write_text('["one", "tw')
    assert _read_saved_prompts(path) is None and "sampling them again" in caplog.text
    path.write_text('["one", "two"]')
    assert _read_saved_prompts(path) == ["one", "two"]


def test_an_unwritable_data_cache_is_one_line(tmp_path, tiny_llama):
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import load_or_build

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SelfSpecError, match="SELFSPEC_CACHE must name a writable directory") as info:
        load_or_build(tiny_llama, DataConfig(), blocker / "cache", "tiny", progress=False)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ converted models
def test_a_complete_converted_copy_is_never_removed(tmp_path, monkeypatch):
    """Two processes convert the same GGUF file at once: the second to finish must not delete (or rename
    away) the copy the first published, since a reader may be loading it."""
    import shutil

    from selfspec.model import loading

    class Saver:
        def __init__(self, text, name="weights"):
            self.text, self.name = text, name

        def save_pretrained(self, d):
            (Path(d) / self.name).write_text(self.text)

    conv = tmp_path / "converted" / "model-float32-abc"
    touched = []
    real_rmtree, real_rename, real_replace = shutil.rmtree, os.rename, os.replace
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: (touched.append(("rmtree", Path(p))), real_rmtree(p, *a, **k)))
    monkeypatch.setattr(os, "rename", lambda a, b, *x: (touched.append(("rename", Path(a))), real_rename(a, b, *x)))
    monkeypatch.setattr(os, "replace", lambda a, b, *x: (touched.append(("replace", Path(a))), real_replace(a, b, *x)))
    loading.publish_converted(Saver("first"), Saver("tok", "tokenizer.json"), conv, tmp_path / "m.gguf")
    assert (conv / "done").is_file()
    touched.clear()
    loading.publish_converted(Saver("second"), Saver("tok", "tokenizer.json"), conv, tmp_path / "m.gguf")
    assert (conv / "weights").read_text() == "first"
    assert not [op for op in touched if op[1] == conv], touched
    assert [p.name for p in conv.parent.iterdir()] == [conv.name]  # no temp dirs left either


# ------------------------------------------------------------------------------------------------ prompt files
def test_a_big_jsonl_with_a_limit_is_read_only_as_far_as_needed(tmp_path, monkeypatch):
    from selfspec.data import load_prompts
    from selfspec.training.dataset import _first_records

    path = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 1000}) + "\n"
    with open(path, "w") as f:
        for _ in range(20_000):  # 20 MB of valid records ...
            f.write(line)
        f.write('{"prompt": "a broken record"\n')  # ... and a tail that is not JSON at all
        f.write("\xff\xfe garbage\n")
    items = load_prompts(path, limit=20)
    assert len(items) == 20
    assert len(_first_records(path, 5)) == 5  # the trainer's reader of given answers streams too
    with pytest.raises(SelfSpecError, match="line 20001: not valid JSON"):
        load_prompts(path)  # without a limit the whole file is read, and the tail is reported
    # and reading stops: the bytes read are a small part of the file
    read = []
    real_open = open

    def spy_open(p, mode="r", *a, **k):
        f = real_open(p, mode, *a, **k)
        if str(p) == str(path):
            orig = f.__iter__
            lines = iter(orig())

            class Wrapped:
                def __iter__(self):
                    for x in lines:
                        read.append(len(x))
                        yield x

                def __enter__(self):
                    return self

                def __exit__(self, *e):
                    f.close()

            return Wrapped()
        return f

    import builtins

    monkeypatch.setattr(builtins, "open", spy_open)
    assert len(load_prompts(path, limit=20)) == 20
    assert 0 < sum(read) < 100_000


# ------------------------------------------------------------------------------------------------ head cache
def test_the_head_cache_is_keyed_on_the_training_recipe(tmp_path, monkeypatch):
    from selfspec.evaluation import head_cache
    from selfspec.heads import HeadConfig, build_head, save_head
    from selfspec.training import TrainerConfig, TrainRunConfig

    m = make_tiny("llama")
    trained = []

    def fake_train_head(recipe, run_dir):
        trained.append(recipe.trainer.max_steps)
        head = build_head(HeadConfig(type="medusa", exit_layer=recipe.head.exit_layer), m.backbone)
        return save_head(head, tmp_path / f"trained-{len(trained)}", m.backbone)

    monkeypatch.setattr(head_cache, "_trainer", lambda: fake_train_head)
    kw = dict(model_name="tiny", root=tmp_path / "heads")
    short = TrainRunConfig(model=m.model_config, head=None, trainer=TrainerConfig(max_steps=2))
    long = TrainRunConfig(model=m.model_config, head=None, trainer=TrainerConfig(max_steps=50))
    assert head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, recipe=short, **kw)[1] == "trained"
    assert head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, recipe=long, **kw)[1] == "trained"
    assert head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, recipe=short, **kw)[1] == "cache"
    assert trained == [2, 50]
    # settings that do not change the weights (logging, checkpointing) share the head
    chatty = TrainRunConfig(model=m.model_config, head=None, trainer=TrainerConfig(max_steps=2, log_every=1, ckpt_every=0))
    assert head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, recipe=chatty, **kw)[1] == "cache"
