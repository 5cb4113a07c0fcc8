"""benchmarks/learning.py's arithmetic: time to a target accuracy, interpolation, stopping, the summary, the
clock that leaves evaluation out; worked out by hand, without training."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("learning", Path(__file__).resolve().parents[1] / "benchmarks" / "learning.py")
learning = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(learning)


def curve(*points):
    return [{"seconds": s, "step": step, "accuracy": a} for s, step, a in points]


FAST = curve((0, 0, 0.3), (60, 5, 0.5), (120, 10, 0.7))
SLOW = curve((0, 0, 0.3), (300, 5, 0.4), (600, 10, 0.8))


def test_crossing_interpolates_between_the_points_around_the_target():
    # 0.6 is halfway from 0.5 (60 s, step 5) to 0.7 (120 s, step 10): 60 + 0.5 x 60 = 90 s, step 7.5
    assert learning.crossing(FAST, 0.6) == pytest.approx(90.0)
    assert learning.crossing(FAST, 0.6, "step") == pytest.approx(7.5)
    # a point exactly at the target is where it is reached: (0.6 - 0.3) / (0.6 - 0.3) = 1 of the way to 60 s
    assert learning.crossing(curve((0, 0, 0.3), (60, 5, 0.6)), 0.6) == pytest.approx(60.0)


def test_crossing_edge_cases():
    assert learning.crossing(FAST, 0.9) is None  # never reached
    assert learning.crossing(curve((0, 0, 0.65), (60, 5, 0.7)), 0.6) == 0.0  # already there before training
    assert learning.crossing([], 0.6) is None
    # a dip below after reaching it does not matter: the first crossing counts (0.4 -> 0.8 over 60..120 s: 90 s)
    assert learning.crossing(curve((0, 0, 0.2), (60, 5, 0.4), (120, 10, 0.8), (180, 15, 0.5)), 0.6) == pytest.approx(90.0)


def test_accuracy_at_interpolates_and_is_none_outside():
    assert learning.accuracy_at(FAST, 7.5) == pytest.approx(0.6)  # halfway from 0.5 to 0.7
    assert learning.accuracy_at(FAST, 0) == pytest.approx(0.3)
    assert learning.accuracy_at(FAST, 10) == pytest.approx(0.7)
    assert learning.accuracy_at(FAST, 90, "seconds") == pytest.approx(0.6)
    assert learning.accuracy_at(FAST, 11) is None


def test_stop_reason():
    assert learning.stop_reason(FAST[:2], train_seconds=100, budget_seconds=100, target=0.6, margin_evals=2) == "budget"
    assert learning.stop_reason(FAST[:2], 50, 100, 0.6, 0) is None  # not reached yet
    assert learning.stop_reason(FAST, 50, 100, 0.6, 0) == "target"  # reached at the last evaluation
    assert learning.stop_reason(FAST, 50, 100, 0.6, 1) is None  # one more evaluation wanted after it
    assert learning.stop_reason(FAST + curve((180, 15, 0.55)), 50, 100, 0.6, 1) == "target"


def test_summary_by_hand():
    runs = {"rlvr": {"42": {"curve": FAST}, "1": {"curve": curve((0, 0, 0.2), (60, 5, 0.6))}},
            "trl": {"42": {"curve": SLOW}, "1": {"curve": curve((0, 0, 0.3), (300, 5, 0.4))}}}
    s = learning.summarize(runs, 0.6)
    # rlvr seed 42: 90 s = 1.5 min; TRL seed 42: 0.6 is halfway from 0.4 (300 s) to 0.8 (600 s): 450 s = 7.5 min
    assert s["minutes_to_target"]["rlvr"]["42"] == pytest.approx(1.5)
    assert s["minutes_to_target"]["trl"]["42"] == pytest.approx(7.5)
    assert s["minutes_to_target"]["rlvr"]["1"] == pytest.approx(1.0)  # exactly 0.6 at 60 s
    assert s["minutes_to_target"]["trl"]["1"] is None
    assert s["steps_to_target"]["trl"]["42"] == pytest.approx(7.5)
    assert s["seconds_per_step"]["trl"]["42"] == pytest.approx(60.0)  # 600 s / 10 steps
    assert s["seconds_per_step"]["rlvr"]["1"] == pytest.approx(12.0)  # 60 s / 5 steps
    # the ratio only over the seeds where both reached the target: 7.5 / 1.5
    assert s["ratio_trl_over_rlvr"] == {"42": pytest.approx(5.0)}
    assert s["ratio"] == pytest.approx(5.0)
    # learning per step at the steps every run evaluated (0 and 5): rlvr at step 5 is 0.5 (seed 42) and 0.6 (seed 1)
    by_step = s["accuracy_by_step"]
    assert sorted(by_step["rlvr"]) == [0, 5]
    assert by_step["rlvr"][5]["mean"] == pytest.approx(0.55)
    assert by_step["rlvr"][5]["spread"] == pytest.approx(0.1)
    assert by_step["trl"][5]["mean"] == pytest.approx(0.4)
    assert by_step["trl"][5]["spread"] == pytest.approx(0.0)

    text = learning.format_summary({"summary": s, "runs": {fw: {k: {**r, "stopped_by": "budget"} for k, r in seeds.items()}
                                                           for fw, seeds in runs.items()}})
    assert "not reached within budget" in text
    assert "seed 42: TRL / rlvr = 5.0x" in text


def test_no_ratio_when_trl_never_reaches_the_target():
    s = learning.summarize({"rlvr": {"42": {"curve": FAST}}, "trl": {"42": {"curve": SLOW[:2]}}}, 0.6)
    assert s["ratio_trl_over_rlvr"] == {} and "ratio" not in s


def test_recorder_leaves_evaluation_out_of_the_clock(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(learning.time, "perf_counter", lambda: now[0])
    accuracies = iter([0.3, 0.5, 0.7])

    def evaluate():  # each evaluation takes 100 s
        now[0] += 100
        return next(accuracies)

    log = tmp_path / "rlvr-seed42.jsonl"
    rec = learning.Recorder(log, evaluate, eval_every=2, budget_seconds=1000, target=0.6, margin_evals=0)
    rec.begin()
    stops = []
    for step in range(1, 5):  # each step takes 10 s
        now[0] += 10
        stops.append(rec.step_end(step, reward=0.1 * step))
    # evaluations at steps 0, 2 and 4 after 0, 20 and 40 training seconds (not 0, 120, 240); 0.7 >= 0.6 stops at step 4
    assert [(p["seconds"], p["step"]) for p in rec.curve] == [(0, 0), (20, 2), (40, 4)]
    assert stops == [False, False, False, True]
    run = learning.read_log(log)
    assert run["curve"] == rec.curve
    assert run["stopped_by"] == "target"
    assert [r["step"] for r in run["rewards"]] == [1, 2, 3, 4]
    assert json.loads(log.read_text().splitlines()[-1]) == {"event": "end", "stopped_by": "target"}


def test_read_log_of_a_run_cut_short(tmp_path):
    log = tmp_path / "trl-seed42.jsonl"
    log.write_text('{"event": "meta", "framework": "trl"}\n{"event": "eval", "seconds": 0, "step": 0, "accuracy": 0.35}\n')
    run = learning.read_log(log)
    assert run["curve"] == curve((0, 0, 0.35)) and run["meta"] == {"framework": "trl"}
    assert run["stopped_by"].startswith("cut short")


@pytest.mark.trains
@pytest.mark.processes
def test_the_benchmark_runs_both_trainers_end_to_end(tiny_model_dir, tmp_path):
    """benchmarks/learning.py on the tiny model, 2 steps each, evaluated after every step: both
    frameworks' workers run through their callback and the report has every point (the benchmark is
    not in any other test, and a change to the callbacks once broke it unseen)."""
    import subprocess
    import sys

    pytest.importorskip("trl")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learning.py"
    done = subprocess.run([sys.executable, str(script), "--seeds", "7", "--max-steps", "2", "--eval-every", "1",
                           "--model", str(tiny_model_dir), "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "learning.json").read_text())
    assert sorted(report["runs"]) == ["rlvr", "trl"]
    for framework in ("rlvr", "trl"):
        log = learning.read_log(tmp_path / f"{framework}-seed7.jsonl")
        assert [p["step"] for p in log["curve"]] == [0, 1, 2], framework
        assert [r["step"] for r in log["rewards"]] == [1, 2] and log["stopped_by"] == "max_steps", framework
