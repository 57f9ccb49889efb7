"""Back-to-back prompts beside a running decode: TTFT of prompt A and of prompt B (sent
0.2 s after A, so it waits for A's step), per server, R alternated rounds."""
import sys, time, random, threading, httpx
N, R, B = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
servers = [a.split("=", 1) for a in sys.argv[4:]]
random.seed(11)
def stream(url, prompt, max_tokens, out, key):
    t = time.perf_counter(); first = None; n = 0
    with httpx.stream("POST", url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": prompt,
                      "max_tokens": max_tokens, "stream": True, "ignore_eos": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                n += 1
                if first is None: first = time.perf_counter() - t
    out[key] = (first, time.perf_counter() - t, n)
for rnd in range(R):
    pa = [random.randrange(100, 40000) for _ in range(N)]
    pb = [random.randrange(100, 40000) for _ in range(N)]
    for name, url in servers:
        out = {}
        ths = [threading.Thread(target=stream, args=(url, [5, 6, 7, 8], B, out, "bg"))]
        ths[0].start(); time.sleep(1.5)
        ths.append(threading.Thread(target=stream, args=(url, pa, 8, out, "a"))); ths[-1].start(); time.sleep(0.2)
        ths.append(threading.Thread(target=stream, args=(url, pb, 8, out, "b"))); ths[-1].start()
        for th in ths: th.join()
        print(rnd, name, "A %.3f" % out["a"][0], "B %.3f" % out["b"][0], "bg e2e %.2f" % out["bg"][1],
              "bg tokens", out["bg"][2], flush=True)
        time.sleep(1)
