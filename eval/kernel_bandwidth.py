"""Weights read per second by selfspec's one-row matmul kernels: float32, int8 and int4 (issue 19).

    python eval/kernel_bandwidth.py [--n 3072 --k 576 --copies 30 --repeats 15]

One input row times `copies` different (n, k) weights per pass (more bytes than the caches hold), alternating the
three formats pass by pass so load drift hits them alike; prints the median per matmul and weights/s, bytes/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfspec.model import cpu_kernels
from selfspec.model.quant import quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    cpu_kernels.load_kernel()
    g = torch.Generator().manual_seed(0)
    floats = [torch.randn(args.n, args.k, generator=g) for _ in range(args.copies)]
    quant = {kind: [quantize(w, kind) for w in floats] for kind in ("int8", "int4")}
    # bytes read per weight, scales and zeros included (int4: half a byte + two float32 per group of 32 = 0.75)
    formats = {"float32": (floats, 4.0), **{kind: (ws, ws[0].nbytes / (args.n * args.k)) for kind, ws in quant.items()}}
    x = torch.randn(1, args.k, generator=g)
    times: dict[str, list[float]] = {name: [] for name in formats}
    for _ in range(args.repeats):
        for name, (weights, _) in formats.items():
            t = time.perf_counter()
            for w in weights:
                cpu_kernels.linear(x, w)
            times[name].append((time.perf_counter() - t) / len(weights))
    print(f"kernel ISA: {cpu_kernels.gemm_isa()}, threads: {torch.get_num_threads()}, weight {args.n} x {args.k}")
    base = statistics.median(times["float32"])
    for name, (_, bytes_per_weight) in formats.items():
        m = statistics.median(times[name])
        w_s = args.n * args.k / m
        print(f"{name}: {m * 1e6:.0f} us, {w_s / 1e9:.2f} G weights/s, {w_s * bytes_per_weight / 1e9:.1f} GB/s, "
              f"{m / base:.2f} of float32's time")


if __name__ == "__main__":
    main()
