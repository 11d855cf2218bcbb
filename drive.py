import asyncio, httpx, sys, time, json, collections, random
URL = "http://127.0.0.1:17080"
DUR = float(sys.argv[1]) if len(sys.argv) > 1 else 10
CONC = int(sys.argv[2]) if len(sys.argv) > 2 else 4
MAXTOK = int(sys.argv[3]) if len(sys.argv) > 3 else 20
TIMEOUT = float(sys.argv[4]) if len(sys.argv) > 4 else 30
res = collections.Counter(); eps = collections.Counter(); fails = []
async def one(c, k):
    chat = k % 2 == 0; stream = (k // 2) % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "llama-3.1-8b", "max_tokens": MAXTOK, "stream": stream}
    if chat: body["messages"] = [{"role": "user", "content": f"hello {k} " * 20}]
    else: body["prompt"] = f"hello {k} " * 20
    t = time.time()
    try:
        if stream:
            async with c.stream("POST", URL + path, json=body) as r:
                txt = b""
                async for ch in r.aiter_bytes(): txt += ch
                ep = r.headers.get("x-leadtime-endpoint")
                ok = r.status_code == 200 and b'"error"' not in txt and txt.rstrip().endswith(b"[DONE]")
                tag = f"{r.status_code}{'' if ok else ':bad'}"
                if not ok: fails.append((round(time.time()-t,2), ep, r.status_code, dict(r.headers).get("retry-after"), txt[-300:]))
        else:
            r = await c.post(URL + path, json=body)
            ep = r.headers.get("x-leadtime-endpoint")
            ok = r.status_code == 200
            try: j = r.json(); ok = ok and "choices" in j
            except Exception: ok = False
            tag = f"{r.status_code}{'' if ok else ':bad'}"
            if not ok: fails.append((round(time.time()-t,2), ep, r.status_code, r.headers.get("retry-after"), r.text[:300]))
    except Exception as e:
        tag = type(e).__name__; ep = None; fails.append((round(time.time()-t,2), None, tag, None, str(e)[:200]))
    res[tag] += 1; eps[ep] += 1
async def worker(c, w):
    k = w; end = time.time() + DUR
    while time.time() < end:
        await one(c, k); k += CONC
async def main():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        await asyncio.gather(*[worker(c, w) for w in range(CONC)])
    print("results", dict(res)); print("endpoints", dict(eps))
    for f in fails[:8]: print("FAIL", f)
    if len(fails) > 8: print("... total fails", len(fails))
asyncio.run(main())
