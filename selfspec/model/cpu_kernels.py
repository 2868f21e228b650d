"""selfspec's CPU kernels for the few rows of a decode step (float32), compiled on first use.

- `linear(x, w, b)`: y = x w^T + b through kernels/small_gemm.c for 1..MAX_ROWS rows, else torch.
- `decoder_layer(...)`: one whole llama-family decoder layer in one call (kernels/decoder_layer.c), for
  batch 1; the backbone uses it for decode steps and falls back to its torch code everywhere else.

A decode step multiplies 1..K+1 rows by every weight matrix. On CPUs that is bound by reading the weights,
and torch's MKL path reads them slowly for 2-16 rows (a K=4 verify costs ~2x one step on a 2-core AVX2 EPYC,
see BENCHMARKS.md). The C kernel streams each weight row once over OpenMP threads, so verifying K+1 tokens
costs about what one token costs. It is compiled on first use with the system C compiler into
~/.cache/selfspec/kernels (or $SELFSPEC_CACHE/kernels); without a compiler, on a CPU without AVX2/FMA, or with
`SELFSPEC_CPU_KERNELS=0`, everything runs on torch.

`linear` takes the kernel only when it applies (CPU, float32, no autograd, at most `MAX_ROWS` rows) and
otherwise calls `torch.nn.functional.linear`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this (prefill, training batches) MKL's blocked GEMM is the better kernel
SOURCES = [Path(__file__).with_name("kernels") / name for name in ("small_gemm.c", "decoder_layer.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_kernel = None  # ctypes function once loaded, False once known unavailable
_layer_kernel = None  # the decoder-layer entry point of the same library


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


def _build(srcs: list[Path], out: Path) -> None:
    """Compile into a temp file in out's folder, then rename: concurrent first uses never see half a library."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, srcs), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_kernel():
    """The compiled matmul kernel (ctypes function), or None when it cannot be used here. Built once per source version."""
    global _kernel, _layer_kernel
    if _kernel is not None:
        return _kernel or None
    _kernel = False
    if os.environ.get("SELFSPEC_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    if not _cpu_has_avx2_fma():
        log.info("fast linear: this CPU lacks AVX2/FMA; using torch's matmul")
        return None
    try:
        src = b"".join(p.read_bytes() for p in SOURCES)
        tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:12]
        lib_path = _kernel_dir() / f"selfspec_kernels-{tag}.so"
        if not lib_path.is_file():
            _build(SOURCES, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError) as exc:
        log.warning("fast linear unavailable (%s); using torch's matmul", exc)
        return None
    fn = lib.selfspec_small_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    layer = lib.selfspec_decoder_layer
    layer.restype = ctypes.c_int
    layer.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    _kernel, _layer_kernel = fn, layer
    return fn


class LayerWeights(ctypes.Structure):
    """The C struct of kernels/decoder_layer.c: sizes, epsilons and weight pointers of one decoder layer."""

    _fields_ = [(n, ctypes.c_int) for n in ("hidden", "q_heads", "kv_heads", "head_dim", "inter")]
    _fields_ += [(n, ctypes.c_float) for n in ("eps1", "eps2", "scale")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("ln1", "ln2", "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd")]


def layer_weights(sizes: dict, eps1: float, eps2: float, scale: float, tensors: dict) -> LayerWeights:
    """Build the struct; `tensors` (contiguous float32 CPU, biases may be None) must outlive it."""
    ptr = {n: (t.data_ptr() if t is not None else None) for n, t in tensors.items()}
    return LayerWeights(**sizes, eps1=eps1, eps2=eps2, scale=scale, **ptr)


def layer_kernel():
    """The decoder-layer entry point, or None where the CPU kernels are unavailable."""
    return _layer_kernel if load_kernel() else None


def decoder_layer(weights: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, pos0: int, window: int | None) -> None:
    """One decoder layer in place on h (T, hidden) at positions pos0..pos0+T-1 (batch 1, float32, contiguous).
    cos/sin: (T, head_dim); k_cache/v_cache: this layer's (kv_heads, max_len, head_dim) buffers, written at
    those positions and attended over [0, pos0+T) (within `window` when given)."""
    T = h.shape[0]
    kv_len = pos0 + T
    qkv = (weights.q_heads + 2 * weights.kv_heads) * weights.head_dim
    work = torch.empty(T * (weights.hidden + qkv + weights.q_heads * weights.head_dim + 2 * weights.inter)
                       + weights.q_heads * T * kv_len)
    _layer_kernel(ctypes.byref(weights), h.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                  v_cache.data_ptr(), k_cache.shape[1], pos0, window or 0, work.data_ptr())


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
