#!/bin/bash
# The rest of the sitting, once run.sh's (d) is done (vLLM's (d) runs took longer than the
# time left for it in (a)-(c)): vLLM stopped; (a)(b)(c) for colocated, colocated at c45fe6d
# and serve, 3 alternated rounds each; then the 8,000-token prompt through serve,
# layer-wise transfer on against off, one round (the session's time).
cd /work/main
out=/work/main/benchmarks/results/zen2-acceptance-14
while [ ! -s $out/d/result.json ] || pgrep -f "result-dir $out/d" >/dev/null; do sleep 5; done
pkill -f 'zen2-acceptance-14/run.sh'; sleep 1; pkill -f 'kvrelay bench'; pkill -f 'vllm.entrypoints'
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_(engine|request_finished|transfer|phase_duration_seconds_(count|sum))" ; done > $out/worker-metrics-after-d.txt
sleep 10
for w in a b c; do
  .venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 before_c45fe6d=http://127.0.0.1:8211 \
     serve=http://127.0.0.1:8220 --workload $w --rounds 3 --warmup 4 --settle 5 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
sleep 5
mkdir -p $out/long
.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 > $out/long/server-layerwise.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8260 --worker-base-port 8270 --no-layerwise-transfer > $out/long/server-no-layerwise.log 2>&1 &
for u in 8240 8260; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare layerwise=http://127.0.0.1:8240 no_layerwise=http://127.0.0.1:8260 \
   --workload a --prompt-len 8000 --output-len 16 --num-requests 2 --max-concurrency 1 --rounds 1 --warmup 1 \
   --settle 5 --no-progress --result-dir $out/long > $out/long/bench-8k.txt 2>&1
for p in 8250 8270; do echo "== prefill worker $p"; curl -s http://127.0.0.1:$p/metrics | grep -E '^kvrelay_(phase_duration_seconds_(sum|count)|transfer_ahead_bytes_total|transfer_bytes)' ; done > $out/long/prefill-metrics.txt
pkill -f 'kvrelay serve'
echo done
