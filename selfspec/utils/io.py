"""One way to write files: atomically, durably, and under a lock where parallel jobs share a cache.

- `atomic_write(path, write)` (and `_bytes` / `_text` / `_json`): the bytes go to a temp file in the same
  directory, are flushed and fsync'ed, then renamed over `path` (and the directory entry fsync'ed). A reader
  sees the old file or the new one, never half of one, and a crash or power loss never leaves a zero-length
  file under the real name.
- `checksum=True` also writes `<path>.sum` (size and BLAKE2b of the bytes); `checksum_problem(path)` says
  whether the file still matches it, so a cache that was truncated or bit-flipped is rebuilt, not trusted.
- `atomic_dir(path)`: the same for a directory (a saved head, a converted model).
- `file_lock(path)`: an exclusive advisory lock (flock) on a lock file, released when the process dies.
- `unique_dir(base)`: a new directory `base`, or `base_1`, `base_2`, ... (mkdir is atomic, so two processes
  started in the same second never share one).
- `safe_name(text)`: a string made safe as one path component (no `/`, no `..`).

Permissions follow the user's umask, as a plain open() or mkdir would: files 0666 & ~umask, directories
0777 & ~umask (so under umask 077 prompts, checkpoints and heads stay private).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

CHECKSUM_SUFFIX = ".sum"
_CHUNK = 1 << 20


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it (/proc/self/status on Linux; elsewhere set-and-restore)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def checksum_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], *, checksum: bool = False,
                 mode: int | None = None) -> Path:
    """Call write(f) on a binary temp file next to `path`, fsync it, rename it over `path`.

    With checksum=True, `<path>.sum` is written afterwards (see checksum_problem). The temp file is named
    `.<name>.<random>.tmp` and removed if anything fails. Its mode: `mode` if given, else what open() would give
    a new file (0666 & ~umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask() if mode is None else mode)  # mkstemp makes it 0600 whatever the umask
        record = {"size": os.path.getsize(tmp), "blake2b": file_digest(tmp)} if checksum else None
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    if record is not None:
        atomic_write_json(checksum_path(path), record)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, **kw) -> Path:
    return atomic_write(path, lambda f: f.write(data), **kw)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8", **kw) -> Path:
    return atomic_write_bytes(path, text.encode(encoding), **kw)


def atomic_write_json(path: str | os.PathLike, payload: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      default: Callable | None = str, ensure_ascii: bool = True, **kw) -> Path:
    text = json.dumps(payload, indent=indent, sort_keys=sort_keys, default=default, ensure_ascii=ensure_ascii)
    return atomic_write_text(path, text + "\n", **kw)


def checksum_problem(path: str | os.PathLike) -> str | None:
    """None when `path` matches the checksum written with it; else what is wrong, in a few words."""
    path, side = Path(path), checksum_path(path)
    try:
        record = json.loads(side.read_text())
        size, digest = int(record["size"]), str(record["blake2b"])
    except FileNotFoundError:
        return f"no checksum file {side.name}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable checksum file {side.name}"
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{actual} bytes, {size} were written"
        if file_digest(path) != digest:
            return "checksum mismatch"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


def _fsync_tree(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool | Callable[[Path], bool] = True) -> Iterator[Path]:
    """Yield a fresh temp directory next to `path`; when the block succeeds, it becomes `path`.

    A `path` that exists at that moment is replaced (replace=True: moved aside, the new one renamed in, the
    old one removed; a reader that opened a file of the old one keeps reading it) or kept (replace=False:
    the existing one wins and the new one is discarded; for caches whose entries are complete once present).
    replace may be a function of the existing directory, asked only then. On failure the temp directory is
    removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700 whatever the umask
        _fsync_tree(tmp)
        try:
            os.rename(tmp, path)  # atomic when path does not exist (or is an empty directory)
        except OSError:
            if not path.exists():
                raise
            if not (replace(path) if callable(replace) else replace):
                shutil.rmtree(tmp, ignore_errors=True)
                return
            aside = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            os.rename(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) for the block. Parallel jobs building
    the same cache wait for one another; the kernel drops the lock if the holder dies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def unique_dir(base: str | os.PathLike) -> Path:
    """Create and return a new directory: `base` itself when free, else `base_1`, `base_2`, ...
    os.mkdir either creates the directory or fails, so concurrent callers always get different ones."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        candidate = base if i == 0 else base.with_name(f"{base.name}_{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: no free name among {base.name}_1 .. _9999")


def safe_name(text: str, max_len: int = 80) -> str:
    """`text` as one safe path component: runs of other characters than letters, digits, `_`, `-`, `.`
    become `_`; leading and trailing dots and underscores go (so `..` cannot climb out of a directory)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("._")[:max_len].strip("._")
    return name or "model"
