"""Target loading: the embedded default, the safetensors cache, and clear errors on bad input."""
from __future__ import annotations

import json

import pytest

from engine.loader import TargetLoadError, _gguf_cache_dir, default_gguf_path, load_target, resolve_target


def test_default_target_is_the_packaged_gguf_and_cached_as_safetensors(target_f32):
    kind, path = resolve_target(None)
    assert kind == "gguf" and path == default_gguf_path() and path.name.endswith(".gguf")
    cache = _gguf_cache_dir(path)
    assert (cache / "model.safetensors").is_file() and (cache / "config.json").is_file()
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert target_f32.config.model_type == "llama" and target_f32.config.num_hidden_layers == 30
    assert target_f32.eos_token_ids == {2} and target_f32.max_context == 8192


def test_bad_targets_are_named_in_the_error(tmp_path):
    with pytest.raises(TargetLoadError, match="'/no/such/dir' is neither"):
        load_target("/no/such/dir")
    with pytest.raises(TargetLoadError, match="GGUF file 'missing.gguf' does not exist"):
        load_target("missing.gguf")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(TargetLoadError, match="file of unknown format"):
        load_target(str(f))
    with pytest.raises(TargetLoadError, match="has no config.json"):
        load_target(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(TargetLoadError, match="architecture 'gpt2', which is not supported"):
        load_target(str(tmp_path))
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        load_target(None, dtype="int3")


def test_hub_ids_resolve_without_download():
    assert resolve_target("Qwen/Qwen3-8B") == ("hub", "Qwen/Qwen3-8B")
