"""``sample``: the next token of each row of logits, greedy or sampled, in one launch.

A decode step ends in a reduction over the vocabulary: ``argmax`` (greedy) or a draw from
``softmax(logits / temperature)``, often restricted to the top k. PyTorch's argmax over GPT-2's 50257
logits is one block per row (~13 µs on an H100 at batch 1); sampling is several kernels (scale, rand,
log, argmax). Here both are one kernel (``csrc/sample/``) that splits each row over a cluster of blocks
and draws the sample by the Gumbel-max trick, ``argmax(logits / temperature - log(-log U))``, with U
from a counter-based generator (Philox4x32-10) keyed by ``seed`` and indexed by ``(offset, row,
column)``: no generator state, so the same call replayed in a CUDA graph draws fresh numbers when the
caller advances a device-side ``offset`` tensor, and the CPU path (``fused_attn.reference.sample``)
draws the same numbers as the GPU.

Op (schemas in ``fused_attn/_ops.py``): ``sample(logits, temperature, seed, offset, offsets)`` and
``sample_out(..., *, out, advance=None, history=None, history_index=None)``; ``advance``: a decode
loop's per-row counters, each + 1 in the same launch once its row's token is written; ``history``: a
token-history ``[rows, L]`` into which each row's token is also written, at the column
``history_index[row]`` read from device memory before the row advances its counters (an index outside
[0, L) writes nothing there and -1 into ``out``), so a decode loop replaying a CUDA graph keeps its
tokens without a copy per step. ``top_k`` (sampling only) restricts the draw to the k largest logits and any
equal to the k-th, as Hugging Face's ``TopKLogitsWarper`` does: on CUDA inside the same launch (a radix select
of the k-th largest over the row's blocks, csrc/sample/sample_kernel.cuh), on the CPU as PyTorch ops (topk,
then the logits below the k-th set to -inf): NaN counts as the largest, and a NaN k-th keeps every column.

Gradients: none; the result is an integer index (as ``torch.argmax``'s).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from fused_attn import _ops, reference
from fused_attn.softmax import _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = _DTYPES + (torch.float64,)
MAX_ROWS = 65535  # the kernel's grid: one row per grid row
_INT63 = 2 ** 63


def _check_int_tensor(t, name: str, logits: torch.Tensor, dtypes=(torch.int32, torch.int64)) -> None:
    """offsets / advance / history_index (int32 or int64), out / history (int64): a tensor of ``dtypes`` on
    logits' device (the messages of csrc/sample/sample.cpp)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != logits.device:
        raise ValueError(f"{name} must be on the same device as logits ({logits.device}), got {t.device}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {t.dtype}")


