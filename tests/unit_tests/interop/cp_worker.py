"""``cp_worker.py SIDE WORKDIR`` (2 processes under ``torch.distributed.run``; SIDE ``upstream`` with the real
upstream megatron-core 0.19.2 first on ``PYTHONPATH``, or ``fork``): a MoE router (sigmoid scores, top-2 of 4
experts, expert bias, z-loss) at --context-parallel-size 2, each rank routing its load-balanced chunks of a fixed
[s, b, h] input, with the load-balancing loss ``aux_loss`` or ``seq_aux_loss`` (and a case without router losses).
The loss ``sum(probs * G)`` is back-propagated with the aux-loss scale upstream's schedule sets under CP (the CP
size per micro-batch), the router weight's gradient averaged over the data x context ranks as DDP does. Written to
``WORKDIR/cp_<side>_<rank>.json``: per case the probs, the routing map, the input's gradient (this rank's) and the
averaged weight gradient; and under ``roll`` multi-token prediction's ``roll_tensor`` of this rank's chunks of fixed
token ids and of a loss mask with ``cp_group`` (the rolled tensors and their sums)."""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import roundtrip_cases as rc  # noqa: E402
except ImportError:  # imported by the test (the fork's side runs in ranks forked from pytest)
    from tests.unit_tests.interop import roundtrip_cases as rc  # noqa: E402

S, B, H, E, CP = 8, 2, 16, 4, 2
CASES = {"none": dict(moe_aux_loss_coeff=0.0),
         "aux_loss": dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1),
         "seq_aux_loss": dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1,
                              moe_router_load_balancing_type="seq_aux_loss")}


def _cp_chunks(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This CP rank's chunks ``rank`` and ``2 CP - 1 - rank`` of ``t`` along dim 0 (upstream's layout)."""
    chunks = t.chunk(2 * CP, dim=0)
    return torch.cat([chunks[rank], chunks[2 * CP - 1 - rank]], dim=0)


def run(side: str, workdir: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    ps.initialize_model_parallel(context_parallel_size=CP)
    rank = ps.get_context_parallel_rank()
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(E, H, generator=g) * 0.5
    x_full = torch.randn(S, B, H, generator=g)
    grad_full = torch.randn(S, B, E, generator=g)
    out = {}
    for name, extra in CASES.items():
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                                   moe_router_topk=2, moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=True, context_parallel_size=CP,
                                   add_bias_linear=False, **extra)
        if side == "upstream":
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            router = TopKRouter(config, pg_collection=get_default_pg_collection())
            router.set_layer_number(1)
        else:
            router = TopKRouter(config, layer_number=1)
        with torch.no_grad():
            router.weight.copy_(weight)
        router.train()
        x = _cp_chunks(x_full, rank).clone().requires_grad_()
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(CP)))  # upstream's schedule: x CP / micro-batches
        probs, routing_map = router(x)
        (probs * _cp_chunks(grad_full, rank).reshape(-1, E)).sum().backward()
        wgrad = router.weight.grad.detach().clone()
        dist.all_reduce(wgrad)  # DDP over data x context ranks (DP 1 x CP 2): the average
        out[name] = {"probs": probs.detach().tolist(), "routing_map": routing_map.int().tolist(),
                     "x_grad": x.grad.tolist(), "weight_grad": (wgrad / CP).tolist()}
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    ids = torch.randint(1, 100, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    cp_group = ps.get_context_parallel_group()
    out["roll"] = {}
    for key, full in (("ids", ids), ("mask", mask)):
        rolled, total = roll_tensor(_cp_chunks(full.t(), rank).t().contiguous(), shifts=-1, dims=-1, cp_group=cp_group)
        rolled2, _ = roll_tensor(rolled, shifts=-1, dims=-1, cp_group=cp_group)  # a second depth
        out["roll"][key] = rolled.tolist()
        out["roll"][key + "_twice"] = rolled2.tolist()
        out["roll"][key + "_sum"] = float(total)
    with open(os.path.join(workdir, f"cp_{side}_{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    ps.destroy_model_parallel()


def main(side: str, workdir: str) -> int:
    if side == "upstream":
        rc.eager_torch_compile()
        from megatron.core.package_info import __version__  # this fork has no package_info: upstream's alone
        from upstream_worker import _shim_cuda

        assert __version__.split("+")[0] == "0.19.2", __version__
        _shim_cuda()
    dist.init_process_group("gloo")
    run(side, workdir)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
