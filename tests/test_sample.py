"""sample: greedy against torch.argmax (ties, NaN, -inf rows, -0 / +0, layouts), the Philox generator
against Random123's published answers, the GPU's draws against the CPU reference's (same seed and
offsets), the sampled frequencies against softmax(logits / temperature) (chi-square), top_k, offsets read
from device memory under CUDA-graph replay, the counters of advance and the token history (history,
history_index), torch.compile, opcheck and argument errors. The spec is the
docstring of ``fused_attn.sample.sample``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.sample import sample, top_k_filter
from tests.streams import on_side_stream_without_sync
from tests.test_decode_attention import with_examples

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU_VOCABS = [1, 2, 7, 8, 9, 255, 4096, 4097, 32000, 50257, 128256]
LAYOUTS = ["contiguous", "strided_rows", "transposed", "misaligned"]
# kind of logits: N(0, 1); N(0, 1) rounded to 1 / 4 (many exact ties); with NaNs; whole rows of -inf;
# signed zeros only; N(0, 1e4)
KINDS = ["randn", "ties", "nan", "neg_inf_rows", "zeros", "large"]


@st.composite
def sample_case(draw, cuda):
    vocab = draw(st.one_of(st.sampled_from(GPU_VOCABS if cuda else [1, 2, 7, 9, 100]),
                           st.integers(1, 70000 if cuda else 3000)))
    rows = draw(st.one_of(st.sampled_from([0, 1, 2, 16]), st.integers(0, max(1, min(64, (1 << 18) // vocab)))))
    return dict(rows=rows, vocab=vocab, lead=draw(st.sampled_from(["1d", "2d", "3d"])),
                dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
                kind=draw(st.sampled_from(KINDS)), layout=draw(st.sampled_from(LAYOUTS)),
                temperature=draw(st.sampled_from([0.0, 0.0, 1.0, 0.7, 1e-3, 5.0])),
                seed=draw(st.integers(0, 2**63 - 1)), offset=draw(st.integers(0, 2**63 - 1)),
                offsets=draw(st.sampled_from([None, "one", "per_row"])),
                offsets_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                top_k=draw(st.one_of(st.sampled_from([0, 0, 1, 2, 3, 50]), st.integers(0, vocab + 2))),
                data_seed=draw(st.integers(0, 2**31 - 1)))


def case_of(**kw):
    base = dict(rows=4, vocab=50257, lead="2d", dtype=torch.float16, kind="randn", layout="contiguous",
                temperature=0.0, seed=0, offset=0, offsets=None, offsets_dtype=torch.int64, top_k=0, data_seed=0)
    base.update(kw)
    return base


EDGE_EXAMPLES = [
    case_of(),
    case_of(rows=16, temperature=1.0, seed=123, offset=7),
    case_of(rows=3, vocab=50257, kind="ties", layout="misaligned"),
    case_of(rows=5, vocab=9, kind="nan"),
    case_of(rows=5, vocab=4097, kind="neg_inf_rows", temperature=0.8, offsets="per_row"),
    case_of(rows=2, vocab=1, kind="randn", temperature=2.0),
    case_of(rows=6, vocab=1000, kind="zeros"),
    case_of(rows=0, vocab=100),
    case_of(rows=7, vocab=32000, dtype=torch.bfloat16, layout="transposed", temperature=1.0, offsets="one",
            offsets_dtype=torch.int32),
    # top_k inside the kernel: GPT-2's chat setting; ties at the k-th (kept); a NaN k-th (nothing masked) or
    # NaNs among the kept; rows of -inf and half -inf (the k-th -inf: everything kept); -0 / +0 ties;
    # float32's four passes; k = vocab - 1; k >= vocab (no filter); huge logits; temperature 0 (ignored)
    case_of(rows=16, temperature=0.8, top_k=50, seed=11, offsets="per_row"),
    case_of(rows=3, vocab=50257, kind="ties", temperature=5.0, top_k=3, layout="misaligned"),
    case_of(rows=5, vocab=4097, kind="nan", temperature=1.0, top_k=5),
    case_of(rows=5, vocab=300, kind="nan", temperature=1.0, top_k=200),
    case_of(rows=6, vocab=4097, kind="neg_inf_rows", temperature=0.8, top_k=2500),
    case_of(rows=6, vocab=1000, kind="zeros", temperature=1.0, top_k=1),
    case_of(rows=4, vocab=128256, dtype=torch.float32, temperature=1.0, top_k=40, kind="large"),
    case_of(rows=2, vocab=9, dtype=torch.float32, temperature=2.0, top_k=8),
    case_of(rows=7, vocab=32000, dtype=torch.bfloat16, temperature=1.0, top_k=32000, layout="strided_rows"),
    case_of(rows=3, vocab=50257, temperature=0.0, top_k=5),
    # 64 rows: GPT-2's row over a 3- or 4-block cluster (sample_heuristics.h; fewer rows get up to 8);
    # bench_sample's check drew a token outside the top 50 once there on the path with top_k applied before
    # the op (2026-11-27, H100; docs/lab-notes/sampling.md, "A sampling bug, fixed"): the draws against the
    # reference, with and without top_k
    case_of(rows=64, vocab=50257, temperature=1.0, seed=9, offsets="per_row"),
    case_of(rows=64, vocab=50257, temperature=1.0, top_k=50, seed=9, offsets="per_row"),
    # clusters of 3 and 7 blocks (sample_heuristics.h: 64 and 33 rows where the device holds fewer clusters of 4
    # and 8 than rows), ties and NaNs across the blocks' chunks
    case_of(rows=64, vocab=50257, kind="ties", layout="misaligned"),
    case_of(rows=33, vocab=50257, kind="nan", layout="strided_rows"),
    # top_k's columns staged in shared memory or not (launch_sample): float32 128256 above (64 KB a block:
    # the opt-in beyond 48 KB); 262144 float32 columns (128 KB a block: read from global memory each pass);
    # 300 rows (one block a row, no cluster: GPT-2's 100 KB row from global memory), misaligned
    case_of(rows=1, vocab=262144, dtype=torch.float32, temperature=1.0, top_k=100, seed=3),
    case_of(rows=300, vocab=50257, temperature=0.7, top_k=50, layout="misaligned", offsets="per_row", seed=4),
]


def lead_shape(case) -> tuple[int, ...]:
    rows = case["rows"]
    if case["lead"] == "1d":
        return (rows,)
    if case["lead"] == "2d":
        return (2, rows // 2) if rows % 2 == 0 else (1, rows)
    return (1, rows, 1)


def make_logits(case, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["data_seed"])
    rows, vocab = case["rows"], case["vocab"]
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    kind = case["kind"]
    if kind == "ties":
        x = (x * 4).round() / 4
    elif kind == "nan":
        x[torch.rand(rows, vocab, generator=g) < 0.01] = math.nan
    elif kind == "neg_inf_rows":
        x[::2] = -math.inf
        x[1::2, torch.rand(vocab, generator=g) < 0.5] = -math.inf
    elif kind == "zeros":
        x = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, -0.0, 0.0).to(torch.float64)
    elif kind == "large":
        x = x * 1e4
    x = x.to(case["dtype"])
    layout = case["layout"]
    if layout == "strided_rows":
        x = torch.cat([x, torch.zeros(rows, 3, dtype=x.dtype)], 1)[:, :vocab]
    elif layout == "transposed":
        x = x.t().contiguous().t()
    elif layout == "misaligned":
        x = torch.cat([torch.zeros(1, dtype=x.dtype), x.flatten()])[1:].view(rows, vocab)
    x = x.to(device)
    if layout == "misaligned" and device != "cpu":  # the copy above is aligned again on the GPU
        x = torch.cat([torch.zeros(1, dtype=x.dtype, device=device), x.flatten()])[1:].view(rows, vocab)
    return x.view(*lead_shape(case), vocab) if x.is_contiguous() or rows == 0 else x


def make_offsets(case, device):
    rows = case["rows"]
    g = torch.Generator().manual_seed(case["data_seed"] + 1)
    if case["offsets"] is None:
        return None, case["offset"]
    n = 1 if case["offsets"] == "one" else rows
    hi = 2**31 - 1 if case["offsets_dtype"] == torch.int32 else 2**62
    return torch.randint(-hi, hi, (n,), generator=g, dtype=torch.int64).to(case["offsets_dtype"]).to(device), 0


def perturbed_scores(logits: torch.Tensor, case, offsets: torch.Tensor | None, offset: int) -> torch.Tensor:
    """float32 [rows, vocab]: what the kernel maximizes (the CPU reference's scores), -inf at the columns
    top_k drops (computed in the logits' own dtype on the CPU: torch.topk, then ``<`` the k-th)."""
    x = logits.reshape(-1, logits.shape[-1]).cpu()
    dropped = top_k_filter(x, case["temperature"], case.get("top_k", 0)) != x
    dropped &= ~x.isnan()  # NaN != NaN: a kept NaN is not a dropped column
    x = x.to(torch.float32)
    if case["temperature"] == 0:
        return x
    rows = x.shape[0]
    base = torch.full((rows,), offset, dtype=torch.int64)
    if offsets is not None:
        base = base + offsets.cpu().reshape(-1).to(torch.int64).expand(rows)
    scores = x / case["temperature"] + reference.gumbel_noise(rows, x.shape[1], case["seed"], base)
    return scores.masked_fill(dropped, -math.inf)


def check_case(case, device):
    logits = make_logits(case, device)
    offsets, offset = make_offsets(case, device)
    off = offsets if offsets is not None else offset
    out = torch.full(logits.shape[:-1], -7, dtype=torch.int64, device=device)  # poisoned: -7 is never a token
    got = sample(logits, case["temperature"], top_k=case["top_k"], seed=case["seed"], offset=off, out=out)
    assert got is out
    also = sample(logits, case["temperature"], top_k=case["top_k"], seed=case["seed"], offset=off)
    assert torch.equal(also, out), "sample and sample_out differ"
    check_advance(logits, case, device, out)
    assert got.shape == logits.shape[:-1] and got.dtype == torch.int64
    got = got.reshape(-1).cpu()
    if got.numel() == 0:
        return
    assert bool(((got >= 0) & (got < case["vocab"])).all()), f"an index outside [0, vocab): {got}"
    scores = perturbed_scores(logits, case, offsets, offset)
    want = scores.argmax(-1)
    if case["temperature"] == 0:
        assert torch.equal(got, want), "greedy must be torch.argmax's index (first of equal maxima, NaN largest)"
        return
    # Sampling: the GPU's logarithms may differ from the CPU's in the last ulp, which can only flip a
    # draw between two perturbed scores within a few ulp of each other.
    diff = got != want
    if device != "cpu" and bool(diff.any()):
        rows = diff.nonzero()[:, 0]
        a, b = scores[rows, got[rows]], scores[rows, want[rows]]
        assert bool(((a - b).abs() <= 1e-5 * b.abs().clamp_min(1.0)).all()), \
            f"draws differ from the reference beyond rounding: rows {rows.tolist()}"
    elif device == "cpu":
        assert not bool(diff.any())


def check_advance(logits, case, device, want_tokens):
    """sample_out with advance: the same tokens, each row's counters + 1 and nothing else written. The
    offsets (per row, when the case has them) are one row of the counters, read before they advance."""
    rows = logits.numel() // logits.shape[-1]
    k = 1 + case["data_seed"] % 3
    dtype = case["offsets_dtype"] if case["offsets"] is not None else torch.int32
    offsets, offset = make_offsets(case, device)
    g = torch.Generator().manual_seed(case["data_seed"] + 2)
    hi = 2**30 if dtype == torch.int32 else 2**61
    before = torch.randint(-hi, hi, (k + 1, rows + 1), generator=g, dtype=torch.int64).to(dtype).to(device)
    buf = before.clone()
    advance = buf.view(-1)[:k * rows].view(k, rows)  # inside a larger buffer: the rest must stay as it was
    region = torch.zeros(buf.numel(), dtype=torch.bool, device=device)
    region[:k * rows] = True
    region = region.view_as(buf)
    off = offset
    if offsets is not None and offsets.numel() == rows and rows > 0:
        advance[k - 1].copy_(offsets.to(dtype))  # the offsets are the counters' last row
        before = buf.clone()
        off = advance[k - 1]
    elif offsets is not None:
        off = offsets
    out = torch.full(logits.shape[:-1], -7, dtype=torch.int64, device=device)
    got = sample(logits, case["temperature"], top_k=case["top_k"], seed=case["seed"], offset=off, out=out,
                 advance=advance)
    assert got is out and torch.equal(out, want_tokens), "advance changed the tokens"
    want = torch.where(region, before + 1, before)
    assert torch.equal(buf, want), "advance must add 1 to each counter of [k, rows] and write nothing else"


POISON = -5  # never a token, never -1


@st.composite
def history_case(draw, cuda):
    """A sample case and a token history: its length L, the padding of its rows (a view inside a larger
    poisoned buffer), the index dtype and layout, the share of indices out of range, and whether the
    index is the first row of advance's counters."""
    case = draw(sample_case(cuda))
    case.update(history_len=draw(st.one_of(st.sampled_from([1, 2, 8]), st.integers(1, 40))),
                history_pad=draw(st.sampled_from([0, 0, 1, 5])),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                index_layout=draw(st.sampled_from(["contiguous", "strided", "advance_row"])),
                out_of_range=draw(st.sampled_from([0.0, 0.2, 1.0])))
    return case


def history_case_of(**kw):
    return case_of(**(dict(history_len=8, history_pad=3, index_dtype=torch.int64, index_layout="advance_row",
                           out_of_range=0.2) | kw))


HISTORY_EXAMPLES = [
    history_case_of(),
    history_case_of(rows=16, temperature=1.0, seed=5, offsets="per_row", index_dtype=torch.int32),
    history_case_of(rows=5, vocab=9, history_len=1, history_pad=0, index_layout="strided", out_of_range=1.0),
    history_case_of(rows=1, vocab=100, history_len=1, history_pad=0, index_layout="contiguous", out_of_range=0.0),
    history_case_of(rows=0, vocab=100),
]


def make_history_index(case, rows):
    """int64 [rows] on the CPU: in [0, L) but for a share out_of_range of rows: -1, L, a huge index or a
    very negative one (near the ends of the index dtype's range, with room for advance's + 1)."""
    g = torch.Generator().manual_seed(case["data_seed"] + 3)
    L = case["history_len"]
    big = 2**31 - 2 if case["index_dtype"] == torch.int32 else 2**62
    bad = torch.tensor([-1, L, big, -big], dtype=torch.int64)
    good = torch.randint(0, L, (rows,), generator=g)
    pick = bad[torch.randint(0, 4, (rows,), generator=g)]
    return torch.where(torch.rand(rows, generator=g) < case["out_of_range"], pick, good)


def check_history(case, device):
    """sample_out with history: the same tokens as without; row r's token at history[r, history_index[r]]
    (the index read before advance adds 1 to it when it is advance's first row) and nothing else of the
    poisoned buffer around the history written; an index out of range: out[r] = -1 and no write."""
    logits = make_logits(case, device)
    offsets, offset = make_offsets(case, device)
    off = offsets if offsets is not None else offset
    want = sample(logits, case["temperature"], top_k=case["top_k"], seed=case["seed"], offset=off).reshape(-1).cpu()
    rows, L, width = want.numel(), case["history_len"], case["history_len"] + case["history_pad"]
    buf = torch.full(((rows + 1) * width + 1,), POISON, dtype=torch.int64, device=device)
    history = buf.as_strided((rows, L), (width, 1), 1)
    index = make_history_index(case, rows)
    dtype = case["index_dtype"]
    advance = None
    if case["index_layout"] == "advance_row":
        advance = torch.zeros(2, rows, dtype=dtype, device=device)
        advance[0] = index.to(dtype)
        advance[1] = 7
        history_index = advance[0]
    elif case["index_layout"] == "strided":
        history_index = torch.zeros(2 * rows, dtype=dtype, device=device)[::2]
        history_index.copy_(index.to(dtype))
    else:
        history_index = index.to(dtype).to(device)
    index = history_index.cpu().to(torch.int64, copy=True)  # copies: on the CPU, .cpu() is the same tensor
    before = buf.cpu().clone()
    counters = None if advance is None else advance.cpu().clone()
    out = torch.full(logits.shape[:-1], -7, dtype=torch.int64, device=device)
    got = sample(logits, case["temperature"], top_k=case["top_k"], seed=case["seed"], offset=off, out=out,
                 advance=advance, history=history, history_index=history_index)
    assert got is out
    ok = (index >= 0) & (index < L)
    assert torch.equal(out.reshape(-1).cpu(), torch.where(ok, want, -1)), \
        "out must hold the tokens without history, and -1 where the history index is out of range"
    expect = before.clone()
    expect.as_strided((rows, L), (width, 1), 1)[torch.arange(rows)[ok], index[ok]] = want[ok]
    assert torch.equal(buf.cpu(), expect), \
        "history must get row r's token at [r, history_index[r]] (pre-advance) and nothing else of the buffer"
    if advance is not None:
        assert torch.equal(advance.cpu(), counters + 1), "advance must add 1 to every counter"


@pytest.mark.gpu
@given(case=history_case(cuda=True))
@with_examples(HISTORY_EXAMPLES)
def test_history_gpu(case):
    check_history(case, "cuda")


@given(case=history_case(cuda=False))
@with_examples([c | dict(vocab=min(c["vocab"], 3000)) for c in HISTORY_EXAMPLES])
def test_history_cpu(case):
    check_history(case, "cpu")


@pytest.mark.gpu
@given(case=sample_case(cuda=True))
@with_examples(EDGE_EXAMPLES)
def test_matches_reference_gpu(case):
    check_case(case, "cuda")


@given(case=sample_case(cuda=False))
@with_examples([c | dict(vocab=min(c["vocab"], 3000)) for c in EDGE_EXAMPLES])
def test_matches_reference_cpu(case):
    check_case(case, "cpu")


def test_philox_matches_random123_known_answers():
    """Random123's kat_vectors for philox4x32_10: counter and key all zeros, and all ones."""
    zero = torch.zeros(1, dtype=torch.int64)
    ones = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    assert [int(w) for w in reference.philox4x32_10([zero] * 4, (0, 0))] == \
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(w) for w in reference.philox4x32_10([ones] * 4, (0xFFFFFFFF, 0xFFFFFFFF))] == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_gumbel_noise_moments():
    g = reference.gumbel_noise(4, 50000, 5, torch.arange(4))
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01


def test_gumbel_noise_is_finite_and_increasing_at_the_extreme_words():
    """U must stay inside (0, 1) in float32 for every word: G finite, and strictly increasing in the word's
    top 23 bits (the Gumbel-max trick's noise is a monotone map of U)."""
    words = torch.tensor([0, 0x1FF, 0x200, 0x7FFFFFFF, 0x80000000, 0xFFFFFC00, 0xFFFFFE00, 0xFFFFFEFF,
                          0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64)
    g = reference.gumbel_of_bits(words)
    assert bool(torch.isfinite(g).all()), f"non-finite noise {g.tolist()} for words {[hex(w) for w in words.tolist()]}"
    top = (words >> 9).tolist()
    for i in range(len(top) - 1):
        assert (g[i + 1] > g[i]).item() if top[i + 1] > top[i] else (g[i + 1] == g[i]).item(), (hex(words[i]), hex(words[i + 1]))


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_masked_column_never_drawn_at_the_all_ones_word(device, top_k):
    """Seed 1, offset 0: row 26's Philox word at column 138 has its top 24 bits all ones, the word that
    made U = 1 and G = +inf under the old 24-bit uniform, so a -inf logit there scored -inf + inf = NaN
    and was drawn (bench_sample's check at 64 rows, H100). Every column but 0 is -inf here: every row must
    draw 0."""
    c = torch.tensor([138 // 4])
    word = reference.philox4x32_10([c, torch.tensor([26]), torch.tensor([0]), torch.tensor([0])], (1, 0))[138 % 4]
    assert int(word) >> 8 == 0xFFFFFF, "the test's premise: the all-ones word at row 26, column 138"
    x = torch.full((27, 140), -math.inf, device=device)
    x[:, 0] = 0.0
    got = sample(x, 1.0, top_k=top_k, seed=1, offset=torch.zeros(1, dtype=torch.int64, device=device))
    assert got.tolist() == [0] * 27, f"drew {got.tolist()}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (2.0, 3)])
def test_frequencies_follow_softmax(device, temperature, top_k):
    """8000 draws (8000 offsets, one row) of a 6-token vocabulary against softmax(top_k(logits) / T):
    a chi-square statistic below the 0.999 quantile (df 5: 20.5), fixed seed, so deterministic."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0], device=device)
    rows = 8000
    x = logits.expand(rows, -1)
    # one row per draw: each row gets its own offset, which is what a decode loop advances
    got = sample(x, temperature, top_k=top_k, seed=99, offset=torch.arange(rows, device=device)).cpu()
    z = logits.double().cpu() / temperature
    if top_k:
        z = z.masked_fill(z < z.topk(top_k).values[-1], -math.inf)
    p = torch.softmax(z, 0)
    counts = torch.bincount(got, minlength=6).double()
    assert bool((counts[p == 0] == 0).all()), "a token outside the top k was drawn"
    keep = p > 0
    expected = p[keep] * rows
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, f"chi-square {chi2:.1f} for counts {counts.tolist()} against {expected.tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_top_k_draws_exactly_the_kept_columns(device, dtype):
    """GPT-2's vocabulary on CUDA (7 blocks of a cluster a row), -5 everywhere but a few columns spread over
    the blocks: top_k 2 keeps the largest (3.0) and the three tied at 2.0; at temperature 100 the draws (one
    offset a row) hit all four and nothing else, and top_k 1 always gives the largest. Independent of the
    reference's filter: the kept set is written down here. The CPU's Philox is slow: a smaller row there."""
    vocab, rows = (50257, 4000) if device == "cuda" else (3001, 400)
    x = torch.full((vocab,), -5.0, dtype=torch.float64)
    cols = [7, 100, vocab * 2 // 5, vocab * 4 // 5, vocab - 1, vocab - 2]
    x[cols] = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 1.99], dtype=torch.float64)
    x = x.to(dtype).to(device).expand(rows, -1)
    got = sample(x, 100.0, top_k=2, seed=5, offset=torch.arange(rows, device=device)).cpu()
    assert set(got.tolist()) == set(cols[1:5]), f"top_k 2 drew {sorted(set(got.tolist()))}"
    one = sample(x, 100.0, top_k=1, seed=5, offset=torch.arange(rows, device=device)).cpu()
    assert bool((one == 100).all()), "top_k 1 must always draw the largest logit"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_pre_masked_logits_draw_inside_the_kept_columns_gpu(rows):
    """bench_sample's "unfused" provider as a test: logits already masked to their top 50 (-inf elsewhere),
    then sample at temperature 1 with top_k 0, 20 offsets: every token among its row's 50. At 64 rows (a
    4-block cluster a row) bench_sample's check failed once (2026-11-27, H100); 1 and 16 rows
    (8-block clusters) are the control. Also the same draws with top_k 50 inside the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, 50257, generator=gen, device="cuda") * 3).to(torch.float16)
    kth = logits.topk(50, dim=-1).values[..., -1:]
    masked = top_k_filter(logits, 1.0, 50)
    for step in range(20):
        offset = torch.full((1,), step, dtype=torch.int64, device="cuda")
        for name, got in (("pre-masked", sample(masked, 1.0, seed=1, offset=offset)),
                          ("top_k 50", sample(logits, 1.0, top_k=50, seed=1, offset=offset))):
            inside = logits.gather(-1, got[:, None]) >= kth
            assert bool(inside.all()), (f"{name}, offset {step}: rows {(~inside[:, 0]).nonzero()[:, 0].tolist()} "
                                        f"drew {got[~inside[:, 0]].tolist()}, outside their top 50")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_seed_offset_and_rows_select_the_stream(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, generator=g).to(device)
    a = sample(x, 1.0, seed=1, offset=5)
    assert torch.equal(a, sample(x, 1.0, seed=1, offset=5)), "same seed and offset, different draws"
    assert torch.equal(a, sample(x, 1.0, seed=1, offset=torch.tensor([5], device=device)))
    assert not torch.equal(a, sample(x, 1.0, seed=2, offset=5))
    assert not torch.equal(a, sample(x, 1.0, seed=1, offset=6))
    per_row = torch.tensor([5, 9, 5, 9], device=device, dtype=torch.int32)
    b = sample(x, 1.0, seed=1, offset=per_row)
    assert torch.equal(b[0::2], a[0::2])
    assert torch.equal(b[1::2], sample(x, 1.0, seed=1, offset=9)[1::2])
    # top_k = 1 is greedy; temperature 0 ignores top_k
    assert torch.equal(sample(x, 1.3, top_k=1, seed=3), x.argmax(-1))
    assert torch.equal(sample(x, 0.0, top_k=5, seed=3), x.argmax(-1))


@pytest.mark.gpu
def test_cuda_graph_replay_reads_the_offset_gpu():
    """Captured once; each replay after the offset advances draws what the reference draws at that offset."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 50257, generator=gen, device="cuda", dtype=torch.float16)
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.empty(16, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample(x, 0.9, seed=4, offset=offset, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sample(x, 0.9, seed=4, offset=offset, out=out)
        offset.add_(1)
    draws = []
    for step in range(3):
        out.fill_(-1)
        g.replay()
        draws.append(out.clone())
        case = dict(temperature=0.9, seed=4)
        want = perturbed_scores(x, case, None, step).argmax(-1)
        assert torch.equal(out.cpu(), want), f"replay {step}"
    assert not torch.equal(draws[0], draws[1])


@pytest.mark.gpu
def test_cuda_graph_replay_advances_its_counters_gpu():
    """A decode loop's state in one launch: each replay samples at the per-row offsets (one row of the
    counters) and advances every counter; the draws are the reference's at each step's offsets."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = 5
    x = torch.randn(rows, 50257, generator=gen, device="cuda", dtype=torch.float16)
    counters = torch.zeros(3, rows, dtype=torch.int32, device="cuda")
    counters[2] = torch.arange(rows, dtype=torch.int32) * 1000
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: one step outside the graph
        sample(x, 0.9, seed=4, offset=counters[2], out=out, advance=counters)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sample(x, 0.9, seed=4, offset=counters[2], out=out, advance=counters)
    start = counters.clone()
    for step in range(3):
        offs = counters[2].clone()
        out.fill_(-1)
        g.replay()
        want = perturbed_scores(x, dict(temperature=0.9, seed=4), offs, 0).argmax(-1)
        assert torch.equal(out.cpu(), want), f"replay {step}"
        assert torch.equal(counters, start + step + 1), f"replay {step}: the counters did not advance by 1"


