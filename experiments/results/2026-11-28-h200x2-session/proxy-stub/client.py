import json, sys, time, uuid, http.client, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, sport, n, conc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sent = {}
def one(i):
    rid = f"r-{uuid.uuid4().hex[:8]}"
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model":"m","prompt":"x"*2000,"max_tokens":16,"stream":True}).encode()
    sent[rid] = time.time()
    c.request("POST","/v1/completions", body, {"Content-Type":"application/json","X-Request-Id":rid})
    r = c.getresponse(); r.read(); c.close()
with ThreadPoolExecutor(conc) as ex: list(ex.map(one, range(n)))
arr = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{sport}/dump").read())
lat = sorted(1e3*(t - sent[rid]) for role, rid, t in arr if role == "P" and rid in sent)
d = sorted(1e3*(t - sent[rid]) for role, rid, t in arr if role == "D" and rid in sent)
print(f"to P p50 {lat[len(lat)//2]:.2f} p90 {lat[int(.9*len(lat))]:.2f} ms; to D p50 {d[len(d)//2]:.2f} (n {len(lat)})")
