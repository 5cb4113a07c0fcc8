"""The run report: robust reading of files being written, escaping, alert shading, and the page in a real browser."""

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlvr.config import build_config
from rlvr.report import Span, alert_spans, write_report

HOSTILE = '<script>document.title="pwned"</script><img src=x onerror=alert(1)> & </td>'


def write_lines(path: Path, rows: list, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def metrics_rows(steps=10):
    return [{"step": s, "reward": s / steps, "reward_std": 0.5, "rewards/accuracy/mean": s / steps,
             "rewards/format/mean": 1.0, "frac_reward_zero_std": 0.25, "loss": 0.01 * s, "kl": 0.001 * s, "beta": 0.04,
             "entropy": 1.5, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01, "completions/mean_length": 20.0,
             "tokens_per_second": 100.0, "step_time": 1.0} for s in range(1, steps + 1)]


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("model: tiny\nloss_type: dapo\nbeta: 0.04\nreward_funcs: [accuracy, format]\n")
    return d


def test_empty_run_dir_gives_a_page_saying_no_metrics(run_dir):
    path = write_report(run_dir)
    page = path.read_text()
    assert path == run_dir / "report.html"
    assert "No metrics logged yet" in page and "<img" not in page
    assert "dapo" in page  # the settings from config.yaml are in the header


def test_torn_last_line_and_nulls_are_skipped(run_dir):
    rows = metrics_rows(5)
    rows[2]["loss"] = None
    rows[3]["eval/accuracy"] = 0.5
    write_lines(run_dir / "metrics.jsonl", rows, tail='{"step": 6, "reward": 0.')  # the trainer is mid-write
    (run_dir / "completions.jsonl").write_text('{"step": 1, "prompt": "p", "comp')
    page = write_report(run_dir).read_text()
    plots = {p.name for p in (run_dir / "plots").iterdir()}
    assert {"reward.png", "loss.png", "kl.png", "eval_accuracy.png", "clip_ratio.png", "throughput.png"} <= plots
    assert page.count("data:image/png;base64,") == len(plots)  # every plot is embedded, the page stands alone
    assert "step 5" in page
    assert not list(run_dir.glob(".*.tmp")) and not list((run_dir / "plots").glob(".*.tmp"))


def test_only_present_curves_are_drawn(run_dir):
    write_lines(run_dir / "metrics.jsonl", [{"step": 1, "reward": 0.0}, {"step": 2, "reward": 1.0, "kl": None}])
    write_report(run_dir)
    assert {p.name for p in (run_dir / "plots").iterdir()} == {"reward.png"}


def test_model_text_is_escaped(run_dir):
    write_lines(run_dir / "metrics.jsonl", metrics_rows(3))
    write_lines(run_dir / "completions.jsonl", [
        {"step": s, "prompt": HOSTILE, "answer": "2", "completion": HOSTILE, "reward": 1.0, "advantage": 0.5} for s in (1, 2, 3)
    ])
    page = write_report(run_dir).read_text()
    assert "<script" not in page and "<img src=x" not in page
    assert "&lt;script&gt;document.title=&quot;pwned&quot;&lt;/script&gt;" in page


def test_samples_come_from_the_start_middle_and_end(run_dir):
    write_lines(run_dir / "metrics.jsonl", metrics_rows(9))
    write_lines(run_dir / "completions.jsonl", [{"step": s, "completion": f"text-of-step-{s}", "reward": 0.0} for s in range(1, 10)])
    page = write_report(run_dir).read_text()
    assert [s for s in range(1, 10) if f"text-of-step-{s}<" in page] == [1, 5, 9]


def test_alert_periods_run_from_start_to_clear_or_to_the_last_step():
    alerts = [
        {"step": 3, "rule": "kl_high", "event": "start", "severity": "warn"},
        {"step": 5, "rule": "reward_std_low", "event": "start", "severity": "stop"},
        {"step": 6, "rule": "kl_high", "event": "clear", "severity": "warn"},
        {"step": 8, "rule": "kl_high", "event": "start", "severity": "warn"},
    ]
    assert alert_spans(alerts, last_step=10) == [
        Span("kl_high", "warn", 3, 6, True),
        Span("reward_std_low", "stop", 5, 10, False),
        Span("kl_high", "warn", 8, 10, False),
    ]


def test_alerts_are_shaded_on_every_plot_and_listed(run_dir, monkeypatch):
    import rlvr.report as report

    write_lines(run_dir / "metrics.jsonl", metrics_rows(10))
    write_lines(run_dir / "alerts.jsonl", [
        {"step": 4, "rule": "kl_high", "event": "start", "severity": "warn", "message": "KL 0.2 > 0.1 <b>", "suggestion": "lower lr", "value": 0.2},
        {"step": 7, "rule": "kl_high", "event": "clear", "severity": "warn", "message": "", "suggestion": "", "value": 0.05},
    ], tail='{"step": 9, "ru')
    shaded, draw = [], report.draw_panel

    def spy(title, lines, spans, *args, **kwargs):
        shaded.append(spans)
        return draw(title, lines, spans, *args, **kwargs)

    monkeypatch.setattr(report, "draw_panel", spy)
    page = write_report(run_dir).read_text()
    assert len(shaded) == len(list((run_dir / "plots").iterdir())) >= 8
    assert all(spans == [Span("kl_high", "warn", 4, 7, True)] for spans in shaded)
    assert 'id="alerts"' in page and "KL 0.2 &gt; 0.1 &lt;b&gt;" in page and "lower lr" in page


def test_repeated_calls_replace_the_files(run_dir):
    write_lines(run_dir / "metrics.jsonl", metrics_rows(2))
    first = write_report(run_dir).read_text()
    write_lines(run_dir / "metrics.jsonl", metrics_rows(4))
    second = write_report(run_dir).read_text()
    assert "step 2 " in first and "step 4 " in second


def test_cli_writes_the_report_of_the_latest_run_by_default(tmp_path, monkeypatch, capsys):
    from rlvr.cli import main

    for name, mtime in (("older", 1_000_000), ("newer", 2_000_000)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        write_lines(tmp_path / "runs" / name / "metrics.jsonl", metrics_rows(2))
        os.utime(tmp_path / "runs" / name / "metrics.jsonl", (mtime, mtime))
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 0
    assert capsys.readouterr().out.strip() == str(Path("runs/newer/report.html"))
    assert main(["report", "runs/older"]) == 0 and (tmp_path / "runs/older/report.html").is_file()


@pytest.mark.parametrize("make", ["missing", "no_metrics"])
def test_cli_says_what_is_wrong_with_the_run_dir(tmp_path, capsys, make):
    from rlvr.cli import main

    if make == "no_metrics":
        (tmp_path / "run").mkdir()
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlvr report: error: ") and ("not a directory" if make == "missing" else "no metrics.jsonl") in err


@pytest.mark.processes
def test_matplotlib_is_imported_only_when_drawing():
    code = "import sys, rlvr, rlvr.cli, rlvr.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- end to end: a real short run, then the page in headless Chromium --------------------------

SEVEN = """
def starts_with_seven(completions, **kwargs):
    return [1.0 if c.startswith("7") else 0.0 for c in completions]
"""


@pytest.mark.trains
@pytest.mark.processes
def test_report_of_a_real_run_loads_in_chromium(tiny_model_dir, tmp_path):
    from rlvr.run import train

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")
    plugin = tmp_path / "seven.py"
    plugin.write_text(SEVEN)
    run = tmp_path / "run"
    cfg = build_config({
        "model": str(tiny_model_dir), "task_args": {"num_train": 64, "num_test": 8},
        "reward_funcs": [f"{plugin}:starts_with_seven", "boxed_format"], "num_generations": 8,
        "per_device_train_batch_size": 32, "max_completion_length": 6, "learning_rate": 1e-2, "beta": 0.04,
        "max_steps": 6, "logging_steps": 1, "save_steps": 1000, "eval_max_examples": 8, "output_dir": str(run),
        "eval_strategy": "steps", "eval_steps": 3,
    })
    train(cfg)
    with (run / "alerts.jsonl").open("a") as f:  # as the alert monitor would write them
        f.write(json.dumps({"step": 2, "rule": "reward_std_low", "event": "start", "severity": "warn",
                            "message": HOSTILE, "suggestion": "raise temperature", "value": 0.01}) + "\n")
    with (run / "completions.jsonl").open("a") as f:
        f.write(json.dumps({"step": 6, "prompt": "p", "completion": HOSTILE, "reward": 0.0}) + "\n")
    path = write_report(run)
    result = load_in_chromium(browser, path, tmp_path / "profile")
    assert result["errors"] == []
    images = result["images"]
    assert len(images) >= 8 and all(complete and width > 0 for _, complete, width in images), images
    assert {"plot-reward", "plot-kl", "plot-loss", "plot-eval_accuracy"} <= {name for name, _, _ in images}
    assert result["scripts"] == 0 and result["title"].startswith("rlvr report")
    assert HOSTILE in result["text"]  # shown as text, not run


def load_in_chromium(browser: str, page: Path, profile: Path, timeout: float = 30.0) -> dict:
    """Open `page` in headless Chromium over the DevTools protocol (--remote-debugging-pipe: JSON
    messages separated by NUL on fds 3 and 4, no websocket needed). Returns the console errors,
    uncaught exceptions and failed loads, and (id, complete, naturalWidth) of every <img>."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
    # bash puts the two pipe ends on the fds Chromium expects.
    shell = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
    proc = subprocess.Popen(["bash", "-c", shell, "bash", *args], pass_fds=(to_browser_r, from_browser_w),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_browser_r)
    os.close(from_browser_w)
    cdp = _Pipe(to_browser_w, from_browser_r, time.monotonic() + timeout)
    try:
        target = cdp.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            cdp.call(f"{domain}.enable", session=session)
        cdp.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        cdp.wait_for("Page.loadEventFired", session)
        probe = ("JSON.stringify({images: Array.from(document.images, i => [i.id, i.complete, i.naturalWidth]),"
                 " scripts: document.scripts.length, title: document.title, text: document.body.innerText})")
        value = cdp.call("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=session)
        result = json.loads(value["result"]["value"])
        result["errors"] = cdp.errors(session)
        cdp.call("Browser.close")
        return result
    finally:
        os.close(to_browser_w)
        os.close(from_browser_r)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Pipe:
    """A minimal DevTools-protocol client: numbered calls, and every event kept for later checks."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float):
        self.write_fd, self.read_fd, self.deadline = write_fd, read_fd, deadline
        self.buffer, self.events, self.next_id = b"", [], 0

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> None:
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._read())

    def errors(self, session: str) -> list:
        out = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if e.get("sessionId") != session:
                continue
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(params.get("args"))
            elif method == "Runtime.exceptionThrown":
                out.append(params.get("exceptionDetails"))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                out.append(params["entry"])
        return out

    def _read(self) -> dict:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise ConnectionError("Chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)
