#!/bin/bash
# vllm.sh PORT DTYPE BIND LOG
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=$3 \
exec /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype $2 --max-model-len 2048 --host 127.0.0.1 --port $1 > $4 2>&1
