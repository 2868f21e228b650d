#!/usr/bin/env bash
# Step costs (draft at E per head type, verify over K+1 tokens) relative to one autoregressive step.
#   eval/costs.sh                        # the default model on this machine's CPU
#   eval/costs.sh llama3_8b              # a random-init Llama-3-8B-like model in bfloat16 on CUDA
#   eval/costs.sh model=qwen2.5_coder_0.5b costs.context=500
# Writes costs.json + costs.md into outputs/costs/<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
if [[ "${1:-}" == "llama3_8b" ]]; then
  shift
  # Costs do not depend on the weights: a random init of the real shapes measures the same thing. (Keys must
  # be ones conf/model/tiny.yaml has: a Hydra override merges into that dict.)
  set -- model=tiny \
    'model.random_init={model_type: llama, vocab_size: 128256, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 8192, tie_word_embeddings: false}' \
    model.name=llama3_8b_random model.dtype=bfloat16 model.device=cuda 'costs.exit_layers=[4,8,12,16]' "$@"
fi
exec python -m selfspec.cli.costs "$@"
