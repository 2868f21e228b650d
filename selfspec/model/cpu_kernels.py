"""selfspec's CPU kernels for the few rows of a decode step (float32), compiled on first use.

- `linear(x, w, b)`: y = x w^T + b through kernels/small_gemm.c for 1..MAX_ROWS rows, else torch.
- `decoder_layer(...)`: one whole llama-family decoder layer in one call (kernels/decoder_layer.c), for
  batch 1, causal or over a draft tree's rows (an ancestor mask); `decoder_layers(LayerStack, ...)`: a run of them
  in one call, what the backbone uses for decode steps (it falls back to its torch code everywhere else).
- `draft_chain(...)`: a logit lens's drafts in one call (a LayerStack's layers, the final norm, the LM head and the
  argmax, or a draw from the tempered top-p distribution, per draft, each draft fed back as the next token), what the
  engine's fused chain uses.
- `gemm_isa()`: the matmul blocks run in AVX-512 where the CPU has it, else AVX2 (SELFSPEC_CPU_ISA=avx2 forces
  the AVX2 blocks, for before/after timings).
- `gemm_prefetch_level()`, `gemm_stream_rows()`: how the float matmul reads the weights. Blocks of rows side by side
  prefetch what they read next into L1 (1) or into L2 only (2), and calls of up to stream_rows rows read the weights
  one row at a time front to back instead. Which is faster depends on the CPU, so both are measured once per machine
  and library (gemm_tuning.py, cached beside the library); SELFSPEC_GEMM_PREFETCH=1|2 and
  SELFSPEC_GEMM_STREAM_ROWS=0..8 set them. Neither changes a result.

A decode step multiplies 1..K+1 rows by every weight matrix. On CPUs that is bound by reading the weights,
and torch's MKL path reads them slowly for 2-16 rows (a K=4 verify costs ~2x one step on a 2-core AVX2 EPYC,
see BENCHMARKS.md). The C kernel streams each weight row once over OpenMP threads, so verifying K+1 tokens
costs about what one token costs. It is compiled on first use with the system C compiler into
~/.cache/selfspec/kernels (or $SELFSPEC_CACHE/kernels); without a compiler, on a CPU without AVX2/FMA, or with
`SELFSPEC_CPU_KERNELS=0`, everything runs on torch.

The compiled library is only loaded from a cache directory and a file that this user owns and that nobody
else can write (a library is code: whoever can replace it runs code in every selfspec process). It must load,
have every entry point, and pass a small self-test; a cached library that does not (empty, truncated, stale,
writable by others) is rebuilt. When the kernels cannot be used (no compiler, a read-only or foreign cache
directory, a failed build) one warning line says why and everything runs on torch.

`linear` takes the kernel only when it applies (CPU, float32, no autograd, at most `MAX_ROWS` rows) and
otherwise calls `torch.nn.functional.linear`. It also takes a low-precision weight (quant.QuantWeight, the draft
pass of head.draft_precision=int8|int4|int4_mlp): kernels/quant_gemm.c dequantizes it in registers; elsewhere (no kernel,
more rows, another device) it is dequantized and multiplied by torch.

Loading is free of a swap window: the library file is opened once (no symlink followed), its owner and mode are
checked on the open descriptor, and the dynamic loader maps that same descriptor (/proc/self/fd/N); the cache
directory and its parents must not be writable by other users (a sticky directory such as /tmp excepted). Every
entry point is self-tested against torch before use: the float matmul, both low-precision matmuls, the
decoder layer (causal and tree), two layers in one call, a draft chain and a context head's chain, all with explicit float32 buffers whatever
torch's default dtype.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import itertools
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.model import gemm_tuning
from selfspec.model.quant import RESCORE, group_reference, int8_reference, quantize, rescore, round_groups
from selfspec.utils.paths import cache_dir

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this (prefill, training batches) MKL's blocked GEMM is the better kernel
# The C decoder layer takes any number of rows (small_gemm runs them in groups of 8 per weight row read); the
# backbone gives it a draft tree's rows up to this many, chain chunks up to MAX_ROWS. Measured on SmolLM2
# (eval/verify_rows.py, BENCHMARKS.md): C is cheaper up to 16 tree rows (2.20 vs 2.51 steps), torch above
# (32 rows 3.16 vs 3.79, 64 rows 4.33 vs 6.44).
TREE_MAX_ROWS = 16
SOURCES = [Path(__file__).with_name("kernels") / name
           for name in ("small_gemm.c", "decoder_layer.c", "quant_gemm.c", "group_gemm.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_kernel = None  # ctypes function once loaded, False once known unavailable
_layer_kernel = None  # the decoder-layer entry point of the same library
_tree_layer_kernel = None  # the same layer with a tree mask among the new rows
_layers_kernel = None  # a run of layers in one call (LayerStack)
_isa_kernel = None  # selfspec_gemm_isa: which instruction set the matmul blocks use
_stream_kernel = None  # selfspec_gemm_stream_rows: up to how many rows the float matmul reads weights row by row
_prefetch_kernel = None  # selfspec_gemm_prefetch_level: the float blocks prefetch into L1 (1) or L2 (2)
_quant_kernel = None  # selfspec_quant_gemm: the int8 / int4 matmul
_group_path_kernel = None  # selfspec_group_gemm_path: the _a8 matmul in AVX512-VNNI (1) or plain C (0)
_chain_kernel = None  # selfspec_draft_chain: a greedy draft chain through a LayerStack, norm and LM head
_context_kernel = None  # selfspec_context_chain: a context head's draft chain (layers < E, the head, readout)
_OPEN_LIBRARY_FDS: list[int] = []  # descriptors of the loaded libraries (see _dlopen_checked)
ISAS = {"auto": 0, "avx2": 1, "avx512": 2}  # SELFSPEC_CPU_ISA: auto = AVX-512 where the CPU has it, else AVX2


def _cpu_has_avx2_fma() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    words = set(flags.split())
    return "avx2" in words and "fma" in words


def _kernel_dir() -> Path:
    return cache_dir() / "kernels"  # the one resolution of $SELFSPEC_CACHE (empty = unset)


class KernelUnavailable(Exception):
    """Why the compiled kernels cannot be used here (one line)."""


def library_path() -> Path:
    """Where the library for the current sources and flags lives (the name carries their hash)."""
    src = b"".join(p.read_bytes() for p in SOURCES)
    tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:12]
    return _kernel_dir() / f"selfspec_kernels-{tag}.so"


def _untrusted_stat(st: os.stat_result, is_dir: bool) -> str | None:
    """Why an object with this stat must not be trusted for loading code, or None: it must be this user's, not
    writable by group or others, and (for a file) a regular file."""
    if not is_dir and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def _untrusted(path: Path) -> str | None:
    st = os.lstat(path)
    return _untrusted_stat(st, stat.S_ISDIR(st.st_mode))


def _untrusted_parents(directory: Path) -> str | None:
    """Why a parent of the cache directory lets another user swap what lies below it, or None: each must be owned
    by this user or root and not writable by group or others, unless sticky (/tmp: others cannot rename our
    entries there)."""
    for parent in directory.resolve().parents:
        st = os.stat(parent)
        if st.st_uid not in (0, os.getuid()):
            return f"{parent} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def _build(srcs: list[Path], out: Path) -> Path:
    """Compile into a temp file in out's folder (mode 0755: not writable by others) -> the temp file. The
    caller validates it and renames it into place, so concurrent first uses never see half a library."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, srcs), "-lm"], capture_output=True, text=True)
        except OSError as exc:
            raise KernelUnavailable(f"cannot run the C compiler {cc} ({exc.strerror or exc})") from None
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
            raise KernelUnavailable(f"{Path(cc).name} failed: {last}")
        os.chmod(tmp, 0o755)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _dlopen_checked(path: Path):
    """dlopen the very file that was checked: open it without following links, check owner/mode/type on the
    descriptor, and let the loader map that descriptor (no window in which the path could be swapped)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KernelUnavailable(f"cannot open it ({exc.strerror or exc})") from None
    try:
        problem = _untrusted_stat(os.fstat(fd), is_dir=False)
        if problem:
            raise KernelUnavailable(f"it is {problem}")
        fd_path = f"/proc/self/fd/{fd}"
        try:
            lib = ctypes.CDLL(fd_path if os.path.exists(fd_path) else str(path))
        except OSError as exc:
            raise KernelUnavailable(f"cannot load it: {str(exc).splitlines()[0] if str(exc) else 'dlopen failed'}") from None
    except BaseException:
        os.close(fd)
        raise
    # The descriptor stays open: the loader knows the library by the name /proc/self/fd/N, and a later load must
    # never find that name reused by another file.
    _OPEN_LIBRARY_FDS.append(fd)
    return lib


def _load(path: Path):
    """dlopen `path`, bind every entry point and self-test -> the library; KernelUnavailable if any fails."""
    lib = _dlopen_checked(path)
    try:
        _bind(lib)
    except AttributeError as exc:
        raise KernelUnavailable(f"an entry point is missing: {str(exc).splitlines()[0]}") from None
    try:
        failed = self_test()
    except Exception as exc:  # a library that crashes Python cannot be caught; anything else can
        failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if failed:
        _forget()
        raise KernelUnavailable(f"its self-test failed ({failed})")
    return lib


def _forget() -> None:
    global _kernel, _layer_kernel, _tree_layer_kernel, _quant_kernel, _layers_kernel, _chain_kernel
    _kernel, _layer_kernel, _tree_layer_kernel, _quant_kernel, _layers_kernel = False, None, None, None, None
    _chain_kernel = None


def _open_library():
    """The validated library: the cached one when trustworthy and working, else a fresh build."""
    try:
        lib_path = library_path()
    except OSError as exc:
        raise KernelUnavailable(f"cannot read the kernel sources ({exc.strerror or exc})") from None
    directory = lib_path.parent
    try:
        missing = [d for d in (directory, *directory.parents) if not d.exists()]
        for d in reversed(missing):  # each directory this creates is private, whatever the umask
            d.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create {directory} ({exc.strerror or exc})") from None
    problem = _untrusted(directory)
    if problem:
        raise KernelUnavailable(f"the cache directory {directory} is {problem}")
    problem = _untrusted_parents(directory)
    if problem:
        raise KernelUnavailable(f"the cache directory {directory} is unsafe: {problem}")
    reason = None
    if os.path.lexists(lib_path):
        reason = _untrusted(lib_path)
        if reason is None:
            try:
                return _load(lib_path)
            except KernelUnavailable as exc:
                reason = str(exc)
    try:
        try:
            tmp = _build(SOURCES, lib_path)
        except OSError as exc:
            raise KernelUnavailable(f"cannot build into {directory} ({exc.strerror or exc})") from None
        try:
            lib = _load(tmp)  # validated under its temp name, then published (the loaded mapping stays valid)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, lib_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except KernelUnavailable as exc:
        if reason is None:
            raise
        raise KernelUnavailable(f"the cached {lib_path.name} is unusable ({reason}) and rebuilding it failed: {exc}") from None
    if reason is not None:
        log.warning("rebuilt the CPU kernels %s (the cached library was unusable: %s)", lib_path, reason)
    return lib


def load_kernel():
    """The compiled matmul kernel (ctypes function), or None when it cannot be used here. Built once per
    source version; validated on every first use in a process (see the module docstring)."""
    global _kernel
    if _kernel is not None:
        return _kernel or None
    _kernel = False
    if os.environ.get("SELFSPEC_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    if not _cpu_has_avx2_fma():
        log.info("fast linear: this CPU lacks AVX2/FMA; using torch's matmul")
        return None
    try:
        _open_library()
    except (KernelUnavailable, OSError) as exc:
        _forget()
        why = exc if isinstance(exc, KernelUnavailable) else f"{exc.strerror or exc} ({getattr(exc, 'filename', '')})"
        log.warning("selfspec CPU kernels unavailable: %s; decode steps run on torch", why)
        return None
    try:
        gemm_tuning.apply_read_order(sys.modules[__name__])  # this module is the Kernels it tunes
    except Exception as exc:  # only speed is at stake: the kernels keep their default read order
        log.warning("CPU kernels: could not measure the matmul's read order (%s); using the default",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _kernel


def _declare(fn, argtypes: list):
    """A library entry point with its C signature (every one returns an int) -> the entry point."""
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def _bind(lib) -> None:
    """Declare the C signatures of the library's entry points and make them the module's kernels
    (AttributeError when one is missing)."""
    global _kernel, _layer_kernel, _tree_layer_kernel, _isa_kernel, _quant_kernel, _layers_kernel, _chain_kernel
    global _stream_kernel, _prefetch_kernel, _context_kernel, _group_path_kernel
    stream = _declare(lib.selfspec_gemm_stream_rows, [ctypes.c_int])
    level = _declare(lib.selfspec_gemm_prefetch_level, [ctypes.c_int])
    stream(0)
    level(1)
    _stream_kernel, _prefetch_kernel = stream, level
    isa = _declare(lib.selfspec_gemm_isa, [ctypes.c_int])
    want = os.environ.get("SELFSPEC_CPU_ISA", "auto").lower()
    if want not in ISAS:
        log.warning("SELFSPEC_CPU_ISA=%s: allowed %s; using auto", want, ", ".join(ISAS))
        want = "auto"
    isa(ISAS[want])
    fn = _declare(lib.selfspec_small_gemm, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p])
    quant = _declare(lib.selfspec_quant_gemm, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.POINTER(QuantWeightC),
                                               ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p])
    layer = _declare(lib.selfspec_decoder_layer, [
        ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p])
    tree = _declare(lib.selfspec_decoder_layer_tree,
                    layer.argtypes[:-1] + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p])
    layers = _declare(lib.selfspec_decoder_layers, [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_long, ctypes.c_void_p])
    chain = _declare(lib.selfspec_draft_chain,
                     [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p]
                     + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.POINTER(QuantWeightC)]
                     + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
                     + [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
                     + [ctypes.c_void_p, ctypes.c_void_p])
    context = _declare(lib.selfspec_context_chain,
                       [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p]
                       + [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.POINTER(QuantWeightC), ctypes.c_void_p]
                       + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
                       + [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.POINTER(QuantWeightC)]
                       + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
                       + [ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float]
                       + [ctypes.c_void_p] * 4)
    group_path = _declare(lib.selfspec_group_gemm_path, [ctypes.c_int])
    group_path(-1)
    _group_path_kernel = group_path
    _kernel, _layer_kernel, _tree_layer_kernel, _isa_kernel, _quant_kernel = fn, layer, tree, isa, quant
    _layers_kernel, _chain_kernel, _context_kernel = layers, chain, context


def gemm_isa(want: str | None = None) -> str | None:
    """The instruction set of the matmul blocks ("avx2" or "avx512"; None without the kernels). `want` ("auto",
    "avx2", "avx512") switches it for this process (avx512 only where the CPU has it): for tests and
    before/after timings; SELFSPEC_CPU_ISA sets it at load."""
    if not load_kernel():
        return None
    if want is not None and want not in ISAS:
        raise ValueError(f"gemm_isa: {want!r}: allowed {', '.join(ISAS)}")
    code = _isa_kernel(ISAS[want] if want is not None else -1)
    return {1: "avx2", 2: "avx512"}[code]


def gemm_stream_rows(want: int | None = None) -> int | None:
    """Up to how many input rows the float matmul reads the weights row by row (0: never; None without the
    kernels). `want` (0..8) sets it for this process: for tests and before/after timings. It changes which order
    the weights are read in, never a result."""
    if not load_kernel():
        return None
    if want is not None and (not isinstance(want, int) or isinstance(want, bool) or not 0 <= want <= 8):
        raise ValueError(f"gemm_stream_rows: {want!r}: allowed an integer from 0 to 8")
    return int(_stream_kernel(want if want is not None else -1))


def gemm_prefetch_level(want: int | None = None) -> int | None:
    """Where the float matmul's blocks prefetch the weights they read next: 1 = L1, 2 = L2 only (None without the
    kernels). `want` sets it for this process: for tests and before/after timings. Never changes a result."""
    if not load_kernel():
        return None
    if want is not None and (isinstance(want, bool) or not isinstance(want, int) or want not in (1, 2)):
        raise ValueError(f"gemm_prefetch_level: {want!r}: allowed 1 (L1) or 2 (L2)")
    return int(_prefetch_kernel(want if want is not None else -1))


GROUP_PATHS = {"c": 0, "avx512vnni": 1, "avx2": 2, "avxvnni": 3}


def group_gemm_path(want: str | None = None) -> str | None:
    """How the _a8 precisions' matmul runs here (kernels/group_gemm.c): "avx512vnni", "avxvnni", "avx2" or "c"
    (plain C), chosen at load as the first of those this CPU has; None without the kernels. Every path gives the same
    bits. `want` switches it for this process: for tests and before/after timings ("avxvnni" on a CPU with AVX512-VNNI
    but not AVX-VNNI runs its EVEX twin). ValueError for a path this CPU cannot run."""
    if not load_kernel():
        return None
    if want is not None:
        if want not in GROUP_PATHS:
            raise ValueError(f"group_gemm_path: {want!r}: allowed {', '.join(GROUP_PATHS)}")
        if _group_path_kernel(GROUP_PATHS[want]) != GROUP_PATHS[want]:
            raise ValueError(f"group_gemm_path: {want!r} does not run on this CPU")
    code = _group_path_kernel(-1)
    return next(name for name, c in GROUP_PATHS.items() if c == code)


def group_gemm_paths() -> list[str]:
    """The _a8 matmul paths this CPU runs (for tests): every one group_gemm_path accepts."""
    if not load_kernel():
        return []
    was, out = _group_path_kernel(-1), []
    for name, code in GROUP_PATHS.items():
        if _group_path_kernel(code) == code:
            out.append(name)
    _group_path_kernel(was)
    return out


class QuantWeightC(ctypes.Structure):
    """The C struct of kernels/quant_gemm.c: a weight in 8 bits (kind 1) or 4 bits (kind 2), or either laid out for
    the _a8 kernels of kernels/group_gemm.c (kinds 3 and 4), see quant.py."""

    _fields_ = [("kind", ctypes.c_int), ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("exact", ctypes.c_void_p), ("shortlist", ctypes.c_int)]


_KINDS = {"int8": 1, "int4": 2}
_GROUP_KINDS = {"int8": 3, "int4": 4}


def quant_struct(w) -> QuantWeightC:
    """The C view of a quant.QuantWeight (its tensors must outlive the struct; the weight keeps it)."""
    if w.act8:
        exact = w.exact.data_ptr() if w.exact is not None else None
        return QuantWeightC(_GROUP_KINDS[w.kind], w.packed().data_ptr(), w.scale.data_ptr(), None, exact, RESCORE)
    z = w.zero.data_ptr() if w.zero is not None else None
    return QuantWeightC(_KINDS[w.kind], w.q.data_ptr(), w.scale.data_ptr(), z)


class LayerWeights(ctypes.Structure):
    """The C struct of kernels/decoder_layer.c: sizes, epsilons and weight pointers of one decoder layer, and
    optionally a low-precision copy of its four matrices (qqkv, qo, qgu, qd; NULL = the float32 ones)."""

    _fields_ = [(n, ctypes.c_int) for n in ("hidden", "q_heads", "kv_heads", "head_dim", "inter")]
    _fields_ += [(n, ctypes.c_float) for n in ("eps1", "eps2", "scale")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("ln1", "ln2", "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd")]
    _fields_ += [(n, ctypes.POINTER(QuantWeightC)) for n in ("qqkv", "qo", "qgu", "qd")]


def layer_weights(sizes: dict, eps1: float, eps2: float, scale: float, tensors: dict, quant: dict | None = None) -> LayerWeights:
    """Build the struct (it keeps `tensors` alive: contiguous float32 CPU, biases may be None). `quant` maps
    wqkv/wo/wgu/wd to quant.QuantWeight copies the kernel uses instead (kept alive by the struct)."""
    ptr = {n: (t.data_ptr() if t is not None else None) for n, t in tensors.items()}
    lw = LayerWeights(**sizes, eps1=eps1, eps2=eps2, scale=scale, **ptr)
    # The struct keeps what it points into: a LayerStack still holding it after the layer was fused again (new
    # weights) must never read freed memory.
    lw._tensors = dict(tensors)
    if quant:
        structs = {n: quant_struct(quant[n]) for n in ("wqkv", "wo", "wgu", "wd")}
        lw._keep = (structs, quant)
        lw.qqkv, lw.qo, lw.qgu, lw.qd = (ctypes.pointer(structs[n]) for n in ("wqkv", "wo", "wgu", "wd"))
    return lw


def decoder_layer(weights: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, pos0: int, window: int | None, tree: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> None:
    """One decoder layer in place on h (T, hidden) at cache slots pos0..pos0+T-1 (batch 1, float32, contiguous).
    cos/sin: (T, head_dim); k_cache/v_cache: this layer's (kv_heads, max_len, head_dim) buffers, written at
    those slots. Causal (tree None): rows attend over [0, pos0+t] (within `window` when given). With
    tree=(qpos, mask) from `tree_args`: row t attends every slot before pos0+T-S and, among the last S slots,
    those where mask[t] is set (its root-to-node path); the window is counted in rotary positions (qpos)."""
    T = h.shape[0]
    kv_len = pos0 + T
    for name, t in (("h", h), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"decoder_layer: {name} must be a contiguous float32 CPU tensor")
    qkv = (weights.q_heads + 2 * weights.kv_heads) * weights.head_dim
    n = T * (weights.hidden + qkv + weights.q_heads * weights.head_dim + 2 * weights.inter) + weights.q_heads * T * kv_len
    if tree is None:
        work = torch.empty(n, dtype=torch.float32)  # explicit: the C code reads float32 whatever the default dtype
        _layer_kernel(ctypes.byref(weights), h.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                      v_cache.data_ptr(), k_cache.shape[1], pos0, window or 0, work.data_ptr())
        return
    qpos, mask = tree
    S = mask.shape[1]
    work = torch.empty(n + T * S + 2 * T, dtype=torch.float32)  # + the key lists of each row
    _tree_layer_kernel(ctypes.byref(weights), h.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                       v_cache.data_ptr(), k_cache.shape[1], pos0, window or 0, qpos.data_ptr(), mask.data_ptr(), S,
                       work.data_ptr())


class LayerStack:
    """Consecutive decoder layers prepared for one `decoder_layers` call: the C arrays of their weight structs, of
    one cache's K/V buffers and of their windows and rotary kinds. Built once per (cache, layers, precision) by the
    backbone; every object it points into is kept alive here."""

    def __init__(self, weights: list, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], windows: list,
                 kinds: list[int]):
        for name, bufs in (("k_cache", k_bufs), ("v_cache", v_bufs)):
            for t in bufs:
                if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError(f"LayerStack: {name} must be contiguous float32 CPU tensors")
        n = self.n = len(weights)
        self._keep = (weights, k_bufs, v_bufs)
        self.weights = (ctypes.c_void_p * n)(*[ctypes.addressof(w) for w in weights])
        self.k = (ctypes.c_void_p * n)(*[t.data_ptr() for t in k_bufs])
        self.v = (ctypes.c_void_p * n)(*[t.data_ptr() for t in v_bufs])
        self.windows = (ctypes.c_long * n)(*[w or 0 for w in windows])
        self.kinds = (ctypes.c_int * n)(*kinds)
        self.num_kinds = max(kinds) + 1
        self.max_len = k_bufs[0].shape[1]
        # work floats per row and per attended slot (the largest layer's; a model's layers share their sizes)
        self.per_row = max(w.hidden + (w.q_heads + 2 * w.kv_heads) * w.head_dim + w.q_heads * w.head_dim + 2 * w.inter
                           for w in weights)
        self.per_slot = max(w.q_heads for w in weights)


def decoder_layers(stack: LayerStack, h: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], pos0: int,
                   tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The stack's layers one after another in one C call, in place on h (T, hidden), as `decoder_layer` does for
    one layer. rope[kind] = (cos, sin), each (T, head_dim) contiguous float32, for every kind the stack uses."""
    T = h.shape[0]
    for t in (h, *(x for pair in rope for x in pair)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("decoder_layers: h, cos and sin must be contiguous float32 CPU tensors")
    if len(rope) < stack.num_kinds:
        raise ValueError(f"decoder_layers: rotary rows for {len(rope)} layer kinds, the stack uses {stack.num_kinds}")
    k = stack.num_kinds
    cos = (ctypes.c_void_p * k)(*[rope[i][0].data_ptr() for i in range(k)])
    sin = (ctypes.c_void_p * k)(*[rope[i][1].data_ptr() for i in range(k)])
    n = T * stack.per_row + stack.per_slot * T * (pos0 + T)
    if tree is None:
        work = torch.empty(n, dtype=torch.float32)
        qpos = mask = None
        S = 0
    else:
        qpos, mask = tree
        S = mask.shape[1]
        work = torch.empty(n + T * S + 2 * T, dtype=torch.float32)  # + the key lists of each row
        qpos, mask = qpos.data_ptr(), mask.data_ptr()
    r = _layers_kernel(stack.weights, stack.n, h.data_ptr(), T, stack.kinds, cos, sin, stack.k, stack.v,
                       stack.max_len, pos0, stack.windows, qpos, mask, S, work.data_ptr())
    if r:
        raise RuntimeError(f"decoder_layers: the C kernel returned {r}")


def draft_chain(stack: LayerStack, rope: list[tuple[torch.Tensor, torch.Tensor]], embed: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, lm, lm_bias: torch.Tensor | None, vocab_ids: torch.Tensor | None,
                tokens: torch.Tensor, pos0: int, count: int, hidden_out: torch.Tensor | None = None,
                sampled: tuple[float, float, torch.Tensor, torch.Tensor] | None = None) -> None:
    """`count` greedy drafts in one C call (kernels/decoder_layer.c: selfspec_draft_chain), in place in `tokens` ((N,)
    int64): step s embeds tokens[pos0+s] at cache slot pos0+s, runs the stack's layers there (writing their K/V), and
    writes to tokens[pos0+s+1] the argmax of the final norm (norm_weight, eps) and LM head `lm` ((V, hidden) float32,
    or a quant.QuantWeight; the first of equal maxima), mapped through `vocab_ids` (a draft vocabulary) when given.
    rope[kind] = (cos, sin) rows (count, head_dim) for positions pos0..; hidden_out (count, hidden) gets the states
    after the layers. sampled = (temperature > 0, top_p, uniforms (count,), q_out (count, V)): each draft is drawn
    with uniforms[s] from the tempered softmax cut to its top-p nucleus, which goes to q_out[s] (sampling's q) instead
    of the argmax. Nothing is read back to Python."""
    H, V = embed.shape[1], lm.shape[0]
    temperature, top_p, uniforms, q_out = sampled if sampled is not None else (0.0, 1.0, None, None)
    tensors = [embed, norm_weight, *(x for pair in rope for x in pair)]
    if sampled is not None:
        if not (temperature > 0 and 0 < top_p <= 1) or uniforms.numel() < count or tuple(q_out.shape) != (count, V):
            raise ValueError(f"draft_chain: sampling needs temperature > 0, top_p in (0, 1], {count} uniforms and q_out ({count}, {V})")
        tensors += [uniforms, q_out]
    tensors += [t for t in (lm_bias, hidden_out) if t is not None] + ([lm] if isinstance(lm, torch.Tensor) else [])
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        raise ValueError("draft_chain: embed, norm, rotary rows, LM head, bias and hidden_out must be contiguous float32 CPU tensors")
    if len(rope) < stack.num_kinds or any(c.shape[0] < count for c, _ in rope[: stack.num_kinds]):
        raise ValueError(f"draft_chain: rotary rows for {count} positions of {stack.num_kinds} layer kinds are needed")
    for name, ids, n in (("tokens", tokens, pos0 + count + 1), ("vocab_ids", vocab_ids, V)):
        if ids is not None and (ids.dtype != torch.int64 or not ids.is_contiguous() or ids.device.type != "cpu"
                                or ids.dim() != 1 or ids.numel() < n):
            raise ValueError(f"draft_chain: {name} must be a contiguous int64 CPU vector of at least {n} ids")
    if lm.shape[1] != H or norm_weight.numel() != H or count < 1 or pos0 < 0 or pos0 + count > stack.max_len:
        raise ValueError("draft_chain: the LM head, norm and embedding disagree on sizes, or the slots are out of range")
    if hidden_out is not None and tuple(hidden_out.shape) != (count, H):
        raise ValueError(f"draft_chain: hidden_out must be ({count}, {H})")
    k = stack.num_kinds
    cos = (ctypes.c_void_p * k)(*[rope[i][0].data_ptr() for i in range(k)])
    sin = (ctypes.c_void_p * k)(*[rope[i][1].data_ptr() for i in range(k)])
    work = torch.empty(stack.per_row + stack.per_slot * (pos0 + count) + 2 * H + V * (3 if sampled else 1), dtype=torch.float32)
    quant = not isinstance(lm, torch.Tensor)
    qs = quant_struct(lm) if quant else None
    r = _chain_kernel(stack.weights, stack.n, stack.kinds, cos, sin, stack.k, stack.v, stack.max_len, stack.windows,
                      embed.data_ptr(), norm_weight.data_ptr(), eps, ctypes.byref(qs) if quant else None,
                      None if quant else lm.data_ptr(), None if lm_bias is None else lm_bias.data_ptr(), V,
                      None if vocab_ids is None else vocab_ids.data_ptr(), pos0, tokens.data_ptr(), count, temperature,
                      top_p, None if uniforms is None else uniforms.data_ptr(), None if q_out is None else q_out.data_ptr(),
                      None if hidden_out is None else hidden_out.data_ptr(), work.data_ptr())
    if r:
        raise RuntimeError(f"draft_chain: the C kernel returned {r}")


@dataclasses.dataclass
class ContextChainHead:
    """What `context_chain` reads of a context head (heads/context.py): its two input norms (one epsilon), fc
    ((hidden, 2 hidden) float32 or a quant.QuantWeight), its decoder layers' weight structs, its own cache's
    per-layer K/V buffers, and the generation's feature rows `feats` ((max_len, hidden): verified below real_upto)."""

    norm_h: torch.Tensor
    norm_f: torch.Tensor
    eps: float
    fc: object
    layers: list
    k_bufs: list
    v_bufs: list
    feats: torch.Tensor
    real_upto: int


def context_chain(stack: LayerStack | None, rope: tuple[torch.Tensor, torch.Tensor], base: int, embed: torch.Tensor,
                  head: ContextChainHead, norm_weight: torch.Tensor, eps: float, lm, lm_bias: torch.Tensor | None,
                  vocab_ids: torch.Tensor | None, tokens: torch.Tensor, hidden: torch.Tensor, early: int, seen: int,
                  p0: int, count: int, threshold: float = 0.0, cont: float = 0.0,
                  sampled: tuple[float, float, torch.Tensor, torch.Tensor] | None = None) -> tuple[int, int]:
    """A context head's drafts for positions p0+1 .. in one C call (kernels/decoder_layer.c:
    selfspec_context_chain), in place in `tokens` ((N,) int64), `hidden` ((max_len, hidden): layer-E states, rows
    early .. written) and head.feats; `stack` is the target's layers [0, E) (None: E = 0), rope = (cos, sin) rows
    from position `base` = min(early, seen) through p0 + count. Stops at `count` drafts, before a draft whose
    softmax probability is below `threshold`, or after the one that takes the drafts' joint probability below
    `cont` (0 = off). Greedy: each draft is the readout's argmax, its confidence its softmax probability; sampled =
    (temperature > 0, top_p, uniforms (count,), q_out (count, V)) as in `draft_chain`, the confidence q's largest
    probability. -> (drafts made, head passes run)."""
    _check_context_chain(stack, rope, base, embed, head, norm_weight, lm, lm_bias, vocab_ids, tokens, hidden, early, seen,
                         p0, count, sampled)
    H, V = embed.shape[1], lm.shape[0]
    cos, sin = rope
    temperature, top_p, uniforms, q_out = sampled if sampled is not None else (0.0, 1.0, None, None)
    last = p0 + count  # the last position a row is written at
    T = max(p0 + 1 - early, p0 + 1 - seen, 1)
    layers = head.layers + (list(stack._keep[0]) if stack is not None else [])
    per_row = max(w.hidden + (w.q_heads + 2 * w.kv_heads) * w.head_dim + w.q_heads * w.head_dim + 2 * w.inter for w in layers)
    per_slot = max(w.q_heads for w in layers)
    work = torch.empty(T * 3 * H + H + V * (3 if sampled else 1) + T * per_row + per_slot * T * (last + 1), dtype=torch.float32)
    out = torch.zeros(2, dtype=torch.int64)
    hl = (ctypes.c_void_p * len(head.layers))(*[ctypes.addressof(w) for w in head.layers])
    hk = (ctypes.c_void_p * len(head.k_bufs))(*[t.data_ptr() for t in head.k_bufs])
    hv = (ctypes.c_void_p * len(head.v_bufs))(*[t.data_ptr() for t in head.v_bufs])
    if stack is not None:
        k = stack.num_kinds
        cs = (ctypes.c_void_p * k)(*[cos.data_ptr()] * k)
        sn = (ctypes.c_void_p * k)(*[sin.data_ptr()] * k)
        early_args = (stack.weights, stack.n, stack.kinds, cs, sn, stack.k, stack.v, stack.max_len, stack.windows)
    else:
        early_args = (None, 0, None, None, None, None, None, 0, None)
    lq = None if isinstance(lm, torch.Tensor) else quant_struct(lm)
    fq = None if isinstance(head.fc, torch.Tensor) else quant_struct(head.fc)
    r = _context_kernel(*early_args, embed.data_ptr(), head.norm_h.data_ptr(), head.norm_f.data_ptr(), head.eps,
                        None if fq is None else ctypes.byref(fq), head.fc.data_ptr() if fq is None else None,
                        hl, len(head.layers), hk, hv, head.k_bufs[0].shape[1], cos.data_ptr(), sin.data_ptr(),
                        norm_weight.data_ptr(), eps, None if lq is None else ctypes.byref(lq),
                        lm.data_ptr() if lq is None else None, None if lm_bias is None else lm_bias.data_ptr(), V,
                        None if vocab_ids is None else vocab_ids.data_ptr(), tokens.data_ptr(), hidden.data_ptr(),
                        head.feats.data_ptr(), base, early, seen, head.real_upto, p0, count, threshold, cont,
                        temperature, top_p, None if uniforms is None else uniforms.data_ptr(),
                        None if q_out is None else q_out.data_ptr(), out.data_ptr(), work.data_ptr())
    if r:
        raise RuntimeError(f"context_chain: the C kernel returned {r}")
    return int(out[0]), int(out[1])


def _check_context_chain(stack: LayerStack | None, rope: tuple[torch.Tensor, torch.Tensor], base: int, embed: torch.Tensor,
                         head: ContextChainHead, norm_weight: torch.Tensor, lm, lm_bias: torch.Tensor | None,
                         vocab_ids: torch.Tensor | None, tokens: torch.Tensor, hidden: torch.Tensor, early: int, seen: int,
                         p0: int, count: int, sampled: tuple | None) -> None:
    """context_chain's arguments as the C call reads them: dtypes, layouts, sizes and positions that agree
    (ValueError naming what does not), so that the kernel never reads or writes out of bounds."""
    H = embed.shape[1]
    V = lm.shape[0]
    cos, sin = rope
    floats = [embed, head.norm_h, head.norm_f, head.feats, norm_weight, hidden, cos, sin, *head.k_bufs, *head.v_bufs]
    if sampled is not None:
        temperature, top_p, uniforms, q_out = sampled
        if not (temperature > 0 and 0 < top_p <= 1) or uniforms.numel() < count or tuple(q_out.shape) != (count, V):
            raise ValueError(f"context_chain: sampling needs temperature > 0, top_p in (0, 1], {count} uniforms and q_out ({count}, {V})")
        floats += [uniforms, q_out]
    floats += [t for t in (lm_bias,) if t is not None] + [w for w in (lm, head.fc) if isinstance(w, torch.Tensor)]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in floats):
        raise ValueError("context_chain: weights, norms, rotary rows, hidden, feats and caches must be contiguous float32 CPU tensors")
    last = p0 + count  # the last position a row is written at
    for name, ids, need in (("tokens", tokens, last + 1), ("vocab_ids", vocab_ids, V)):
        if ids is not None and (ids.dtype != torch.int64 or not ids.is_contiguous() or ids.device.type != "cpu"
                                or ids.dim() != 1 or ids.numel() < need):
            raise ValueError(f"context_chain: {name} must be a contiguous int64 CPU vector of at least {need} ids")
    base_ok = base == min(early, seen) and cos.shape[0] >= last + 1 - base and tuple(cos.shape) == tuple(sin.shape)
    rows_ok = hidden.shape[0] > last and head.feats.shape[0] > last and all(k.shape[1] > last for k in head.k_bufs)
    if not (count >= 1 and 0 <= early <= p0 + 1 and 0 <= seen <= p0 and head.real_upto >= p0 and base_ok and rows_ok
            and (stack is None or stack.max_len > last) and lm.shape[1] == H and tuple(hidden.shape[1:]) == (H,)
            and tuple(head.fc.shape) == (H, 2 * H) and len(head.layers) == len(head.k_bufs) == len(head.v_bufs) >= 1):
        raise ValueError("context_chain: positions, rotary rows, buffers or weights disagree")


