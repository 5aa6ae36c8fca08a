"""Where our GPT-2's greedy tokens part from Hugging Face eager's, is it a near tie? (GPU, ~1 min)

    python -m dev.check_token_ties --backend graph-fused --batch 16 --dtype float16

The batch of bench_gpt2 (prompt 128 down to 64 tokens, left padded), 128 new tokens, gpt2-random. For
each row whose tokens differ: the first differing step, and at that step the gap between the two
largest of hf-eager's logits (its scores) and between hf-eager's chosen token's and ours in hf-eager's
logits. A gap within the dtype's rounding of the logits (~1e-2 in float16 at |logit| ~ 3) says the
two computations rounded a near tie differently; a large gap says a bug.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.bench_gpt2 import prompt_lengths
from fused_attn.generate import DTYPES, GRAPH_BACKENDS
from fused_attn.gpt2 import GPT2, load_hf_model
from tests.prompts import left_padded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="graph-fused", choices=sorted(GRAPH_BACKENDS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    hf = load_hf_model()
    ids, mask = left_padded(hf.config.vocab_size, prompt_lengths(args.batch, args.prompt), "cuda", seed=0)
    ref = hf.to(device="cuda", dtype=dtype).generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                                      do_sample=False, pad_token_id=0, eos_token_id=None,
                                                      output_scores=True, return_dict_in_generate=True)
    want, scores = ref.sequences[:, ids.shape[1]:], torch.stack(ref.scores, 1).float()
    m = GPT2.from_hf(load_hf_model(), dtype=dtype, device="cuda", backends=GRAPH_BACKENDS[args.backend])
    got = m.generate(ids, mask, max_new_tokens=args.new)[:, ids.shape[1]:]
    rows = (got != want).any(1).nonzero().flatten().tolist()
    print(f"{args.backend} {args.dtype} batch {args.batch}: {len(rows)} of {args.batch} rows part from hf-eager")
    worst = 0.0
    for r in rows:
        t = int((got[r] != want[r]).nonzero()[0])
        s = scores[r, t]
        top2 = s.topk(2).values
        ours = float(s[want[r, t]] - s[got[r, t]])
        worst = max(worst, ours)
        print(f"  row {r:2d}: step {t:3d}, hf-eager's top-2 gap {float(top2[0] - top2[1]):.4f}, "
              f"its token over ours by {ours:.4f} (logits ~{float(s.abs().max()):.2f})")
    print(f"largest gap at a parting: {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
