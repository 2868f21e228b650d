"""Integer matmuls from existing libraries against selfspec's own, for the few rows of a draft step (issue 55, item 4).

    python eval/kernels/library_int8.py [--rows 1 2 4 8 16] [--repeats 15] [--model smollm2]

For each of a model's draft-step shapes (its q/k/v, o, gate/up and down projections and its LM head) and each row
count, the median time of one call, weights read cold (enough copies cycled to exceed the caches), every method
called from Python the same way (so each pays one call's overhead), methods interleaved call by call:
  - fbgemm / onednn / x86: torch's dynamic-quantized linear (per-row int8 weights, activations quantized per call to
    uint8 per tensor) under each quantized engine torch has;
  - torch int4: aten._weight_int4pack_mm_for_cpu (int4 weights in groups of 32, bfloat16 activations), where present;
  - ours: selfspec's int8 / int4 weight-only kernels (quant_gemm.c) and the _a8 ones (group_gemm.c).
Prints a markdown table of microseconds per call and each method's time over ours (int8_a8 for int8 methods, int4_a8
for int4 ones).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfspec.model import cpu_kernels
from selfspec.model.quant import quantize

SHAPES = {"smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536),
                      ("lm head", 49152, 576)],
          "qwen": [("qkv", 1152, 896), ("o", 896, 896), ("gate+up", 9728, 896), ("down", 896, 4864),
                   ("lm head", 151936, 896)]}
CACHE_BYTES = 96 << 20  # cycle through at least this many bytes of each method's weights


def _torch_dynamic(engine: str, w: torch.Tensor):
    torch.backends.quantized.engine = engine
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    q = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)

    def run(x, packed=packed, engine=engine):
        torch.backends.quantized.engine = engine
        return torch.ops.quantized.linear_dynamic(x, packed)
    return run


def _torch_int4(w: torch.Tensor):
    qw = quantize(w, "int4")
    codes = qw.codes().to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    # scales_and_zeros (K/32, N, 2): aten's int4 dequantizes as (code - 8) * scale + zero
    sz = torch.stack([qw.scale.T, (qw.zero + 8 * qw.scale).T], dim=-1).to(torch.bfloat16).contiguous()

    def run(x, packed=packed, sz=sz):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32, sz)
    return run


def _ours(w: torch.Tensor, precision: str):
    kind = "int8" if precision.startswith("int8") else "int4"
    qw = quantize(w, kind, precision)
    qw.packed() if qw.act8 else None
    return lambda x, qw=qw: cpu_kernels.linear(x, qw)


def makers() -> dict:
    """name -> (weight -> the function that multiplies rows by it)."""
    out = {}
    for engine in torch.backends.quantized.supported_engines:
        if engine in ("fbgemm", "onednn", "x86"):
            out[f"torch {engine} int8"] = lambda w, e=engine: _torch_dynamic(e, w)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        out["torch int4 (bf16 x)"] = _torch_int4
    for p in ("int8", "int8_a8", "int4", "int4_a8"):
        out[f"ours {p}"] = lambda w, p=p: _ours(w, p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    cpu_kernels.load_kernel()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, engines {torch.backends.quantized.supported_engines}, "
          f"ours: {cpu_kernels.gemm_isa()} / {cpu_kernels.group_gemm_path()}\n")
    rows_out = []
    names: list[str] = []
    for label, n, k in SHAPES[args.model]:
        copies = max(2, min(16, CACHE_BYTES // (n * k)))
        ws = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        built: dict[str, list] = {}
        for name, make in makers().items():
            try:
                fns = [make(w) for w in ws]
                fns[0](torch.randn(1, k))
            except (RuntimeError, NotImplementedError, AttributeError) as exc:
                print(f"{label} {name}: unavailable ({str(exc).splitlines()[0][:100]})")
                continue
            built[name] = fns
        names = list(built)
        for rows in args.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {m: [] for m in built}
            for _ in range(args.repeats):
                for m, fns in built.items():
                    t = time.perf_counter()
                    for f in fns:
                        f(x)
                    times[m].append((time.perf_counter() - t) / len(fns) * 1e6)
            rows_out.append((label, n, k, rows, {m: statistics.median(v) for m, v in times.items()}))
    print("| shape | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for label, n, k, rows, med in rows_out:
        cells = []
        for m in names:
            ref = med["ours int4_a8"] if "int4" in m else med["ours int8_a8"]
            cells.append(f"{med[m]:.0f} ({med[m] / ref:.2f})")
        print(f"| {label} {n}x{k} | {rows} | " + " | ".join(cells) + " |")
    print("\nmicroseconds per call (its time over ours: int8_a8 for int8 methods, int4_a8 for int4 ones)")


if __name__ == "__main__":
    main()
