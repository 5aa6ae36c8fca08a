import torch, transformers, fused_attn.hf as fh
from transformers import GPT2Config, GPT2LMHeadModel, StaticCache
torch.manual_seed(0)
cfg = GPT2Config(n_layer=2)
m = GPT2LMHeadModel(cfg).eval().cuda().half()
fh.register(); m.set_attn_implementation("fused_attn")
cache = StaticCache(config=cfg, max_cache_len=64)
ids = torch.randint(0, 128, (1, 8), device="cuda")
with torch.no_grad():
    m(ids, past_key_values=cache, cache_position=torch.arange(8, device="cuda"), use_cache=True)
    step = torch.randint(0, 128, (1, 1), device="cuda")
    am = torch.ones(1, 64, dtype=torch.long, device="cuda")
    ex = torch._dynamo.explain(m)(step, past_key_values=cache, cache_position=torch.tensor([8], device="cuda"), attention_mask=am, use_cache=True)
print("graph breaks", ex.graph_break_count)
for b in ex.break_reasons: print(b.reason); print("".join(str(f) for f in b.user_stack[-4:]))
