#!/bin/sh
# Build eval/kernels/step_gemms.c against selfspec's kernel sources (the library's own flags) and run it.
set -e
here=$(cd "$(dirname "$0")" && pwd); k="$here/../../selfspec/model/kernels"
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
${CC:-cc} $EXTRA_CFLAGS -O3 -mavx2 -mfma -fopenmp -o "$out/step_gemms" "$here/step_gemms.c" "$k/small_gemm.c" "$k/quant_gemm.c" \
  "$k/group_gemm.c" "$k/decoder_layer.c" -lm
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$out/step_gemms" "$@"
