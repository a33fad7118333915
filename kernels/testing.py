"""Helpers for comparing an op with its reference (used by tests/test_kernels_*.py and benchmarks)."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def outputs_and_grads(fn, inputs, grad_outputs=None, seed=0):
    """Run fn(*inputs) on fresh leaf copies; return (outputs, grads of every float input).

    The loss is sum(out * g) with g random (seeded, same for every call with the same seed), so
    each output's gradient path is exercised with non-uniform weights. Outputs that are None are
    skipped.
    """
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = [o for o in outs if o is not None]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if grad_outputs is None:
        grad_outputs = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
    loss = sum((o * g).sum() for o, g in zip(outs, grad_outputs))
    params = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [o.detach() for o in outs], [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
