"""The run report: report.html and plots/*.png drawn from a run directory's files.

`write_report(run_dir)` reads metrics.jsonl, completions.jsonl, alerts.jsonl,
config.yaml and the held-out evaluations, draws one PNG per panel (reward,
reward std, held-out accuracy, KL and beta, loss, entropy, clip ratios,
completion length, zero-signal fraction, throughput; DPO's implicit rewards and pair accuracy,
rejection sampling's correct and kept rates) with the alert periods
shaded, and writes a self-contained HTML page (the PNGs embedded as data URIs)
with the alerts and sample completions from the start, middle and end.

The trainer calls it every `report_steps` steps while it is still appending to
those files, so reading is forgiving: a half-written last line, a missing file
or a null value is skipped. Every file is written to a temporary name and
renamed, so a browser never sees half a page. Model text is escaped: a
completion is untrusted input, and the page also forbids scripts outright.
matplotlib is imported here only, so `import rlvr` stays light.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

# (file stem, title, metric keys or key patterns); a panel with no data is left out.
PANELS = [
    ("reward", "reward (total and per function)", ["reward", re.compile(r"rewards/.+/mean")]),
    ("reward_std", "reward std", ["reward_std"]),
    ("eval_accuracy", "held-out accuracy", ["eval/accuracy", re.compile(r"eval/(pass|maj|mean)@(?!1$)\d+")]),
    ("kl", "KL to the reference (beta on the right axis)", ["kl"]),
    ("loss", "loss", ["loss"]),
    ("entropy", "entropy", ["entropy"]),
    ("clip_ratio", "clip ratios", [re.compile(r"clip_ratio/.+"), re.compile(r"cispo_clip_ratio")]),
    ("completion_length", "completion length (tokens)", ["completions/mean_length", "completions/min_length", "completions/max_length"]),
    ("zero_signal", "fraction of groups with zero reward std", ["frac_reward_zero_std"]),
    ("throughput", "throughput (completion tokens/s)", ["tokens_per_second"]),
    ("audit", "reward audit: agreement of the reward with its audit (reward_audit)", ["audit/agreement"]),
    # rlvr dpo and rlvr rft (finetune/)
    ("dpo_rewards", "DPO implicit rewards: beta x log-ratio to the reference", ["rewards/chosen", "rewards/rejected", "rewards/margins"]),
    ("dpo_accuracy", "DPO pairs ranked right (rewards/accuracies)", ["rewards/accuracies"]),
    ("self_samples", "own samples: verifier-correct rate and kept rate per round", ["self/correct_rate", "self/keep_rate"]),
]
CONFIG_KEYS = ("method", "model", "task", "dataset", "reward_funcs", "loss_type", "beta", "learning_rate",
               "num_generations", "max_completion_length", "max_steps", "temperature", "seed")
SAMPLES_PER_STEP = 8
MAX_TEXT = 4000  # characters of a prompt or completion shown in the table


@dataclass(frozen=True)
class Span:
    """An alert period: `rule` fired at step `start` and cleared at `end` (the last step if it never did)."""

    rule: str
    severity: str
    start: float
    end: float
    cleared: bool


def write_report(run_dir: Path) -> Path:
    """Draw the plots and write run_dir/report.html; returns its path. Safe to call while training writes."""
    run_dir = Path(run_dir)
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if _number(m.get("step")) is not None]
    alerts = [a for a in read_jsonl(run_dir / "alerts.jsonl") if _number(a.get("step")) is not None]
    completions = read_jsonl(run_dir / "completions.jsonl")
    config = _read_yaml(run_dir / "config.yaml")
    summary = _read_json(run_dir / "summary.json")
    evals = [e for e in (_read_json(run_dir / f"eval_{label}.json") for label in ("before", "after")) if e]
    last_step = max([m["step"] for m in metrics] + [a["step"] for a in alerts], default=0)
    spans = alert_spans(alerts, last_step)
    eval_steps = [e["step"] for e in evals if _number(e.get("step")) is not None]
    first_step = min([m["step"] for m in metrics] + eval_steps, default=0)
    x_range = (first_step, max([last_step] + eval_steps))  # one x range for every plot, so periods line up

    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for stem, title, keys in PANELS:
        lines = collect_series(metrics, keys)
        extra = _panel_extras(stem, metrics, evals)
        if not lines and not extra.get("points") and not extra.get("right"):
            continue
        png = draw_panel(title, lines, spans, x_range, **extra)
        _write_atomic(plots_dir / f"{stem}.png", png)
        images.append((stem, title, png))

    running = summary is None or _number(summary.get("steps")) is None or summary["steps"] < last_step
    audit = read_jsonl(run_dir / "audit.jsonl")
    page = render_html(run_dir, config, summary, last_step, images, alerts, pick_samples(completions), running, audit)
    path = run_dir / "report.html"
    _write_atomic(path, page.encode("utf-8"))
    return path


def find_run_dir(run_dir: str | Path | None = None, root: Path = Path("runs")) -> Path:
    """The run to report on: `run_dir`, or by default the run under `root` that logged most recently."""
    if run_dir is None:
        runs = [p.parent for p in Path(root).glob("*/metrics.jsonl")]
        if not runs:
            raise FileNotFoundError(f"no run with a metrics.jsonl under {root}/; give the run directory, e.g. rlvr report runs/x")
        return max(runs, key=lambda p: (p / "metrics.jsonl").stat().st_mtime)
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; give a run directory, e.g. rlvr report runs/x")
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{path} has no metrics.jsonl: not a training run, or no step has been logged yet")
    return path


# --- reading -------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a missing file, a torn last line or a junk line is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        value = yaml.safe_load(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def _number(value) -> float | None:
    """A finite int or float, else None (null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def collect_series(metrics: list[dict], keys: list) -> dict[str, tuple[list, list]]:
    """{metric name: (steps, values)} for each key (or each name matching a pattern) with a number."""
    names = []
    for key in keys:
        if isinstance(key, str):
            names.append(key)
        else:
            names.extend(sorted({k for m in metrics for k in m if key.fullmatch(k)}))
    out = {}
    for name in dict.fromkeys(names):
        points = [(m["step"], _number(m.get(name))) for m in metrics]
        points = [(s, v) for s, v in points if v is not None]
        if points:
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def _panel_extras(stem: str, metrics: list[dict], evals: list[dict]) -> dict:
    """What a panel draws besides its own metrics: beta beside KL, the before/after evaluations."""
    if stem == "kl":
        return {"right": collect_series(metrics, ["beta"])}
    if stem == "eval_accuracy":
        points = [(e["step"], e["accuracy"]) for e in evals
                  if _number(e.get("step")) is not None and _number(e.get("accuracy")) is not None]
        return {"points": {"held-out before / after": points} if points else {}, "ylim": (-0.02, 1.02)}
    return {}


def alert_spans(alerts: list[dict], last_step: float) -> list[Span]:
    """Pair each rule's "start" with its next "clear"; a period never cleared runs to `last_step`."""
    spans, open_ = [], {}
    for a in sorted(alerts, key=lambda a: a["step"]):
        rule = str(a.get("rule", "alert"))
        if a.get("event") == "start" and rule not in open_:
            open_[rule] = a
        elif a.get("event") == "clear" and rule in open_:
            began = open_.pop(rule)
            spans.append(Span(rule, str(began.get("severity", "warn")), began["step"], a["step"], True))
    for rule, began in open_.items():
        spans.append(Span(rule, str(began.get("severity", "warn")), began["step"], max(last_step, began["step"]), False))
    return sorted(spans, key=lambda s: (s.start, s.rule))


def pick_samples(completions: list[dict]) -> list[tuple[int, list[dict]]]:
    """The sample completions of the first, middle and last logged steps."""
    by_step: dict = {}
    for row in completions:
        if _number(row.get("step")) is not None:
            by_step.setdefault(row["step"], []).append(row)
    steps = sorted(by_step)
    chosen = sorted({steps[0], steps[len(steps) // 2], steps[-1]}) if steps else []
    return [(s, by_step[s][:SAMPLES_PER_STEP]) for s in chosen]


# --- drawing -------------------------------------------------------------------------------


def draw_panel(title: str, lines: dict, spans: list[Span], x_range: tuple, right: dict | None = None,
               points: dict | None = None, ylim: tuple | None = None) -> bytes:
    """One plot over the steps `x_range` (first, last) as PNG bytes: `lines` on the left axis, `right` on a
    second axis, `points` as markers, each alert period shaded and named in the legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)
    first, last = x_range
    if last > first:
        ax.set_xlim(first - 0.02 * (last - first), last + 0.02 * (last - first))
    if ylim:
        ax.set_ylim(*ylim)
    for name, (steps, values) in lines.items():
        ax.plot(steps, values, label=_label(name), marker="o" if len(steps) < 30 else None, markersize=3)
    for name, pts in (points or {}).items():
        ax.scatter([s for s, _ in pts], [v for _, v in pts], label=_label(name), marker="D", zorder=3, color="black")
    handles, labels = ax.get_legend_handles_labels()
    if right:
        twin = ax.twinx()
        for name, (steps, values) in right.items():
            twin.plot(steps, values, label=_label(name), color="tab:purple", linestyle="--")
            twin.set_ylabel(_label(name))
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    colors, seen = _rule_colors(spans), set()
    for span in spans:
        low, high = (span.start - 0.5, span.end + 0.5) if span.start == span.end else (span.start, span.end)
        patch = ax.axvspan(low, high, color=colors[span.rule], alpha=0.15, hatch="//" if span.severity == "stop" else None)
        if span.rule not in seen:
            seen.add(span.rule)
            handles.append(patch)
            labels.append(_label(f"alert: {span.rule}"))
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")
    fig.get_layout_engine().execute(fig)  # the constrained layout once, then kept: savefig would redo it in each draw
    fig.set_layout_engine("none")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})  # 10% more bytes than the default 6, written faster
    return buf.getvalue()


def _rule_colors(spans: list[Span]) -> dict[str, str]:
    palette = ["tab:red", "tab:orange", "tab:olive", "tab:pink", "tab:brown", "tab:cyan", "tab:gray"]
    rules = sorted({s.rule for s in spans})
    return {rule: palette[i % len(palette)] for i, rule in enumerate(rules)}


def _label(text: str) -> str:
    """A legend label as written: no mathtext from a `$`, and not hidden by a leading underscore."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


# --- the page ------------------------------------------------------------------------------

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top;text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:1em} figure{margin:0} img{max-width:640px;width:100%}
pre{white-space:pre-wrap;word-break:break-word;margin:0;max-width:38em;font-size:.95em}
.stop{color:#b00} .muted{color:#777}
"""


def render_html(run_dir, config, summary, last_step, images, alerts, samples, running, audit=()) -> str:
    e = _escape
    title = f"rlvr report: {run_dir.resolve().name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # Model text is escaped below; this also stops any script or remote fetch should that ever fail.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">",
        '<meta http-equiv="refresh" content="60">' if running else "",
        f"<title>{e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>{e(str(run_dir))} &middot; step {e(_fmt(last_step))} &middot; "
        f"{'not finished (no summary.json yet), this page reloads every minute' if running else 'finished'} &middot; "
        f"written {e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        _settings_table(config, summary),
        "<h2>Curves</h2>",
    ]
    if images:
        parts.append('<div class="plots">')
        for stem, caption, png in images:
            data = base64.b64encode(png).decode("ascii")
            parts.append(f'<figure><img id="plot-{stem}" alt="{e(caption)}" src="data:image/png;base64,{data}"></figure>')
        parts.append("</div>")
    else:
        parts.append('<p class="muted">No metrics logged yet.</p>')
    parts += [_alerts_table(alerts), _audit_table(audit), _samples_table(samples), "</body></html>"]
    return "\n".join(p for p in parts if p) + "\n"


def _settings_table(config: dict, summary: dict | None) -> str:
    rows = [(k, config[k]) for k in CONFIG_KEYS if config.get(k) not in (None, "", [], {})]
    for label in ("eval_before", "eval_after"):
        result = (summary or {}).get(label)
        if isinstance(result, dict) and _number(result.get("accuracy")) is not None:
            rows.append((f"held-out accuracy, {label[5:]}", f"{result['accuracy']:.1%} (n={result.get('n', '?')})"))
    if summary and _number(summary.get("train_seconds")) is not None:
        rows.append(("training wall time", f"{summary['train_seconds']:.0f} s"))
    if not rows:
        return ""
    body = "".join(f"<tr><th>{_escape(k)}</th><td>{_escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f'<table id="settings">{body}</table>'


def _alerts_table(alerts: list[dict]) -> str:
    if not alerts:
        return '<h2>Alerts</h2><p class="muted">None.</p>'
    head = "".join(f"<th>{c}</th>" for c in ("step", "rule", "event", "severity", "value", "message", "suggestion"))
    rows = []
    for a in sorted(alerts, key=lambda a: a["step"]):
        cls = ' class="stop"' if a.get("severity") == "stop" else ""
        cells = "".join(f"<td>{_escape(_fmt(a.get(k)))}</td>" for k in ("step", "rule", "event", "severity", "value", "message", "suggestion"))
        rows.append(f"<tr{cls}>{cells}</tr>")
    return f'<h2>Alerts</h2><table id="alerts"><tr>{head}</tr>{"".join(rows)}</table>'


AUDIT_ROWS = 20  # the latest disagreements shown


def _audit_table(rows) -> str:
    """The reward audit's latest disagreements (audit.jsonl): what the reward and its audit scored differently."""
    if not rows:
        return ""
    head = "".join(f"<th>{c}</th>" for c in ("step", "prompt", "answer", "completion", "reward", "audit"))
    body = []
    for row in rows[-AUDIT_ROWS:]:
        cells = [_fmt(row.get("step")), _clip(row.get("prompt")), _fmt(row.get("answer")), _clip(row.get("completion")),
                 f"{_fmt(row.get('reward'))} {_fmt(row.get('reward_score'))}", f"{_fmt(row.get('audit'))} {_fmt(row.get('audit_score'))}"]
        body.append("<tr>" + "".join(f"<td><pre>{_escape(c)}</pre></td>" for c in cells) + "</tr>")
    return (f"<h2>Reward audit: {len(rows)} disagreement{'s' * (len(rows) != 1)} (the latest {min(len(rows), AUDIT_ROWS)}; "
            f'all in audit.jsonl)</h2><table id="audit"><tr>{head}</tr>{"".join(body)}</table>')


def _samples_table(samples: list[tuple[int, list[dict]]]) -> str:
    if not samples:
        return ""
    head = "".join(f"<th>{c}</th>" for c in ("step", "prompt", "answer", "completion", "reward"))
    rows = []
    for step, group in samples:
        for row in group:
            scores = " ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k != "step" and _number(v) is not None)
            extra = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
            scores += "".join(f" {k} {_fmt(v)}" for k, v in extra.items())
            cells = [_fmt(step), _clip(row.get("prompt")), _fmt(row.get("answer")), _clip(row.get("completion")), scores]
            rows.append("<tr>" + "".join(f"<td><pre>{_escape(c)}</pre></td>" for c in cells) + "</tr>")
    return f'<h2>Sample completions (start, middle, end)</h2><table id="samples"><tr>{head}</tr>{"".join(rows)}</table>'


def _clip(text) -> str:
    text = _fmt(text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f" ... ({len(text) - MAX_TEXT} more characters)"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _escape(text: str) -> str:
    return html.escape(str(text), quote=True)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
