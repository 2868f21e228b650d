"""selfspec's CPU kernels for the few rows of a decode step (float32), compiled on first use.

- `linear(x, w, b)`: y = x w^T + b through kernels/small_gemm.c for 1..MAX_ROWS rows, else torch.
- `decoder_layer(...)`: one whole llama-family decoder layer in one call (kernels/decoder_layer.c), for
  batch 1, causal or over a draft tree's rows (an ancestor mask); the backbone uses it for decode steps and
  falls back to its torch code everywhere else.
- `gemm_isa()`: the matmul blocks run in AVX-512 where the CPU has it, else AVX2 (SELFSPEC_CPU_ISA=avx2 forces
  the AVX2 blocks, for before/after timings).

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
otherwise calls `torch.nn.functional.linear`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this (prefill, training batches) MKL's blocked GEMM is the better kernel
# The C decoder layer takes any number of rows (small_gemm runs them in groups of 8 per weight row read); the
# backbone gives it a draft tree's rows up to this many, chain chunks up to MAX_ROWS. Measured on SmolLM2
# (eval/verify_rows.py, BENCHMARKS.md): C is cheaper up to 16 tree rows (2.20 vs 2.51 steps), torch above
# (32 rows 3.16 vs 3.79, 64 rows 4.33 vs 6.44).
TREE_MAX_ROWS = 16
SOURCES = [Path(__file__).with_name("kernels") / name for name in ("small_gemm.c", "decoder_layer.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_kernel = None  # ctypes function once loaded, False once known unavailable
_layer_kernel = None  # the decoder-layer entry point of the same library
_tree_layer_kernel = None  # the same layer with a tree mask among the new rows
_isa_kernel = None  # selfspec_gemm_isa: which instruction set the matmul blocks use
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
    root = os.environ.get("SELFSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "selfspec")
    return Path(root) / "kernels"


class KernelUnavailable(Exception):
    """Why the compiled kernels cannot be used here (one line)."""


def library_path() -> Path:
    """Where the library for the current sources and flags lives (the name carries their hash)."""
    src = b"".join(p.read_bytes() for p in SOURCES)
    tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:12]
    return _kernel_dir() / f"selfspec_kernels-{tag}.so"


def _untrusted(path: Path) -> str | None:
    """Why `path` must not be trusted for loading code, or None: it must be this user's, not writable by
    group or others, and (for a file) a regular file, not a link."""
    st = os.lstat(path)
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o777:o})"
    if not path.is_dir() and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
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


def _load(path: Path):
    """dlopen `path`, bind every entry point and self-test -> the library; KernelUnavailable if any fails."""
    global _kernel, _layer_kernel, _tree_layer_kernel
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load it: {str(exc).splitlines()[0] if str(exc) else 'dlopen failed'}") from None
    try:
        _bind(lib)
    except AttributeError as exc:
        raise KernelUnavailable(f"an entry point is missing: {str(exc).splitlines()[0]}") from None
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        ok = applies(x, w, b) and torch.allclose(linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    except Exception as exc:  # a library that crashes Python cannot be caught; anything else can
        ok, exc_text = False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        exc_text = "wrong results"
    if not ok:
        _kernel, _layer_kernel, _tree_layer_kernel = False, None, None
        raise KernelUnavailable(f"its self-test failed ({exc_text})")
    return lib


def _open_library():
    """The validated library: the cached one when trustworthy and working, else a fresh build."""
    try:
        lib_path = library_path()
    except OSError as exc:
        raise KernelUnavailable(f"cannot read the kernel sources ({exc.strerror or exc})") from None
    directory = lib_path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create {directory} ({exc.strerror or exc})") from None
    problem = _untrusted(directory)
    if problem:
        raise KernelUnavailable(f"the cache directory {directory} is {problem}")
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
    global _kernel, _layer_kernel, _tree_layer_kernel
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
        _kernel, _layer_kernel, _tree_layer_kernel = False, None, None
        why = exc if isinstance(exc, KernelUnavailable) else f"{exc.strerror or exc} ({getattr(exc, 'filename', '')})"
        log.warning("selfspec CPU kernels unavailable: %s; decode steps run on torch", why)
        return None
    return _kernel


def _bind(lib) -> None:
    """Declare the C signatures of the library's entry points and make them the module's kernels
    (AttributeError when one is missing)."""
    global _kernel, _layer_kernel, _tree_layer_kernel, _isa_kernel
    isa = lib.selfspec_gemm_isa
    isa.restype = ctypes.c_int
    isa.argtypes = [ctypes.c_int]
    want = os.environ.get("SELFSPEC_CPU_ISA", "auto").lower()
    if want not in ISAS:
        log.warning("SELFSPEC_CPU_ISA=%s: allowed %s; using auto", want, ", ".join(ISAS))
        want = "auto"
    isa(ISAS[want])
    fn = lib.selfspec_small_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    layer = lib.selfspec_decoder_layer
    layer.restype = ctypes.c_int
    layer.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    tree = lib.selfspec_decoder_layer_tree
    tree.restype = ctypes.c_int
    tree.argtypes = layer.argtypes[:-1] + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    _kernel, _layer_kernel, _tree_layer_kernel, _isa_kernel = fn, layer, tree, isa


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


class LayerWeights(ctypes.Structure):
    """The C struct of kernels/decoder_layer.c: sizes, epsilons and weight pointers of one decoder layer."""

    _fields_ = [(n, ctypes.c_int) for n in ("hidden", "q_heads", "kv_heads", "head_dim", "inter")]
    _fields_ += [(n, ctypes.c_float) for n in ("eps1", "eps2", "scale")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("ln1", "ln2", "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd")]


def layer_weights(sizes: dict, eps1: float, eps2: float, scale: float, tensors: dict) -> LayerWeights:
    """Build the struct; `tensors` (contiguous float32 CPU, biases may be None) must outlive it."""
    ptr = {n: (t.data_ptr() if t is not None else None) for n, t in tensors.items()}
    return LayerWeights(**sizes, eps1=eps1, eps2=eps2, scale=scale, **ptr)


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
    qkv = (weights.q_heads + 2 * weights.kv_heads) * weights.head_dim
    n = T * (weights.hidden + qkv + weights.q_heads * weights.head_dim + 2 * weights.inter) + weights.q_heads * T * kv_len
    if tree is None:
        work = torch.empty(n)
        _layer_kernel(ctypes.byref(weights), h.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                      v_cache.data_ptr(), k_cache.shape[1], pos0, window or 0, work.data_ptr())
        return
    qpos, mask = tree
    S = mask.shape[1]
    work = torch.empty(n + T * S + 2 * T)  # + the key lists of each row
    _tree_layer_kernel(ctypes.byref(weights), h.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                       v_cache.data_ptr(), k_cache.shape[1], pos0, window or 0, qpos.data_ptr(), mask.data_ptr(), S,
                       work.data_ptr())


def tree_args(positions: torch.Tensor, tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qpos int64 (T,), mask uint8 (T, S)) as the tree layer reads them, both contiguous on the CPU."""
    return (positions.to(device="cpu", dtype=torch.int64).contiguous(),
            tree_mask.to(device="cpu", dtype=torch.uint8).contiguous())


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel can compute linear(x, weight, bias) here."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    k = weight.shape[1]
    return x.shape[-1] == k and 0 < x.numel() // max(k, 1) <= MAX_ROWS and weight.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, through the small-row kernel when it applies."""
    fn = _kernel if _kernel else load_kernel()
    if not fn or not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    fn(x2.data_ptr(), x2.stride(0), x2.shape[0], weight.data_ptr(), n, k, y.data_ptr(), n,
       bias.data_ptr() if bias is not None else None)
    return y
