import json
import sys

for f in sys.argv[1:]:
    d = json.load(open(f))
    for b in d["benchmarks"]:
        e = b["extra_info"]
        sp = " ".join(f"{k}={v:.2f}" for k, v in e.items() if "speedup" in k and isinstance(v, (int, float)))
        print(f'{b["name"].split("[")[-1][:-1]:44s} p50 {e.get("p50_us", 0):8.2f} {sp}')
