"""benchmarks/speed.py's summary: the step's fraction of the machine's limit, worked out by hand."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("speed", Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py")
speed = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(speed)


def test_step_limit_fraction_by_hand():
    rlvr = {"seconds_per_step": 16.0, "completion_tokens_per_step": 1000, "update_flops": 6e12, "update_seconds": 2.0,
            "rollout_seconds": 1.5, "reward_seconds": 0.0, "peak_memory_mb": 1.0}
    trl = {"seconds_per_step": 80.0, "completion_tokens_per_step": 1000, "peak_memory_mb": 1.0}
    rollout = {"flops_per_token": 2e9, "matmul_flops_fp32": 1e12, "rows": []}
    report = speed.summarize({"fp32": {"rlvr": rlvr, "trl": trl}}, rollout)
    # step FLOPs: 6e12 (update) + 1000 sampled tokens x 2e9 = 8e12; at 1e12 FLOP/s they take 8 s, the step 16 s
    assert report["step_limit_fraction_fp32"] == pytest.approx(0.5)
    assert rlvr["update_peak_fraction"] == pytest.approx(6e12 / 2.0 / 1e12)
    assert report["step_speedup_vs_trl"] == pytest.approx(5.0)
    assert "step fp32: 50% of the time its FLOPs take at the matmul peak" in speed.format_report(
        {**report, "device": "cpu", "rollout": {**rollout, "flops_per_token": 2e9}})
