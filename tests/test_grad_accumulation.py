"""kernels/grad_accumulation.py: a marked weight's gradient is added into its `.grad` by the layer itself. Into a
zeroed `.grad` that is bit-equal to plain autograd; over micro-batches it is the same sum up to the rounding of
the matmul's running additions; unmarked weights, a missing `.grad` and `torch.autograd.grad` get plain autograd."""
import pytest
import torch
import torch.nn.functional as F

from engine.config.schema import ModelConfig
from engine.model import CausalLM
from kernels.grad_accumulation import embedding, linear

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def marked(*shape, dtype=torch.float32, seed=0):
    weight = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    weight.grad = torch.zeros_like(weight)
    weight.fuse_grad_accumulation = True
    return weight


def inputs(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_adds_into_grad_bit_equal_once_and_close_over_micro_batches(dtype):
    weight, bias = marked(48, 32, dtype=dtype), torch.nn.Parameter(torch.zeros(48, dtype=dtype))
    plain_weight = torch.nn.Parameter(weight.detach().clone())
    grad_storage = weight.grad
    for step in range(4):
        x = inputs(step, 3, 20, 32, dtype=dtype)
        x_plain = x.detach().clone().requires_grad_()
        upstream = torch.randn(3, 20, 48, generator=torch.Generator().manual_seed(10 + step)).to(dtype)
        linear(x, weight, bias).backward(upstream)
        F.linear(x_plain, plain_weight, bias.detach()).backward(upstream)
        assert torch.equal(x.grad, x_plain.grad)
        if step == 0:  # 0 + x = x
            assert torch.equal(weight.grad, plain_weight.grad)
    assert weight.grad is grad_storage  # added in place, never replaced
    scale = plain_weight.grad.abs().max().item()
    assert (weight.grad.float() - plain_weight.grad.float()).abs().max().item() <= TOL[dtype] * scale


def test_linear_bias_gradient_is_plain_autograds():
    weight, bias = marked(8, 6), torch.nn.Parameter(torch.randn(8))
    plain_weight, plain_bias = (torch.nn.Parameter(t.detach().clone()) for t in (weight, bias))
    x = inputs(1, 5, 6)
    linear(x, weight, bias).pow(2).sum().backward()
    F.linear(x.detach(), plain_weight, plain_bias).pow(2).sum().backward()
    assert torch.equal(bias.grad, plain_bias.grad) and torch.equal(weight.grad, plain_weight.grad)


def test_embedding_adds_the_rows_it_read():
    weight = marked(50, 8)
    plain = torch.nn.Parameter(weight.detach().clone())
    ids = torch.tensor([[3, 7, 3, 49], [0, 7, 7, 1]])
    upstream = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    embedding(ids, weight).backward(upstream)
    F.embedding(ids, plain).backward(upstream)
    assert torch.equal(weight.grad, plain.grad)
    embedding(ids, weight).backward(upstream)
    assert torch.allclose(weight.grad, 2 * plain.grad)


def test_unmarked_missing_grad_and_autograd_grad_take_plain_autograd():
    weight = marked(6, 4)
    weight.grad = None  # nothing to add into: the gradient is returned as usual
    x = inputs(3, 5, 4)
    linear(x, weight).sum().backward()
    assert torch.allclose(weight.grad, torch.ones(5, 6).t() @ x.detach(), rtol=1e-6, atol=1e-6)
    before = weight.grad.clone()
    weight.fuse_grad_accumulation = False
    (got,) = torch.autograd.grad(linear(x, weight).sum(), [weight])
    assert torch.equal(got, before) and torch.equal(weight.grad, before)  # returned, `.grad` untouched
    with torch.no_grad():
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_model_step_with_marked_parameters_equals_plain_autograd():
    """The whole model, one micro-batch into zeroed gradients: every parameter's gradient bit-equal."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, vocab_size=96,
                      seq_length=16)
    fused, plain = CausalLM(cfg), CausalLM(cfg)
    fused.init_weights(5)
    plain.init_weights(5)
    for p in fused.parameters():
        p.grad = torch.zeros_like(p)
        p.fuse_grad_accumulation = True
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(6))
    fused(tokens[:, :-1], tokens[:, 1:]).backward()
    plain(tokens[:, :-1], tokens[:, 1:]).backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_queued_weight_gradients_are_bit_identical_and_reported_once_when_added():
    """WeightGradQueue: inside the block only input gradients are computed; a weight's post-accumulate hook sees
    it pending; run() adds the same products in the same order as the direct path (bit-identical over several
    micro-batches) and calls on_deferred_grad once per weight, after its gradient is in."""
    from kernels.grad_accumulation import WeightGradQueue, is_pending
    shared, other = marked(16, 16, seed=1), marked(8, 16, seed=2)
    direct = [marked(16, 16, seed=1), marked(8, 16, seed=2)]
    seen_in_backward, reported = [], []
    shared.register_post_accumulate_grad_hook(lambda p: seen_in_backward.append(is_pending(p)))
    shared.on_deferred_grad = other.on_deferred_grad = lambda p: reported.append((p is shared, p.grad.clone()))

    def loss(x, w1, w2):  # w1 used twice in one pass, as a shared weight would be
        return linear(linear(linear(x, w1).relu(), w1), w2).pow(2).sum()

    for micro_batch in range(3):
        x = inputs(micro_batch, 4, 16)
        x_direct = x.detach().clone().requires_grad_()
        loss(x_direct, *direct).backward()
        if micro_batch < 2:
            loss(x, shared, other).backward()
        else:
            with WeightGradQueue() as queue:
                loss(x, shared, other).backward()
            assert seen_in_backward[-1] and not reported  # nothing added yet, nothing reported
            assert not torch.equal(shared.grad, direct[0].grad)
            queue.run()
        assert torch.equal(x.grad, x_direct.grad)
    assert seen_in_backward[:2] == [False, False] and not is_pending(shared)
    assert torch.equal(shared.grad, direct[0].grad) and torch.equal(other.grad, direct[1].grad)
    assert sorted(flag for flag, _ in reported) == [False, True]  # once each, with the finished gradient
    assert all(torch.equal(g, (shared if flag else other).grad) for flag, g in reported)
