"""Upstream's placeholders for a submodule that does nothing: ``IdentityOp`` (``x -> x``; the norm slot that a fused
Transformer Engine LayerNormLinear fills) and ``IdentityFuncOp`` (called, returns a function that returns its first
argument: the slot of an op such as ``bias_dropout_add`` that itself returns a function). Both accept and ignore any
constructor arguments, so a spec can build them like the module they stand for."""
import torch


class IdentityOp(torch.nn.Module):
    """``IdentityOp(*any)(x, *any) -> x``."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """``IdentityFuncOp(*any)(*any) -> f`` with ``f(x, *any) -> x``."""

    def forward(self, *args, **kwargs):
        return super().forward
