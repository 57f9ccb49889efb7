"""TTFT of an N-token prompt, idle server, per server, R rounds; prints wall-clock send time."""
import sys, time, random, httpx
N, R, B = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
servers = [a.split("=", 1) for a in sys.argv[4:]]
random.seed(7)
for rnd in range(R):
    p = [random.randrange(100, 40000) for _ in range(N)]
    for name, url in servers:
        t0w = time.time(); t = time.perf_counter(); first = None
        with httpx.stream("POST", url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": p,
                          "max_tokens": B, "stream": True, "ignore_eos": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line and first is None:
                    first = time.perf_counter() - t
        print(rnd, name, "sent %.3f" % t0w, "ttft %.3f" % first, "e2e %.3f" % (time.perf_counter() - t), flush=True)
        time.sleep(1)
