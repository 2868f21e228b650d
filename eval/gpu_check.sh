#!/usr/bin/env bash
# The GPU code paths in one command, for a CUDA machine with torch (CUDA build), transformers, hydra and pytest
# installed; no model files and no network are needed:
#
#   eval/gpu_check.sh          # results under $OUT when set, else outputs/gpu_check/<time>/
#
#   1. tests     the exactness, host-sync, engine, synthesis and dtype tests on cuda (SELFSPEC_TEST_DEVICE=cuda:
#                tests/conftest.py builds the tiny random models there)
#   2. train     a short training run on cuda (experiment=tiny: synthesis, the feature cache, training, validation)
#   3. eval-*    a short `python -m selfspec.eval` on cuda of random-init real architectures (conf/model/random/:
#                SmolLM2-, Qwen2.5- and Gemma-3-like at their real widths, 6 layers): HF generate, our autoregressive
#                path and selfspec with a lens head, float32; and SmolLM2-like with model.dtype=auto on a bfloat16
#                checkpoint (loads in bfloat16 on the GPU)
#
# Each step writes <step>.log; summary.txt has one line per step (exit status, seconds) and each eval's speedup and
# lossless rate. The exit status is the number of failed steps (2 when no CUDA device is found).
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (to try the script itself); PYTEST_K='expr' selects tests (-k).
set -u
cd "$(dirname "$0")/.." || exit 2
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# The first Python whose torch sees the device: $PYTHON, the project's .venv (a CPU build there is skipped), python3.
PY=
for candidate in ${PYTHON:-} .venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, sys; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=$candidate; break
  fi
done
if [ -z "$PY" ]; then
  echo "error: no Python with a CUDA-enabled torch that sees a GPU (set PYTHON=...)" | tee "$OUT/summary.txt" >&2
  exit 2
fi

export SELFSPEC_TEST_DEVICE=$DEVICE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export SELFSPEC_CACHE=${SELFSPEC_CACHE:-$OUT/cache}
{ echo "python: $PY"; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"; } > "$OUT/env.txt" 2>&1
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/env.txt"

fails=0
step() {  # step NAME COMMAND...: run it, its output into NAME.log, one line into summary.txt
  local name=$1; shift
  local start rc
  echo "== $name"
  start=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  if [ $rc -ne 0 ]; then fails=$((fails + 1)); tail -n 25 "$OUT/$name.log"; fi
}

K=(); [ -n "${PYTEST_K:-}" ] && K=(-k "$PYTEST_K")
step tests "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" ${K[@]+"${K[@]}"} \
  tests/decoding/test_exactness.py tests/decoding/test_host_syncs.py tests/decoding/test_engine.py \
  tests/model/test_dtype_auto.py tests/test_synthesis.py

step train "$PY" -m selfspec.train experiment=tiny model.device="$DEVICE" trainer.max_steps=6 logger=none \
  hydra.run.dir="$OUT/train"

EVAL=(head=lens head.exit_layer=2 prompts=builtin prompts.limit=4 decode.max_new_tokens=48
      "methods=[hf_generate,autoregressive,selfspec]" logger=none model.device="$DEVICE")
for arch in smollm2 qwen2 gemma3; do
  step "eval-$arch" "$PY" -m selfspec.eval model=random/$arch "${EVAL[@]}" hydra.run.dir="$OUT/eval-$arch"
done
step eval-smollm2-auto "$PY" -m selfspec.eval model=random/smollm2 model.dtype=auto +model.random_init.dtype=bfloat16 \
  "${EVAL[@]}" hydra.run.dir="$OUT/eval-smollm2-auto"

"$PY" - "$OUT" >> "$OUT/summary.txt" <<'PY'
import json, sys
from pathlib import Path

for result in sorted(Path(sys.argv[1]).glob("eval-*/summary.json")):
    s = json.loads(result.read_text())
    run = s.get("run", {})
    for name, m in s["methods"].items():
        print(f"{result.parent.name} {run.get('device')} {run.get('dtype')} {name}: speedup {m.get('speedup')} "
              f"tau {m.get('tau')} lossless {m.get('lossless')} tokens/s {m.get('tokens_per_s')}")
PY
echo "failed steps: $fails" | tee -a "$OUT/summary.txt"
echo "written: $OUT"
exit $fails
