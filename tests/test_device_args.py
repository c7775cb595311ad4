"""--device / --dtype: the model is loaded where and how the user asks, and bad values are refused."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvshrink.cli import main
from kvshrink.models import load_model, model_dtype, usable_device


@pytest.mark.parametrize("device,message", [("bogus", "unknown device 'bogus'"),
                                            ("cuda", "no usable CUDA GPU")])
def test_bad_device_is_refused_before_loading(device, message, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["generate", "--prompt", "hi", "--device", device]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=message):
        usable_device(device)


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match=r"one of \['float32', 'bfloat16', 'float16'\]"):
        model_dtype("int8")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--dtype", "int8"])


@pytest.mark.model
def test_eval_backend_loads_the_model_in_the_dtype_asked(real_model, tmp_path):
    from kvshrink.eval.backend import KVShrinkBackend

    model, _ = KVShrinkBackend(None, "cpu", "bfloat16").load_model()
    assert next(model.parameters()).dtype == torch.bfloat16
    # a transformers folder (a tiny model with the embedded tokenizer) in float16: the same dtype argument,
    # without reading the GGUF file a second time
    folder = tmp_path / "tiny"
    tiny_model().save_pretrained(folder)
    real_model[1].save_pretrained(folder)
    model, _ = load_model(folder, dtype="float16")
    assert next(model.parameters()).dtype == torch.float16
