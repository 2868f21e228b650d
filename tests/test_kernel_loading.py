"""Loading the compiled CPU kernels is safe and self-healing (selfspec/model/cpu_kernels.py, issue 12):
only a library this user owns and nobody else can write is loaded; an empty, corrupt, incomplete or
writable one is rebuilt; when the kernels cannot be used, one warning line and torch takes over."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from selfspec.model import cpu_kernels as fl

HAS_KERNEL_PREREQS = fl._cpu_has_avx2_fma() and bool(shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not HAS_KERNEL_PREREQS, reason="the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch, caplog):
    """A process that has not loaded the kernels yet, with an empty kernel cache of its own."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SELFSPEC_CPU_KERNELS", raising=False)
    monkeypatch.setenv("SELFSPEC_GEMM_STREAM_ROWS", "0")  # loading is under test here, not the read-order measurement
    monkeypatch.setenv("SELFSPEC_GEMM_PREFETCH", "1")
    for name in ("_kernel", "_layer_kernel", "_tree_layer_kernel", "_quant_kernel", "_isa_kernel", "_stream_kernel",
                 "_prefetch_kernel"):
        monkeypatch.setattr(fl, name, None)  # restored after the test: later tests keep the session's library
    caplog.set_level(logging.WARNING, logger=fl.__name__)
    return tmp_path


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == fl.__name__ and r.levelno >= logging.WARNING]


def kernel_works() -> bool:
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    return fl.load_kernel() is not None and torch.allclose(fl.linear(x, w), F.linear(x, w), atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("content", [b"", b"\x7fELF" + os.urandom(3000)], ids=["empty", "corrupt"])
def test_a_damaged_cached_library_is_rebuilt(fresh, caplog, content):
    path = fl.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert kernel_works()
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x7fELF"
    (line,) = warnings_of(caplog)  # exactly one line says what happened
    assert "rebuilt" in line and "cannot load it" in line and "\n" not in line


@needs_kernel
def test_a_library_missing_an_entry_point_is_rebuilt(fresh, caplog):
    path = fl.library_path()
    path.parent.mkdir(parents=True)
    src = fresh / "stub.c"
    src.write_text("int selfspec_small_gemm(void) { return 0; }\n")  # one symbol, the others missing
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    os.chmod(path, 0o755)
    assert kernel_works()
    (line,) = warnings_of(caplog)
    assert "rebuilt" in line and "entry point is missing" in line


@needs_kernel
def test_a_library_others_can_write_is_not_loaded_but_rebuilt(fresh, caplog):
    assert fl.load_kernel() is not None  # a good library in the cache
    path = fl.library_path()
    os.chmod(path, 0o777)
    before = path.stat().st_ino
    for name in ("_kernel", "_layer_kernel", "_tree_layer_kernel", "_quant_kernel"):
        setattr(fl, name, None)
    caplog.clear()
    assert kernel_works()
    assert path.stat().st_ino != before and path.stat().st_mode & 0o022 == 0  # a fresh file, not group/world-writable
    (line,) = warnings_of(caplog)
    assert "writable by group or others" in line


@needs_kernel
def test_a_cache_dir_owned_by_another_user_is_refused(fresh, caplog, monkeypatch):
    fl.library_path().parent.mkdir(parents=True)
    monkeypatch.setattr(fl.os, "getuid", lambda: 4242)  # everything on disk now belongs to "someone else"
    assert fl.load_kernel() is None
    (line,) = warnings_of(caplog)
    assert "owned by uid" in line and "run on torch" in line
    assert not list(fl.library_path().parent.iterdir())  # nothing built or loaded there
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    torch.testing.assert_close(fl.linear(x, w), F.linear(x, w))  # torch fallback
    assert fl.load_kernel() is None and len(warnings_of(caplog)) == 1  # the warning comes once per process


@needs_kernel
def test_a_read_only_cache_falls_back_with_one_line(fresh, caplog, monkeypatch):
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fl.tempfile, "mkstemp", read_only)
    assert fl.load_kernel() is None
    (line,) = warnings_of(caplog)
    assert "Read-only file system" in line and "\n" not in line


