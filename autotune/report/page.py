"""The report page: the headline, the tables and the figures with a caption each, in one HTML
file that opens offline (plotly.js inlined once, no other script or style fetched).
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.config import describe_params, format_bytes
from autotune.errors import AutotuneError, ConfigError
from autotune.files import write_text_atomic
from autotune.report.view import StudyView, headline, phases_of, read_study
from autotune.version import __version__

if TYPE_CHECKING:
    from optuna import Study
    from plotly.graph_objects import Figure

REPORT_NAME = "report.html"
GENERATOR = '<meta name="generator" content="autotune report">'  # marks a file as ours
BEST_FEW = 4  # configs in the per-phase bars: the best few and the start
STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;padding:0 1.5em;max-width:1200px;
color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-top:1px solid #ddd;padding-top:1em}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.2em .8em;text-align:left;
border-bottom:1px solid #eee}th{background:#f6f6f6}.caption{color:#555;margin:.2em 0 .6em}
.changed{font-weight:bold}.note{color:#777;font-style:italic}.gain{font-size:1.1em}"""


def require_plotly() -> None:
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise AutotuneError("the report needs plotly, which is not installed: pip install "
                           "'autotune[report]' (or pip install plotly)") from None


def check_out_path(path: Path) -> None:
    """Refuse a path whose folder is missing, or a file there that is not an autotune report
    (one is replaced whole; anything else is left alone)."""
    if path.parent.is_file():
        raise ConfigError(f"--out {path}: folder {path.parent} is a file; choose another path")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {path}: folder {path.parent} does not exist; create it first")
    if path.is_dir():
        raise ConfigError(f"--out {path}: is a folder; give a file name such as "
                          f"{path / REPORT_NAME}")
    if path.exists():
        with open(path, "rb") as handle:
            start = handle.read(4096).decode("utf-8", "replace")
        if GENERATOR not in start:
            raise ConfigError(f"--out {path}: exists and is not an autotune report; choose a "
                              "new path or remove it")


def write_report(study: Study, path: Path) -> Path:
    """Render `study` and write it to `path` atomically; returns the path."""
    require_plotly()
    check_out_path(path)
    write_text_atomic(path, render(read_study(study)))
    return path


