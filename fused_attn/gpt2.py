"""A compact GPT-2 with a static KV cache and a CUDA-graph decode step.

    from fused_attn.gpt2 import GPT2, load_hf_model
    model = GPT2.from_hf(load_hf_model("gpt2-random"), dtype=torch.float16, device="cuda")
    tokens = model.generate(prompt_ids, attention_mask, max_new_tokens=128, use_graph=True)

Pre-LN blocks, Conv1D-style linear layers (x @ W + b), tanh GELU and an lm_head tied to
the token embedding, loaded from any transformers ``GPT2LMHeadModel``. Attention in
prefill and decode is Q·Kᵀ (cuBLAS) → ``scaled_masked_softmax`` → P·V.

KV cache ``[layers, batch, nheads, max_len, headdim]``, preallocated. Prompts are left
padded (``attention_mask`` 0 on the left); positions follow transformers' generate()
(cumulative sum of the mask), so greedy tokens match Hugging Face's. The decode step
(embed the last token at a device-side position, append K/V at a device-side slot,
attend over the cache with unfilled and padded slots masked, MLP, logits, next token)
has only device-side state, so it is captured once in a CUDA graph and replayed per
token with no host synchronization and no Python per layer. The prefill is captured too,
once per prompt shape (its ~180 launches from Python dominate the time to first token).
The host reads the tokens back every ``sync_every`` steps to stop at EOS.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fused_attn.softmax import scaled_masked_softmax

RANDOM_NAME = "gpt2-random"


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    n_positions: int
    eps: float


def load_hf_model(name_or_path: str = RANDOM_NAME, seed: int = 0):
    """``gpt2-random``: GPT-2 small's configuration (124M parameters) with seeded random
    weights (no download needed); anything else goes to ``GPT2LMHeadModel.from_pretrained``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if name_or_path == RANDOM_NAME:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return GPT2LMHeadModel(GPT2Config()).eval()
    return GPT2LMHeadModel.from_pretrained(name_or_path).eval()