def tree_args(positions: torch.Tensor, tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qpos int64 (T,), mask uint8 (T, S)) as the tree layer reads them, both contiguous on the CPU."""
    return (positions.to(device="cpu", dtype=torch.int64).contiguous(),
            tree_mask.to(device="cpu", dtype=torch.uint8).contiguous())


def applies(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel can compute linear(x, weight, bias) here (weight float32 or a quant.QuantWeight)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    quant = not isinstance(weight, torch.Tensor)
    if quant:
        k = weight.shape[1]
        if weight.device.type != "cpu" or (weight.kind == "int4" and k % 32):
            return False
    else:
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
            return False
        k = weight.shape[1]
    if torch.is_grad_enabled() and (x.requires_grad or (not quant and weight.requires_grad) or (bias is not None and bias.requires_grad)):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    return x.shape[-1] == k and 0 < x.numel() // max(k, 1) <= MAX_ROWS


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, through the small-row kernels when they apply. `weight` may be a
    quant.QuantWeight (a low-precision draft copy): the C kernel dequantizes it in registers; elsewhere it is
    dequantized and multiplied by torch."""
    if callable(weight) and not isinstance(weight, torch.Tensor):  # a trained low-bit draft training (quant.TrainingCopy)
        return weight(x, bias)
    fn = _kernel if _kernel else load_kernel()
    quant = not isinstance(weight, torch.Tensor)
    if not fn or not applies(x, weight, bias):
        if quant:
            xr = round_groups(x).to(x.dtype) if weight.act8 else x
            y = F.linear(xr, weight.dequantize(x.dtype), bias)
            return y if weight.exact is None else rescore(x, y, weight, bias)
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    b = bias.data_ptr() if bias is not None else None
    if quant:
        qs = quant_struct(weight)
        rc = _quant_kernel(x2.data_ptr(), x2.stride(0), x2.shape[0], ctypes.byref(qs), n, k, y.data_ptr(), n, b)
        if rc != 0:
            raise RuntimeError(f"selfspec_quant_gemm failed ({rc}) for a {weight.kind} weight of shape {tuple(weight.shape)}")
        return y
    fn(x2.data_ptr(), x2.stride(0), x2.shape[0], weight.data_ptr(), n, k, y.data_ptr(), n, b)
    return y