def table(rows: list[dict[str, str]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in (row.get(c, "")
                                                                    for c in columns)) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def gain_lines(view: StudyView) -> list[str]:
    """The best config and what it gains over the start, as HTML paragraphs."""
    if view.best is None:
        return ["<p class='gain'>No feasible configuration yet: nothing probed fits the "
                "budget.</p>"]
    best = view.trial(view.best)
    tokens, peak = view.best_figures or (best.tokens_per_s or 0.0, best.peak_mem_bytes or 0)
    lines = [f"<p class='gain'><b>Best: trial {best.number}</b>, {tokens:,.1f} tokens/s at "
             f"{format_bytes(peak)} peak" + (" (the mean over its probes, the most memory "
                                             "any held)" if view.finalists else "") + ".</p>"]
    if view.start is None:
        return lines
    start = view.trial(view.start)
    what = f"{view.start_kind} (trial {start.number})"
    if start.number == best.number:
        lines.append(f"<p>The best is {html.escape(what)}: the sweep found nothing better.</p>")
    elif start.outcome == "stopped slow":
        lines.append(f"<p>{html.escape(what)} was stopped early: "
                     f"{html.escape(start.reason)}.</p>")
    elif start.outcome != "fits" or not start.tokens_per_s or not start.peak_mem_bytes:
        lines.append(f"<p>{html.escape(what)} does not fit: {html.escape(start.outcome)}"
                     f"{', ' + html.escape(start.reason) if start.reason else ''}.</p>")
    else:
        assert best.tokens_per_s and best.peak_mem_bytes  # the best was probed and fits
        lines.append(f"<p class='gain'>Against {html.escape(what)}: <b>"
                     f"{tokens / start.tokens_per_s:.2f}x the tokens/s</b> at <b>"
                     f"{peak / start.peak_mem_bytes:.2f}x the peak memory</b> "
                     "(measured side by side in this study).</p>")
    return lines


def knob_table(view: StudyView) -> str:
    if view.best is None or not view.searched:
        return ""
    best = view.trial(view.best)
    start = view.trial(view.start) if view.start is not None else None
    rows = []
    for name in view.searched:
        value, before = best.params.get(name, ""), start.params.get(name, "") if start else ""
        mark = " class='changed'" if start is not None and value != before else ""
        rows.append({"knob": html.escape(name), "start": html.escape(str(before)),
                     "best": f"<span{mark}>{html.escape(str(value))}</span>"})
    return table(rows, ["knob", "start", "best"])


def front_table(view: StudyView) -> str:
    rows = [{"trial": f"#{t.number}", "tokens/s": f"{t.tokens_per_s:,.1f}",
             "peak": format_bytes(t.peak_mem_bytes),
             "config": html.escape(describe_params(t.params))}
            for t in (view.trial(n) for n in view.front)]
    if not rows:
        return "<p class='note'>No Pareto front: no feasible probe yet.</p>"
    return table(rows, ["trial", "tokens/s", "peak", "config"])


def finalists_table(view: StudyView) -> str:
    """The finalists probed again before the pick, each with its interval, and the rule."""
    record = view.finalists
    if record is None:
        return ""
    rows = []
    for item in record["entries"]:
        low, high = item["tokens_per_s_interval"]
        rows.append({"trial": f"#{item['trial']}" + (" (picked)" if item["trial"] ==
                                                      record["chosen"] else ""),
                     "probes": str(len(item["probes"])),
                     "tokens/s": f"{item['tokens_per_s_mean']:,.1f}",
                     "interval": f"{low:,.1f} to {high:,.1f}",
                     "peak": format_bytes(item["peak_mem_bytes"]),
                     "under contention": str(item["contended"])})
    return ("<h2>Finalists</h2><p class='caption'>The best configs probed again before the "
            f"pick, each up to {record['max_probes']} times; one probe's noise "
            f"{record['noise_relative_sd']:.1%}; intervals are the mean's, at 2 standard "
            f"errors. Rule: {html.escape(record['rule'])}. Picked trial {record['chosen']}: "
            f"{html.escape(record['why'])}.</p>"
            + table(rows, ["trial", "probes", "tokens/s", "interval", "peak",
                           "under contention"]))


def section(title: str, caption: str, figure: Figure | None, key: str,
            missing: str = "") -> str:
    """One figure with its heading and its one-line caption (or why it is not drawn)."""
    import plotly.io as pio

    head = f"<h2>{html.escape(title)}</h2><p class='caption'>{html.escape(caption)}</p>"
    if figure is None:
        return head + f"<p class='note'>Not drawn: {html.escape(missing)}.</p>"
    body = pio.to_html(figure, full_html=False, include_plotlyjs=False, div_id=f"fig-{key}",
                       config={"displaylogo": False, "responsive": True})
    return head + f"<div class='figure' data-figure='{key}'>{body}</div>"


def figure_sections(view: StudyView) -> list[str]:
    """Every figure of the page with its heading and caption, in page order."""
    from autotune.report import figures
    from autotune.report.estimates import phase_parts

    phases = phases_of(view)
    bars_for = list(dict.fromkeys([*view.ranked[:BEST_FEW],
                                   *([view.start] if view.start is not None else [])]))
    parts = phase_parts(view, [t for t in view.trials if t.phase_peak_mem_bytes
                               or t.number in bars_for])
    bars = figures.phase_breakdown(view, parts, bars_for, phases)
    model_fig, model_note = figures.model_vs_measured(view, parts)
    length_fig, length_why = figures.length_headroom(view, view.ranked[:BEST_FEW])
    feasible = figures.feasible_study(view)
    importance_fig, importance_why = figures.importances(feasible)
    speed_fig, speed_why = figures.slices(feasible, 0)
    memory_fig, memory_why = figures.slices(feasible, 1)
    return [
        section("Throughput against peak memory", "Each point is one probed config: up is "
                "faster, left needs less memory; out-of-memory configs stand on the capacity "
                "line, predicted OOMs, invalid and failed configs just right of it; the line "
                "joins the Pareto front; hover a point for its config.",
                figures.throughput_vs_memory(view), "frontier"),
        section("Memory per phase of the best configs", "Bars split each phase's estimate "
                "into model states, transient and context (memory model, calibrated on this "
                "study); diamonds are the measured peaks; a config binds where its tallest "
                "diamond is, and must stay under the dashed headroom budget.", bars, "phases",
                "no probe measured a phase yet"),
        section("How long responses may grow", "Peak memory of the best configs against "
                "the response length, everything else held (the study's memory model, "
                "calibrated on its probes and anchored on each config's own measured peaks; "
                "diamonds are the probes): RL responses grow as training goes on, and a "
                "config runs out of memory where its line crosses the headroom budget. With "
                "token budgets the update and log-prob peaks stay flat up to the budget.",
                length_fig, "length", length_why),
        section("The sweep over time", "The line is the tokens/s of the best feasible config "
                "so far (by the study's objective), by trial and by wall-clock time; markers "
                "are each trial's outcome, at 0 when it has no throughput.",
                figures.sweep_over_time(view), "timeline", "no trial finished yet"),
        section("What each knob matters for", "Optuna's importance of each knob that varied "
                "among the feasible probes, for tokens/s and for peak memory: long bars are "
                "the knobs worth tuning.", importance_fig, "importance", importance_why),
        section("Each knob against tokens/s", "Optuna's slice plot over the feasible probes: "
                "one panel per knob, one point per probe, colour by trial order.", speed_fig,
                "slice-speed", speed_why),
        section("Each knob against peak memory", "The same slices for the measured peak "
                "memory.", memory_fig, "slice-memory", memory_why),
        section("The memory model against measurement", "Each point is one phase of one "
                "successful probe (marker: rollout circle, experience square, update diamond, "
                "validation triangle): the model's estimate against the measured peak, before "
                "and after calibration (in-sample); on the dotted line it is exact. "
                + model_note, model_fig, "model",
                "no successful probe to compare with, or no memory model for this model"),
    ]


def render(view: StudyView) -> str:
    """The whole page."""
    from plotly.offline import get_plotlyjs

    facts = table([{"": f"<b>{html.escape(k)}</b>", " ": html.escape(v)}
                   for k, v in headline(view).items()], ["", " "])
    written = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>", GENERATOR,
        f"<title>autotune report: {html.escape(view.name)}</title>",
        f"<style>{STYLE}</style>", f"<script type='text/javascript'>{get_plotlyjs()}</script>",
        "</head><body>", f"<h1>autotune report: study {html.escape(view.name)}</h1>", facts,
        *gain_lines(view), knob_table(view), "<h2>Pareto front</h2><p class='caption'>"
        "Feasible configs no other beats on both tokens/s and peak memory, least memory "
        "first.</p>", front_table(view), finalists_table(view), *figure_sections(view),
        f"<p class='note'>Written by autotune {__version__} on {written}; opens offline "
        "(plotly.js is embedded in this file).</p>", "</body></html>", ""])
