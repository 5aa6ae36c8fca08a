import sys
import fused_attn.mlp as M
from bench import time_decode_graph as T
batches = sys.argv[1] if len(sys.argv) > 1 else "1,4,16"
for r in (1, 2):
    for rows, tag in ((range(0), "two"), (range(1, 17), "one")):
        M.SINGLE_LAUNCH_ROWS = rows
        T.main(["--backends", "graph-fused", "--batches", batches, "--reps", "5", "--tag", f"{tag} r{r}"])
