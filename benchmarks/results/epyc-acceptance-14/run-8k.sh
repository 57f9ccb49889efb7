#!/bin/bash
# #14 item 5 in the same sitting: one 8,000-token prompt at a time through serve (1P+1D, shm),
# layer-wise transfer on (default) against --no-layerwise-transfer, 3 alternated rounds.
cd /work/main
out=benchmarks/results/epyc-acceptance-14/long; mkdir -p $out
while ! grep -q '^done' benchmarks/results/epyc-acceptance-14/run.log; do sleep 10; done
sleep 5
.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 > $out/server-layerwise.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8260 --worker-base-port 8270 --no-layerwise-transfer > $out/server-no-layerwise.log 2>&1 &
for u in 8240 8260; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare layerwise=http://127.0.0.1:8240 no_layerwise=http://127.0.0.1:8260 \
   --workload a --prompt-len 8000 --output-len 16 --num-requests 2 --max-concurrency 1 --rounds 3 --warmup 1 \
   --no-progress --result-dir $out > $out/bench-8k.txt 2>&1
for p in 8250 8270; do echo "== prefill worker $p"; curl -s http://127.0.0.1:$p/metrics | grep -E '^kvrelay_(phase_duration_seconds_(sum|count)|transfer_ahead_bytes_total|transfer_bytes)' ; done > $out/prefill-metrics.txt
pkill -f 'kvrelay serve'
echo done2
