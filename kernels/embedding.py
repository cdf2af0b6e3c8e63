"""Embedding of a decode step's input tokens, read through its rows (the token each row sampled last):
out[b] = weight[tokens[rows[b]]], without a gather kernel before it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_enabled

_BLOCK = 1024


@triton.jit
def _embed_rows_kernel(
    weight_ptr, tokens_ptr, rows_ptr, out_ptr, stride_w, stride_out, hidden, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    token = tl.load(tokens_ptr + tl.load(rows_ptr + b)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    values = tl.load(weight_ptr + token * stride_w + cols, mask=mask)
    tl.store(out_ptr + b.to(tl.int64) * stride_out + cols, values, mask=mask)


def embed_rows_triton(weight: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if weight.stride(-1) != 1:
        raise ValueError(f"embed_rows needs a unit stride on the hidden dim, got {weight.stride()}")
    hidden = weight.shape[1]
    out = torch.empty((rows.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    _embed_rows_kernel[(rows.shape[0], triton.cdiv(hidden, _BLOCK))](
        weight, tokens, rows, out, weight.stride(0), out.stride(0), hidden, BLOCK=_BLOCK, PDL=pdl_enabled(weight.device)
    )
    return out


def embed_rows(weight: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight[tokens[rows[b]]] for every b: [B, H]. Token ids must be in [0, V) (the sampler's draws are)."""
    return embed_rows_triton(weight, tokens, rows) if weight.is_cuda else F.embedding(tokens[rows], weight)
