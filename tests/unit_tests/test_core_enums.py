"""``megatron.core.enums`` (upstream's module; upstream's pretrain scripts and tests import ``ModelType`` from it):
``ModelType`` is the transformer enums' class (one identity, so pickled args from either path load and the
checkpoint allowlist covers it), ``Fp8Recipe`` / ``Fp4Recipe`` members equal their flag strings."""
import io
import pickle
import zipfile

import torch

from megatron.core import enums
from megatron.core.transformer import enums as transformer_enums


def test_model_type_is_one_class():
    assert enums.ModelType is transformer_enums.ModelType
    assert enums.ModelType.encoder_or_decoder.value == 1
    from megatron.training.training import ModelType

    assert ModelType is enums.ModelType


def test_recipes_are_their_flag_strings():
    assert [r.value for r in enums.Fp8Recipe] == ["delayed", "tensorwise", "mxfp8", "blockwise", "custom"]
    assert enums.Fp8Recipe("mxfp8") == "mxfp8" and enums.Fp4Recipe.nvfp4 == "nvfp4"
    assert [r.value for r in enums.Fp4Recipe] == ["nvfp4", "custom"]


def _torch_file(pickled: bytes) -> io.BytesIO:
    """A torch.save zip whose data.pkl is ``pickled``."""
    buf = io.BytesIO()
    torch.save({}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, pickled if info.filename.endswith("data.pkl") else src.read(info.filename))
    out.seek(0)
    return out


def test_pickled_enums_load_weights_only():
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    # upstream's pickle of ModelType.encoder_or_decoder names megatron.core.enums (its own class there)
    upstream = b"\x80\x02cmegatron.core.enums\nModelType\nK\x01\x85R."
    assert torch.load(_torch_file(upstream), weights_only=True) is enums.ModelType.encoder_or_decoder
    buf = io.BytesIO()
    torch.save({"model_type": enums.ModelType.encoder_or_decoder, "recipe": enums.Fp8Recipe.mxfp8}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == {"model_type": enums.ModelType.encoder_or_decoder, "recipe": enums.Fp8Recipe.mxfp8}
    assert pickle.loads(pickle.dumps(enums.Fp8Recipe.delayed)) is enums.Fp8Recipe.delayed
