#!/bin/bash
# #13: kvrelay int4 / gguf (colocated, default flags otherwise) vs llama.cpp (AMX off build), same Q4_1 GGUF
cd /work/main
out=/work/bench/llama; mkdir -p $out
.venv/bin/python -m kvrelay serve --mode colocated --port 8212 --quantization int4 > $out/server-int4.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8213 --quantization gguf > $out/server-gguf.log 2>&1 &
for u in 8212 8213 8202; do for j in $(seq 1 240); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
curl -s 127.0.0.1:8212/health > $out/health-int4.json; curl -s 127.0.0.1:8213/health > $out/health-gguf.json
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare llamacpp=http://127.0.0.1:8202 kvrelay_int4=http://127.0.0.1:8212 \
     kvrelay_gguf=http://127.0.0.1:8213 --workload $w --text-prompts --rounds ${ROUNDS:-3} --warmup 2 --no-progress \
     --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve --mode colocated --port 821'
echo done