# ------------------------------------------------------------------------------------------------ self-test
_SELF_TEST_RUNS = itertools.count()  # the seed of each self-test's inputs
def _reference_layer(p: dict, h, cos, sin, k_ref, v_ref, pos0: int, heads: tuple[int, int, int]):
    """A llama decoder layer in float64 torch ops over rows at pos0..: the self-test's reference."""
    Hq, Hkv, D = heads
    T = h.shape[0]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rot(x):  # (heads, T, D)
        half = D // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    qkv = rms(h, p["ln1"]) @ p["wqkv"].T
    q = rot(qkv[:, : Hq * D].view(T, Hq, D).transpose(0, 1))
    k = rot(qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D).transpose(0, 1))
    v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D).transpose(0, 1)
    k_ref[:, pos0 : pos0 + T], v_ref[:, pos0 : pos0 + T] = k, v
    K, V = k_ref[:, : pos0 + T].repeat_interleave(Hq // Hkv, 0), v_ref[:, : pos0 + T].repeat_interleave(Hq // Hkv, 0)
    scores = q @ K.transpose(1, 2) / D**0.5
    mask = torch.arange(pos0 + T)[None, :] <= torch.arange(pos0, pos0 + T)[:, None]
    o = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ V).transpose(0, 1).reshape(T, Hq * D)
    h = h + o @ p["wo"].T
    g, u = (rms(h, p["ln2"]) @ p["wgu"].T).split(p["wd"].shape[1], -1)
    return h + (torch.nn.functional.silu(g) * u) @ p["wd"].T