def test_a_cache_path_that_cannot_be_created_falls_back(fresh, caplog, monkeypatch):
    blocker = fresh / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SELFSPEC_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(fl, "_cpu_has_avx2_fma", lambda: True)
    assert fl.load_kernel() is None
    (line,) = warnings_of(caplog)
    assert "cannot create" in line


# ------------------------------------------------------------------------------------------------ issue 22
@needs_kernel
def test_the_loader_maps_the_descriptor_it_checked(fresh, monkeypatch):
    """No window between the checks and dlopen: the file is opened once (O_NOFOLLOW), checked with fstat, and the
    loader is handed that descriptor's /proc/self/fd path, never the file name again."""
    loaded = []
    real = fl.ctypes.CDLL

    def recording(name, *args, **kwargs):
        loaded.append(str(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(fl.ctypes, "CDLL", recording)
    assert fl.load_kernel() is not None
    assert loaded and all(name.startswith("/proc/self/fd/") for name in loaded)


@needs_kernel
def test_a_symlinked_library_is_not_followed(fresh, caplog):
    path = fl.library_path()
    path.parent.mkdir(parents=True, mode=0o700)
    target = fresh / "elsewhere.so"
    target.write_bytes(b"\x7fELF not really")
    os.symlink(target, path)
    assert kernel_works()  # rebuilt in place of the link
    assert not path.is_symlink()
    (line,) = warnings_of(caplog)
    assert "not a regular file" in line


def test_a_cache_dir_under_a_parent_others_can_write_is_refused(fresh, caplog, monkeypatch):
    shared = fresh / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, not sticky: anyone could rename our directory away
    monkeypatch.setenv("SELFSPEC_CACHE", str(shared / "cache"))
    monkeypatch.setattr(fl, "_cpu_has_avx2_fma", lambda: True)
    assert fl.load_kernel() is None
    (line,) = warnings_of(caplog)
    assert "unsafe" in line and "writable by group or others" in line and str(shared) in line


@needs_kernel
def test_the_kernel_dir_is_created_private(fresh, monkeypatch):
    old = os.umask(0)
    try:
        assert fl.load_kernel() is not None
    finally:
        os.umask(old)
    assert fl.library_path().parent.stat().st_mode & 0o777 == 0o700


def test_an_empty_selfspec_cache_means_the_default_for_kernels_too(monkeypatch, tmp_path):
    from selfspec.utils.paths import cache_dir

    monkeypatch.setenv("SELFSPEC_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fl._kernel_dir() == cache_dir() / "kernels" == tmp_path / ".cache" / "selfspec" / "kernels"


def test_one_threads_kernel_switch_does_not_reach_another_thread(monkeypatch):
    """The decoder's patched nn.Linear modules take the C kernel (or a low-precision copy) only in the thread whose
    run_layers switched it on: HF generate, training or a verify pass in another thread at the same moment computes
    plain F.linear (the switch used to be one global flag)."""
    import threading

    from selfspec.model import backbone as bbmod
    from tests.conftest import make_tiny

    m = make_tiny("gemma3_text")  # HF's own layer code: every projection goes through the patched forward
    bb = m.backbone
    bbmod._patch_linears(bb.layers)
    calls = []
    monkeypatch.setattr(bbmod.cpu_kernels_mod, "linear", lambda x, w, b=None: calls.append(threading.get_ident()) or F.linear(x, w, b))
    quant = bb.quantized("int8")
    inside, done = threading.Event(), threading.Event()

    def drafting_thread():
        with bbmod._linears(True, quant.module_map(bb, 0)):
            inside.set()
            done.wait(30)

    t = threading.Thread(target=drafting_thread)
    t.start()
    inside.wait(30)
    try:
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            out = m.hf_model(ids).logits
    finally:
        done.set()
        t.join()
    assert calls == []  # this thread never saw the other's switch
    with bbmod._linears(True):
        with torch.no_grad():
            again = m.hf_model(ids).logits
    assert calls and set(calls) == {threading.get_ident()}
    torch.testing.assert_close(out, again, rtol=1e-5, atol=1e-5)
