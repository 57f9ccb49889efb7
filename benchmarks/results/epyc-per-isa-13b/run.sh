#!/bin/bash
# #13: every kernel variant this Zen 4 (lscpu "AMD EPYC", family 25 model 17) runs, forced (--kernels),
# bf16-stored weights and int4, (a) and (b), colocated kvrelay, 3 alternated rounds, all six servers up
# at once. Run it from a worktree at a fixed commit (edits elsewhere never reach the servers); results
# land in this folder of that worktree.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/epyc-per-isa-13b; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
port=8400
names=()
for q in none int4; do for k in avx512_bf16 avx512_vnni avx2; do
  .venv/bin/python -m kvrelay serve --mode colocated --kernels $k --quantization $q --port $port > $out/server-$k-$q.log 2>&1 &
  names+=("${k}_${q}=http://127.0.0.1:$port"); port=$((port+1))
done; done
bash benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh $(seq 8400 8405)
for p in $(seq 8400 8405); do curl -s 127.0.0.1:$p/health; echo; done > $out/health.txt
for w in b a; do
  .venv/bin/python -m kvrelay bench --compare "${names[@]}" --workload $w --rounds ${ROUNDS:-3} --no-progress \
     --warmup 2 --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve --mode colocated --kernels'
echo done