class GPT2(torch.nn.Module):
    def __init__(self, config: Config, params: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        for name, t in params.items():
            self.register_buffer(name.replace(".", "_"), t, persistent=False)
        # One decode state (KV cache, masks) and one captured graph per (batch, max_len,
        # temperature, top_k): a later generate() of the same shape reuses both.
        self._states: dict[tuple, _DecodeState] = {}
        self.annotate = False
        self._graphs: dict[tuple, _DecodeGraph] = {}

    @classmethod
    def from_hf(cls, hf_model, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "GPT2":
        """Weights of a transformers GPT2LMHeadModel (object, hub name or local path)."""
        if isinstance(hf_model, str):
            hf_model = load_hf_model(hf_model)
        c = hf_model.config
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(c, flag, False):
                raise ValueError(f"hf_model.config.{flag} must be False for fused_attn.gpt2, got True")
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hf_model.config.activation_function must be gelu_new, got {c.activation_function}")
        config = Config(c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions, c.layer_norm_epsilon)
        sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
        keep = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
        for i in range(config.n_layer):
            keep += [f"h.{i}.{n}" for n in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                                            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]
        params = {k: sd[k].detach().to(device=device, dtype=dtype).contiguous() for k in keep}
        return cls(config, params)

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "_"))

    @property
    def dtype(self) -> torch.dtype:
        return self.p("wte.weight").dtype

    @property
    def device(self) -> torch.device:
        return self.p("wte.weight").device

    # ------------------------------------------------------------------ blocks
    def scope(self, name: str):
        """A profiler label around a part of the model (fused_attn.profile turns them on;
        off, they cost nothing, and a captured graph never contains them)."""
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _block(self, i: int, x: torch.Tensor, attend) -> torch.Tensor:
        c = self.config
        pre = f"h.{i}."
        b, s = x.shape[0], x.shape[1]
        with self.scope("ln_1"):
            h = F.layer_norm(x, (c.n_embd,), self.p(pre + "ln_1.weight"), self.p(pre + "ln_1.bias"), c.eps)
        with self.scope("attention"):
            qkv = torch.addmm(self.p(pre + "attn.c_attn.bias"), h.flatten(0, -2), self.p(pre + "attn.c_attn.weight"))
            q, k, v = qkv.view(b, s, 3, c.n_head, c.n_embd // c.n_head).permute(2, 0, 3, 1, 4).unbind(0)
            a = attend(i, q, k, v)  # [b, heads, s, d]
            a = torch.addmm(self.p(pre + "attn.c_proj.bias"), a.transpose(1, 2).reshape(b * s, c.n_embd),
                            self.p(pre + "attn.c_proj.weight"))
        with self.scope("residual"):
            x = x + a.view(b, s, -1)
        with self.scope("ln_2"):
            h = F.layer_norm(x, (c.n_embd,), self.p(pre + "ln_2.weight"), self.p(pre + "ln_2.bias"), c.eps)
        with self.scope("mlp"):
            h = F.gelu(torch.addmm(self.p(pre + "mlp.c_fc.bias"), h.flatten(0, -2), self.p(pre + "mlp.c_fc.weight")),
                       approximate="tanh")
            h = torch.addmm(self.p(pre + "mlp.c_proj.bias"), h, self.p(pre + "mlp.c_proj.weight"))
        with self.scope("residual"):
            return x + h.view(b, s, -1)

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with self.scope("embeddings"):
            return self.p("wte.weight")[ids] + self.p("wpe.weight")[pos]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        with self.scope("ln_f"):
            x = F.layer_norm(x, (c.n_embd,), self.p("ln_f.weight"), self.p("ln_f.bias"), c.eps)
        with self.scope("lm_head"):
            return x @ self.p("wte.weight").t()

    @staticmethod
    def positions(attention_mask: torch.Tensor) -> torch.Tensor:
        """transformers' generate() positions for left padding: cumsum(mask) - 1, pads at 1."""
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.masked_fill(attention_mask == 0, 1)

    def prompt_pass(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states ``[batch, seqlen, n_embd]`` of a causal pass over left-padded prompts;
        with ``kv`` = (k cache, v cache) ``[layers, batch, heads, max_len, headdim]`` it also stores
        each layer's keys and values in the first seqlen slots."""
        scale = (self.config.n_embd // self.config.n_head) ** -0.5
        keys_ok = attention_mask.bool()[:, None, None, :]
        s = input_ids.shape[1]
        x = self._embed(input_ids, self.positions(attention_mask))

        def attend(i, q, k, v):
            if kv is not None:
                kv[0][i, :, :, :s] = k
                kv[1][i, :, :, :s] = v
            probs = scaled_masked_softmax(q @ k.transpose(-1, -2), scale, causal=True, attn_mask=keys_ok)
            return probs @ v

        for i in range(self.config.n_layer):
            x = self._block(i, x, attend)
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seqlen, vocab]`` of a full (teacher-forced) pass, no cache."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self._logits(self.prompt_pass(input_ids, attention_mask))

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        eos_token_id: int | None = None,
        use_graph: bool = True,
        sync_every: int = 16,
        seed: int = 0,
        timings: dict | None = None,
    ) -> torch.Tensor:
        """Prompt ``[batch, seqlen]`` (left padded per ``attention_mask``) followed by up to
        ``max_new_tokens`` tokens; greedy when temperature == 0, else softmax sampling at that
        temperature (top_k > 0 keeps the k largest logits). After a sequence emits
        ``eos_token_id`` it is filled with it; generation stops early when all have.

        ``timings``, if given, receives ``ttft_s`` (prompt in to first token out) and ``step_s``
        (each further token, from one token out to the next), both from CUDA events recorded on the
        stream at the call's start and after each token (the host clock on the CPU), and ``marks``:
        those events (host clock readings), the start first, so a caller can time the call's tail
        with a mark of its own."""
        c = self.config
        b, s = input_ids.shape
        if input_ids.device != self.device:
            raise ValueError(f"input_ids must be on the model's device ({self.device}), got {input_ids.device}")
        total = s + max_new_tokens
        if total > c.n_positions:
            raise ValueError(f"prompt length + max_new_tokens must be <= n_positions ({c.n_positions}), got {total}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        use_graph = use_graph and self.device.type == "cuda"
        key = (b, total, float(temperature), int(top_k))
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _DecodeState(self, b, total, temperature, top_k)
        cuda = self.device.type == "cuda"
        marks: list = []  # token boundaries: CUDA events, or host clock readings on the CPU

        def mark():
            if cuda:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            else:
                marks.append(time.perf_counter())

        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.manual_seed(seed)
            if cuda:
                torch.cuda.synchronize()
            mark()
            if use_graph:  # the prefill is host-bound (~180 launches): replay it as one graph too
                pg = state.prefill_graphs.get(s)
                if pg is None:
                    pg = state.prefill_graphs[s] = _PrefillGraph(state, input_ids, attention_mask)
                first = pg.run(input_ids, attention_mask)
            else:
                first = state.prefill(input_ids, attention_mask)
            mark()
            if cuda:
                torch.cuda.synchronize()
            if use_graph:
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._graphs[key] = _DecodeGraph(state)
                step = graph.replay
            else:
                step = state.step
            out = [first]
            done_at = None
            for t in range(1, max_new_tokens):
                step()
                out.append(state.token.clone())
                mark()
                if eos_token_id is not None and t % sync_every == 0:
                    if bool((torch.stack(out, 1) == eos_token_id).any(1).all()):
                        done_at = t + 1
                        break
        if timings is not None:
            if cuda:
                torch.cuda.synchronize()
                gaps = [a.elapsed_time(z) * 1e-3 for a, z in zip(marks, marks[1:])]
            else:
                gaps = [z - a for a, z in zip(marks, marks[1:])]
            timings.update(marks=marks, ttft_s=gaps[0], step_s=gaps[1:])
        gen = torch.stack(out, 1)[:, :done_at]
        if eos_token_id is not None:
            hit = (gen == eos_token_id).long().cumsum(1) > 0
            after = torch.cat([torch.zeros_like(hit[:, :1]), hit[:, :-1]], 1)
            gen = gen.masked_fill(after, eos_token_id)
        return torch.cat([input_ids, gen], 1)


class _DecodeState:
    """Device-side state of one generation: KV cache, masks, positions, the last token."""

    def __init__(self, model: GPT2, batch: int, max_len: int, temperature: float, top_k: int):
        c = model.config
        d = c.n_embd // c.n_head
        dev, dt = model.device, model.dtype
        self.model, self.batch, self.max_len = model, batch, max_len
        self.temperature, self.top_k = temperature, top_k
        self.sampling = temperature > 0
        self.k = torch.zeros(c.n_layer, batch, c.n_head, max_len, d, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.keys_ok = torch.zeros(batch, max_len, dtype=torch.bool, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # cache column of the next token
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)  # its position id
        self.token = torch.zeros(batch, dtype=torch.long, device=dev)
        self.scale = d ** -0.5
        self.prefill_graphs: dict[int, _PrefillGraph] = {}  # by prompt length

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.k, self.v, self.keys_ok, self.slot, self.pos, self.token)

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.sampling:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits); capturable in a graph.
        # The default generator: CUDA graphs advance its offset on every replay.
        u = torch.rand(logits.shape, device=logits.device).clamp_(1e-20, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = self.model
        s = input_ids.shape[1]
        self.keys_ok.zero_()
        self.keys_ok[:, :s] = attention_mask.bool()
        x = m.prompt_pass(input_ids, attention_mask, kv=(self.k, self.v))
        self.token.copy_(self.next_token(m._logits(x[:, -1])))
        self.slot.fill_(s)
        self.pos.copy_(GPT2.positions(attention_mask)[:, -1] + 1)
        return self.token.clone()

    @torch.no_grad()
    def step(self) -> None:
        """One decode step, device-side state only (capturable)."""
        m = self.model
        self.keys_ok.index_fill_(1, self.slot, True)
        x = m._embed(self.token, self.pos)[:, None]
        keys_ok = self.keys_ok[:, None, None, :]

        def attend(i, q, k, v):
            self.k[i].index_copy_(2, self.slot, k)
            self.v[i].index_copy_(2, self.slot, v)
            probs = scaled_masked_softmax(q @ self.k[i].transpose(-1, -2), self.scale, attn_mask=keys_ok)
            return probs @ self.v[i]

        for i in range(m.config.n_layer):
            x = m._block(i, x, attend)
        self.token.copy_(self.next_token(m._logits(x[:, 0])))
        self.slot.add_(1)
        self.pos.add_(1)


def _capture(state: _DecodeState, fn):
    """Warm ``fn`` up on a side stream, undo its effect on the state, then capture it."""
    saved = [t.clone() for t in state.buffers()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # allocator, cuBLAS workspaces, our library
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for dst, src in zip(state.buffers(), saved):
        dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run
        result = fn()
    return graph, result


class _PrefillGraph:
    """The prefill of one prompt shape, captured with its own input buffers."""

    def __init__(self, state: _DecodeState, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.ids, self.mask = input_ids.clone(), attention_mask.clone()
        self.graph, self.first = _capture(state, lambda: state.prefill(self.ids, self.mask))

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(input_ids)
        self.mask.copy_(attention_mask)
        self.graph.replay()
        return self.first.clone()


class _DecodeGraph:
    """The decode step of one _DecodeState, captured once; each replay advances that state."""

    def __init__(self, state: _DecodeState):
        self.graph, _ = _capture(state, state.step)

    def replay(self) -> None:
        self.graph.replay()
