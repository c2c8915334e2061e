"""A CPU double of flash-attn 2 for tests of how Trilith calls it."""
import torch


class FlashAttnDouble:
    """flash-attn 2's two entry points with their real signatures and layout rules ([b, s, h, d] or varlen
    [total, h, d] with int32 `cu_seqlens` and int maxima; GQA by head groups; `window_size=(left, right)`;
    ALiBi as -slope * |i - j| from fp32 slopes), computed by explicit loops so that CPU tests can check
    how `attention_flash` calls the library: transposes, flattening, window and slope conventions."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _one_sequence(q, k, v, causal, window_size, alibi_slopes):
        s, groups = q.shape[0], q.shape[1] // k.shape[1]
        rows = []
        for i in range(s):
            keys = [j for j in range(s) if (not causal or j <= i)
                    and (window_size[0] < 0 or j >= i - window_size[0])
                    and (window_size[1] < 0 or j <= i + window_size[1])]
            heads = []
            for h in range(q.shape[1]):
                scores = (k[keys, h // groups].float() @ q[i, h].float()) / q.shape[-1] ** 0.5
                if alibi_slopes is not None:
                    scores = scores - alibi_slopes[h] * torch.tensor([abs(i - j) for j in keys], dtype=torch.float32)
                heads.append((torch.softmax(scores, -1) @ v[keys, h // groups].float()).to(q.dtype))
            rows.append(torch.stack(heads))
        return torch.stack(rows)

    def _check(self, q, k, v, dropout_p, causal, alibi_slopes, softmax_scale):
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "flash-attn needs a contiguous last dimension"
        assert q.shape[-2] % k.shape[-2] == 0 and k.shape == v.shape and q.shape[-1] == k.shape[-1]
        assert dropout_p == 0.0 and causal and softmax_scale is None
        assert alibi_slopes is None or (alibi_slopes.dtype == torch.float32 and alibi_slopes.shape == (q.shape[-2],))

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        self._check(q, k, v, dropout_p, causal, alibi_slopes, softmax_scale)
        assert q.dim() == 4 and q.shape[:2] == k.shape[:2], "flash_attn_func takes [batch, seq, heads, dim]"
        self.calls.append(("dense", window_size))
        return torch.stack([self._one_sequence(q[b], k[b], v[b], causal, window_size, alibi_slopes)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        self._check(q, k, v, dropout_p, causal, alibi_slopes, softmax_scale)
        assert q.dim() == 3, "flash_attn_varlen_func takes [total tokens, heads, dim]"
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and int(cu_seqlens_q[-1]) == q.shape[0]
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert isinstance(max_seqlen_q, int) and max_seqlen_q == max_seqlen_k == max(lengths)
        self.calls.append(("varlen", window_size, lengths))
        bounds = cu_seqlens_q.tolist()
        return torch.cat([self._one_sequence(q[lo:hi], k[lo:hi], v[lo:hi], causal, window_size, alibi_slopes)
                          for lo, hi in zip(bounds[:-1], bounds[1:])])