@pytest.mark.gpu
def test_cuda_graph_replay_records_the_history_gpu():
    """A decode loop's token history without a copy per step: captured once, each replay writes row r's
    token at column counters[0, r] (the cache length, advanced in the same launch): N consecutive columns;
    the row that runs out of columns gets -1 and writes nothing."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, L, steps = 4, 8, 5
    x = torch.randn(rows, 50257, generator=gen, device="cuda", dtype=torch.float16)
    counters = torch.zeros(2, rows, dtype=torch.int64, device="cuda")
    start = torch.tensor([0, 1, 3, L - 2])
    counters[0] = start.cuda()  # the history column (cache length) of each row
    counters[1] = torch.arange(rows) * 1000  # the Philox offsets
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    buf = torch.full((rows, L + 2), POISON, dtype=torch.int64, device="cuda")
    history = buf[:, 1:L + 1]

    def step():
        sample(x, 0.9, seed=4, offset=counters[1], out=out, advance=counters, history=history,
               history_index=counters[0])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph, then back to the start
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    counters[0] = start.cuda()
    counters[1] = torch.arange(rows) * 1000
    buf.fill_(POISON)
    expect = torch.full((rows, L + 2), POISON, dtype=torch.int64)
    for i in range(steps):
        offs = counters[1].clone()
        g.replay()
        tokens = perturbed_scores(x, dict(temperature=0.9, seed=4), offs, 0).argmax(-1)
        col = start + i
        ok = col < L
        assert torch.equal(out.cpu(), torch.where(ok, tokens, -1)), f"replay {i}"
        expect[torch.arange(rows)[ok], 1 + col[ok]] = tokens[ok]
        assert torch.equal(buf.cpu(), expect), f"replay {i}: history"
    assert torch.equal(counters[0].cpu(), start + steps)


@pytest.mark.gpu
def test_does_not_sync_and_uses_the_current_stream_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(8, 50257, generator=gen, device="cuda")
    x = torch.zeros_like(src)
    got = on_side_stream_without_sync(x, src, lambda: sample(x))
    assert torch.equal(got, src.argmax(-1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def step(logits, offset, out):
        sample(logits * 2, 0.7, top_k=10, seed=1, offset=offset, out=out)
        return sample(logits), out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 1000, generator=gen, device=device)
    offset = torch.tensor([3], device=device)
    a = compiled(x, offset, torch.empty(3, dtype=torch.int64, device=device))
    b = step(x, offset, torch.empty(3, dtype=torch.int64, device=device))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_history(device):
    """A decode step's sampler with its counters and token history, compiled: the same tokens, counters and
    history as eager, twice (the second call at the advanced column)."""
    def step(logits, counters, out, history):
        sample(logits, 0.7, top_k=10, seed=1, offset=counters[1], out=out, advance=counters, history=history,
               history_index=counters[0])
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 1000, generator=gen, device=device)
    state = [(torch.tensor([[0, 2, 5], [3, 4, 5]], device=device), torch.empty(3, dtype=torch.int64, device=device),
              torch.full((3, 6), POISON, dtype=torch.int64, device=device)) for _ in range(2)]
    for _ in range(2):
        compiled(x, *state[0])
        step(x, *state[1])
        assert all(torch.equal(a, b) for a, b in zip(*state)), "compiled and eager differ"
    history = state[0][2]
    assert state[0][1][2] == -1 and bool((history[2, :5] == POISON).all()) and history[2, 5] >= 0, \
        "row 2 writes column 5, then -1 into out at column 6 (out of range)"


def test_meta_tensors_give_shapes():
    x = torch.empty(2, 3, 50257, device="meta", dtype=torch.float16)
    assert torch.ops.fused_attn.sample(x, 1.0, 0, 0, None).shape == (2, 3)
    assert sample(x).dtype == torch.int64
    meta = dict(dtype=torch.int64, device="meta")
    index = torch.empty(6, **meta)
    assert sample(x, history=torch.empty(6, 4, **meta), history_index=index).shape == (2, 3)
    with pytest.raises(ValueError, match=r"history must have shape \(rows, L\) with rows = 6 and L >= 1, got \(6, 0\)"):
        torch.ops.fused_attn.sample_out(x, 0.0, 0, 0, None, out=torch.empty(2, 3, **meta),
                                        history=torch.empty(6, 0, **meta), history_index=index)
    with pytest.raises(ValueError, match=r"history must be given with history_index, got None"):
        torch.ops.fused_attn.sample_out(x, 0.0, 0, 0, None, out=torch.empty(2, 3, **meta), history_index=index)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 3000, generator=g, device=device)
    offs = torch.arange(4, device=device, dtype=torch.int32)
    for args in [(x, 0.0, 0, 0, None), (x.half(), 1.0, 5, 7, None), (x.bfloat16(), 0.5, 1, 0, offs)]:
        torch.library.opcheck(torch.ops.fused_attn.sample.default, args)
    torch.library.opcheck(torch.ops.fused_attn.sample_out.default, (x, 1.0, 2, 3, offs),
                          dict(out=torch.empty(4, dtype=torch.int64, device=device)))
    counters = torch.zeros(2, 4, dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.fused_attn.sample_out.default, (x, 0.5, 2, 3, counters[1]),
                          dict(out=torch.empty(4, dtype=torch.int64, device=device), advance=counters))
    counters = torch.tensor([[0, 1, 2, 9], [5, 6, 7, 8]], device=device)
    torch.library.opcheck(torch.ops.fused_attn.sample_out.default, (x, 0.5, 2, 3, counters[1]),
                          dict(out=torch.empty(4, dtype=torch.int64, device=device), advance=counters,
                               history=torch.zeros(4, 6, dtype=torch.int64, device=device),
                               history_index=counters[0]))


def test_logits_requiring_grad_give_an_index_without_grad():
    x = torch.randn(2, 50, requires_grad=True)
    got = sample(x, 1.0)
    assert got.dtype == torch.int64 and not got.requires_grad


# --------------------------------------------------------------------------- bad arguments


def _x(*shape, dtype=torch.float16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


BAD_INPUTS = [
    ("not a tensor", lambda d: dict(logits=[1.0, 2.0]), TypeError, r"logits must be a torch.Tensor, got list"),
    ("int logits", lambda d: dict(logits=_x(2, 5, dtype=torch.int32, device=d)), ValueError,
     r"logits must have dtype float32, float16,? (or )?bfloat16.*, got torch.int32"),
    ("0-d logits", lambda d: dict(logits=_x(device=d)), ValueError, r"logits must have at least 1 dim"),
    ("empty vocab", lambda d: dict(logits=_x(3, 0, device=d)), ValueError, r"vocab >= 1, got \(3, 0\)"),
    ("negative temperature", lambda d: dict(logits=_x(2, 5, device=d), temperature=-1.0), ValueError,
     r"temperature must be a finite number >= 0, got -1.0"),
    ("nan temperature", lambda d: dict(logits=_x(2, 5, device=d), temperature=math.nan), ValueError,
     r"temperature must be a finite number >= 0, got nan"),
    ("bool temperature", lambda d: dict(logits=_x(2, 5, device=d), temperature=True), TypeError,
     r"temperature must be a finite number >= 0, got True"),
    ("negative top_k", lambda d: dict(logits=_x(2, 5, device=d), top_k=-1), ValueError,
     r"top_k must be an int in \[0, 2147483648\), got -1"),
    ("float seed", lambda d: dict(logits=_x(2, 5, device=d), seed=1.5), TypeError,
     r"seed must be an int in \[0, 9223372036854775808\), got 1.5"),
    ("huge offset", lambda d: dict(logits=_x(2, 5, device=d), offset=2**63), ValueError,
     r"offset must be an int in \[0, 9223372036854775808\), got 9223372036854775808"),
    ("float offsets", lambda d: dict(logits=_x(2, 5, device=d), offset=torch.zeros(1, device=d)), ValueError,
     r"offsets must have dtype int32 or int64, got torch.float32"),
    ("offsets count", lambda d: dict(logits=_x(3, 5, device=d), offset=torch.zeros(2, dtype=torch.long, device=d)),
     ValueError, r"offsets must have 1 element or one per row \(3\), got \(2,\)"),
    ("out dtype", lambda d: dict(logits=_x(3, 5, device=d), out=torch.zeros(3, dtype=torch.int32, device=d)),
     ValueError, r"out must have dtype int64, got torch.int32"),
    ("out shape", lambda d: dict(logits=_x(3, 5, device=d), out=torch.zeros(5, dtype=torch.long, device=d)),
     ValueError, r"out must have shape \(3,\) \(logits' without the last dim\), got \(5,\)"),
    ("out strided", lambda d: dict(logits=_x(3, 5, device=d), out=torch.zeros(6, dtype=torch.long, device=d)[::2]),
     ValueError, r"out must be contiguous, got strides \(2,\)"),
    ("advance not a tensor", lambda d: dict(logits=_x(3, 5, device=d), advance=[1, 2, 3]), TypeError,
     r"advance must be a torch.Tensor or None, got list"),
    ("advance dtype", lambda d: dict(logits=_x(3, 5, device=d), advance=torch.zeros(2, 3, device=d)), ValueError,
     r"advance must have dtype int32 or int64, got torch.float32"),
    ("advance shape", lambda d: dict(logits=_x(3, 5, device=d), advance=torch.zeros(3, dtype=torch.int32, device=d)),
     ValueError, r"advance must have shape \(k, rows\) with rows = 3, got \(3,\)"),
    ("advance rows", lambda d: dict(logits=_x(2, 3, 5, device=d), advance=torch.zeros(2, 3, dtype=torch.int32,
                                                                                         device=d)),
     ValueError, r"advance must have shape \(k, rows\) with rows = 6, got \(2, 3\)"),
    ("advance expanded", lambda d: dict(logits=_x(3, 5, device=d),
                                        advance=torch.zeros(1, 3, dtype=torch.int32, device=d).expand(2, 3)),
     ValueError, r"advance must have no two elements in the same memory \(one counter each: a dense layout\), "
                 r"got strides \(0, 1\)"),
    ("out overlaps advance", lambda d: (lambda c: dict(logits=_x(3, 5, device=d), out=c[0], advance=c))(
        torch.zeros(2, 3, dtype=torch.long, device=d)), ValueError, r"out must not overlap advance, got overlapping memory"),
    ("shared offset is a counter", lambda d: (lambda c: dict(logits=_x(3, 5, device=d), offset=c[1, :1], advance=c))(
        torch.zeros(2, 3, dtype=torch.int32, device=d)), ValueError,
     r"offsets must be one of advance's rows or not overlap it \(every row must read its own offset before it "
     r"advances its own counters\), got an overlap of another shape"),
    ("offsets another row's counters", lambda d: (lambda c: dict(logits=_x(3, 5, device=d), offset=c.view(-1)[1:4],
                                                                 advance=c))(
        torch.zeros(2, 3, dtype=torch.int32, device=d)), ValueError, r"offsets must be one of advance's rows"),
]


def _hist(logits, history=None, history_index=None, d="cpu", **kw):
    """A bad-input case of the token history: history [3, 4] and history_index [3] unless given."""
    history = torch.zeros(3, 4, dtype=torch.long, device=d) if history is None else history
    history_index = torch.zeros(3, dtype=torch.long, device=d) if history_index is None else history_index
    return dict(logits=logits, history=history, history_index=history_index, **kw)


_LONG = dict(dtype=torch.long)
HISTORY_BAD_INPUTS = [
    ("history without history_index", lambda d: dict(logits=_x(3, 5, device=d),
                                                      history=torch.zeros(3, 4, **_LONG, device=d)),
     ValueError, r"history_index must be given with history, got None"),
    ("history_index without history", lambda d: dict(logits=_x(3, 5, device=d),
                                                     history_index=torch.zeros(3, **_LONG, device=d)),
     ValueError, r"history must be given with history_index, got None"),
    ("history not a tensor", lambda d: _hist(_x(3, 5, device=d), history=[[0]], d=d), TypeError,
     r"history must be a torch.Tensor or None, got list"),
    ("history dtype", lambda d: _hist(_x(3, 5, device=d), torch.zeros(3, 4, dtype=torch.int32, device=d), d=d),
     ValueError, r"history must have dtype int64, got torch.int32"),
    ("history 1-d", lambda d: _hist(_x(3, 5, device=d), torch.zeros(3, **_LONG, device=d), d=d), ValueError,
     r"history must have shape \(rows, L\) with rows = 3 and L >= 1, got \(3,\)"),
    ("history rows", lambda d: _hist(_x(3, 5, device=d), torch.zeros(4, 4, **_LONG, device=d), d=d), ValueError,
     r"history must have shape \(rows, L\) with rows = 3 and L >= 1, got \(4, 4\)"),
    ("history empty", lambda d: _hist(_x(3, 5, device=d), torch.zeros(3, 0, **_LONG, device=d), d=d), ValueError,
     r"history must have shape \(rows, L\) with rows = 3 and L >= 1, got \(3, 0\)"),
    ("history strided last dim", lambda d: _hist(_x(3, 5, device=d), torch.zeros(3, 8, **_LONG, device=d)[:, ::2],
                                                 d=d), ValueError,
     r"history must have a last dim of stride 1 and rows that do not overlap \(stride\(0\) >= L\), "
     r"got strides \(8, 2\)"),
    ("history rows overlap", lambda d: _hist(_x(3, 5, device=d),
                                             torch.zeros(8, **_LONG, device=d).as_strided((3, 4), (2, 1)), d=d),
     ValueError, r"history must have a last dim of stride 1 and rows that do not overlap \(stride\(0\) >= L\), "
                 r"got strides \(2, 1\)"),
    ("history_index not a tensor", lambda d: _hist(_x(3, 5, device=d), history_index=[0, 0, 0], d=d), TypeError,
     r"history_index must be a torch.Tensor or None, got list"),
    ("history_index dtype", lambda d: _hist(_x(3, 5, device=d), history_index=torch.zeros(3, device=d), d=d),
     ValueError, r"history_index must have dtype int32 or int64, got torch.float32"),
    ("history_index count", lambda d: _hist(_x(3, 5, device=d), history_index=torch.zeros(1, **_LONG, device=d),
                                            d=d),
     ValueError, r"history_index must have shape \(rows,\) with rows = 3, got \(1,\)"),
    ("history_index 2-d", lambda d: _hist(_x(3, 5, device=d), history_index=torch.zeros(3, 1, **_LONG, device=d),
                                          d=d),
     ValueError, r"history_index must have shape \(rows,\) with rows = 3, got \(3, 1\)"),
    ("history overlaps out", lambda d: (lambda b: _hist(_x(3, 5, device=d), b[2:14].view(3, 4), d=d, out=b[:3]))(
        torch.zeros(16, **_LONG, device=d)), ValueError, r"history must not overlap out, got overlapping memory"),
    ("history overlaps advance", lambda d: (lambda c: _hist(_x(3, 5, device=d), c.view(3, 2), d=d, advance=c))(
        torch.zeros(2, 3, **_LONG, device=d)), ValueError, r"history must not overlap advance, got overlapping memory"),
    ("history overlaps logits", lambda d: (lambda x: _hist(x, x.view(torch.int64), d=d))(_x(3, 8, device=d)),
     ValueError, r"history must not overlap logits, got overlapping memory"),
    ("history overlaps offsets", lambda d: (lambda b: _hist(_x(3, 5, device=d), b.view(3, 3), d=d, offset=b[:3]))(
        torch.zeros(9, **_LONG, device=d)), ValueError, r"history must not overlap offsets, got overlapping memory"),
    ("history overlaps history_index", lambda d: (lambda b: _hist(_x(3, 5, device=d), b.view(3, 3), b[6:], d=d))(
        torch.zeros(9, **_LONG, device=d)), ValueError,
     r"history must not overlap history_index, got overlapping memory"),
    ("history_index overlaps out", lambda d: (lambda b: _hist(_x(3, 5, device=d), history_index=b[1:4], d=d,
                                                              out=b[:3]))(torch.zeros(6, **_LONG, device=d)),
     ValueError, r"history_index must not overlap out, got overlapping memory"),
    ("history_index another row's counters", lambda d: (lambda c: _hist(_x(3, 5, device=d),
                                                                        history_index=c.view(-1)[1:4], d=d,
                                                                        advance=c))(
        torch.zeros(2, 3, dtype=torch.int32, device=d)), ValueError,
     r"history_index must be one of advance's rows or not overlap it \(every row must read its own index before "
     r"it advances its own counters\), got an overlap of another shape"),
    ("history_index a shared counter", lambda d: (lambda c: _hist(_x(3, 5, device=d),
                                                                  history_index=c[1, :1].expand(3), d=d,
                                                                  advance=c))(
        torch.zeros(2, 3, **_LONG, device=d)), ValueError, r"history_index must be one of advance's rows"),
]
BAD_INPUTS += HISTORY_BAD_INPUTS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,make,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(device, name, make, exc, match):
    with pytest.raises(exc, match=match):
        sample(**make(device))


@pytest.mark.gpu
def test_bad_inputs_through_the_op_gpu():
    """The C++ checks (the same messages) for calls that skip the Python wrapper."""
    x = _x(3, 5, device="cuda")
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got -1"):
        torch.ops.fused_attn.sample(x, -1.0, 0, 0, None)
    with pytest.raises(ValueError, match=r"offsets must have 1 element or one per row \(3\), got \(2,\)"):
        torch.ops.fused_attn.sample(x, 1.0, 0, 0, torch.zeros(2, dtype=torch.long, device="cuda"))
    with pytest.raises(ValueError, match=r"out must have dtype int64, got torch.int32"):
        torch.ops.fused_attn.sample_out(x, 1.0, 0, 0, None, out=torch.zeros(3, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"logits must have at most 65535 rows"):
        torch.ops.fused_attn.sample(_x(65536, 2, device="cuda"), 0.0, 0, 0, None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_top_k_through_the_op(device):
    """top_k's check for calls that skip the Python wrapper (the C++ launcher's on CUDA, the CPU kernel's on
    the CPU: the same message), in both ops."""
    x = _x(3, 5, device=device)
    for top_k in (-1, 2**31):
        match = rf"top_k must be an int in \[0, 2147483648\), got {top_k}"
        with pytest.raises(ValueError, match=match):
            torch.ops.fused_attn.sample(x, 1.0, 0, 0, None, top_k)
        with pytest.raises(ValueError, match=match):
            torch.ops.fused_attn.sample_out(x, 1.0, 0, 0, None, top_k, out=torch.zeros(3, dtype=torch.long,
                                                                                    device=device))


def test_top_k_with_logits_requiring_grad_gives_an_index_without_grad():
    x = torch.randn(2, 50, requires_grad=True)
    got = sample(x, 1.0, top_k=5)
    assert got.dtype == torch.int64 and not got.requires_grad


TENSOR_OPTIONS = ("advance", "history", "history_index")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_tensor_options_through_the_op(device):
    """sample_out's checks of advance, history and history_index for calls that skip the Python wrapper:
    the C++ launcher's on CUDA, the CPU kernel's on the CPU (the same messages)."""
    checked = 0
    for _, make, exc, match in BAD_INPUTS:
        kw = make(device)
        options = {k: kw.get(k) for k in TENSOR_OPTIONS}
        if not any(isinstance(v, torch.Tensor) for v in options.values()) or \
                not all(v is None or isinstance(v, torch.Tensor) for v in options.values()):
            continue
        offs = kw.get("offset") if isinstance(kw.get("offset"), torch.Tensor) else None
        out = kw.get("out", torch.zeros(kw["logits"].shape[:-1], dtype=torch.long, device=device))
        with pytest.raises(exc, match=match):
            torch.ops.fused_attn.sample_out(kw["logits"], 1.0, 0, 0, offs, out=out, **options)
        checked += 1
    assert checked == 7 + len(HISTORY_BAD_INPUTS) - 2  # all but the two whose history is not a tensor


@pytest.mark.gpu
def test_history_on_another_device_gpu():
    x = _x(3, 5, device="cuda")
    index = torch.zeros(3, dtype=torch.long, device="cuda")
    history = torch.zeros(3, 4, dtype=torch.long, device="cuda")
    out = torch.zeros(3, dtype=torch.long, device="cuda")
    for kw, name in [(dict(history=history.cpu(), history_index=index), "history"),
                     (dict(history=history, history_index=index.cpu()), "history_index")]:
        with pytest.raises(ValueError, match=rf"{name} must be on the same device as logits \(cuda:0\), got cpu"):
            sample(x, **kw)
        with pytest.raises(ValueError, match=rf"{name} must be on the same device as logits \(cuda:0\), got cpu"):
            torch.ops.fused_attn.sample_out(x, 1.0, 0, 0, None, out=out, **kw)