def self_test() -> str | None:
    """Run every entry point on small random inputs against torch in float64 -> None, or what failed (one
    line). Buffers are float32 explicitly (the default dtype may be anything)."""
    # New inputs on every run: a kernel that writes nothing must not pass on an output buffer that the allocator
    # hands back still holding an earlier run's right answer (seen with a stubbed int8 kernel in the tests).
    g = torch.Generator().manual_seed(next(_SELF_TEST_RUNS))
    return _matmul_self_test(g) or _layers_self_test(g)


def _matmul_self_test(g: torch.Generator) -> str | None:
    """The float32 matmul (every read order giving the very same sums), the int8 / int4 ones and their _a8 twins."""
    f32 = dict(dtype=torch.float32)
    x, w, b = torch.randn(3, 64, generator=g, **f32), torch.randn(24, 64, generator=g, **f32), torch.randn(24, generator=g, **f32)
    if not torch.allclose(linear(x, w, b).double(), F.linear(x.double(), w.double(), b.double()), rtol=1e-4, atol=1e-4):
        return "the float32 matmul gave wrong results"
    stream, level = _stream_kernel(-1), _prefetch_kernel(-1)
    try:  # every way of reading the weights gives the very same sums
        outs = []
        for rows, lvl in ((0, 1), (0, 2), (8, 1)):
            _stream_kernel(rows)
            _prefetch_kernel(lvl)
            outs.append(linear(x, w, b))
    finally:
        _stream_kernel(stream)
        _prefetch_kernel(level)
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        return "the float32 matmul gave other sums for another read order"
    for kind in ("int8", "int4"):
        qw = quantize(w, kind)
        rounded = kind == "int8" or _isa_kernel(-1) == 2  # int4 rounds its inputs as int8 does under AVX-512 only
        ref = int8_reference(x, qw, b) if rounded else F.linear(x.double(), qw.dequantize().double(), b.double())
        if not torch.allclose(linear(x, qw, b).double(), ref, rtol=1e-4, atol=1e-4):
            return f"the {kind} matmul gave wrong results"
        qa = quantize(w, kind, kind + "_a8")
        if not torch.allclose(linear(x, qa, b).double(), group_reference(x, qa, b), rtol=1e-4, atol=1e-4):
            return f"the {kind}_a8 matmul gave wrong results"
    return None


