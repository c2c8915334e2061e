"""Text generation from a whole-model `CausalLM` (one pipeline stage; any tensor-parallel size without
sequence parallelism), with a KV cache so each new token costs one position's forward, not the prefix's.

`generate` is what tools/generate.py and the training diary (engine/observe/diary.py) call. The cached forward
(`forward_cached`) reuses the model's own modules (norms, projections, RoPE tables, MLP, output layer)
and differs from `CausalLM.forward` only in keeping the keys and values of earlier positions; with
`use_cache=False` every token re-runs the plain forward over the whole sequence, which the tests hold the
cached tokens against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.rope import apply_rope_fused, rope_cos_sin


@dataclass
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; otherwise softmax(logits / T) cut to the smallest
    set of tokens whose probability reaches top_p, drawn with a generator seeded by `seed`."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs max_new_tokens ≥ 0, temperature ≥ 0 and 0 < top_p ≤ 1, got "
                             f"{self.max_new_tokens}, {self.temperature}, {self.top_p}")


def _attend(attn, x, rope, start: int, cache: list | None):
    """Attention of the new positions [start, start + n) over the cached ones and themselves."""
    q, k, v = attn.project(x)
    b, _, n, d = q.shape
    if rope is not None:
        cos, sin = rope[0][start:start + n], rope[1][start:start + n]
        q, k = apply_rope_fused(q, cos, sin), apply_rope_fused(k, cos, sin)
    if cache is not None:
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
    distance = (torch.arange(start, start + n, device=x.device)[:, None]
                - torch.arange(k.shape[2], device=x.device)[None, :])
    allowed = distance >= 0
    if attn.cfg.attention_window > 0:
        allowed &= distance < attn.cfg.attention_window
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=x.device).masked_fill(~allowed, float("-inf"))
    if attn.slopes is not None:  # ALiBi: a penalty growing with the distance, per head
        bias = bias - attn.slopes.to(x.device)[:, None, None] * distance.clamp(min=0)
    group = attn.local_heads // attn.local_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, attn.local_heads * d))


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, start: int, caches: dict, rope) -> torch.Tensor:
    """Full-vocabulary logits [b, n, V] of the tokens at positions [start, start + n), given (and
    extending) the per-layer KV caches of positions [0, start)."""
    x = model.model.embed_tokens(tokens)
    for i, layer in model.model.layers.items():
        x = x + _attend(layer.self_attn, layer.input_layernorm(x), rope, start, caches.setdefault(i, []))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = model.tp.enter(model.model.norm(x))
    return model.full_logits(F.linear(hidden, model.output_weight()))


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from the last position's logits [V]."""
    logits = logits.float()
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # the mass of the tokens ranked above each one
        sorted_probs[before >= sampling.top_p] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model, prompt: list[int], sampling: Sampling, eod_id: int | None = None, max_length: int = 0,
             use_cache: bool = True) -> list[int]:
    """The new tokens after `prompt` (without the end-of-document token that stopped them). Stops after
    sampling.max_new_tokens, at `eod_id`, or when the sequence reaches `max_length` positions (default:
    the model's max_position_embeddings, else seq_length). Every TP rank must call it with the same
    arguments: all of them then pick the same tokens."""
    sampling.check()
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    cfg = model.cfg
    limit = max_length or cfg.max_position_embeddings or cfg.seq_length
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens, the model's limit is {limit} positions")
    model.eval()
    device = model.output_weight().device
    dtype = model.output_weight().dtype
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    rope = rope_cos_sin(limit, cfg.head_dim, cfg.rope_theta, device, dtype, cfg.rope_scaling) \
        if cfg.position_embedding == "rope" else None
    tokens, new, caches = list(prompt), [], {}
    pending = torch.tensor([prompt], device=device)
    while len(new) < sampling.max_new_tokens and len(tokens) < limit:
        if use_cache:
            logits = forward_cached(model, pending, len(tokens) - pending.shape[1], caches, rope)
        else:
            logits = model.full_logits(model(torch.tensor([tokens], device=device)))
        token = choose(logits[0, -1], sampling, generator)
        if token == eod_id:
            break
        tokens.append(token)
        new.append(token)
        pending = torch.tensor([[token]], device=device)
    return new
