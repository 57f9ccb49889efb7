#!/bin/bash
# #13: every kernel variant this Zen 4 runs, forced (--kernels), bf16-stored weights and int4, (a) and (b),
# colocated kvrelay, 3 alternated rounds, all six servers up at once.
cd /work/bench-tree
out=/work/main/benchmarks/results/epyc-per-isa; mkdir -p $out
PY=/work/main/.venv/bin/python
port=8400
names=()
for q in none int4; do for k in avx512_bf16 avx512_vnni avx2; do
  $PY -m kvrelay serve --mode colocated --kernels $k --quantization $q --port $port > $out/server-$k-$q.log 2>&1 &
  names+=("${k}_${q}=http://127.0.0.1:$port"); port=$((port+1))
done; done
bash /work/bench/wait.sh $(seq 8400 8405)
for w in a b; do
  $PY -m kvrelay bench --compare "${names[@]}" --workload $w --rounds 3 --text-prompts --no-progress --warmup 2 \
     --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
echo done
