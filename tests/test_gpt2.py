"""fused_attn.gpt2 (own GPT-2, static KV cache, CUDA-graph decode) against Hugging Face GPT-2."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from fused_attn import generate as gen_cli  # noqa: E402
from fused_attn.gpt2 import GPT2  # noqa: E402
from tests.prompts import left_padded  # noqa: E402

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=160)


def hf_model(config=None, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(**(config or TINY))).eval()


def test_logits_match_hf_cpu():
    hf = hf_model()
    ids, mask = left_padded(TINY["vocab_size"], (20, 13, 6))
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=GPT2.positions(mask)).logits
    got = GPT2.from_hf(hf)(ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(20,), (20, 13, 6)])
def test_greedy_tokens_match_hf_generate_cpu(lengths):
    hf = hf_model()
    ids, mask = left_padded(TINY["vocab_size"], lengths)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = GPT2.from_hf(hf).generate(ids, mask, max_new_tokens=64)
    assert torch.equal(got, want)


def test_sampling_is_seeded_and_top_k_1_is_greedy_cpu():
    m = GPT2.from_hf(hf_model())
    ids, mask = left_padded(TINY["vocab_size"], (20, 13, 6))
    a = m.generate(ids, mask, max_new_tokens=12, temperature=0.9, top_k=50, seed=7)
    b = m.generate(ids, mask, max_new_tokens=12, temperature=0.9, top_k=50, seed=7)
    c = m.generate(ids, mask, max_new_tokens=12, temperature=0.9, top_k=50, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = m.generate(ids, mask, max_new_tokens=12)
    assert torch.equal(m.generate(ids, mask, max_new_tokens=12, temperature=1.3, top_k=1, seed=3), greedy)


def test_eos_fills_the_rest_and_stops_early_cpu():
    m = GPT2.from_hf(hf_model())
    ids, mask = left_padded(TINY["vocab_size"], (20,))
    free = m.generate(ids, mask, max_new_tokens=40)
    eos = int(free[0, 20 + 5])
    out = m.generate(ids, mask, max_new_tokens=40, eos_token_id=eos, sync_every=4)
    first = int((out[0, 20:] == eos).nonzero()[0])
    assert (out[0, 20 + first:] == eos).all()
    assert out.shape[1] < 20 + 40  # stopped at the first check after every row had EOS


def test_bad_arguments_raise():
    m = GPT2.from_hf(hf_model())
    ids, mask = left_padded(TINY["vocab_size"], (20,))
    with pytest.raises(ValueError, match=r"prompt length \+ max_new_tokens must be <= n_positions \(160\), got 161"):
        m.generate(ids, mask, max_new_tokens=141)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1, got 0"):
        m.generate(ids, mask, max_new_tokens=0)
    cfg = dict(TINY, reorder_and_upcast_attn=True)
    with pytest.raises(ValueError, match=r"hf_model.config.reorder_and_upcast_attn must be False"):
        GPT2.from_hf(hf_model(cfg))


def test_make_batch_left_pads_each_copy():
    ids, mask = gen_cli.make_batch(torch.arange(1, 6), 3)
    assert ids.tolist() == [[0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 2, 3, 4, 5], [0, 0, 0, 0, 3, 4, 5]]
    assert mask.sum(1).tolist() == [5, 4, 3]


def test_cli_compare_runs_every_backend_cpu(capsys):
    rc = gen_cli.main(["--compare", "--batch-size", "2", "--max-new-tokens", "3", "--prompt-len", "6",
                       "--dtype", "float32"])
    text = capsys.readouterr().out
    assert rc == 0, text
    for backend in ("hf-eager", "hf-sdpa", "hf-fused", "graph"):
        assert backend in text
    assert "tokens identical across backends: True" in text


# ------------------------------------------------------------------------- GPU: GPT-2 small's shape

SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(40,), (40, 29, 13)])
def test_graph_decode_matches_hf_eager_fp32_gpu(lengths):
    hf = hf_model(SMALL)
    ids, mask = left_padded(SMALL["vocab_size"], lengths)
    want = hf.to("cuda").generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=64, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    got = GPT2.from_hf(hf, device="cuda").generate(ids.cuda(), mask.cuda(), max_new_tokens=64, use_graph=True)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graph_and_eager_decode_identical_gpu(dtype):
    m = GPT2.from_hf(hf_model(SMALL), dtype=dtype, device="cuda")
    ids, mask = left_padded(SMALL["vocab_size"], (40, 29, 13))
    ids, mask = ids.cuda(), mask.cuda()
    a = m.generate(ids, mask, max_new_tokens=64, use_graph=True)
    b = m.generate(ids, mask, max_new_tokens=64, use_graph=False)
    c = m.generate(ids, mask, max_new_tokens=64, use_graph=True)  # replays the captured graph again
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_error_at_most_twice_hf_sdpa_gpu(dtype):
    hf = hf_model(SMALL)
    ids, mask = left_padded(SMALL["vocab_size"], (40, 29, 13))
    ids, mask, pos = ids.cuda(), mask.cuda(), GPT2.positions(mask).cuda()
    keep = mask.bool()
    with torch.no_grad():
        ref = hf.to("cuda")(ids, attention_mask=mask, position_ids=pos).logits[keep].double()
        sdpa = hf_model(SMALL).to("cuda", dtype)
        sdpa.set_attn_implementation("sdpa")
        err_sdpa = (sdpa(ids, attention_mask=mask, position_ids=pos).logits[keep].double() - ref).abs().max()
    err_ours = (GPT2.from_hf(hf, dtype=dtype, device="cuda")(ids, mask)[keep].double() - ref).abs().max()
    assert err_ours <= 2 * err_sdpa + 1e-3, (err_ours.item(), err_sdpa.item())
