"""The CPU kernels the runner swaps into speculators' training (runner/integrations/
speculators_cpu.py) give speculators' own values: the same loss, gradients and accuracy, and
everything is put back afterwards."""

from __future__ import annotations

import pytest
import torch

from runner.integrations.speculators_cpu import cpu_kernels


def _logits(seed: int, scale: float = 6.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 64, 512, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["kl_div", "lk_hybrid", "ce"])
def test_the_loss_and_its_gradient_are_speculators_own(name):
    from speculators.losses import resolve_loss_config

    def loss_and_grad(fn):
        x = _logits(0).requires_grad_()
        loss = fn(x, _logits(1))
        loss.sum().backward()
        return loss.detach(), x.grad.float()

    ((theirs_fn, _),) = resolve_loss_config(name, "eager").values()
    theirs = loss_and_grad(theirs_fn)
    with cpu_kernels():
        ((mine_fn, _),) = resolve_loss_config(name, "eager").values()
        mine = loss_and_grad(mine_fn)
    assert (mine_fn is not theirs_fn) == (name == "kl_div")
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[1], theirs[1], rtol=0, atol=1e-3)  # bf16 gradients


def test_argmax_is_the_first_index_of_the_maximum_as_torchs():
    import speculators.models.eagle3.metrics as metrics

    x = _logits(2)
    x[0, :8, 7] = x[0, :8, 300] = 100.0  # ties: the first index wins in both
    with cpu_kernels():
        mine = metrics.torch.argmax(x, dim=-1)
        assert torch.equal(metrics.torch.argmax(x), torch.argmax(x))
    assert torch.equal(mine, torch.argmax(x, dim=-1))
    assert (mine[0, :8] == 7).all()


def test_speculators_is_restored_on_exit_even_after_an_error():
    import speculators.losses.eager as eager
    import speculators.models.eagle3.core as core
    import speculators.models.eagle3.metrics as metrics

    before = (core.torch, metrics.torch, eager.torch, eager.kl_div_loss)
    with pytest.raises(RuntimeError), cpu_kernels():
        assert core.torch is not torch and eager.torch is not torch
        raise RuntimeError("a failed step")
    assert (core.torch, metrics.torch, eager.torch, eager.kl_div_loss) == before
    assert core.torch is torch


def test_muon_orthogonalises_in_the_runs_format_with_torchs_iteration():
    """Without native bf16 the run trains in float32, Muon's Newton-Schulz products included:
    the same iteration as torch's, in float32, and torch's own bf16 one is back on exit."""
    import torch.optim._muon as muon

    from runner.integrations.speculators_cpu import newton_schulz

    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(3))
    coef = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    theirs = muon._zeropower_via_newtonschulz(g, coef, 5, 1e-7)
    assert theirs.dtype == torch.bfloat16
    mine = newton_schulz(g, coef, 5, 1e-7)
    assert mine.dtype == torch.float32 and mine.shape == g.shape
    torch.testing.assert_close(mine.bfloat16().float(), theirs.float(), rtol=0, atol=0.05)
    base = muon._zeropower_via_newtonschulz
    with cpu_kernels(torch.float32):
        assert muon._zeropower_via_newtonschulz(g, coef, 5, 1e-7).dtype == torch.float32
        p = torch.nn.Parameter(torch.randn(8, 4))
        p.grad = torch.randn(8, 4)
        before = p.detach().clone()
        torch.optim.Muon([p], lr=0.1).step()  # torch's optimizer, through the float32 iteration
        assert p.dtype == torch.float32 and not torch.equal(p.detach(), before)
    with cpu_kernels():  # a bf16 run keeps torch's own
        assert muon._zeropower_via_newtonschulz is base
    assert muon._zeropower_via_newtonschulz is base
