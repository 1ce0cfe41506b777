"""``megatron.core.transformer.identity_op`` (upstream's module): ``IdentityOp`` / ``IdentityFuncOp`` take and ignore
constructor arguments, so a ``ModuleSpec`` naming the module by import path builds them; the norm slots still use the
same class."""
import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module
from megatron.core.transformer.torch_norm import IdentityOp as NormSlotIdentity


def test_identity_op_ignores_arguments():
    x = torch.randn(3, 2)
    op = IdentityOp(object(), hidden_size=8)
    assert op(x, "extra", key=1) is x
    assert list(op.parameters()) == []
    assert NormSlotIdentity is IdentityOp


def test_identity_func_op_returns_identity_function():
    x = torch.randn(2)
    fn = IdentityFuncOp(1, 2)(True, training=False)
    assert fn(x, "bias", 0.1) is x


def test_spec_by_import_path():
    assert import_module(("megatron.core.transformer.identity_op", "IdentityOp")) is IdentityOp
    built = build_module(ModuleSpec(module=("megatron.core.transformer.identity_op", "IdentityOp")))
    assert type(built) is IdentityOp
