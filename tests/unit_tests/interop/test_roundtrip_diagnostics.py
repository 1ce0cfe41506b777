"""The diagnostics of the upstream round trip's records (``roundtrip_cases.diagnose`` and what feeds it), on CPU:
which parameters each side holds as quantized tensors, which loaded weights and module outputs differ from the
saver's. The GPU round trip (``test_upstream_roundtrip.py``) prints them under a failed job."""
import torch

from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor
from tests.unit_tests.interop import fork_worker
from tests.unit_tests.interop import roundtrip_cases as rc


class _Pair(torch.nn.Module):
    """Returns a tuple (output, None), as the layers do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.proj(x) * 2, None


def test_captured_outputs_records_each_module_once_in_call_order_and_removes_its_hooks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Pair(), torch.nn.Identity())
    model[1].forward = lambda pair: pair[0] + 1  # takes the tuple, returns a tensor
    x = torch.randn(2, 4)
    with rc._captured_outputs(model, False) as off:
        model(x)
    assert off is None
    with rc._captured_outputs(model, True) as outputs:
        model(x)
        model(x + 1)  # a second call changes nothing recorded
    # inner modules finish first; a leaf's input comes before its output
    assert list(outputs) == ["0.proj:input", "0.proj", "0", "1:input", "1"]
    expected = model[0].proj(x).detach()
    assert torch.equal(outputs["0.proj:input"], x) and torch.equal(outputs["1:input"], expected * 2)
    assert torch.equal(outputs["0.proj"], expected) and torch.equal(outputs["0"], expected * 2)
    assert torch.equal(outputs["1"], expected * 2 + 1)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_named_diffs_per_name_shapes_and_names_of_one_side():
    ref = {"a": torch.zeros(2), "b": torch.ones(2), "c": torch.zeros(3), "gone": torch.zeros(1)}
    mine = {"a": torch.tensor([0.0, 0.5]), "b": torch.ones(2), "c": torch.zeros(2, 2), "new": torch.zeros(1)}
    assert rc.named_diffs(mine, ref) == {"a": 0.5, "b": 0.0, "c": "shape (2, 2) != (3,)", "only_loader": ["new"],
                                         "only_saver": ["gone"]}
    assert rc.named_diffs(mine, ref, nonzero=True, limit=1) == {"a": 0.5, "only_loader": ["new"],
                                                                "only_saver": ["gone"]}


def test_diagnose_names_params_quantized_on_one_side_weights_and_first_outputs():
    bad = {"side": "upstream", "phase": "load", "layout": "gpu_te", "case": "mla_fp0_te_tensorwise", "ok": False,
           "tolerance": 1e-3, "quantized_params": ["x.weight", "y.weight"],
           "weight_diffs": {"y.weight": 0.01},
           "activation_diffs": {"emb": 0.0, "l0.down:input": 1e-7, "l0.down": 2e-3, "l0": "shape (1,) != (2,)", "l1": 5e-4, "out": 0.01}}
    records = [bad,
               {"side": "fork", "phase": "load", "case": "dense_fp0_te_tensorwise", "quantized_params": ["q"]},
               {"side": "fork", "phase": "save", "case": "mla_fp0_te_tensorwise",
                "quantized_params": ["x.weight", "z.weight"], "repeat_diff": 0.0}]
    lines = rc.diagnose(bad, records).splitlines()
    assert lines.pop(1) == "  the saver's second forward differs from its first (the reference) by 0.0"
    assert lines[0] == ("  quantized params: 2 on upstream, 2 on the other side; only on upstream: ['y.weight']; "
                        "only on the other side: ['z.weight']")
    assert lines[1] == "  loaded weights differing from the saver's: {'y.weight': 0.01}"
    assert lines[2].endswith("[('l0.down', 0.002), ('l0', 'shape (1,) != (2,)'), ('out', 0.01)]")
    assert lines[3] == "  largest difference before l0.down: ('l0.down:input', 1e-07)"
    records[2]["quantizer_kinds"] = {"Float8Tensor/Float8Quantizer": 2}
    assert rc.diagnose(bad, records).splitlines()[1] == (
        "  quantized tensor / quantizer kinds: None on upstream, {'Float8Tensor/Float8Quantizer': 2} on the other "
        "side")
    # without the other side's list (or any diagnostics) nothing is claimed
    assert rc.diagnose(dict(bad, activation_diffs={}, weight_diffs={}), [bad]).splitlines() == [
        "  loaded weights differing from the saver's: none"]
    assert rc.diagnose({"side": "fork", "case": "c"}, []) == ""


def test_fork_worker_lists_quantized_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    model[1].weight = torch.nn.Parameter(FakeQuantizedTensor.quantize(model[1].weight.detach(), "tensorwise"))
    assert fork_worker.quantized_param_names(model) == ["1.weight"]
    assert rc.quantizer_kinds(model, ["1.weight"]) == {"FakeQuantizedTensor/FakeQuantizer": 1}
    assert fork_worker.quantized_param_names(torch.nn.Linear(2, 2)) == []


# upstream 0.19.2 loading the fork's MLA checkpoint with current-scaling FP8 weights (H100, 2026-12-06): the record
# of that failed load, as the device run wrote it
_UPSTREAM_TENSORWISE_LOAD = {
    "side": "upstream", "phase": "load", "case": "mla_fp0_te_tensorwise", "layout": "gpu_te", "ok": False,
    "quantizer_kinds": {"Float8Tensor/Float8CurrentScalingQuantizer": 14},
    "max_abs_diff": 0.012079417705535889, "tolerance": 0.001,
    "weight_diffs": {"decoder.layers.0.self_attention.linear_kv_down_proj.weight": 7.450580596923828e-09,
                     "decoder.layers.0.mlp.linear_fc1.weight": 0.00551953911781311,
                     "decoder.layers.1.mlp.linear_fc1.weight": 0.006077975034713745}}


def test_known_upstream_defect_is_only_upstreams_glu_fc1_current_scaling_load():
    import copy

    why = rc.known_upstream_defect(_UPSTREAM_TENSORWISE_LOAD)
    assert why is not None and "decoder.layers.0.mlp.linear_fc1.weight" in why
    assert "linear_kv_down_proj" not in why  # 7e-9: not a difference
    for change in (
        {"side": "fork"},  # the fork's loads are never excused
        {"phase": "save"},
        {"quantizer_kinds": {"Float8Tensor/Float8Quantizer": 14}},  # delayed scaling
        {"quantizer_kinds": {}},
        {"case": "dense_fp0_te_tensorwise"},  # no gated linear unit
        {"weight_diffs": {}},  # nothing changed in the weights: the difference is elsewhere
    ):
        r = dict(_UPSTREAM_TENSORWISE_LOAD, **change)
        assert rc.known_upstream_defect(r) is None, change
    r = copy.deepcopy(_UPSTREAM_TENSORWISE_LOAD)
    r["weight_diffs"]["decoder.layers.0.mlp.linear_fc2.weight"] = 0.004  # another weight changed too
    assert rc.known_upstream_defect(r) is None
