"""fused_attn: fused CUDA kernels for transformer inference, as PyTorch ops.

    import fused_attn
    p = fused_attn.scaled_masked_softmax(scores, headdim ** -0.5, causal=True)

``torch.ops.fused_attn.*`` exist from import on (schemas: ``fused_attn._ops``): CPU tensors
run a pure-PyTorch path with the same semantics and meta tensors (``torch.compile`` tracing)
the fake kernels, with no build; the CUDA library is compiled and loaded on the first
CUDA call (see ``fused_attn.build``).
"""

from fused_attn._ops import ensure_loaded as load
from fused_attn.attention import Attention, attention
from fused_attn.decode_attention import decode_attention
from fused_attn.layer_norm import layer_norm, rms_norm
from fused_attn.linear import linear
from fused_attn.mlp import mlp
from fused_attn.qkv_decode_attention import qkv_decode_attention
from fused_attn.sample import sample
from fused_attn.softmax import scaled_masked_softmax, scaled_masked_softmax_backward

__all__ = ["Attention", "attention", "decode_attention", "layer_norm", "linear", "load", "mlp", "qkv_decode_attention",
           "rms_norm", "sample", "scaled_masked_softmax", "scaled_masked_softmax_backward"]
__version__ = "0.1.0"
