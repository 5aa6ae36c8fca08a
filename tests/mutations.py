"""Mutation harness: plant plausible one-line bugs and check that the tests catch each one.

    python -m tests.mutations              # every CPU mutation (CI runs this: .ci/run)
    python -m tests.mutations --gpu        # the GPU ones too (kernel edits rebuild the library)
    python -m tests.mutations --only-gpu   # the GPU ones only
    python -m tests.mutations --list       # names, files and the tests that should kill each
    python -m tests.mutations NAME ...     # just these

Each mutation replaces one anchor string (which must occur exactly once in its file) in a
temporary copy of the repository (the files git tracks plus the untracked ones it does not
ignore; the checkout is never touched), runs its tests there with the deterministic `ci`
hypothesis profile, and prints KILLED (the tests failed) or SURVIVED (they passed, or were all
skipped). The exit status is non-zero if any mutation survived, if an anchor was found zero
or several times (the code moved: update the anchor), or if pytest could not run the tests.
``--baseline`` first runs the same tests on an unmutated copy, which must pass.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

T_SOFTMAX = "tests/test_softmax.py"
T_HF = "tests/test_hf.py"
T_GPT2 = "tests/test_gpt2.py"
T_DECODE = "tests/test_decode_attention.py"
T_QKV = "tests/test_qkv_decode_attention.py"
T_NORM = "tests/test_layer_norm.py"
T_LINEAR = "tests/test_linear.py"
T_MLP = "tests/test_mlp.py"
T_SAMPLE = "tests/test_sample.py"
T_ATTN = "tests/test_attention.py"
T_ATTN_ARGS = "tests/test_attention_args.py"
T_DECODE_ARGS = "tests/test_decode_attention_args.py"
T_DECODE_PAGED = "tests/test_decode_attention_paged.py"
T_DECODE_RAGGED = "tests/test_decode_attention_ragged.py"
T_NORM_ARGS = "tests/test_layer_norm_args.py"
T_LINEAR_ARGS = "tests/test_linear_args.py"
T_SAMPLE_ARGS = "tests/test_sample_args.py"
T_SOFTMAX_ARGS = "tests/test_softmax_args.py"
T_QKV_ARGS = "tests/test_qkv_decode_attention_args.py"
T_GPT2_ARGS = "tests/test_gpt2_args.py"
T_HF_ARGS = "tests/test_hf_args.py"
T_GENERATE_ARGS = "tests/test_generate_args.py"
T_BAD = "tests/test_bad_inputs.py"
T_DIRECT = "tests/test_direct.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, optionally "-k EXPR"
    gpu: bool = False  # needs a GPU to be killed (kernel edits, GPU-only tests)
    why: str = ""


def _t(*ids: str) -> tuple[str, ...]:
    return ids


_HF_PROBS = "probs = scaled_masked_softmax(scores, scale, causal=causal, attn_mask=mask)"
# The HF backend's half-precision prompt attention on CUDA (fused_attn.attention's flash kernel).
_HF_FLASH_GRAD_OUT = "            out = attention(query, key, value, causal=causal, attn_mask=mask, scale=scale)"
_HF_FLASH_OUT = ("attention(query, key, value, causal=causal, attn_mask=mask, scale=scale, out=out.transpose(1, 2))\n"
                 "        return out, None")
# The fused backend's prompt attention (fused_attn.attention written into c_proj's layout), 1% off.
_GPT2_PROMPT_OUT = "        return o.view(b, s, h * d)\n"
_GPT2_PROMPT_OUT_OFF = "        return o.view(b, s, h * d) * 1.01\n"


# GPT-2's rule for the fused QKV + attention launch (fused_attn/gpt2.py, _qkv_attention_applies): two mutations' anchor.
QKV_RULE = "return rows <= QKV_ATTENTION_MAX_ROWS and (rows == 1 or slots <= QKV_ATTENTION_MAX_SLOTS)"

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------ decode, cache and sampling bugs
    Mutation("hf-static-cache-key-slice-removed", "fused_attn/hf.py",
             "key, value = key[:, :, :q_len], value[:, :, :q_len]", "pass",
             _t(f"{T_HF}::test_generate_logits_match_eager_cpu"),
             why="StaticCache prefill attends over its unfilled slots (decode logits off by ~0.017)"),
    Mutation("hf-mask-builder-padding-unsliced", "fused_attn/hf.py",
             "key_pad = pad[:, :kv_length]", "key_pad = pad",
             _t(f"{T_HF}::test_mask_builder_is_sdpa_mask_or_its_causal_key_padding"),
             why="a padding mask wider than the keys reaches the forward with columns sdpa_mask does not read"),
    Mutation("hf-key-padding-mask-loses-causal", "fused_attn/hf.py",
             "causal, mask = True, key_pad[:, None, None, :]", "causal, mask = False, key_pad[:, None, None, :]",
             _t(f"{T_HF}::test_key_padding_mask_equals_its_4d_mask_cpu"),
             why="the 2-D mask read as key padding alone: every prompt token sees the tokens after it"),
    Mutation("direct-path-never-taken", "fused_attn/layer_norm.py",
             "if not torch.compiler.is_compiling() and _ops.direct is not None and type(eps) is float:",
             "if False and _ops.direct is not None and type(eps) is float:",
             _t(f"{T_DIRECT}::test_direct_path_is_taken_and_equals_the_dispatcher_path"), gpu=True,
             why="eager layer_norm calls pay the dispatcher's Python autograd kernel again: right values, 2x the host time"),
    Mutation("direct-path-ignores-requires-grad", "csrc/direct/direct.cpp",
             "(grad && t.requires_grad())", "(false && t.requires_grad())",
             _t(f"{T_DIRECT}::test_an_input_that_requires_grad_goes_through_autograd"), gpu=True,
             why="an input that requires grad runs without the dispatcher: the output has no grad_fn, the gradient is lost"),
    Mutation("hf-prompts-never-on-flash", "fused_attn/hf.py",
             'if (query.device.type == "cuda" and (mask is None', 'if (False and (mask is None',
             _t(f"{T_HF}::test_half_precision_prompts_take_the_flash_path_gpu"), gpu=True,
             why="half-precision prompts silently fall back to matmul + softmax: right logits, no flash kernel"),
    Mutation("hf-decode-ignores-padding-mask", "fused_attn/hf.py",
             "key_mask=key_mask, scale=scale)", "key_mask=None, scale=scale)",
             _t(f"{T_HF}::test_generate_logits_match_eager_cpu"),
             why="decode steps attend to left padding and to a StaticCache's unfilled slots"),
    Mutation("hf-decode-fallback-ignores-padding-mask", "fused_attn/hf.py",
             "    mask = attention_mask\n", "    mask = attention_mask if q_len > 1 else None\n",
             _t(f"{T_HF}::test_decode_path_only_without_grad_dropout_or_additive_mask"),
             why="a one-query step that needs gradients (not the decode_attention path) attends to padding"),
    Mutation("hf-decode-path-never-taken", "fused_attn/hf.py",
             "    if q_len != 1 or (dropout and module.training)", "    if True or (dropout and module.training)",
             _t(f"{T_HF}::test_greedy_decode_through_decode_attention_cpu"),
             why="decode steps silently fall back to matmul + softmax: right tokens, no decode kernel"),
    Mutation("out-requires-grad-unchecked", "fused_attn/softmax.py",
             "    if torch.is_grad_enabled() and out.requires_grad:\n",
             "    if False and out.requires_grad:\n",
             _t(f"{T_BAD}::test_bad_argument_is_named"),
             why="an out= tensor that requires grad would be written in place with no gradient recorded"),
    Mutation("hf-decode-path-taken-with-grad", "fused_attn/hf.py",
             "if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):\n"
             "        return False",
             "if False and (query.requires_grad or key.requires_grad or value.requires_grad):\n        return False",
             _t(f"{T_HF}::test_decode_path_only_without_grad_dropout_or_additive_mask"),
             why="a one-query step that needs gradients reaches decode_attention, which raises"),
    Mutation("gpt2-decode-ignores-keys-ok", "fused_attn/gpt2.py",
             "keys_ok = cache.keys_ok[:, None, None, :]", "keys_ok = torch.ones_like(cache.keys_ok)[:, None, None, :]",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="our decode attends to padding and to unfilled cache slots"),
    Mutation("gpt2-decode-attention-zeroed", "fused_attn/gpt2.py",
             "return self.c_proj(self.attend(q, k, v, keys_ok, causal)",
             "return self.c_proj(self.attend(q, k, v, keys_ok, causal) * (s > 1)",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="decode attention output dropped"),
    Mutation("hf-decode-attention-zeroed", "fused_attn/hf.py",
             "key_mask=key_mask, scale=scale)", "key_mask=key_mask, scale=scale) * 0",
             _t(f"{T_HF}::test_generate_logits_match_eager_cpu")),
    Mutation("reference-additive-mask-scaled", "fused_attn/reference.py",
             "s = s + attn_mask.to(compute_dtype)", "s = s + attn_mask.to(compute_dtype) * scale",
             _t(f"{T_SOFTMAX}::test_cpu_grid_matches_row_definition"),
             why="additive mask multiplied by the scale along with the scores (CPU path and reference)"),
    Mutation("sampling-temperature-ignored", "fused_attn/gpt2.py",
             "logits = logits.float() / self.temperature", "logits = logits.float()",
             _t(f"{T_GPT2}::test_sampling_frequencies_cpu")),
    Mutation("sampling-gumbel-sign-flipped", "fused_attn/gpt2.py",
             "(logits - torch.log(-torch.log(u)))", "(logits + torch.log(-torch.log(u)))",
             _t(f"{T_GPT2}::test_sampling_frequencies_cpu")),
    Mutation("eos-stops-when-any-row-is-done", "fused_attn/gpt2.py",
             ".any(1).all())", ".any(1).any())",
             _t(f"{T_GPT2}::test_eos_some_rows_stop_cpu")),
    Mutation("eos-stop-length-off-by-one", "fused_attn/gpt2.py",
             "done_at = t + 1", "done_at = t",
             _t(f"{T_GPT2}::test_eos_some_rows_stop_cpu")),
    Mutation("hf-scaling-kwarg-ignored", "fused_attn/hf.py",
             "scale = scaling if scaling is not None else query.shape[-1] ** -0.5",
             "scale = query.shape[-1] ** -0.5",
             _t(f"{T_HF}::test_attention_forward_matches_definition_cpu")),
    Mutation("hf-gqa-heads-tiled-not-interleaved", "fused_attn/hf.py",
             "key = key.repeat_interleave(n_rep, dim=1)", "key = key.repeat(1, n_rep, 1, 1)",
             _t(f"{T_HF}::test_attention_forward_matches_definition_cpu")),
    Mutation("gpt2-state-leaks-between-prompts", "fused_attn/gpt2.py",
             "cache.keys_ok.zero_()", "pass",
             _t(f"{T_GPT2}::test_reused_state_different_prompts_cpu"),
             why="cache slots of the previous generate() stay visible"),
    Mutation("prefill-graph-keeps-first-ids", "fused_attn/gpt2.py",
             "self.ids.copy_(input_ids)", "pass",
             _t(f"{T_GPT2}::test_graph_replay_new_prompts_gpu"), gpu=True,
             why="a prefill graph replayed for a new prompt of the same shape computes the old one"),
    Mutation("prefill-graph-keeps-first-mask", "fused_attn/gpt2.py",
             "self.mask.copy_(attention_mask)", "pass",
             _t(f"{T_GPT2}::test_graph_replay_new_prompts_gpu"), gpu=True),
    # ------------------------------------------------------------ more Python-side bugs
    Mutation("reference-causal-alignment-off-by-one", "fused_attn/reference.py",
             "return j <= i + (seqlen_k - seqlen_q)", "return j < i + (seqlen_k - seqlen_q)",
             _t(f"{T_SOFTMAX}::test_cpu_grid_matches_row_definition")),
    Mutation("reference-causal-top-left-aligned", "fused_attn/reference.py",
             "return j <= i + (seqlen_k - seqlen_q)", "return j <= i",
             _t(f"{T_SOFTMAX}::test_cpu_grid_matches_row_definition")),
    Mutation("reference-all-masked-rows-nan", "fused_attn/reference.py",
             "p = e / torch.where(total > 0, total, torch.ones_like(total))", "p = e / total",
             _t(f"{T_SOFTMAX}::test_cpu_grid_matches_row_definition")),
    Mutation("hf-bool-mask-taken-as-additive", "fused_attn/hf.py",
             "elif mask.dtype != torch.bool and mask.dtype != query.dtype:",
             "elif mask.dtype != query.dtype:",
             _t(f"{T_HF}::test_attention_forward_matches_definition_cpu"),
             why="mask dtype confusion: True/False become +1/0 added to the scores"),
    Mutation("hf-probs-off-by-1pct", "fused_attn/hf.py", _HF_PROBS, _HF_PROBS + " * 1.01",
             _t(f"{T_HF}::test_generate_logits_match_eager_cpu")),
    Mutation("sampling-top-k-keeps-k-plus-1", "fused_attn/gpt2.py",
             "kth = logits.topk(self.top_k, dim=-1)", "kth = logits.topk(self.top_k + 1, dim=-1)",
             _t(f"{T_GPT2}::test_sampling_frequencies_cpu")),
    Mutation("sampling-top-k-keeps-k-minus-1", "fused_attn/gpt2.py",
             "logits = logits.masked_fill(logits < kth, -math.inf)",
             "logits = logits.masked_fill(logits <= kth, -math.inf)",
             _t(f"{T_GPT2}::test_sampling_frequencies_cpu")),
    Mutation("gpt2-positions-off-by-one", "fused_attn/gpt2.py",
             "pos = attention_mask.long().cumsum(-1) - 1", "pos = attention_mask.long().cumsum(-1)",
             _t(f"{T_GPT2}::test_logits_match_hf_cpu", f"{T_GPT2}::test_greedy_tokens_match_hf_generate_varied_model_cpu")),
    Mutation("gpt2-decode-position-not-advanced", "fused_attn/gpt2.py",
             "        self.counters.add_(1)\n",
             "        self.counters[:self.batch].add_(1)\n",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="only seqlens advance: every step embeds the same position"),
    Mutation("gpt2-decode-cache-slot-not-advanced", "fused_attn/gpt2.py",
             "            self.slot.add_(1)\n", "            pass\n",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu")),
    Mutation("gpt2-decode-seqlens-not-advanced", "fused_attn/gpt2.py",
             "        self.counters.add_(1)\n",
             "        self.counters[self.batch:].add_(1)\n",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="every decode step appends at the same slot"),
    Mutation("sample-advance-first-counter-only", "fused_attn/sample.py",
             "            advance.add_(1)\n", "            advance[:1].add_(1)\n",
             _t(f"{T_SAMPLE}::test_matches_reference_cpu", f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="the fused sampler advances only seqlens: every step embeds the same position"),
    Mutation("sample-kernel-advance-skips-first-counter", "csrc/sample/sample_kernel.cuh",
             "  for (int i = 0; i < p.adv_k; ++i) {", "  for (int i = 1; i < p.adv_k; ++i) {",
             _t(f"{T_SAMPLE}::test_cuda_graph_replay_advances_its_counters_gpu"), gpu=True),
    Mutation("sample-top-k-filter-drops-the-kth", "fused_attn/sample.py",
             "        logits = logits.masked_fill(logits < kth, -math.inf)\n",
             "        logits = logits.masked_fill(logits <= kth, -math.inf)\n",
             _t(f"{T_SAMPLE}::test_top_k_draws_exactly_the_kept_columns"),
             why="the CPU path's top_k keeps k - 1 logits and none tied with the k-th"),
    Mutation("sample-kernel-for-draws-on-greedy", "csrc/sample/sample_kernel.cuh",
             "return p.temperature > 0.f ? sample_kernel<T, false, true> : sample_kernel<T, false, false>;",
             "return sample_kernel<T, false, false>;",
             _t(f"{T_SAMPLE}::test_matches_reference_gpu", f"{T_SAMPLE}::test_frequencies_follow_softmax"), gpu=True,
             why="a draw at temperature > 0 launched on greedy's instantiation: the argmax every time"),
    Mutation("sample-kernel-top-k-drops-ties-with-the-kth", "csrc/sample/sample_kernel.cuh",
             "    if (filter && order_key(v) < tau) return;",
             "    if (filter && order_key(v) <= tau) return;",
             _t(f"{T_SAMPLE}::test_top_k_draws_exactly_the_kept_columns"), gpu=True),
    Mutation("qkv-cpu-ignores-leftpad", "fused_attn/qkv_decode_attention.py",
             "out, _, _ = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad, scale,",
             "out, _, _ = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k, v, None, scale,",
             _t(f"{T_QKV}::test_cpu_path_matches_the_chain")),
    Mutation("qkv-kernel-new-key-from-the-cache", "csrc/qkv_decode_attention/qkv_decode_attention_kernel.cuh",
             "    auto is_new = [&](int j) { return pass_slot(pass, j) == len; };",
             "    auto is_new = [&](int j) { return false; };",
             _t(f"{T_QKV}::test_matches_reference_gpu"), gpu=True,
             why="the new slot taken from the K / V requested before the lead rank wrote it (zeros), not from "
                 "shared memory"),
    Mutation("qkv-kernel-rows-a-fragment-k-halves-swapped", "csrc/qkv_decode_attention/qkv_decode_attention_kernel.cuh",
             "      const uint32_t a0[4] = {wr[0][c].x, wr[1][c].x, wr[0][c].y, wr[1][c].y};",
             "      const uint32_t a0[4] = {wr[0][c].y, wr[1][c].y, wr[0][c].x, wr[1][c].x};",
             _t(f"{T_QKV}::test_matches_reference_gpu"), gpu=True,
             why="2-8 rows: the A fragment's two k halves against the B fragment's, misaligned"),
    Mutation("gpt2-qkv-rule-ignores-slots", "fused_attn/gpt2.py", QKV_RULE,
             "return rows <= QKV_ATTENTION_MAX_ROWS",
             _t(f"{T_QKV}::test_gpt2_rule_by_rows_and_slots"),
             why="GPT-2's step would take the fused launch at 2-8 rows over long caches, where it measured slower"),
    Mutation("gpt2-qkv-rule-bounds-one-row", "fused_attn/gpt2.py", QKV_RULE,
             "return rows <= QKV_ATTENTION_MAX_ROWS and slots <= QKV_ATTENTION_MAX_SLOTS",
             _t(f"{T_QKV}::test_gpt2_rule_by_rows_and_slots"),
             why="one row over a long cache would take the two launches, measured 20-25 us a step slower"),
    Mutation("reference-gumbel-uniform-reaches-one", "fused_attn/reference.py",
             "u = ((bits >> 9).to(torch.float32) + 0.5) * 2.0 ** -23",
             "u = ((bits >> 8).to(torch.float32) + 0.5) * 2.0 ** -24",
             _t(f"{T_SAMPLE}::test_masked_column_never_drawn_at_the_all_ones_word"),
             why="the former 24-bit uniform: one word in 2**24 gives U = 1, G = +inf, and a masked column drawn"),
    Mutation("sample-kernel-gumbel-uniform-reaches-one", "csrc/sample/sample_kernel.cuh",
             "const float u = (float(bits >> 9) + 0.5f) * 1.1920928955078125e-7f;",
             "const float u = (float(bits >> 8) + 0.5f) * 5.9604644775390625e-8f;",
             _t(f"{T_SAMPLE}::test_masked_column_never_drawn_at_the_all_ones_word"), gpu=True,
             why="the kernel's side of the same bug (the former 24-bit uniform)"),
    Mutation("sample-history-index-off-by-one", "fused_attn/sample.py",
             "    index = history_index.to(torch.int64)\n", "    index = history_index.to(torch.int64) + 1\n",
             _t(f"{T_SAMPLE}::test_history_cpu"),
             why="the CPU path records each token one column late (the post-advance cache length)"),
    Mutation("gpt2-folded-norm-drops-its-bias", "fused_attn/gpt2.py",
             "        bf[:n_out] = w @ ln.bias.float() + (0.0 if bias is None else bias.float())\n",
             "        bf[:n_out] = 0.0 + (0.0 if bias is None else bias.float())\n",
             _t(f"{T_GPT2}::test_folded_norms_match_separate_norms_cpu"),
             why="the folded linear forgets W . b, the norm's bias through the weight"),
    Mutation("gpt2-lm-head-keeps-padded-columns", "fused_attn/gpt2.py",
             '                return linear(x, *folded, norm="layer_norm", eps=self.ln_f.eps)[..., :vocab]\n',
             '                return linear(x, *folded, norm="layer_norm", eps=self.ln_f.eps)\n',
             _t(f"{T_GPT2}::test_lm_head_logits_at_any_rows"),
             why="above 16 rows the logits keep the padded vocabulary's zero columns (50304 for GPT-2's 50257)"),
    Mutation("linear-fold-drops-the-mean-term", "csrc/linear/linear_kernel.cuh",
             "        s = (s - mean * ws) * rsqrtf(var + p.eps);\n", "        s = s * rsqrtf(var + p.eps);\n",
             _t(f"{T_LINEAR}::test_norm_fold_one_row_gpu"), gpu=True,
             why="the one-row fold multiplies x~ without subtracting its mean: wrong for every row not centred on x[0]"),
    Mutation("linear-wide-rows-launch-two-n-tiles", "csrc/linear/linear.cpp",
             "            launch_linear_mma<scalar_t, 32>(p, sms, stream);\n",
             "            launch_linear_mma<scalar_t, 16>(p, sms, stream);\n",
             _t(f"{T_LINEAR}::test_wide_rows_gpu"), gpu=True,
             why="17-32 rows on the two-n-tile build: the rows past 16 are never computed"),
    Mutation("linear-wide-rows-split-k-two-n-tiles", "csrc/linear/linear.cpp",
             "            launch_linear_splitk<scalar_t, 32>(p, splits, sms, stream);\n",
             "            launch_linear_splitk<scalar_t, 16>(p, splits, sms, stream);\n",
             _t(f"{T_LINEAR}::test_wide_rows_gpu"), gpu=True,
             why="17-32 rows on the split-K kernel's two-n-tile build: the rows past 16 are never computed"),
    Mutation("linear-row-groups-one-group", "csrc/linear/linear_splitk.cuh",
             "const unsigned groups = MT == 64 ? unsigned(linear_row_groups(p.m)) : 1;",
             "const unsigned groups = 1;",
             _t(f"{T_LINEAR}::test_wide_rows_gpu"), gpu=True,
             why="33-64 rows of the split-K shapes in one row group: the rows past 32 are never computed"),
    Mutation("linear-row-groups-second-group-rows-off-by-one", "csrc/linear/linear_splitk.cuh",
             "  const int first = g * kMmaGroupRows;\n", "  const int first = g * (kMmaGroupRows - 1);\n",
             _t(f"{T_LINEAR}::test_wide_rows_gpu"), gpu=True,
             why="the second row group starts a row early: row 31's outputs written twice, the last row never"),
    Mutation("linear-lt-split-tail-columns", "csrc/linear/linear.cpp",
             "    at::Tensor y = at::cat({part(0, n8), part(n8, n - n8)}, 1);\n",
             "    at::Tensor y = at::cat({part(0, n8), part(n8 - 8, n - n8)}, 1);\n",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="a wide odd output's last n % 8 columns computed from the wrong weight rows"),
    Mutation("linear-lt-split-residual-dropped", "csrc/linear/linear.cpp",
             "    if (residual2.has_value()) y.add_(*residual2);\n    return y;\n  }\n",
             "    return y;\n  }\n",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="a wide odd output split into two GEMMs without the residual"),
    Mutation("linear-one-row-wide-norm-twice", "csrc/linear/linear.cpp",
             "    x2 = normalized(x2, norm);\n    norm = Norm{};\n  }\n  if (norm.norm != kNormNone && x.scalar_type() != at::kFloat && m >= 2",
             "    x2 = normalized(x2, norm);\n  }\n  if (norm.norm != kNormNone && x.scalar_type() != at::kFloat && m >= 2",
             _t(f"{T_LINEAR}::test_norm_matches_reference_gpu"), gpu=True,
             why="one row into a vocabulary-wide output normalized by its own launch and then again in the kernel"),
    Mutation("sample-kernel-history-writes-at-len", "csrc/sample/sample_kernel.cuh",
             "static_cast<uint64_t>(at) < static_cast<uint64_t>(p.history_len)",
             "static_cast<uint64_t>(at) <= static_cast<uint64_t>(p.history_len)",
             _t(f"{T_SAMPLE}::test_history_gpu", f"{T_SAMPLE}::test_cuda_graph_replay_records_the_history_gpu"),
             gpu=True, why="a full history's row writes one past its end (the next row or its padding)"),
    Mutation("gpt2-decode-ignores-left-padding", "fused_attn/gpt2.py",
             "cache.leftpad.copy_(s - attention_mask.sum(-1))", "cache.leftpad.zero_()",
             _t(f"{T_GPT2}::test_decode_logits_match_teacher_forced_cpu"),
             why="the fused decode step attends to the padding of shorter prompts"),
    Mutation("eos-not-filled-after-stop", "fused_attn/gpt2.py",
             "gen = gen.masked_fill(after, eos_token_id)", "pass",
             _t(f"{T_GPT2}::test_eos_some_rows_stop_cpu")),
    Mutation("tolerance-score-magnitude-term", "tests/tolerances.py",
             "rel = RTOL[dtype] + 2 * SCORE_ULPS * row_mag * (1 - _softmax64(scores))",
             "rel = RTOL[dtype] + SCORE_ULPS * row_mag",
             _t("tests/test_tolerances.py"),
             why="the old tolerance: a 1% error passes on near-one-hot rows of large scores"),
    # ------------------------------------------------------------ half precision, end to end
    Mutation("hf-probs-off-by-1pct-half", "fused_attn/hf.py", _HF_PROBS, _HF_PROBS + " * 1.01",
             _t(f"{T_HF}::test_half_precision_attention_per_layer_cpu"),
             why="a 1% error in every attention probability must fail the float16/bfloat16 tests"),
    Mutation("gpt2-probs-off-by-1pct-half", "fused_attn/gpt2.py", _GPT2_PROMPT_OUT, _GPT2_PROMPT_OUT_OFF,
             _t(f"{T_GPT2}::test_half_precision_attention_per_layer_cpu")),
    Mutation("hf-flash-out-off-by-1pct-half-gpu", "fused_attn/hf.py", _HF_FLASH_OUT,
             _HF_FLASH_OUT.replace("return out, None", "return out * 1.01, None"),
             _t(f"{T_HF}::test_half_precision_attention_per_layer_gpu"), gpu=True,
             why="float16/bfloat16 prompts on CUDA run the flash path: a 1% error there must fail the GPU test"),
    Mutation("hf-flash-grad-out-off-by-1pct-half-gpu", "fused_attn/hf.py", _HF_FLASH_GRAD_OUT,
             _HF_FLASH_GRAD_OUT + " * 1.01", _t(f"{T_HF}::test_half_precision_attention_per_layer_gpu"), gpu=True,
             why="the prompt path with inputs that require grad (training) keeps the autograd op: 1% off there"),
    Mutation("hf-flash-out-wrong-layout-gpu", "fused_attn/hf.py", "out=out.transpose(1, 2))", "out=out.view(query.shape))",
             _t(f"{T_HF}::test_half_precision_attention_per_layer_gpu"), gpu=True,
             why="the flash output written as [batch, heads, seqlen, headdim] into the buffer returned as "
                 "[batch, seqlen, heads, headdim]: rows land under the wrong positions and heads"),
    Mutation("gpt2-probs-off-by-1pct-half-gpu", "fused_attn/gpt2.py", _GPT2_PROMPT_OUT, _GPT2_PROMPT_OUT_OFF,
             _t(f"{T_GPT2}::test_half_precision_attention_per_layer_gpu"), gpu=True),
    # ------------------------------------------------------------ decode_attention (CPU path, tolerance)
    Mutation("decode-cpu-v-append-dropped", "fused_attn/decode_attention.py",
             "            v_cache[b, :, n:n + q.shape[2]] = v_new[b]\n", "",
             _t(f"{T_DECODE}::test_matches_reference_cpu")),
    Mutation("decode-cpu-leftpad-ignored", "fused_attn/decode_attention.py",
             "reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,",
             "reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, None,",
             _t(f"{T_DECODE}::test_matches_reference_cpu")),
    Mutation("decode-cpu-output-off-by-1e-3", "fused_attn/decode_attention.py",
             "            v_cache[b, :, n:n + q.shape[2]] = v_new[b]\n    return out\n",
             "            v_cache[b, :, n:n + q.shape[2]] = v_new[b]\n    return out * (1 + 1e-3)\n",
             _t(f"{T_DECODE}::test_matches_reference_cpu"),
             why="a 0.1% error in every output must fail float32 and float16"),
    # ------------------------------------------------------------ decode_attention's paged cache
    Mutation("decode-cpu-pages-in-logical-order", "fused_attn/decode_attention.py",
             "rows = pool[table.clamp(0, max(num_pages - 1, 0))]",
             "rows = pool[torch.arange(max_blocks).expand(batch, -1).clamp(0, max(num_pages - 1, 0))]",
             _t(f"{T_DECODE_PAGED}::test_paged_matches_definition_cpu"),
             why="the page gather uses the logical block as the page (block_table ignored)"),
    Mutation("decode-cpu-append-page-off-by-one", "fused_attn/decode_attention.py",
             "page, row = table[b][s // page_size], s % page_size",
             "page, row = table[b][s // page_size - 1], s % page_size",
             _t(f"{T_DECODE_PAGED}::test_paged_matches_definition_cpu"),
             why="the append writes into the previous block's page"),
    Mutation("decode-cpu-append-row-is-the-slot", "fused_attn/decode_attention.py",
             "page, row = table[b][s // page_size], s % page_size",
             "page, row = table[b][s // page_size], s",
             _t(f"{T_DECODE_PAGED}::test_paged_matches_definition_cpu"),
             why="the append's row in the page is the logical slot"),
    Mutation("decode-cpu-pages-unchecked", "fused_attn/decode_attention.py",
             "    check_pages(table, seqlens, leftpad, q.shape[2], page_size, num_pages, k_new is not None)\n", "",
             _t(f"{T_DECODE_PAGED}::test_host_checked_pages_raise"),
             why="an out-of-range block_table entry is read as zeros instead of raising"),
    Mutation("decode-page-stride-limit-off-by-one", "fused_attn/decode_attention.py",
             "if (pool.shape[0] > 1 and pool.stride(0) * size >= 2**32)",
             "if (pool.shape[0] > 1 and pool.stride(0) * size > 2**32)",
             _t(f"{T_DECODE_PAGED}::test_page_strides_of_4gb_raise"),
             why="a page stride of exactly 2**32 bytes passes the check and wraps in the kernels' 32-bit strides"),
    Mutation("decode-v-page-strides-unchecked", "fused_attn/decode_attention.py",
             '        _check_page_strides(v_cache, "v_cache")\n', "",
             _t(f"{T_DECODE_PAGED}::test_page_strides_of_4gb_raise"),
             why="only k_cache's strides are checked: a V pool past 4 GB of page stride is addressed wrong"),
    # ------------------------------------------------------------ decode_attention's ragged batch (cu_seqlens_q)
    Mutation("decode-ragged-cpu-row-offset-ignored", "fused_attn/decode_attention.py",
             "        rows = slice(cu[b], cu[b + 1])\n", "        rows = slice(0, new[b])\n",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_cpu"),
             why="every sequence reads (and writes) the first rows of the packed q / k_new / out"),
    Mutation("decode-ragged-host-offsets-unchecked-gpu", "fused_attn/decode_attention.py",
             "    check_offsets(host, q.shape[0])\n", "",
             _t(f"{T_DECODE_RAGGED}::test_bad_ragged_inputs_raise"), gpu=True,
             why="host offsets that do not start at 0, decrease or miss total_q reach the kernel (on the CPU the op "
                 "checks them again)"),
    Mutation("decode-ragged-cpu-op-max-seqlen-unchecked", "fused_attn/decode_attention.py",
             "new = check_offsets(cu, q.shape[0])\n    check_max_seqlen_q(max_seqlen_q, new)\n",
             "new = check_offsets(cu, q.shape[0])\n",
             _t(f"{T_DECODE_RAGGED}::test_bad_ragged_inputs_through_the_op"),
             why="the op's CPU kernel takes a max_seqlen_q below a sequence's new tokens (the CUDA kernel gives NaN)"),
    Mutation("decode-ragged-cpu-append-bound-uses-max", "fused_attn/decode_attention.py",
             "    check_lengths(seqlens, leftpad, new, max_len, k_new is not None)\n",
             "    check_lengths(seqlens, leftpad, max(new, default=0), max_len, k_new is not None)\n",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_cpu"),
             why="a sequence with fewer new tokens than the longest may not fill its cache to max_len"),
    Mutation("decode-ragged-kernel-row-offset-ignored", "csrc/decode_attention/decode_attention_kernel.cuh",
             "return {min(n, p.seqlen_new), inside ? lo : 0, inside && n <= p.seqlen_new};",
             "return {min(n, p.seqlen_new), 0, inside && n <= p.seqlen_new};",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_gpu",
                f"{T_DECODE_RAGGED}::test_rows_of_each_sequence_and_its_causal_rule"), gpu=True,
             why="every sequence's rows are read from (and written to) the first rows of the packed tensors"),
    Mutation("decode-ragged-kernel-causal-bound-uses-max", "csrc/decode_attention/decode_attention_kernel.cuh",
             "lim[r] = rr < p.rows && i < nr.n ? end - nr.n + 1 + i : 0;",
             "lim[r] = rr < p.rows && i < nr.n ? end - p.seqlen_new + 1 + i : 0;",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_gpu",
                f"{T_DECODE_RAGGED}::test_rows_of_each_sequence_and_its_causal_rule"), gpu=True,
             why="a sequence shorter than max_seqlen_q has its causal window shifted back (CUDA-core kernel)"),
    Mutation("decode-ragged-mma-kernel-causal-bound-uses-max", "csrc/decode_attention/decode_attention_kernel.cuh",
             "lim[h] = live ? end - nr.n + 1 + i : 0;",
             "lim[h] = live ? end - p.seqlen_new + 1 + i : 0;",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_gpu"), gpu=True,
             why="the same on the tensor-core kernel (float16 / bfloat16, head dim 64 / 128)"),
    Mutation("decode-ragged-combine-row-offset-ignored", "csrc/decode_attention/decode_attention_kernel.cuh",
             "T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + (nr.row0 + i) * p.o_stride_s;",
             "T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s;",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_gpu"), gpu=True,
             why="the combine kernel (num_splits > 16, or pre-sm_90) writes every sequence into the first rows"),
    Mutation("decode-ragged-chunk-live-without-wrap", "csrc/decode_attention/decode_attention_kernel.cuh",
             "return count > 0 && nr.n > 0 && (a < nr.n || p.seqlen_new - a < count);",
             "return count > 0 && nr.n > 0 && a < nr.n;",
             _t(f"{T_DECODE_RAGGED}::test_ragged_matches_definition_gpu"), gpu=True,
             why="a row chunk whose first row is idle but whose token positions wrap to a live one inside it exits "
                 "before its work: those heads' outputs are never written"),
    Mutation("fastdiv32-multiplier-rounded-down", "csrc/common/fastdiv.cuh",
             "mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d) + 1);",
             "mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d));",
             _t("tests/test_fastdiv.py::test_quotient_and_remainder_match_divmod",
                "tests/test_fastdiv.py::test_fastdiv_quotient_matches_floor_division"),
             why="the multiplier one short: quotients one low just below some multiples of the divisor "
                 "(every index the decode kernels split by a launch-time count)"),
    Mutation("fastdiv-fast-path-past-2-31", "csrc/common/fastdiv.cuh",
             "if (shift < 32 && uint64_t(n) < (uint64_t(1) << 31)) {",
             "if (shift < 32) {",
             _t("tests/test_fastdiv.py::test_fastdiv_quotient_matches_floor_division"),
             why="a dividend past 2^31 through the 32-bit multiply: the softmax's row index of a tensor over 2^31 "
                 "rows split wrong"),
    Mutation("decode-kernel-page-is-the-logical-block", "csrc/decode_attention/decode_attention_kernel.cuh",
             "  return table[blk];", "  return blk;",
             _t(f"{T_DECODE_PAGED}::test_paged_matches_definition_gpu",
                f"{T_DECODE_PAGED}::test_paged_equals_contiguous_bitwise_gpu"), gpu=True),
    Mutation("decode-kernel-page-past-the-pool-accepted", "csrc/decode_attention/decode_attention_kernel.cuh",
             "bad |= e[k] < 0 || e[k] >= p.num_pages;", "bad |= e[k] < 0;",
             _t(f"{T_DECODE_PAGED}::test_out_of_range_pages_give_nan_and_no_write_gpu"), gpu=True,
             why="a block_table entry past the pool is read (and written) out of bounds"),
    Mutation("decode-kernel-first-tiles-unclamped", "csrc/decode_attention/decode_attention_kernel.cuh",
             "if (t < n_tiles) issue(t, std::true_type{});", "if (t < n_tiles) issue(t, std::false_type{});",
             _t(f"{T_DECODE_PAGED}::test_out_of_range_pages_give_nan_and_no_write_gpu"), gpu=True,
             why="the CUDA-core kernel's first tiles, issued before its check, read through an entry out of the pool"),
    Mutation("decode-kernel-own-split-unchecked", "csrc/decode_attention/decode_attention_kernel.cuh",
             "const bool own_pages_ok = decode::pages_ok<kPaged>(p, b, kb, ke);",
             "const bool own_pages_ok = true;",
             _t(f"{T_DECODE_PAGED}::test_bad_page_read_by_a_later_split_gives_nan_gpu"), gpu=True,
             why="the CUDA-core kernel's later split reads through an entry out of the pool: with no append, nothing "
                 "else checks it, and the sequence's rows come out from rows outside the pool"),
    Mutation("decode-kernel-append-before-the-rest-checked", "csrc/decode_attention/decode_attention_kernel.cuh",
             "      ok = decode::pages_ok<kPaged>(p, b, ke, end) && ok;\n", "",
             _t(f"{T_DECODE_PAGED}::test_bad_page_read_by_a_later_split_gives_nan_gpu"), gpu=True,
             why="the CUDA-core kernel's first split appends having seen only its own split's entries: a sequence "
                 "with a bad page past them gets its new rows written"),
    Mutation("decode-kernel-empty-pool-read", "csrc/decode_attention/decode_attention_kernel.cuh",
             "|| (kPaged && p.num_pages <= 0 && end > start)) {", ") {",
             _t(f"{T_DECODE_PAGED}::test_empty_pool_gpu"), gpu=True,
             why="an empty pool has no page to clamp into: the first tiles read outside it"),
    Mutation("decode-mma-full-tile-row-step-dropped", "csrc/decode_attention/decode_attention_kernel.cuh",
             "          ka += k_step;\n", "",
             _t(f"{T_DECODE}::test_forced_splits_gpu"), gpu=True,
             why="the tensor-core kernel's full tiles copy one contiguous K row into all of a thread's rows"),
    Mutation("decode-mma-plain-tile-past-a-causal-limit", "csrc/decode_attention/decode_attention_kernel.cuh",
             "    if (live) plain_end = min(plain_end, lim[h]);\n", "",
             _t(f"{T_DECODE}::test_causal_limit_inside_a_full_tile_gpu"), gpu=True,
             why="the tensor-core kernel scales a full tile without masking where a new row's causal limit falls "
                 "inside it: the earlier new rows see the later ones"),
    Mutation("decode-mma-full-tile-takes-new-rows", "csrc/decode_attention/decode_attention_kernel.cuh",
             "const bool fast = jt + TILE <= min(cached, ke);", "const bool fast = jt + TILE <= ke;",
             _t(f"{T_DECODE}::test_forced_splits_gpu"), gpu=True,
             why="a tile holding this step's new rows takes the full-tile path: it reads their cache slots, not k_new"),
    Mutation("decode-mma-first-split-page-past-the-pool-accepted", "csrc/decode_attention/decode_attention_kernel.cuh",
             "return !__syncthreads_or(r.last > r.first && worst >= uint32_t(p.num_pages));",
             "return !__syncthreads_or(r.last > r.first && worst >= 0x80000000u);",
             _t(f"{T_DECODE_PAGED}::test_out_of_range_pages_give_nan_and_no_write_gpu",
                f"{T_DECODE_PAGED}::test_bad_page_read_by_a_later_split_gives_nan_gpu"), gpu=True,
             why="the tensor-core kernel's first split lets an entry past the pool through: the append writes out "
                 "of bounds, the sequence's rows come out computed from a clamped page"),
    Mutation("decode-mma-page-check-staged-groups-ignored", "csrc/decode_attention/decode_attention_kernel.cuh",
             "        worst = max(worst, max(max(e.x, e.y), max(e.z, e.w)));\n", "",
             _t(f"{T_DECODE_PAGED}::test_bad_page_anywhere_in_a_long_table_gives_nan_gpu",
                f"{T_DECODE_PAGED}::test_bad_page_read_by_a_later_split_gives_nan_gpu"), gpu=True,
             why="the tensor-core kernel's first split drops the entries it staged in shared memory before its loop "
                 "(the first 512): a bad page among them is neither poisoned nor kept from the append"),
    Mutation("decode-mma-paged-append-before-the-check", "csrc/decode_attention/decode_attention_kernel.cuh",
             "  if (!kPaged && lengths && appends) decode::append<T, kPaged>(p, b, hkv, cached, nr);",
             "  if (lengths && appends) decode::append<T, kPaged>(p, b, hkv, cached, nr);",
             _t(f"{T_DECODE_PAGED}::test_out_of_range_pages_give_nan_and_no_write_gpu",
                f"{T_DECODE_PAGED}::test_bad_page_read_by_a_later_split_gives_nan_gpu"), gpu=True,
             why="the tensor-core kernel appends to a paged cache before its first split's check has its verdict: "
                 "a sequence with a bad entry gets its pages written"),
    Mutation("tolerance-attention-cap-removed", "tests/tolerances.py", "ATTN_CAP = 0.05", "ATTN_CAP = 1.0",
             _t("tests/test_tolerances.py::test_attention_errors_fail"),
             why="a peer that lost everything would let any error through"),
    # ------------------------------------------------------------ gradients
    Mutation("autograd-not-registered", "fused_attn/softmax.py",
             "    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)\n", "",
             _t(f"{T_SOFTMAX}::test_opcheck_autograd", f"{T_SOFTMAX}::test_gradcheck_op_and_its_backward"),
             why="the op's gradient silently missing (a bug the op once shipped with)"),
    Mutation("autograd-mask-gradient-scaled", "fused_attn/softmax.py",
             "g = bwd(grad, y, 1.0, causal=ctx.causal)", "g = bwd(grad, y, ctx.scale, causal=ctx.causal)",
             _t(f"{T_SOFTMAX}::test_gradcheck_op_and_its_backward", f"{T_SOFTMAX}::test_gradcheck_cpu_path")),
    Mutation("backward-cpu-dot-dropped", "fused_attn/reference.py",
             "return (scale * yy * (g - dot)).to(y.dtype)", "return (scale * yy * g).to(y.dtype)",
             _t(f"{T_SOFTMAX}::test_gradcheck_op_and_its_backward")),
    Mutation("double-backward-sign", "fused_attn/softmax.py",
             "d_y = (ctx.scale * (uu * (g - dot_gy) - dot_uy * g)).to(y.dtype)",
             "d_y = (ctx.scale * (uu * (g - dot_gy) + dot_uy * g)).to(y.dtype)",
             _t(f"{T_SOFTMAX}::test_gradcheck_op_and_its_backward")),
    Mutation("hf-dropout-ignored-in-training", "fused_attn/hf.py",
             "    if dropout and module.training:\n", "    if False:\n",
             _t("tests/test_hf_training.py::test_dropout_is_applied_in_training_only")),
    Mutation("kernel-backward-dot-dropped", "csrc/softmax/softmax_kernel.cuh",
             "d.v[e] = from_float<T>(c + e < kv ? p.scale * yv * (gv - dot) : 0.f);",
             "d.v[e] = from_float<T>(c + e < kv ? p.scale * yv * gv : 0.f);",
             _t(f"{T_SOFTMAX}::test_backward_every_row_class_gpu"), gpu=True),
    Mutation("kernel-backward-causal-edge-read", "csrc/softmax/softmax_kernel.cuh",
             "      if (c + e < kv) dot += to_float(g[it].v[e]) * to_float(y[it].v[e]);",
             "      dot += to_float(g[it].v[e]) * to_float(y[it].v[e]);",
             _t(f"{T_SOFTMAX}::test_backward_every_row_class_gpu"), gpu=True,
             why="the pack at the causal edge adds unread registers to the dot product"),
    Mutation("kernel-backward-stream-second-pass-zeros", "csrc/softmax/softmax_kernel.cuh",
             "        d.v[e] = from_float<T>(c + e < kv ? p.scale * to_float(y.v[e]) * (to_float(g.v[e]) - dot) : 0.f);",
             "        d.v[e] = from_float<T>(0.f);",
             _t(f"{T_SOFTMAX}::test_backward_every_row_class_gpu"), gpu=True,
             why="rows over 16384 keys (streaming backward)"),
    # ------------------------------------------------------------ GPU-only
    Mutation("compile-bypasses-the-op", "fused_attn/softmax.py",
             'if x.device.type == "cpu":', 'if x.device.type == "cpu" or torch.compiler.is_compiling():',
             _t(f"{T_SOFTMAX}::test_torch_compile_traces_our_op", "-k", "cuda"), gpu=True,
             why="under torch.compile the wrapper traces the reference instead of our op"),
    # ------------------------------------------------------------ GPU-only: kernels (csrc/)
    Mutation("kernel-mask-last-dim-stride-assumed-1", "csrc/softmax/softmax_kernel.cuh",
             "const int64_t off = row_off + int64_t(j) * p.mask_stride_k;",
             "const int64_t off = row_off + int64_t(j);",
             _t(f"{T_SOFTMAX}::test_mask_with_last_dim_stride_not_one_gpu"), gpu=True),
    Mutation("kernel-mask-query-stride-assumed-dense", "csrc/softmax/softmax.cpp",
             "p.mask_stride_q = m.stride(-2);", "p.mask_stride_q = m.size(-1);",
             _t(f"{T_SOFTMAX}::test_mask_with_last_dim_stride_not_one_gpu"), gpu=True,
             why="a [B, 1, 1, Sk] padding mask read as if it had a row per query"),
    Mutation("kernel-causal-visible-keys-off-by-one", "csrc/softmax/softmax_kernel.cuh",
             "const int64_t v = int64_t(q) + p.seqlen_k - p.seqlen_q + 1;",
             "const int64_t v = int64_t(q) + p.seqlen_k - p.seqlen_q;",
             _t(f"{T_SOFTMAX}::test_every_launch_class_gpu"), gpu=True),
    Mutation("kernel-v1-all-masked-guard-dropped", "csrc/softmax/softmax_kernel.cuh",
             "const float inv = m == kNegInf ? 0.f : fast_rcp(l);",
             "const float inv = fast_rcp(l);",
             _t(f"{T_SOFTMAX}::test_fully_masked_rows_are_zero_gpu"), gpu=True),
    Mutation("kernel-stream-all-masked-guard-dropped", "csrc/softmax/softmax_kernel.cuh",
             "group_merge<kV1StreamThreads>(m, l, red_m, red_l);\n\n  const float inv = m == kNegInf ? 0.f : 1.f / l;",
             "group_merge<kV1StreamThreads>(m, l, red_m, red_l);\n\n  const float inv = 1.f / l;",
             _t(f"{T_SOFTMAX}::test_fully_masked_rows_are_zero_gpu"), gpu=True,
             why="rows over 32768 keys (streaming path) with no visible key"),
    Mutation("kernel-exp-all-masked-guard-dropped", "csrc/common/math.cuh",
             "return m == kNegInf ? 0.f : exp2f((t - m) * kLog2e);", "return exp2f((t - m) * kLog2e);",
             _t(f"{T_SOFTMAX}::test_fully_masked_rows_are_zero_gpu"), gpu=True),
    Mutation("kernel-vector-stores-to-misaligned-out", "csrc/softmax/softmax.cpp",
             "aligned16(p.x) && aligned16(p.out)", "aligned16(p.x)",
             _t(f"{T_SOFTMAX}::test_misaligned_out_gpu"), gpu=True),
    Mutation("kernel-launch-on-default-stream", "csrc/softmax/softmax.cpp",
             "const cudaStream_t stream = at::cuda::getCurrentCUDAStream();\n  FA_DISPATCH_FLOAT(x.scalar_type()",
             "const cudaStream_t stream = at::cuda::getDefaultCUDAStream();\n  FA_DISPATCH_FLOAT(x.scalar_type()",
             _t(f"{T_SOFTMAX}::test_runs_on_the_current_nondefault_stream_gpu",
                f"{T_SOFTMAX}::test_cuda_graph_capture_and_replay_gpu"), gpu=True,
             why="the sleep test alone let it survive on the H100 (the legacy default stream waited for s); "
                 "a launch on the legacy stream during graph capture is an error"),
    # ------------------------------------------------------------ layer_norm / rms_norm
    Mutation("norm-cpu-eps-times-10", "fused_attn/layer_norm.py",
             "reference.layer_norm(x, weight, bias, eps, residual=residual",
             "reference.layer_norm(x, weight, bias, eps * 10, residual=residual",
             _t(f"{T_NORM}::test_matches_reference_cpu"), why="rows whose variance is below eps"),
    Mutation("norm-backward-mean-term-dropped", "fused_attn/reference.py",
             "        dh = dh - g.mean(dim=-1, keepdim=True)\n", "        dh = dh\n",
             _t(f"{T_NORM}::test_gradients_match_reference", f"{T_NORM}::test_gradcheck_cpu")),
    Mutation("norm-backward-dweight-off-by-1pct", "fused_attn/reference.py",
             "(gy * xhat).sum(dim=lead)", "(gy * xhat).sum(dim=lead) * 1.01",
             _t(f"{T_NORM}::test_gradients_match_reference")),
    Mutation("norm-kernel-no-shift", "csrc/layer_norm/layer_norm_kernel.cuh",
             "if (load_ok) shift = ", "if (false) shift = ",
             _t(f"{T_NORM}::test_matches_reference_gpu"), gpu=True,
             why="float32 rows of equal values must give the bias exactly; 1e4 + N(0, 1) rows lose digits"),
    Mutation("norm-kernel-variance-over-n-minus-1", "csrc/layer_norm/layer_norm_kernel.cuh",
             "rsqrtf(sq / float(n) + p.eps)", "rsqrtf(sq / float(n - 1) + p.eps)",
             _t(f"{T_NORM}::test_every_row_class_gpu"), gpu=True),
    Mutation("norm-kernel-y-of-x-not-h", "csrc/layer_norm/layer_norm_kernel.cuh",
             "      xa[it] = hp;\n", "",
             _t(f"{T_NORM}::test_matches_reference_gpu"), gpu=True,
             why="with a residual, y must be the norm of h = x + residual (as stored), not of x"),
    Mutation("norm-gather-negative-index-wraps", "fused_attn/layer_norm.py",
             "ok = (index >= 0) & (index < table.shape[0])", "ok = index < table.shape[0]",
             _t(f"{T_NORM}::test_gathered_rows_match_reference_cpu"),
             why="an index below 0 must give a NaN row, not row 0 (the kernel's rule)"),
    Mutation("norm-gather-grad-repeats-overwrite", "fused_attn/layer_norm.py",
             "return table.index_add_(0, index.long(), grad)", "return table.index_copy_(0, index.long(), grad)",
             _t(f"{T_NORM}::test_gathered_rows_gradients_reach_the_tables"),
             why="a token gathered twice takes the sum of both rows' gradients"),
    Mutation("norm-kernel-residual-index-past-the-end", "csrc/layer_norm/layer_norm_kernel.cuh",
             "load_ok = load_ok && rrow >= 0 && rrow < p.r_rows;", "load_ok = load_ok && rrow >= 0;",
             _t(f"{T_NORM}::test_gathered_rows_match_reference_gpu"), gpu=True,
             why="an index past the table's end must read nothing and give a NaN row"),
    Mutation("gpt2-embed-first-norm-skipped", "fused_attn/gpt2.py",
             "h = self.ln_1(x) if normed is None else normed", "h = self.ln_1(x) if normed is None else x",
             _t(f"{T_GPT2}::test_fused_embedding_matches_the_separate_launches_cpu")),
    # ------------------------------------------------------------ linear / mlp
    Mutation("linear-backward-drops-residual", "fused_attn/linear.py",
             "ctx.save_for_backward(x, weight, bias, residual, norm_weight, norm_bias)",
             "ctx.save_for_backward(x, weight, bias, None, norm_weight, norm_bias)",
             _t(f"{T_LINEAR}::test_gradcheck_float64_cpu"), why="residual's gradient silently missing"),
    Mutation("linear-backward-ignores-norm", "fused_attn/linear.py",
             "y = _reference(*leaves, ctx.activation, ctx.norm, ctx.eps)",
             "y = _reference(*leaves, ctx.activation, 0, ctx.eps)",
             _t(f"{T_LINEAR}::test_norm_gradcheck_float64_cpu"),
             why="the backward differentiates linear(x), not linear(norm(x)): wrong x grads, no norm_weight grads"),
    Mutation("mlp-residual-dropped", "fused_attn/mlp.py",
             "return linear(h, w_proj, b_proj, residual=residual)", "return linear(h, w_proj, b_proj)",
             _t(f"{T_MLP}::test_matches_reference_cpu")),
    Mutation("kernel-linear-swiglu-up-bias-of-gate", "csrc/linear/linear_kernel.cuh",
             "in.bias_up = b && build_activation<kAct>(p) == kActSwiglu ? to_float(bias[p.n_out + col]) : 0.f;",
             "in.bias_up = b && build_activation<kAct>(p) == kActSwiglu ? to_float(bias[col]) : 0.f;",
             _t(f"{T_LINEAR}::test_every_row_count_and_epilogue_gpu"), gpu=True),
    Mutation("kernel-linear-swiglu-pass-gate-only", "csrc/linear/linear_swiglu.cu",
             "o.v[e] = from_float<T>(silu(to_float(g.v[e])) * to_float(u.v[e]));",
             "o.v[e] = from_float<T>(silu(to_float(g.v[e])));",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="the many-row SwiGLU pass drops the up projection"),
    Mutation("kernel-linear-residual-c-dropped", "csrc/linear/linear.cpp",
             ": residual_c     ? at::addmm(*residual2, x2, weight.t())",
             ": residual_c     ? at::mm(x2, weight.t())",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="the many-row ATen path's residual (float32: addmm's C operand) silently missing"),
    Mutation("kernel-linear-lt-residual-dropped", "csrc/linear/linear_cublaslt.cpp",
             "const float alpha = 1.f, beta = residual_c ? 1.f : 0.f;", "const float alpha = 1.f, beta = 0.f;",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="cuBLASLt's C operand (the residual) ignored: float16 / bfloat16 rows lose it"),
    Mutation("kernel-linear-lt-bias-dropped", "csrc/linear/linear_cublaslt.cpp",
             "(gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS)",
             "(gelu ? CUBLASLT_EPILOGUE_GELU : CUBLASLT_EPILOGUE_DEFAULT)",
             _t(f"{T_LINEAR}::test_many_rows_epilogue_gpu"), gpu=True,
             why="cuBLASLt's epilogue without the bias: float16 / bfloat16 rows lose it"),
    Mutation("kernel-linear-splitk-last-push-dropped", "csrc/linear/linear_splitk.cuh",
             "    if (r >= splits) continue;", "    if (r >= splits - 1) continue;",
             _t(f"{T_LINEAR}::test_split_k_path_gpu"), gpu=True,
             why="rank 0 adds every split's pushed sums but the last"),
    Mutation("kernel-attention-edge-leaks-one-key", "csrc/attention/attention_kernel.cuh",
             "    lim[hh] = last - col;", "    lim[hh] = last - col + 1;",
             _t(f"{T_ATTN}::test_wgmma_cases_gpu"), gpu=True,
             why="an unmasked call's edge tiles show each row one key past its last visible one (causal or the end)"),
    Mutation("kernel-attention-edge-ignores-seqlen-k", "csrc/attention/attention_kernel.cuh",
             "    int last = p.seqlen_k - 1;", "    int last = 1 << 30;",
             _t(f"{T_ATTN}::test_wgmma_cases_gpu"), gpu=True,
             why="an unmasked call's last key tile attends to the zero-filled keys past seqlen_k"),
    Mutation("kernel-linear-vector-loads-on-odd-k", "csrc/linear/linear.cpp",
             "p.vec = p.k % vec == 0 && ", "p.vec = ",
             _t(f"{T_LINEAR}::test_matches_reference_gpu"), gpu=True,
             why="16-byte loads of rows that are not 16-byte aligned (K not a multiple of the vector width)"),
    Mutation("kernel-linear-mma-x-stage-unwaited", "csrc/linear/linear_kernel.cuh",
             "    cp_async_commit();\n    cp_async_wait<0>();", "    cp_async_commit();",
             _t(f"{T_LINEAR}::test_tensor_core_path_gpu"), gpu=True,
             why="the 16-row short build's MMAs read x's staging slots before its copies have landed"),
    Mutation("kernel-linear-mma-x-fence-dropped", "csrc/linear/linear_kernel.cuh",
             "    if constexpr (kStageX && kMmaXFence) __syncwarp();", "    (void)kMmaXFence;",
             _t("dev/test_sass.py::test_staged_gemv_issues_x_before_its_first_weight_read"),
             why="ptxas puts half of a staged 16-row group's x copies behind the first weight read (SASS)"),
    Mutation("kernel-linear-epilogue-build-drops-the-residual", "csrc/linear/linear_kernel.cuh",
             "  if (bias && residual) return launch(ActBuild<kActCode | kEpiKnown | kEpiBias | kEpiResidual>{});",
             "  if (bias && residual) return launch(ActBuild<kActCode | kEpiKnown | kEpiBias>{});",
             _t(f"{T_LINEAR}::test_tensor_core_path_gpu[dtype0-None-16]"), gpu=True,
             why="launches with a bias and a residual take the build compiled without the residual: never added"),
    Mutation("kernel-linear-tensor-cores-from-4-rows-again", "csrc/linear/linear.cpp",
             "constexpr int kMmaMinRows = 2;", "constexpr int kMmaMinRows = 4;",
             _t(f"{T_LINEAR}::test_kernel_choice_gpu"), gpu=True,
             why="2-3 rows back on the CUDA-core kernel (GPT-2's B2 / B3 steps 43 / 76 us slower)"),
    Mutation("kernel-linear-one-row-k-bound-dropped", "csrc/linear/linear.cpp",
             "constexpr int64_t kMmaOneRowMaxK = 4096;", "constexpr int64_t kMmaOneRowMaxK = int64_t(1) << 40;",
             _t(f"{T_LINEAR}::test_kernel_choice_gpu"), gpu=True,
             why="one row of a long-K weight (Llama's 11008x4096) on the tensor-core kernel, 5% slower there"),
    Mutation("kernel-linear-mma-fragment-order", "csrc/linear/linear_kernel.cuh",
             "hi[0] = w[0].z, hi[1] = w[1].z, hi[2] = w[0].w, hi[3] = w[1].w;",
             "hi[0] = w[0].z, hi[1] = w[0].w, hi[2] = w[1].z, hi[3] = w[1].w;",
             _t(f"{T_LINEAR}::test_tensor_core_path_gpu"), gpu=True,
             why="the second MMA pairs weight rows g + 8 with the wrong k"),
    Mutation("kernel-linear-norm-variance-unshifted", "csrc/linear/linear_kernel.cuh",
             "const float t = (to_float(xp.v[e]) - shift) - mean;", "const float t = to_float(xp.v[e]) - mean;",
             _t(f"{T_LINEAR}::test_norm_matches_reference_gpu"), gpu=True,
             why="the variance of the row around mean - shift, not around its mean"),
    Mutation("kernel-linear-norm-multiplies-raw-x", "csrc/linear/linear_kernel.cuh",
             "xp.raw = kPrologue ? reinterpret_cast", "xp.raw = false ? reinterpret_cast",
             _t(f"{T_LINEAR}::test_norm_rows_match_layer_norm_gpu"), gpu=True,
             why="the CUDA-core kernel multiplies x, not its normalized rows"),
    Mutation("kernel-linear-writes-nothing", "csrc/linear/linear_kernel.cuh",
             "constexpr int U = 8 / NB;  // pieces per row in flight per thread",
             "constexpr int U = 8 / NB;  // pieces per row in flight per thread\n  if (blockDim.x > 0) return;",
             _t(f"{T_LINEAR}::test_every_row_count_and_epilogue_gpu"), gpu=True, why="no output written: poisoned"),
    # ------------------------------------------------------------ an argument ignored: only its default was tested
    Mutation("decode-wave-rule-past-two-waves", "csrc/decode_attention/decode_attention_heuristics.h",
             "work >= wave && work <= 2 * wave", "work >= wave",
             _t("tests/test_decode_heuristics.py::test_long_cache_split_rules"),
             why="16 splits for grids the wave rule was not measured on (batch 64 MHA: 16x the merges)"),
    Mutation("decode-wave-rule-any-length", "csrc/decode_attention/decode_attention_heuristics.h",
             "if (cluster_ok && max_len >= kDecodeWaveMinLen && work >= wave",
             "if (cluster_ok && work >= wave",
             _t("tests/test_decode_heuristics.py::test_long_cache_split_rules"),
             why="16 splits of an 8k cache at batch 16 (512-key splits) where one split was measured as fast"),
    Mutation("decode-wide-build-any-large-batch", "csrc/decode_attention/decode_attention_heuristics.h",
             "batch >= kDecodeWideMinBatch && batch <= kDecodeWideMaxBatch &&", "batch >= kDecodeWideMinBatch &&",
             _t("tests/test_decode_heuristics.py::test_wide_build_rule"),
             why="GPT-2's batch 32-64 back on the 256-thread build (B64 step 516.2 -> 544.2 us, H200)"),
    Mutation("decode-paged-long-rule-ignored", "csrc/decode_attention/decode_attention_heuristics.h",
             "if (max_len < (paged ? kDecodePagedLongMinLen : kDecodeLongMinLen)) return 0;",
             "if (max_len < kDecodeLongMinLen) return 0;",
             _t("tests/test_decode_heuristics.py::test_long_cache_split_rules"),
             why="a paged cache at batch 1 MHA 32k keys back on 8 splits in a cluster (141.7 us against 24 splits' "
                 "136.3, H200)"),
    Mutation("sample-blocks-ignore-resident-clusters", "csrc/sample/sample_heuristics.h",
             "  while (blocks > 1 && rows > int64_t(clusters_at_once(int(blocks)))) --blocks;\n", "",
             _t("tests/test_sample_heuristics.py::test_blocks_per_row_rule"),
             why="GPT-2's 64-row sampler back on 64 clusters of 4 blocks where an H200 holds 62: two rows run after "
                 "the others"),
    Mutation("func-attrs-allowance-never-set", "csrc/common/func_attrs.h",
             "const cudaError_t err = set(kernel, attr, value);", "const cudaError_t err = cudaSuccess;",
             _t("tests/test_func_attrs.py::test_sets_once_and_again_only_for_more"),
             why="the launch-attribute table records an allowance it never set: every launch past 48 KB of dynamic "
                 "shared memory (the prefill and tensor-core decode kernels) fails"),
    Mutation("func-attrs-larger-allowance-not-raised", "csrc/common/func_attrs.h",
             "if (found != nullptr && found->value >= value) return cudaSuccess;",
             "if (found != nullptr) return cudaSuccess;",
             _t("tests/test_func_attrs.py::test_sets_once_and_again_only_for_more"),
             why="a kernel first launched without the cluster merge's push area never allowed the larger launch"),
    Mutation("func-attrs-devices-shared", "csrc/common/func_attrs.h",
             "if (e.kernel == kernel && e.device == device && e.attr == attr) found = &e;",
             "if (e.kernel == kernel && e.attr == attr) found = &e;",
             _t("tests/test_func_attrs.py::test_kernels_devices_and_attributes_apart"),
             why="an allowance set on one GPU taken for every GPU: launches on a second device fail"),
    Mutation("func-attrs-failure-remembered", "csrc/common/func_attrs.h",
             "    if (err == cudaSuccess) {\n      if (found != nullptr) {",
             "    if (true) {\n      if (found != nullptr) {",
             _t("tests/test_func_attrs.py::test_a_failed_set_is_returned_and_not_remembered")),
    Mutation("attention-backward-default-scale", "fused_attn/attention.py",
             "ctx.scale = q.shape[-1] ** -0.5 if scale is None else scale", "ctx.scale = q.shape[-1] ** -0.5",
             _t(f"{T_ATTN_ARGS}::test_scale_causal_gqa_mask_forward_and_grad_match_sdpa"),
             why="gradients of a call with a custom scale computed at headdim ** -0.5"),
    Mutation("attention-backward-not-causal", "fused_attn/attention.py",
             'ctx.causal = keyword_only_inputs.get("causal", False)', "ctx.causal = False",
             _t(f"{T_ATTN_ARGS}::test_scale_causal_gqa_mask_forward_and_grad_match_sdpa")),
    Mutation("attention-fake-lse-always-returned", "fused_attn/attention.py",
             "torch.empty(_lse_shape(q, return_lse), dtype=reference.lse_dtype(q.dtype), device=q.device))",
             "torch.empty(_lse_shape(q, True), dtype=reference.lse_dtype(q.dtype), device=q.device))",
             _t(f"{T_ATTN_ARGS}::test_return_lse_false_through_opcheck_and_compile"),
             why="the fake kernel's lse shape disagrees with the CPU kernel's at return_lse=False"),
    Mutation("attention-cpu-lse-always-returned", "fused_attn/attention.py",
             "return out, lse if return_lse else lse.new_empty((0,))", "return out, lse",
             _t(f"{T_ATTN_ARGS}::test_return_lse_false_through_opcheck_and_compile")),
    Mutation("attention-out-ignores-scale", "fused_attn/attention.py",
             "o, l = _cpu(q, k, v, attn_mask, scale, causal, lse.numel() > 0)",
             "o, l = _cpu(q, k, v, attn_mask, None, causal, lse.numel() > 0)",
             _t(f"{T_ATTN_ARGS}::test_out_with_scale_and_mask_matches_sdpa")),
    Mutation("rms-norm-default-eps-1e-5", "fused_attn/layer_norm.py",
             "    eps: float = 1e-6,\n", "    eps: float = 1e-5,\n",
             _t(f"{T_NORM_ARGS}::test_default_eps_is_the_documented_one")),
    Mutation("layer-norm-backward-default-eps", "fused_attn/layer_norm.py",
             "    x, weight, bias, eps = inputs\n    ctx.eps, ctx.rms = eps,",
             "    x, weight, bias, eps = inputs\n    ctx.eps, ctx.rms = 1e-5,",
             _t(f"{T_NORM_ARGS}::test_eps_weight_bias_residual_forward_and_grad_match_torch")),
    Mutation("linear-backward-default-eps", "fused_attn/linear.py",
             'ctx.eps = keyword_only_inputs.get("eps", 1e-5)', "ctx.eps = 1e-5",
             _t(f"{T_LINEAR_ARGS}::test_norm_weight_bias_eps_match_torch")),
    Mutation("gpt2-from-hf-default-eps", "fused_attn/gpt2.py",
             "c.n_positions, c.layer_norm_epsilon)", "c.n_positions, 1e-5)",
             _t(f"{T_GPT2_ARGS}::test_logits_of_a_varied_checkpoint_match_hf_cpu"),
             why="a checkpoint whose layer_norm_epsilon is not 1e-5 normalized with 1e-5"),
    Mutation("gpt2-eager-layer-norm-default-eps", "fused_attn/gpt2.py",
             "return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)",
             "return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)",
             _t(f"{T_GPT2_ARGS}::test_logits_of_a_varied_checkpoint_match_hf_cpu")),
    Mutation("hf-is-causal-false-ignored", "fused_attn/hf.py",
             'is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)',
             "is_causal = True",
             _t(f"{T_HF_ARGS}::test_is_causal_false_without_a_mask_attends_everywhere"),
             why="an encoder or cross-attention call without a mask gets a causal mask"),
    Mutation("hf-layer-norm-default-eps", "fused_attn/hf.py",
             "return layer_norm(x, self.weight, self.bias, self.eps)", "return layer_norm(x, self.weight, self.bias)",
             _t(f"{T_HF_ARGS}::test_apply_to_gpt2_on_a_varied_checkpoint_matches_the_unpatched_model")),
    Mutation("qkv-cpu-default-eps", "fused_attn/qkv_decode_attention.py",
             "xn = F.layer_norm(x.to(compute), (d,), eps=eps)", "xn = F.layer_norm(x.to(compute), (d,))",
             _t(f"{T_QKV_ARGS}::test_matches_layer_norm_linear_and_sdpa")),
    Mutation("decode-cpu-ignores-scale", "fused_attn/decode_attention.py",
             "return _cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, block_table,\n",
             "return _cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, None, block_table,\n",
             _t(f"{T_DECODE_ARGS}::test_append_leftpad_key_mask_scale_match_the_plain_definition")),
    Mutation("softmax-backward-default-scale", "fused_attn/softmax.py",
             '    ctx.scale = scale\n    ctx.causal = keyword_only_inputs["causal"]\n    ctx.mask_shape',
             '    ctx.scale = 1.0\n    ctx.causal = keyword_only_inputs["causal"]\n    ctx.mask_shape',
             _t(f"{T_SOFTMAX_ARGS}::test_the_ops_own_autograd_with_scale_and_masks_matches_torch")),
    Mutation("softmax-mask-gradient-scaled", "fused_attn/softmax.py",
             "g = bwd(grad, y, 1.0, causal=ctx.causal)", "g = bwd(grad, y, ctx.scale, causal=ctx.causal)",
             _t(f"{T_SOFTMAX_ARGS}::test_the_ops_own_autograd_with_scale_and_masks_matches_torch")),
    Mutation("sample-cpu-ignores-row-offsets", "fused_attn/sample.py",
             "return base if offsets is None else base + offsets.reshape(-1).to(torch.int64).expand(rows)",
             "return base",
             _t(f"{T_SAMPLE_ARGS}::test_temperature_top_k_and_row_offsets_are_pinned")),
    # ------------------------------------------------------------ the CPU path is the reference: a bug moves both
    Mutation("reference-decode-new-tokens-not-causal", "fused_attn/reference.py",
             "visible = j < end - seqlen_new + 1 + i", "visible = j < end",
             _t(f"{T_DECODE_ARGS}::test_append_leftpad_key_mask_scale_match_the_plain_definition"),
             why="every new token of a multi-token decode step sees the ones after it"),
    Mutation("reference-decode-append-reversed", "fused_attn/reference.py",
             "slots = cache_seqlens.to(torch.int64).view(-1, 1) + torch.arange(seqlen_new, device=q.device)",
             "slots = cache_seqlens.to(torch.int64).view(-1, 1) + torch.arange(seqlen_new, device=q.device).flip(0)",
             _t(f"{T_DECODE_ARGS}::test_append_leftpad_key_mask_scale_match_the_plain_definition")),
    Mutation("reference-swiglu-up-then-gate", "fused_attn/reference.py",
             "gate, up = y.chunk(2, dim=-1)", "up, gate = y.chunk(2, dim=-1)",
             _t(f"{T_LINEAR_ARGS}::test_swiglu_is_llama_mlps_gate_then_up")),
    Mutation("reference-rms-norm-centered", "fused_attn/reference.py",
             "t = h if rms else _centered(h)", "t = _centered(h)",
             _t(f"{T_NORM_ARGS}::test_eps_weight_bias_residual_forward_and_grad_match_torch"),
             why="RMSNorm's statistic taken about the mean (a variance) in the reference and the CPU path"),
    Mutation("reference-attention-gqa-heads-tiled", "fused_attn/reference.py",
             "return t.to(compute_dtype).repeat_interleave(nheads_q // t.shape[1], dim=1)",
             "return t.to(compute_dtype).repeat(1, nheads_q // t.shape[1], 1, 1)",
             _t(f"{T_ATTN_ARGS}::test_scale_causal_gqa_mask_forward_and_grad_match_sdpa")),
    Mutation("gpt2-block-attention-reads-ln-2", "fused_attn/gpt2.py",
             "h = self.ln_1(x) if normed is None else normed", "h = self.ln_2(x) if normed is None else normed",
             _t(f"{T_GPT2_ARGS}::test_logits_of_a_varied_checkpoint_match_hf_cpu"),
             why="a block's attention input normalized by ln_2 (identical norms in a fresh model hide it)"),
    Mutation("gpt2-block-mlp-reads-ln-1", "fused_attn/gpt2.py",
             "            h = self.ln_2(x)\n", "            h = self.ln_1(x)\n",
             _t(f"{T_GPT2_ARGS}::test_logits_of_a_varied_checkpoint_match_hf_cpu")),
    Mutation("reference-philox-key-words-swapped", "fused_attn/reference.py",
             "c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0",
             "c0, c1, c2, c3 = hi1 ^ c1 ^ k1, lo1, hi0 ^ c3 ^ k0, lo0",
             _t(f"{T_SAMPLE_ARGS}::test_uniform_draws_are_pinned"),
             why="the CPU draws stop matching the kernel's Philox (both moved by a reference bug)"),
    Mutation("reference-gumbel-counter-row-and-column-swapped", "fused_attn/reference.py",
             "words = philox4x32_10([col >> 2, row, off & _MASK32, (off >> 32) & _MASK32], (seed, seed >> 32))",
             "words = philox4x32_10([row, col >> 2, off & _MASK32, (off >> 32) & _MASK32], (seed, seed >> 32))",
             _t(f"{T_SAMPLE_ARGS}::test_uniform_draws_are_pinned")),
    Mutation("reference-gumbel-words-reversed", "fused_attn/reference.py",
             "pick = col & 3", "pick = 3 - (col & 3)",
             _t(f"{T_SAMPLE_ARGS}::test_uniform_draws_are_pinned")),
    Mutation("mlp-drops-b-proj", "fused_attn/mlp.py",
             "return linear(h, w_proj, b_proj, residual=residual)", "return linear(h, w_proj, None, residual=residual)",
             _t(f"{T_LINEAR_ARGS}::test_mlp_gelu_tanh_with_norm_and_residual_matches_torch"),
             why="a zero bias everywhere in the test models hid it"),
    Mutation("hf-mlp-drops-c-proj-bias", "fused_attn/hf.py",
             "self.c_proj.weight.t(), self.c_proj.bias)", "self.c_proj.weight.t(), None)",
             _t(f"{T_HF_ARGS}::test_apply_to_gpt2_on_a_varied_checkpoint_matches_the_unpatched_model")),
    # ------------------------------------------------------------ a bad argument not pinned
    Mutation("decode-q-checked-after-the-lengths", "fused_attn/decode_attention.py",
             '    _check_tensor(q, "q", "[total_q, nheads_q, headdim]" if ragged else "[batch, nheads_q, seqlen_new, '
             'headdim]")\n    if ragged:',
             '    _check_is_tensor(q, "q")\n    if ragged:',
             _t(f"{T_DECODE_ARGS}::test_three_dim_q_is_named_before_the_lengths"),
             why="a 3-dim q blamed on cache_seqlens"),
    Mutation("decode-key-mask-batch-unchecked", "fused_attn/decode_attention.py",
             "key_mask.shape[0] not in (1, batch)", "key_mask.shape[0] < 1",
             _t(f"{T_DECODE_ARGS}::test_bad_key_mask_is_named"),
             why="a key_mask of the wrong batch size fails later with a bare broadcasting error"),
    Mutation("decode-key-mask-stride-unchecked", "fused_attn/decode_attention.py",
             "if key_mask.shape[1] > 1 and key_mask.stride(1) != 1:", "if False:",
             _t(f"{T_DECODE_ARGS}::test_bad_key_mask_is_named")),
    Mutation("decode-validate-type-unchecked", "fused_attn/decode_attention.py",
             "elif not isinstance(validate, bool):", "elif False:",
             _t(f"{T_BAD}::test_bad_argument_is_named")),
    Mutation("qkv-x-dtype-unchecked", "fused_attn/qkv_decode_attention.py",
             "if x.dtype not in (_CPU_DTYPES if cpu else _DTYPES):", "if False:",
             _t(f"{T_BAD}::test_bad_argument_is_named")),
    # ------------------------------------------------------------ the numbers users read
    Mutation("result-tokens-per-s-one-row", "fused_attn/generate.py",
             "return batch * self.new_tokens / self.total_s", "return self.new_tokens / self.total_s",
             _t(f"{T_GENERATE_ARGS}::test_result_totals_and_tokens_per_s_count_every_row")),
    Mutation("nearest-rank-one-rank-up", "fused_attn/generate.py",
             "return ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)]",
             "return ordered[min(len(ordered) - 1, int(q * len(ordered)))]",
             _t(f"{T_GENERATE_ARGS}::test_nearest_rank_is_the_textbook_percentile"),
             why="the rule shipped before 2026-11-29: the p95 of 20 gaps was the slowest one"),
    Mutation("cli-positions-one-short", "fused_attn/generate.py",
             "    if length > positions:", "    if length >= positions:",
             _t(f"{T_GENERATE_ARGS}::test_cli_generates_exactly_up_to_n_positions")),
    Mutation("gpt2-generate-positions-one-short", "fused_attn/gpt2.py",
             "if total > c.n_positions:", "if total >= c.n_positions:",
             _t(f"{T_GPT2_ARGS}::test_generates_exactly_up_to_n_positions_cpu")),
    Mutation("cli-graph-seed-not-passed", "fused_attn/generate.py",
             "max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,",
             "max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=0,",
             _t(f"{T_GENERATE_ARGS}::test_cli_passes_temperature_top_k_and_seed")),
    Mutation("bench-speedup-inverted", "bench/harness.py",
             "round(medians[(group, base)] / p50_us, 3)", "round(p50_us / medians[(group, base)], 3)",
             _t(f"{T_GENERATE_ARGS}::test_bench_percentiles_roofline_bandwidth_and_speedups")),
    Mutation("onnx-attention-kv-heads-tiled", "fused_attn/onnx.py",
             "op.Expand(op.Unsqueeze(t, [2]), op.Constant(value_ints=[1, 1, group, 1, 1]))",
             "op.Expand(op.Unsqueeze(t, [1]), op.Constant(value_ints=[1, group, 1, 1, 1]))",
             _t("tests/test_onnx.py::test_exported_attention_matches_the_definition"),
             why="query head h reads kv head h % nheads_kv (tile) instead of h // group (repeat_interleave)"),
    Mutation("gpt2-capture-keeps-the-warm-up-draws", "fused_attn/gpt2.py",
             "    torch.cuda.set_rng_state(rng, device)\n", "",
             _t(f"{T_GPT2}::test_sampled_tokens_of_the_first_graph_call_repeat_with_its_seed_gpu"), gpu=True,
             why="the first sampled generate() after a graph capture draws other tokens than later ones"),
    Mutation("build-killed-builds-lock-file-kept", "fused_attn/build.py",
             "    if not hasattr(cpp_extension, \"FileLock\") and baton.exists():",
             "    if False:",
             _t("tests/test_build.py::test_a_killed_builds_lock_file_does_not_block_the_next_build"),
             why="under torch < 2.14 a build killed mid-way leaves cpp_extension's lock file and every later build "
                 "waits on it forever"),
    Mutation("build-redone-after-waiting", "fused_attn/build.py",
             "            return lib  # built by the process this one waited for\n", "            pass\n",
             _t("tests/test_build.py::test_a_build_finished_by_the_process_waited_for_is_not_redone"),
             why="a process that waited for another's build builds the same library again"),
    Mutation("build-lock-not-taken", "fused_attn/build.py",
             "            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n", "            pass\n",
             _t("tests/test_build.py::test_a_build_waits_for_another_process_holding_the_directory_and_resumes_when_it_dies"),
             why="two processes build into one directory at once"),
]


def repo_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def copy_repo(root: Path, dst: Path) -> None:
    for rel in repo_files(root):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def anchor_count(root: Path, m: Mutation) -> int:
    return (root / m.path).read_text().count(m.old)


def replace_once(root: Path, rel: str, old: str, new: str, name: str) -> None:
    """Replace old by new in root's copy of rel; an anchor found zero or several times is refused (the code
    moved: the anchor must be updated). Shared with bench/ab.py's variants."""
    path = root / rel
    text = path.read_text()
    n = text.count(old)
    if n != 1:
        raise LookupError(f"{name}: anchor found {n} times in {rel} (must be exactly once): {old!r}")
    path.write_text(text.replace(old, new))