def check_args(logits, temperature, top_k, seed, offset, offsets) -> tuple[float, int, int, int]:
    """Raise TypeError (wrong type) / ValueError (bad value) naming the bad argument (the messages of
    csrc/sample/sample.cpp); return (temperature, top_k, seed, offset) as Python numbers."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    cpu = logits.device.type == "cpu"
    if logits.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"logits must have dtype {names}, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have at least 1 dim [..., vocab], vocab >= 1, got {_shape(logits)}")
    if logits.shape[-1] >= 2 ** 31:
        raise ValueError(f"logits must have a vocab (last dim) below 2**31, got {_shape(logits)}")
    if not cpu and logits.numel() // logits.shape[-1] > MAX_ROWS:
        raise ValueError(f"logits must have at most {MAX_ROWS} rows (product of all dims but the last) on CUDA, "
                         f"got {_shape(logits)}")
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise TypeError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    for name, v, hi in (("top_k", top_k, 2 ** 31), ("seed", seed, _INT63), ("offset", offset, _INT63)):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must be an int in [0, {hi}), got {v!r}")
        if not 0 <= v < hi:
            raise ValueError(f"{name} must be an int in [0, {hi}), got {v!r}")
    if offsets is not None:
        _check_int_tensor(offsets, "offsets", logits)
        rows = logits.numel() // logits.shape[-1]
        if offsets.numel() not in (1, rows):
            raise ValueError(f"offsets must have 1 element or one per row ({rows}), got {_shape(offsets)}")
    return float(temperature), int(top_k), int(seed), int(offset)


def _check_out(out, logits) -> None:
    _check_int_tensor(out, "out", logits, (torch.int64,))
    if tuple(out.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"out must have shape {tuple(logits.shape[:-1])} (logits' without the last dim), "
                         f"got {_shape(out)}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())}")


def _dense(t: torch.Tensor) -> bool:
    """Every element in its own memory and no gaps (ATen's is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's get_overlap_status(a, b) != No within one storage (csrc/sample/sample.cpp: may_overlap)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if not (_dense(a) and _dense(b)):
        return True  # too hard to tell: taken as an overlap
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _own_row(t: torch.Tensor, advance: torch.Tensor, rows: int) -> bool:
    """Whether ``t`` (``rows`` elements) is exactly one of advance's rows: what each row reads from it is
    then its own counter, read before that row advances it (csrc/sample/sample.cpp: own_row)."""
    t1 = t.reshape(-1)
    return (t1.numel() == rows and t1.dtype == advance.dtype and t1.stride(0) == advance.stride(1)
            and any(t1.data_ptr() == advance[i].data_ptr() for i in range(advance.shape[0])))


def _check_advance(advance, logits, offsets, out, storage: bool = True) -> None:
    """sample_out's advance (csrc/sample/sample.cpp: check_advance, same messages); ``storage``: also the
    overlaps with out and offsets (not for meta tensors, which have none)."""
    _check_int_tensor(advance, "advance", logits)
    rows = logits.numel() // logits.shape[-1]
    if advance.dim() != 2 or advance.shape[1] != rows:
        raise ValueError(f"advance must have shape (k, rows) with rows = {rows}, got {_shape(advance)}")
    if advance.numel() > 1 and not _dense(advance):
        raise ValueError("advance must have no two elements in the same memory (one counter each: a dense "
                         f"layout), got strides {tuple(advance.stride())}")
    if not storage:
        return
    if out is not None and _may_overlap(out, advance):
        raise ValueError("out must not overlap advance, got overlapping memory")
    if offsets is not None and rows > 1 and _may_overlap(offsets, advance):
        if not _own_row(offsets, advance, rows):
            raise ValueError("offsets must be one of advance's rows or not overlap it (every row must read its own "
                             "offset before it advances its own counters), got an overlap of another shape")


def _check_history(history, history_index, logits, offsets, out, advance, storage: bool = True) -> None:
    """sample_out's history and history_index (csrc/sample/sample.cpp: check_history, same messages);
    ``storage``: also the overlaps with the other tensors (not for meta tensors, which have none)."""
    if history_index is None:
        raise ValueError("history_index must be given with history, got None")
    if history is None:
        raise ValueError("history must be given with history_index, got None")
    _check_int_tensor(history, "history", logits, (torch.int64,))
    rows = logits.numel() // logits.shape[-1]
    if history.dim() != 2 or history.shape[0] != rows or history.shape[1] < 1:
        raise ValueError(f"history must have shape (rows, L) with rows = {rows} and L >= 1, got {_shape(history)}")
    if not ((history.shape[1] == 1 or history.stride(1) == 1)
            and (rows <= 1 or history.stride(0) >= history.shape[1])):
        raise ValueError("history must have a last dim of stride 1 and rows that do not overlap (stride(0) >= L), "
                         f"got strides {tuple(history.stride())}")
    _check_int_tensor(history_index, "history_index", logits)
    if tuple(history_index.shape) != (rows,):
        raise ValueError(f"history_index must have shape (rows,) with rows = {rows}, got {_shape(history_index)}")
    if not storage:
        return
    for name, other in (("out", out), ("advance", advance), ("logits", logits), ("offsets", offsets),
                        ("history_index", history_index)):
        if other is not None and _may_overlap(history, other):
            raise ValueError(f"history must not overlap {name}, got overlapping memory")
    if out is not None and _may_overlap(history_index, out):
        raise ValueError("history_index must not overlap out, got overlapping memory")
    if advance is not None and rows > 1 and _may_overlap(history_index, advance) and \
            not _own_row(history_index, advance, rows):
        raise ValueError("history_index must be one of advance's rows or not overlap it (every row must read its "
                         "own index before it advances its own counters), got an overlap of another shape")


def _record(tokens: torch.Tensor, history: torch.Tensor, history_index: torch.Tensor) -> torch.Tensor:
    """The CPU path of the kernel's history write: tokens [rows] into history[r, history_index[r]] where
    the index is in [0, L); returns the tokens with -1 where it is not (what out receives)."""
    t = tokens.reshape(-1)
    index = history_index.to(torch.int64)
    ok = (index >= 0) & (index < history.shape[1])
    rows = torch.arange(t.numel())[ok]
    history[rows, index[ok]] = t[ok]
    return torch.where(ok, t, -1).view_as(tokens)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    *,
    top_k: int = 0,
    seed: int = 0,
    offset: int | torch.Tensor = 0,
    out: torch.Tensor | None = None,
    advance: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    history_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits``: ``argmax`` at temperature 0, else a sample of
    ``softmax(logits / temperature)`` over the ``top_k`` largest logits (all with top_k 0).

    Args:
        logits: ``[..., vocab]`` float32, float16 or bfloat16 (float64 on the CPU), any strides (a layout
            without a contiguous last dim is copied once); at most 65535 rows on CUDA.
        temperature: finite, >= 0; 0 is greedy (top_k then changes nothing).
        top_k: 0 (every token) or keep the k largest logits of each row (and any tied with the k-th);
            k >= vocab keeps all. On CUDA in the same launch (no topk kernels).
        seed, offset: the generator's key and counter, ints in [0, 2**63). ``offset`` may instead be an
            int32 / int64 tensor on logits' device with 1 element or one per row, read when the kernel
            runs: a CUDA graph that replays this call draws new numbers when the caller advances it.
            The same (seed, offset, row) gives the same token on the CPU and the GPU (up to the last ulp
            of the logarithms, which can flip a draw between two near-equal perturbed scores).
        out: None, or an int64 contiguous tensor of shape ``logits.shape[:-1]`` written in place.
        advance: None, or int32 / int64 ``[k, rows]`` counters (rows = the product of logits' leading
            dims, one element each): column r += 1 once row r's token is written, in the same launch. A
            decode loop's per-row state (cache length, position, this ``offset``) advanced without an
            add kernel of its own. ``offset`` may be one of its rows (row r reads its offset before it
            advances it), never a single offset that every row reads; ``out`` may not overlap it.
        history, history_index: both None, or both given: ``history`` an int64 ``[rows, L]`` (L >= 1) token
            history on logits' device, last dim of stride 1, rows that do not overlap (stride(0) >= L);
            ``history_index`` int32 / int64 ``[rows]`` (any stride) on the same device. Row r's token is
            also written to ``history[r, history_index[r]]``, the index read when the kernel runs and
            before the row advances its counters: ``history_index`` may be one of ``advance``'s rows (a
            decode loop's cache length: the token goes at the pre-advance column). An index outside
            [0, L) writes nothing into ``history`` and -1 into ``out[r]`` instead of the token (-1 is
            never a token). ``history`` may overlap no other tensor; ``history_index`` may not overlap
            ``out``, nor ``advance`` except as one of its rows.

    Returns int64 ``logits.shape[:-1]`` (``out`` when given; -1 in the rows whose history index is out of
    range). NaN counts as the largest logit and the
    first of equal maxima wins (torch.argmax's rule); a row of -inf gives 0. Launches on the current
    stream, never synchronizes the host, works under CUDA-graph capture and
    ``torch.compile(fullgraph=True)``.
    """
    if (out is None and advance is None and history is None and history_index is None
            and not torch.compiler.is_compiling() and _ops.direct is not None and type(temperature) is float
            and type(top_k) is int and type(seed) is int):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            if type(offset) is int:
                r = _ops.direct.sample(logits, temperature, seed, offset, None, top_k)
            else:
                r = _ops.direct.sample(logits, temperature, seed, 0, offset, top_k)
        except (TypeError, ValueError):
            r = None  # bad input: the checks below raise it
        if r is not None:
            return r
    offsets = offset if isinstance(offset, torch.Tensor) else None
    temperature, top_k, seed, offset = check_args(logits, temperature, top_k, seed, 0 if offsets is not None
                                                  else offset, offsets)
    if out is not None:
        _check_out(out, logits)
    # Overlaps need storage: none on meta tensors, and not traceable (the op's kernel checks them when it runs).
    storage = logits.device.type != "meta" and not torch.compiler.is_compiling()
    if advance is not None:
        _check_advance(advance, logits, offsets, out, storage)
    if history is not None or history_index is not None:
        _check_history(history, history_index, logits, offsets, out, advance, storage)
    if logits.device.type == "cuda":  # meta tensors (and torch.compile's tracing) run the fake kernel: no build
        _ops.ensure_loaded()
    if out is None and advance is None and history is None:
        return torch.ops.fused_attn.sample(logits, temperature, seed, offset, offsets, top_k)
    if out is None:
        out = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    torch.ops.fused_attn.sample_out(logits, temperature, seed, offset, offsets, top_k, out=out, advance=advance,
                                    history=history, history_index=history_index)
    return out


def top_k_filter(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """``logits`` with every logit below the row's top_k-th largest set to -inf, where top_k applies (a draw,
    0 < top_k < vocab): the CPU path's filter, and the definition the CUDA kernel's radix select matches
    (torch.topk's order: NaN largest; ``<`` against a NaN top_k-th is false, so it masks nothing)."""
    if temperature > 0 and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return logits


# --------------------------------------------------------------------------- CPU, fake


def _row_offsets(logits, offset: int, offsets) -> torch.Tensor:
    rows = logits.numel() // logits.shape[-1]
    base = torch.full((rows,), offset, dtype=torch.int64)
    return base if offsets is None else base + offsets.reshape(-1).to(torch.int64).expand(rows)


def _cpu(logits, temperature, seed, offset, offsets, top_k) -> torch.Tensor:
    check_args(logits, temperature, top_k, seed, offset, offsets)
    return reference.sample(top_k_filter(logits, temperature, top_k), temperature, seed,
                            _row_offsets(logits, offset, offsets))


def _register() -> None:
    """CPU and fake kernels of the two ops (schemas: fused_attn/_ops.py), at import: CPU and meta
    tensors never need the CUDA library."""

    @torch.library.register_fake("fused_attn::sample")
    def _fake(logits, temperature, seed, offset, offsets, top_k=0):
        check_args(logits, temperature, top_k, seed, offset, offsets)
        return torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)

    @torch.library.register_fake("fused_attn::sample_out")
    def _fake_out(logits, temperature, seed, offset, offsets, top_k=0, *, out, advance=None, history=None,
                  history_index=None):
        check_args(logits, temperature, top_k, seed, offset, offsets)
        if advance is not None:
            _check_advance(advance, logits, offsets, out, storage=False)
        if history is not None or history_index is not None:
            _check_history(history, history_index, logits, offsets, out, advance, storage=False)

    @torch.library.register_kernel("fused_attn::sample", "cpu")
    def _cpu_kernel(logits, temperature, seed, offset, offsets, top_k=0):
        return _cpu(logits, temperature, seed, offset, offsets, top_k)

    @torch.library.register_kernel("fused_attn::sample_out", "cpu")
    def _cpu_kernel_out(logits, temperature, seed, offset, offsets, top_k=0, *, out, advance=None, history=None,
                        history_index=None):
        _check_out(out, logits)
        if advance is not None:
            _check_advance(advance, logits, offsets, out)
        if history is not None or history_index is not None:
            _check_history(history, history_index, logits, offsets, out, advance)
        tokens = _cpu(logits, temperature, seed, offset, offsets, top_k)
        if history is not None:
            tokens = _record(tokens, history, history_index)
        out.copy_(tokens)  # every offset and history index read before the advance
        if advance is not None:
            advance.add_(1)


_register()
