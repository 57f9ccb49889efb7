#!/bin/bash
# #15 acceptance: colocated (a) and (b), the commit before #15's engine work (1795b5a) against
# NEW (a commit), 3 alternated rounds, both servers up at once, from worktrees at fixed commits.
NEW=${1:?commit}; ATT=${ATT:-auto}
out=/work/main/benchmarks/results/epyc-attention-backends; mkdir -p $out
rm -rf /work/bench-base /work/bench-new; git -C /work/main worktree prune
git -C /work/main worktree add -q --detach /work/bench-base 1795b5a
git -C /work/main worktree add -q --detach /work/bench-new $NEW
(cd /work/bench-base && PYTHONPATH=/work/bench-base /work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8401 > $out/server-before.log 2>&1 &)
(cd /work/bench-new && PYTHONPATH=/work/bench-new /work/main/.venv/bin/python -m kvrelay serve --mode colocated --attention-backend $ATT --port 8402 > $out/server-after.log 2>&1 &)
bash /work/bench/wait.sh 8401 8402
for w in a b; do
  /work/main/.venv/bin/python -m kvrelay bench --compare before=http://127.0.0.1:8401 after=http://127.0.0.1:8402 \
    --workload $w --rounds 3 --no-progress --warmup 2 --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve --mode colocated --port 840' ; pkill -f 'port 8402'
lscpu > $out/lscpu.txt; echo "before: 1795b5a, after: $NEW ($ATT)" > $out/commits.txt
echo done