def apply(root: Path, m: Mutation) -> None:
    replace_once(root, m.path, m.old, m.new, m.name)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    # The mutant's library is built in the copy: in the user's FUSED_ATTN_CACHE it would replace the library
    # built from the checkout (same flags, same build directory), and a process started meanwhile would load it.
    env = dict(os.environ, PYTHONPATH=str(copy), CI="true", HYPOTHESIS_PROFILE="ci", PYTHONDONTWRITEBYTECODE="1",
               FUSED_ATTN_CACHE=str(copy / ".fused_attn_cache"))
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider", "-rs"]
    try:
        p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    return p.returncode, p.stdout + p.stderr


def summary_line(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def check_copies_are_imported() -> None:
    """Tests in a copy must import the copy's fused_attn (not an installed or checked-out one),
    or every mutation would survive."""
    with tempfile.TemporaryDirectory(prefix="fa-mutant-") as tmp:
        copy_repo(ROOT, Path(tmp))
        env = dict(os.environ, PYTHONPATH=tmp)
        where = subprocess.run([sys.executable, "-c", "import fused_attn; print(fused_attn.__file__)"], cwd=tmp,
                               env=env, capture_output=True, text=True, check=True).stdout.strip()
        if not Path(where).resolve().is_relative_to(Path(tmp).resolve()):
            raise SystemExit(f"a copy of the repository imports fused_attn from {where}, not from the copy")


def run_one(m: Mutation | None, tests: tuple[str, ...], timeout: float) -> tuple[str, str]:
    """(status, detail): status KILLED / SURVIVED / ERROR for a mutation, PASSED / FAILED for None."""
    with tempfile.TemporaryDirectory(prefix="fa-mutant-") as tmp:
        copy = Path(tmp)
        copy_repo(ROOT, copy)
        if m is not None:
            apply(copy, m)
        rc, output = run_tests(copy, tests, timeout)
    last = summary_line(output)
    if m is None:
        return ("PASSED" if rc == 0 else "FAILED"), last
    if rc == 1:
        return "KILLED", last
    if rc == 0:
        return "SURVIVED", last
    return "ERROR", f"pytest exit {rc}: {last}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all CPU ones, or all with --gpu)")
    ap.add_argument("--gpu", action="store_true", help="include the GPU-only mutations")
    ap.add_argument("--only-gpu", action="store_true", help="only the GPU-only mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true", help="first check the tests pass unmutated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    ap.add_argument("--jobs", type=int, default=1, help="mutations run side by side (CPU ones only)")
    args = ap.parse_args(argv)

    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown mutation(s): {', '.join(unknown)}")
    if args.names:
        chosen = [known[n] for n in args.names]
    elif args.only_gpu:
        chosen = [m for m in MUTATIONS if m.gpu]
    else:
        chosen = [m for m in MUTATIONS if args.gpu or not m.gpu]

    bad_anchors = [(m, anchor_count(ROOT, m)) for m in chosen if anchor_count(ROOT, m) != 1]
    if args.list:
        for m in chosen:
            print(f"{m.name:<42} {'gpu' if m.gpu else 'cpu'}  {m.path:<26} {' '.join(m.tests)}")
    for m, n in bad_anchors:
        print(f"ANCHOR   {m.name}: found {n} times in {m.path} (must be exactly once): {m.old!r}")
    if args.list:
        return 1 if bad_anchors else 0

    failed = bool(bad_anchors)
    check_copies_are_imported()
    if args.baseline:  # node ids together, test lists with options ("-k ...") one by one
        plain = tuple(dict.fromkeys(t for m in chosen if not any(a.startswith("-") for a in m.tests) for t in m.tests))
        runs = ([plain] if plain else []) + list(dict.fromkeys(
            m.tests for m in chosen if any(a.startswith("-") for a in m.tests)))
        for tests in runs:
            status, detail = run_one(None, tests, args.timeout)
            print(f"BASELINE {status}: {' '.join(tests)[:80]}: {detail}", flush=True)
            if status != "PASSED":
                return 1
    runnable = [m for m in chosen if all(m is not bad for bad, _ in bad_anchors)]

    def timed(m: Mutation) -> tuple[Mutation, str, str, float]:
        t0 = time.perf_counter()
        status, detail = run_one(m, m.tests, args.timeout)
        return m, status, detail, time.perf_counter() - t0

    # GPU mutations share one device and may rebuild the library: one at a time.
    jobs = 1 if any(m.gpu for m in runnable) else max(1, args.jobs)
    counts: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for m, status, detail, seconds in pool.map(timed, runnable):
            failed |= status != "KILLED"
            counts[status] = counts.get(status, 0) + 1
            print(f"{status:<8} {m.name:<42} {seconds:5.1f} s  {detail}", flush=True)
    if bad_anchors:
        counts["ANCHOR"] = len(bad_anchors)
    print(", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "nothing run")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
