#!/bin/bash
# #13: every kernel variant this Xeon (AVX-512 BF16, AMX) runs, forced (--kernels), bf16-stored weights
# and int4, (a) and (b), colocated kvrelay, 3 alternated rounds, all six servers up at once.
# xeon-emr-per-isa-13/run.sh runs this script into its own folder.
cd "$(dirname "$0")/../../.."
out=${OUT:-benchmarks/results/xeon-amx-per-isa-13}; mkdir -p $out   # OUT: another sitting's folder
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
port=8400
names=()
for q in none int4; do for k in avx512_bf16 avx512_vnni avx2; do
  .venv/bin/python -m kvrelay serve --mode colocated --kernels $k --quantization $q --port $port > $out/server-$k-$q.log 2>&1 &
  names+=("${k}_${q}=http://127.0.0.1:$port"); port=$((port+1))
done; done
for u in $(seq 8400 8405); do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare "${names[@]}" --workload $w --rounds 3 --warmup 2 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
echo done
