"""TTFT of an N-token prompt sent while another request decodes (B tokens out), per server, R rounds."""
import sys, time, random, threading, httpx
N, R, B = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
servers = [a.split("=", 1) for a in sys.argv[4:]]
random.seed(5)
def stream(url, prompt, max_tokens, out):
    t = time.perf_counter(); first = None; n = 0
    with httpx.stream("POST", url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": prompt,
                      "max_tokens": max_tokens, "stream": True, "ignore_eos": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                n += 1
                if first is None: first = time.perf_counter() - t
    out.append((first, time.perf_counter() - t, n))
for rnd in range(R):
    p = [random.randrange(100, 40000) for _ in range(N)]
    for name, url in servers:
        bg = [(0,0,0)]; th = None
        if B: bg = []; th = threading.Thread(target=stream, args=(url, [5, 6, 7, 8], B, bg)); th.start()
        time.sleep(1.5)
        fg = []; t0w = time.time(); stream(url, p, 1, fg)
        if th: th.join()
        print(rnd, name, "sent %.4f first %.4f" % (t0w, t0w + fg[0][0]), "ttft %.3f" % fg[0][0], "bg tokens", bg[0][2], "bg e2e %.2f" % bg[0][1], flush=True)
        time.sleep(1)
