"""speculators' EAGLE-3 loss and accuracy on a CPU: the same values through faster kernels
(checked against speculators 0.9.0 and torch 2.13's CPU build).

    with cpu_kernels():       # around one `speculators train` call on a CPU (runner_training)
        ...

A training step of the embedded default spends about a sixth of its time in two kernels that
torch's CPU build runs without vector instructions for the draft's bf16 logits:
- `torch.argmax` over the draft vocab (about 7 ms for 512 x 8,192 bf16 values, against 1.5 ms
  for `torch.max(dim).indices`, which gives the same first index of the maximum): speculators
  takes it 9 times a step, for the next TTT step's input ids and the accuracy metrics (and the
  `ce` loss its labels);
- `torch.xlogy` inside `kl_div(log_q, p)` (about 8 ms a call, three a step): the same
  divergence from the target's log-probabilities, `kl_div(log_q, log_p, log_target=True)`,
  costs one `exp` instead.

On a CPU without native bf16 the run computes in float32 (runner/core/number_format.py), and
torch's Muon, which speculators builds for `train.optimizer=muon`, still orthogonalises each
update in bf16 (`torch.optim._muon._zeropower_via_newtonschulz` casts it with `.bfloat16()`):
there its Newton-Schulz products took 41 of a step's 48 s. `cpu_kernels(torch.float32)` runs
the same iteration in float32.

Patched here, and restored on exit:
- `speculators.models.eagle3.core.torch`, `speculators.models.eagle3.metrics.torch` and
  `speculators.losses.eager.torch` (the modules' name for torch): a view of torch whose
  `argmax` over a dimension is `max().indices`;
- `speculators.losses.eager.kl_div_loss` (what `lk_hybrid` calls) and the eager loss table's
  `kl_div` entry (`speculators.losses.utils._EAGER_LOSS_FN_MAP`): `kl_div_from_log_probs`.
- with a dtype other than bf16: `torch.optim._muon._zeropower_via_newtonschulz`, with
  `newton_schulz` in that dtype.
Only the eager implementation is touched: the fused one needs Triton, so a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def kl_div_from_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position ([1, seq_len]) from draft logits (q) and target logits (p), as
    speculators' eager `kl_div_loss` computes it, with p taken as log-probabilities."""
    log_q = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32)
    log_p = torch.nn.functional.log_softmax(targets, dim=-1, dtype=torch.float32)
    return torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def argmax(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """torch.argmax, through torch.max over a dimension (the first index of the maximum)."""
    if dim is None:
        return torch.argmax(x)
    return torch.max(x, dim=dim, keepdim=keepdim).indices


class _TorchView:
    """torch as speculators' modules name it, with `argmax` from this module."""

    argmax = staticmethod(argmax)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def newton_schulz(
    grad: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """torch's Muon orthogonalisation (the quintic Newton-Schulz iteration of
    `torch.optim._muon._zeropower_via_newtonschulz`, torch 2.13), computed in `dtype`."""
    if ns_steps >= 100 or grad.ndim != 2 or len(ns_coefficients) != 3:
        raise ValueError("Muon orthogonalises 2-D gradients, in fewer than 100 steps")
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextmanager
def cpu_kernels(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    import speculators.losses.eager as eager
    import speculators.losses.utils as loss_utils
    import speculators.models.eagle3.core as core
    import speculators.models.eagle3.metrics as metrics
    import torch.optim._muon as muon

    table = loss_utils._EAGER_LOSS_FN_MAP
    saved = (core.torch, metrics.torch, eager.torch, eager.kl_div_loss, table["kl_div"])
    base_ns = muon._zeropower_via_newtonschulz
    view = _TorchView()
    core.torch = metrics.torch = eager.torch = view  # type: ignore[assignment]
    eager.kl_div_loss = table["kl_div"] = kl_div_from_log_probs
    if dtype != torch.bfloat16:
        muon._zeropower_via_newtonschulz = lambda g, coef, steps, eps: newton_schulz(
            g, coef, steps, eps, dtype
        )
    try:
        yield
    finally:
        core.torch, metrics.torch, eager.torch, eager.kl_div_loss, table["kl_div"] = saved
        muon._zeropower_via_newtonschulz = base_ns
