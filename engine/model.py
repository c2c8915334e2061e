"""Decoder-only Llama built from `parallel/` layers: RMSNorm, RoPE (or ALiBi), SwiGLU, grouped-query attention.

Parameter names and layouts are those of Hugging Face `LlamaForCausalLM` (at TP=1, without vocabulary
padding), so conversion is a rename-free copy; Mistral is the same with `attention_window`, Qwen2 with
`attention_bias` (q/k/v biases). At TP>1 the same classes hold slices; at PP>1 a model
chunk holds a subset of the layers under their global indices. The model issues no collective itself:
only the `parallel.tensor` layers and the `TensorParallel` context do.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.config.schema import ModelConfig
from kernels.attention import alibi_slopes, attention_entropy, causal_attention
from kernels.grad_accumulation import linear
from kernels.norm import rms_norm
from kernels.recompute import check_mode, recompute
from kernels.rope import apply_rope_fused, rope_cos_sin
from kernels.swiglu import swiglu
from parallel import comm
from parallel.context import ContextParallel
from parallel.random import TRACKER
from parallel.tensor import (ColumnParallelLinear, ReplicatedRowsLinear, RowParallelLinear, TensorParallel,
                             VocabParallelEmbedding, describe, divide, initialize_parameters, padded_vocab_size,
                             vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy)


# The dropout tracker's state, replayed by full-block recomputation (kernels/recompute.py).
TRACKER_STATE = (lambda: dict(TRACKER.states), lambda states: setattr(TRACKER, "states", dict(states)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, tp: TensorParallel, backend: str = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend
        # Under sequence parallelism each TP rank sees only its sequence shard: gradients are partial sums.
        self.weight = describe(nn.Parameter(torch.empty(size)), (size,), None, None,
                               tp_replicated_grad=tp.sequence_parallel)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.backend)


class Dropout(nn.Module):
    """Hidden dropout; on sequence-parallel shards each TP rank must draw its own mask."""

    def __init__(self, p: float, tp: TensorParallel):
        super().__init__()
        self.p, self.tp = p, tp

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        fork = TRACKER.fork() if self.tp.sequence_parallel else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.p, training=True)


def _scaled_std(cfg: ModelConfig) -> float:
    return cfg.init_std * (8 * cfg.num_layers) ** -0.25 if cfg.deepnorm_init else cfg.init_std


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel):
        super().__init__()
        self.cfg, self.tp, self.cp = cfg, tp, cp
        d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.kv_heads
        self.local_heads = divide(heads, tp.size, "model.num_attention_heads")
        residual_std = _scaled_std(cfg)
        bias = cfg.attention_bias
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * d, tp, cfg.init_std, bias=bias)
        if kv >= tp.size:
            self.local_kv_heads = divide(kv, tp.size, "model.num_kv_heads")
            self.k_proj = ColumnParallelLinear(cfg.hidden_size, kv * d, tp, cfg.init_std, bias=bias)
            self.v_proj = ColumnParallelLinear(cfg.hidden_size, kv * d, tp, residual_std, bias=bias)
        else:  # fewer KV heads than TP ranks: every rank keeps all of them and uses the one its queries need
            self.local_kv_heads = 1
            head = tp.rank * kv // tp.size
            rows = slice(head * d, (head + 1) * d)
            self.k_proj = ReplicatedRowsLinear(cfg.hidden_size, kv * d, tp, cfg.init_std, rows, bias=bias)
            self.v_proj = ReplicatedRowsLinear(cfg.hidden_size, kv * d, tp, residual_std, rows, bias=bias)
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, tp, residual_std)
        self.recompute_core = False  # selective recomputation: keep no attention-core activations
        self.entropy_log: list | None = None  # when a list: (entropy sum, count) of each forward (monitoring)
        # ALiBi slopes of this rank's heads, kept in fp32 (not a buffer: model.to(bf16) would round them).
        first = tp.rank * self.local_heads
        self.slopes = alibi_slopes(heads)[first:first + self.local_heads] \
            if cfg.position_embedding == "alibi" else None

    def _apply(self, fn, recurse=True):
        # model.to(device, dtype) moves the ALiBi slopes to the device but keeps them in fp32.
        super()._apply(fn, recurse)
        if self.slopes is not None:
            self.slopes = self.slopes.to(fn(torch.empty(0)).device)
        return self

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries, keys and values [b, heads, s, head_dim] of the hidden states `x`."""
        x = self.tp.enter(x)
        b, s, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, s, self.local_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.local_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.local_kv_heads, d).transpose(1, 2)
        return q, k, v

    def forward(self, x, rope, segment_ids=None):
        q, k, v = self.project(x)
        b, _, s, d = q.shape
        slopes = None
        if self.cfg.position_embedding == "rope":
            cos, sin = rope
            q, k = apply_rope_fused(q, cos, sin), apply_rope_fused(k, cos, sin)
        else:
            slopes = self.slopes
        if self.entropy_log is not None and self.cp.size > 1:  # every key is on some CP rank
            self.entropy_log.append(self.cp.attention_entropy(q, k, self.cfg.attention_window, segment_ids, slopes))
        elif self.entropy_log is not None:
            self.entropy_log.append(attention_entropy(q, k, window=self.cfg.attention_window,
                                                      segment_ids=segment_ids, slopes=slopes))
        p = self.cfg.attention_dropout if self.training else 0.0
        if self.cp.size > 1:  # keys and values of the other CP ranks' chunks (parallel/context.py)
            core = functools.partial(self.cp.attention, window=self.cfg.attention_window, segment_ids=segment_ids,
                                     backend=self.cfg.attention_backend, dropout_p=p, slopes=slopes)
        else:
            core = functools.partial(causal_attention, dropout_p=p, backend=self.cfg.attention_backend,
                                     slopes=slopes, window=self.cfg.attention_window, segment_ids=segment_ids)
        # The tracker is forked outside the recomputed region, so the replay restores the forked state.
        with TRACKER.fork() if p > 0 else contextlib.nullcontext():
            out = recompute(core, q, k, v) if self.recompute_core and torch.is_grad_enabled() else core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.local_heads * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        std = _scaled_std(cfg)
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp, std)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp, std)
        self.down_proj = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp, std)

    def forward(self, x):
        x = self.tp.enter(x)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp, cfg.norm_backend)
        self.self_attn = Attention(cfg, tp, cp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp, cfg.norm_backend)
        self.mlp = MLP(cfg, tp)
        self.dropout = Dropout(cfg.hidden_dropout, tp)
        self.recompute_block = False
        self.body = self._body  # replaced by a compiled version by CausalLM.compile_blocks

    def _body(self, x, rope, segment_ids):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), rope, segment_ids))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))

    def forward(self, x, rope, segment_ids=None):
        if self.recompute_block and torch.is_grad_enabled():
            return recompute(self.body, x, rope, segment_ids, extra_state=TRACKER_STATE)
        return self.body(x, rope, segment_ids)


