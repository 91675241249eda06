import pickle

import pytest
import torch

from tail_ray import CodecError, ConfigError, make_compressor


def test_none_roundtrip_is_exact_and_any_instance_decodes():
    grads = {"w": torch.randn(7, 5), "b": torch.randn(5)}
    payload = make_compressor("none").compress(grads)
    decoded = make_compressor("none").decompress(payload)
    for name, g in grads.items():
        assert torch.equal(decoded[name], g.reshape(-1))


def test_truncated_payload_raises_codec_error():
    payload = make_compressor("none").compress({"w": torch.randn(100)})
    with pytest.raises(CodecError):
        make_compressor("none").decompress(payload[:-3])


def test_unknown_compressor_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown compressor"):
        make_compressor("zip")


def test_codec_error_pickles_with_layer_and_field():
    err = pickle.loads(pickle.dumps(CodecError("bad", layer="fc.weight", field="scales")))
    assert (err.layer, err.field) == ("fc.weight", "scales")
    assert "fc.weight" in str(err)