def _layers_self_test(g: torch.Generator) -> str | None:
    """The decoder layer (causal and tree), two layers in one call, then the draft chain and the context chain."""
    f32 = dict(dtype=torch.float32)
    Hq, Hkv, D, I, T, pos0, L = 4, 2, 16, 96, 3, 5, 16
    H = Hq * D
    p = {"ln1": torch.rand(H, generator=g, **f32) + 0.5, "ln2": torch.rand(H, generator=g, **f32) + 0.5,
         "wqkv": torch.randn((Hq + 2 * Hkv) * D, H, generator=g, **f32) / 8, "wo": torch.randn(H, H, generator=g, **f32) / 8,
         "wgu": torch.randn(2 * I, H, generator=g, **f32) / 8, "wd": torch.randn(H, I, generator=g, **f32) / 8}
    ang = torch.arange(pos0, pos0 + T, **f32)[:, None] * torch.rand(D // 2, generator=g, **f32)[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    kc, vc = torch.randn(Hkv, L, D, generator=g, **f32), torch.randn(Hkv, L, D, generator=g, **f32)
    h = torch.randn(T, H, generator=g, **f32)
    sizes = dict(hidden=H, q_heads=Hq, kv_heads=Hkv, head_dim=D, inter=I)
    tensors = dict(ln1=p["ln1"], ln2=p["ln2"], wqkv=p["wqkv"], bqkv=None, wo=p["wo"], bo=None, wgu=p["wgu"], bgu=None,
                   wd=p["wd"], bd=None)
    k_ref, v_ref = kc.double().clone(), vc.double().clone()
    want = _reference_layer({k: t.double() for k, t in p.items()}, h.double(), cos.double(), sin.double(), k_ref, v_ref,
                            pos0, (Hq, Hkv, D))
    for tree in (None, tree_args(torch.arange(pos0, pos0 + T), torch.ones(T, T, dtype=torch.bool).tril())):
        out, k2, v2 = h.clone(), kc.clone(), vc.clone()
        decoder_layer(layer_weights(sizes, 1e-6, 1e-6, D**-0.5, tensors), out, cos, sin, k2, v2, pos0, None, tree)
        if not (torch.allclose(out.double(), want, rtol=1e-4, atol=1e-3) and torch.allclose(k2.double(), k_ref, atol=1e-4)):
            return f"the decoder layer ({'tree' if tree else 'causal'}) gave wrong results"
    # two layers in one call (the same weights, a cache buffer each) = the reference twice
    k_ref2, v_ref2 = kc.double().clone(), vc.double().clone()
    want2 = _reference_layer({k: t.double() for k, t in p.items()}, want, cos.double(), sin.double(), k_ref2, v_ref2,
                             pos0, (Hq, Hkv, D))
    lw = layer_weights(sizes, 1e-6, 1e-6, D**-0.5, tensors)
    out, bufs = h.clone(), [t.clone() for t in (kc, kc, vc, vc)]
    decoder_layers(LayerStack([lw, lw], bufs[:2], bufs[2:], [None, None], [0, 0]), out, [(cos, sin)], pos0)
    if not (torch.allclose(out.double(), want2, rtol=1e-4, atol=1e-3) and torch.allclose(bufs[1].double(), k_ref2, atol=1e-4)):
        return "the decoder layers (two in one call) gave wrong results"
    return _chain_self_test(lw, kc, vc, g, (Hq, Hkv, D)) or _context_self_test(lw, kc, vc, g, (Hq, Hkv, D))


def _chain_self_test(lw: LayerWeights, kc: torch.Tensor, vc: torch.Tensor, g: torch.Generator, heads) -> str | None:
    """The draft chain (one layer, 3 drafts after slot 2) against decoder_layers + a float64 norm, LM head and argmax."""
    Hq, Hkv, D = heads
    H, V, pos0, count = Hq * D, 40, 2, 3
    f32 = dict(dtype=torch.float32)
    embed, lm = torch.randn(V, H, generator=g, **f32), torch.randn(V, H, generator=g, **f32)
    norm = torch.rand(H, generator=g, **f32) + 0.5
    ang = torch.arange(pos0, pos0 + count, **f32)[:, None] * torch.rand(D // 2, generator=g, **f32)[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    tokens = torch.zeros(pos0 + count + 1, dtype=torch.int64)
    tokens[pos0] = 7
    k1, v1 = kc.clone(), vc.clone()
    draft_chain(LayerStack([lw], [k1], [v1], [None], [0]), [(cos, sin)], embed, norm, 1e-6, lm, None, None, tokens,
                pos0, count)
    k2, v2, tok = kc.clone(), vc.clone(), 7
    for s in range(count):
        h = embed[tok][None].clone()
        decoder_layers(LayerStack([lw], [k2], [v2], [None], [0]), h, [(cos[s : s + 1], sin[s : s + 1])], pos0 + s)
        x = h.double()
        logits = (norm.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ lm.double().T
        top2 = logits[0].topk(2).values
        if tokens[pos0 + s + 1] != int(logits.argmax()) and float(top2[0] - top2[1]) > 1e-3:
            return "the draft chain gave wrong results"
        tok = int(tokens[pos0 + s + 1])
    return None




def _context_self_test(lw: LayerWeights, kc: torch.Tensor, vc: torch.Tensor, g: torch.Generator, heads) -> str | None:
    """The context chain (one early layer, a one-layer head, 3 drafts after slot 2) against decoder_layers and a
    float64 fc, norms, readout and argmax, step by step."""
    Hq, Hkv, D = heads
    H, V, p0, count = Hq * D, 40, 2, 3
    f32 = dict(dtype=torch.float32)
    embed, lm = torch.randn(V, H, generator=g, **f32), torch.randn(V, H, generator=g, **f32)
    norm, nh, nf = (torch.rand(H, generator=g, **f32) + 0.5 for _ in range(3))
    fc = torch.randn(H, 2 * H, generator=g, **f32) / 8
    ang = torch.arange(p0 + count + 1, **f32)[:, None] * torch.rand(D // 2, generator=g, **f32)[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    tokens = torch.zeros(p0 + count + 1, dtype=torch.int64)
    tokens[p0] = 7
    feats = torch.zeros(kc.shape[1], H, **f32)
    feats[:p0] = torch.randn(p0, H, generator=g, **f32)
    bufs = [t.clone() for t in (kc, vc, kc, vc)]
    got_feats, hidden = feats.clone(), torch.zeros(kc.shape[1], H, **f32)
    head = ContextChainHead(nh, nf, 1e-6, fc, [lw], [bufs[2]], [bufs[3]], got_feats, p0)
    made = context_chain(LayerStack([lw], [bufs[0]], [bufs[1]], [None], [0]), (cos[p0:], sin[p0:]), p0, embed, head,
                         norm, 1e-6, lm, None, None, tokens, hidden, p0, p0, p0, count)

    def rms(x, w):
        x = x.double()
        return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    ke, ve, kh, vh = (t.clone() for t in (kc, vc, kc, vc))
    tok = 7
    for s in range(count):
        r = p0 + s
        rope = [(cos[r : r + 1], sin[r : r + 1])]
        h = embed[tok][None].clone()
        decoder_layers(LayerStack([lw], [ke], [ve], [None], [0]), h, rope, r)
        x = (torch.cat([rms(h, nh), rms(feats[r - 1 : r], nf)], -1) @ fc.double().T).float()
        decoder_layers(LayerStack([lw], [kh], [vh], [None], [0]), x, rope, r)
        feats[r] = x[0]
        logits = rms(x, norm) @ lm.double().T
        top2 = logits[0].topk(2).values
        if tokens[r + 1] != int(logits.argmax()) and float(top2[0] - top2[1]) > 1e-3:
            return "the context chain gave wrong drafts"
        tok = int(tokens[r + 1])
    if made != (count, count) or not torch.allclose(got_feats, feats, rtol=1e-4, atol=1e-3):
        return "the context chain gave wrong features"
    return None
