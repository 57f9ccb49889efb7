"""The idle probe of benchmarks/results/epyc-heap-serve-d: one prompt of N tokens to each
server in turn, R rounds; per server and round: time to first token, the CPU-seconds each
named process used, and its context switches. Arguments: N R name=URL=PID[,PID...] ...
(the PIDs whose CPU counts as the server own; SEED picks the prompts)."""
import sys, time, random, httpx, os, glob
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def ctx(pid):
    v = n = 0
    for st in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            for line in open(st):
                if line.startswith("voluntary_ctxt_switches"): v += int(line.split()[1])
                if line.startswith("nonvoluntary_ctxt_switches"): n += int(line.split()[1])
        except OSError: pass
    return v, n
N = int(sys.argv[1]); rounds = int(sys.argv[2])
servers = []   # name, url, pids
for a in sys.argv[3:]:
    name, url, pids = a.split("=", 2)[0], a.split("=", 2)[1], [int(x) for x in a.split("=", 2)[2].split(",")]
    servers.append((name, url, pids))
random.seed(int(os.environ.get("SEED", "2")))
for rnd in range(rounds):
    p = [random.randrange(100, 40000) for _ in range(N)]
    for name, url, pids in servers:
        all_pids = [int(x) for x in os.popen("pgrep -f kvrelay").read().split()]
        c0 = {q: cpu(q) for q in all_pids}; x0 = {q: ctx(q) for q in pids}
        t = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": p, "max_tokens": 1, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    ttft = time.perf_counter() - t; break
        c1 = {q: cpu(q) for q in all_pids}; x1 = {q: ctx(q) for q in pids}
        own = [round(c1[q] - c0[q], 2) for q in pids]
        others = round(sum(c1[q] - c0[q] for q in all_pids if q not in pids), 2)
        sw = [(x1[q][0] - x0[q][0], x1[q][1] - x0[q][1]) for q in pids]
        print(rnd, name, "ttft", round(ttft, 3), "cpu own", own, "cpu others", others, "ctx (vol,invol)", sw, flush=True)
        time.sleep(1.0)
