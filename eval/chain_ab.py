"""A/B of a kernel build flag on the low-precision draft chain (issue 19): c of a lens@L chain, old build vs new.

    python eval/chain_ab.py --base-flags=-DQPREFETCH_HINT=_MM_HINT_T0 [--new-flags=...] [--precision int8] [--repeats 16]

Compiles the kernel library twice (the same sources and FLAGS, plus each side's -D flags), loads both, and swaps the
draft-chain entry point between them in one process. Each repeat times one chain of 8 drafts through all L layers
and one autoregressive step (StepTimer, a 321-token context) per side, in alternating order, so that the machine's
drift cancels in the ratios. It prints each side's median c and the median of the per-repeat new/base ratios.
Developer tool: it compiles and loads the libraries it builds here, in a private temporary folder.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from selfspec.api import SelfSpecModel
from selfspec.evaluation.costs import StepTimer, _timed
from selfspec.model import cpu_kernels as ck


def build(flags: list[str], out: Path):
    subprocess.run(["cc", *ck.FLAGS, *flags, "-o", str(out), *map(str, ck.SOURCES), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.selfspec_gemm_isa.argtypes = [ctypes.c_int]
    lib.selfspec_gemm_isa(0)
    fn = lib.selfspec_draft_chain
    fn.restype, fn.argtypes = ctypes.c_int, ck._chain_kernel.argtypes
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-flags", default="", help="extra compiler flags of the old build, e.g. -DNAME=VALUE")
    ap.add_argument("--new-flags", default="", help="extra compiler flags of the new build")
    ap.add_argument("--precision", default="int8", help="head.draft_precision of the chain")
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--context", type=int, default=321)
    ap.add_argument("--repeats", type=int, default=16)
    args = ap.parse_args()
    m = SelfSpecModel.from_pretrained(args.model, head=None)
    if not ck.load_kernel():
        raise SystemExit("chain_ab: the CPU kernels are unavailable here")
    L, drafts = m.backbone.num_layers, 8
    m.set_head("lens", exit_layer=L, draft_precision=args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(flags.split(), Path(tmp) / f"{name}.so")
                for name, flags in (("base", args.base_flags), ("new", args.new_flags))}
        timer = StepTimer(m.backbone, args.context, drafts, 1, 0)
        with torch.inference_mode():
            chain, ar = timer.chain_step(m.head, L), timer.ar_step()
            if chain is None:
                raise SystemExit("chain_ab: this head drafts pass by pass, not as one chain")
            c = {name: [] for name in libs}
            for name in libs:  # warm-up
                ck._chain_kernel = libs[name]
                for _ in range(3):
                    chain(), ar()
            for rep in range(args.repeats):
                for name in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
                    ck._chain_kernel = libs[name]
                    c[name].append(_timed(chain, timer.device) / drafts / _timed(ar, timer.device))
    for name, values in c.items():
        print(f"{args.precision} {name}: c median {statistics.median(values):.4f}")
    print(f"new / base, median of the per-repeat ratios: {statistics.median(b / a for a, b in zip(c['base'], c['new'])):.3f}")


if __name__ == "__main__":
    main()
