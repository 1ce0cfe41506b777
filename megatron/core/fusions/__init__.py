"""Fused kernels (upstream's ``megatron.core.fusions`` layout): each one computes the same math as the plain torch
ops it replaces, with fewer kernels and less saved activation memory."""
