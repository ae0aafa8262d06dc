"""quant_stats.py on a machine without TE's debug tools: off by default, a clear error when asked for."""

import importlib.util

import pytest
from omegaconf import OmegaConf
from quant_stats import QuantStats


def test_disabled_quant_stats_do_nothing(tmp_path):
    stats = QuantStats.start(OmegaConf.create({"enabled": False, "config_file": "missing.yaml"}), tmp_path)
    stats.watch(object())
    stats.step()
    stats.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    importlib.util.find_spec("nvdlfw_inspect") is not None
    and importlib.util.find_spec("transformer_engine") is not None,
    reason="checks the error raised where TE's debug tools are missing",
)
def test_enabled_without_debug_tools_is_a_clear_error(tmp_path):
    cfg = OmegaConf.create({"enabled": True, "config_file": "debug_configs/fp8_tensor_stats.yaml"})
    with pytest.raises(RuntimeError, match="needs TransformerEngine and nvidia-dlframework-inspect"):
        QuantStats.start(cfg, tmp_path)