class Backbone(nn.Module):
    """Hugging Face's `model.` prefix: embeddings, layers and final norm (each present only on its stage)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel, layer_ids, pre_process: bool,
                 post_process: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.init_std) \
            if pre_process else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, tp, cp) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp, cfg.norm_backend) if post_process else None


class CausalLM(nn.Module):
    """One model chunk: the whole model by default, or the layers `layer_ids` of a pipeline stage. Under
    context parallelism (`cp`) it runs on this rank's chunks of each sequence (parallel/context.py)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, layer_ids=None,
                 pre_process: bool = True, post_process: bool = True, cp: ContextParallel | None = None):
        super().__init__()
        tp, cp = tp or TensorParallel(), cp or ContextParallel()
        self.cfg, self.tp, self.cp = cfg, tp, cp
        self.pre_process, self.post_process = pre_process, post_process
        layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        self.model = Backbone(cfg, tp, cp, layer_ids, pre_process, post_process)
        self.embed_dropout = Dropout(cfg.hidden_dropout, tp)
        self.lm_head = None
        if post_process and not (cfg.tie_embeddings and pre_process):
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, padded_vocab_size(cfg.vocab_size, tp.size), tp,
                                                cfg.init_std, valid_rows=cfg.vocab_size)
            if cfg.tie_embeddings:  # a separate copy on the last stage that must start equal to the embedding
                self.lm_head.weight.init_name = "model.embed_tokens.weight"
                self.lm_head.weight.pipeline_duplicate = True
        self._rope_cache: dict = {}
        self.loss_compile_backend: str | None = None  # set by compile_blocks

    def init_weights(self, seed: int) -> None:
        initialize_parameters(self, seed, self.tp)

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation per block: none, selective (attention core only) or full; switchable
        between steps (train.recompute_switch_step)."""
        check_mode(mode)
        for layer in self.model.layers.values():
            layer.recompute_block = mode == "full"
            layer.self_attn.recompute_core = mode == "selective"

    def capture_attention_entropy(self, on: bool) -> None:
        """Start (clearing) or stop recording each layer's attention entropy on forward (engine/observe/monitor.py)."""
        for layer in self.model.layers.values():
            layer.self_attn.entropy_log = [] if on else None

    def attention_entropy_sums(self) -> dict[int, tuple[float, int]]:
        """{global layer index: (entropy sum, count)} recorded since capture_attention_entropy(True)."""
        sums = {}
        for i, layer in self.model.layers.items():
            log = layer.self_attn.entropy_log
            sums[int(i)] = (sum(e for e, _ in log), sum(c for _, c in log))
        return sums

    def compile_blocks(self, backend: str = "inductor") -> None:
        """torch.compile each block's body (one graph per block, reused by every layer of the same shape) and
        the cross-entropy's per-chunk kernels."""
        for layer in self.model.layers.values():
            layer.body = torch.compile(layer._body, backend=backend)
        self.loss_compile_backend = backend

    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight

    def _rope(self, seq_length: int, device, dtype):
        key = (seq_length, device, dtype)
        if key not in self._rope_cache:
            self._rope_cache = {key: rope_cos_sin(seq_length, self.cfg.head_dim, self.cfg.rope_theta, device, dtype,
                                                  self.cfg.rope_scaling)}
        return self._rope_cache[key]

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, segment_ids=None,
                position_ids=None, loss_mask=None):
        """inputs: token ids [b, s] on the first stage, else hidden states [b, s(/tp), h]. Optional, for
        documents packed into one sample (data/documents.py), each [b, s] over the full sequence:
        segment_ids (attention never crosses a document boundary), position_ids (RoPE positions),
        loss_mask (1 = trained on; the loss is the mean over those tokens).

        Returns hidden states (not last stage), this rank's logits slice [b, s, V_padded/tp] (no labels), or
        the mean token loss (labels given)."""
        if self.pre_process:
            x = self.embed_dropout(self.model.embed_tokens(inputs))
        else:
            x = inputs
        full_seq = x.shape[1] * (self.tp.size if self.tp.sequence_parallel else 1) * self.cp.size
        dtype = x.dtype if x.is_floating_point() else torch.float32
        rope = self._rope(full_seq, x.device, dtype) if self.cfg.position_embedding == "rope" else None
        if rope is not None and position_ids is None and self.cp.size > 1:
            position_ids = self.cp.positions(full_seq, x.device)[None]
        if rope is not None and position_ids is not None:  # per-token angles, broadcast over the heads
            rope = tuple(table[position_ids].unsqueeze(1) for table in rope)
        for layer in self.model.layers.values():
            x = layer(x, rope, segment_ids)
        if not self.post_process:
            return x
        hidden = self.tp.enter(self.model.norm(x))
        if labels is None:
            return F.linear(hidden, self.output_weight())
        if self.cfg.fused_lm_head_loss:
            losses = vocab_parallel_linear_cross_entropy(hidden, self.output_weight(), labels, self.tp,
                                                         self.cfg.vocab_size, self.cfg.loss_chunk_tokens,
                                                         self.loss_compile_backend)
        else:
            losses = vocab_parallel_cross_entropy(linear(hidden, self.output_weight()), labels, self.tp,
                                                  self.cfg.vocab_size, self.cfg.loss_chunk_tokens,
                                                  self.loss_compile_backend)
        if self.cp.size > 1:
            return self.cp.mean_loss(losses, loss_mask)
        if loss_mask is None:
            return losses.mean()
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Gather the vocabulary slices and drop the padding (generation, evaluation, tests)."""
        return comm.gather_from_last_dim(local_logits, self.tp.group)[..., : self.cfg.vocab_size]


def layer_parameters(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h + (q + 2 * kv if cfg.attention_bias else 0)


def num_parameters(cfg: ModelConfig) -> int:
    h, v = cfg.hidden_size, cfg.vocab_size
    return cfg.num_layers * layer_parameters(cfg) + v * h * (1 if cfg.tie_embeddings else 2) + h
