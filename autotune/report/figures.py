"""The report's plots, drawn with plotly (imported here only): memory and time by hand with
plotly's graph objects, the knobs through optuna.visualization.

Each figure function returns a plotly Figure, or None when the study holds nothing to draw
(with the reason, which the page shows in the figure's place).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from autotune.config import describe_params
from autotune.report.estimates import PhaseParts, median_error
from autotune.report.view import OUTCOMES, StudyView, TrialView

if TYPE_CHECKING:
    from optuna import Study
    from plotly.graph_objects import Figure

COLORS = {"fits": "#2a9d8f", "stopped slow": "#8ecae6", "over headroom": "#e9c46a",
          "oom": "#d62828", "predicted oom": "#9d4edd", "invalid": "#6c757d", "failed": "#343a40"}
SYMBOLS = {"fits": "circle", "stopped slow": "triangle-down-open",
           "over headroom": "circle-open", "oom": "x", "predicted oom": "x-open",
           "invalid": "square-open", "failed": "triangle-down"}
PHASE_SYMBOLS = {"rollout": "circle", "experience": "square", "critic_update": "cross",
                 "update": "diamond",
                 "validation": "triangle-up"}
# where the configs without a throughput stand on the memory axis, as multiples of capacity
WALL_COLUMNS = {"oom": 1.0, "predicted oom": 1.04, "invalid": 1.08, "failed": 1.08}
LAYOUT = {"template": "plotly_white", "height": 460, "margin": {"t": 40, "r": 20, "b": 50},
          "legend": {"orientation": "h", "y": -0.18}}


def hover(trial: TrialView, unit: tuple[int, str]) -> str:
    lines = [f"trial {trial.number}: {trial.outcome} ({trial.status})",
             describe_params(trial.params) or "(no searched knobs)"]
    if trial.tokens_per_s:
        lines.append(f"{trial.tokens_per_s:,.1f} tokens/s at "
                     f"{(trial.peak_mem_bytes or 0) / unit[0]:,.3g} {unit[1]}")
    if trial.failed_phase:
        lines.append(f"failed in {trial.failed_phase}")
    if trial.reason and trial.outcome != "fits":
        lines.append(trial.reason[:160])
    return "<br>".join(lines)


def memory_lines(fig: Figure, view: StudyView, vertical: bool) -> None:
    """The capacity and the headroom budget as lines across the plot."""
    size, unit = view.memory_unit
    for value, name, dash in ((view.capacity_bytes, "capacity", "solid"),
                              (view.budget_bytes, "headroom budget", "dash")):
        if not value:
            continue
        line = {"color": "#d62828" if name == "capacity" else "#f4a261", "dash": dash}
        add = fig.add_vline if vertical else fig.add_hline
        add(value / size, line=line, annotation_text=f"{name} {value / size:,.3g} {unit}",
            annotation_position="top left" if vertical else "top right")


def throughput_vs_memory(view: StudyView) -> Figure:
    """Tokens/s against peak memory for every config; what has no throughput at the wall."""
    import plotly.graph_objects as go

    fig = go.Figure()
    size, unit = view.memory_unit
    ran = [t for t in view.trials if t.tokens_per_s and t.peak_mem_bytes]
    top = max((t.tokens_per_s or 0 for t in ran), default=0) or 1.0
    wall = (view.capacity_bytes or max((t.peak_mem_bytes or 0 for t in ran), default=size)
            ) / size
    for outcome in ("fits", "stopped slow", "over headroom"):  # a slow one: its rate at most
        points = [t for t in ran if t.outcome == outcome]
        if points:
            fig.add_trace(go.Scatter(
                x=[(t.peak_mem_bytes or 0) / size for t in points],
                y=[t.tokens_per_s for t in points],
                mode="markers", name=f"{outcome} ({len(points)})",
                marker={"color": COLORS[outcome], "symbol": SYMBOLS[outcome], "size": 10},
                text=[hover(t, (size, unit)) for t in points], hoverinfo="text"))
    for outcome, column in WALL_COLUMNS.items():
        points = [t for t in view.trials if t.outcome == outcome and not t.tokens_per_s]
        if points:  # spread up the column so each can be pointed at
            fig.add_trace(go.Scatter(
                x=[wall * column] * len(points),
                y=[top * (i + 1) / (len(points) + 1) for i in range(len(points))],
                mode="markers", name=f"{outcome} ({len(points)})",
                marker={"color": COLORS[outcome], "symbol": SYMBOLS[outcome], "size": 10},
                text=[hover(t, (size, unit)) for t in points], hoverinfo="text"))
    front = [view.trial(n) for n in view.front]
    if len(front) > 1:
        fig.add_trace(go.Scatter(x=[(t.peak_mem_bytes or 0) / size for t in front],
                                 y=[t.tokens_per_s for t in front], mode="lines",
                                 name="Pareto front", line={"color": COLORS["fits"]},
                                 hoverinfo="skip"))
    for number, name, symbol in ((view.start, "start", "diamond"), (view.best, "best", "star")):
        trial = view.trial(number) if number is not None else None
        if trial is not None and trial.tokens_per_s and trial.peak_mem_bytes:
            fig.add_trace(go.Scatter(
                x=[trial.peak_mem_bytes / size], y=[trial.tokens_per_s], mode="markers+text",
                name=f"{name} (#{trial.number})", text=[name], textposition="top center",
                marker={"symbol": symbol, "size": 18, "color": "rgba(0,0,0,0)",
                        "line": {"color": "#1d3557", "width": 2}}, hoverinfo="skip"))
    memory_lines(fig, view, vertical=True)
    fig.update_layout(**LAYOUT, xaxis_title=f"peak device memory ({unit})",
                      yaxis_title="tokens/s" if ran else "tokens/s (none measured: no probe "
                      "finished a step)", yaxis_rangemode="tozero")
    return fig


def phase_breakdown(view: StudyView, parts: dict[int, dict[str, PhaseParts]],
                    numbers: list[int], phases: list[str]) -> Figure | None:
    """Per-phase peak of a few configs: the model's states / transient / context stacked,
    the measured peak beside them, against capacity."""
    import plotly.graph_objects as go

    size, unit = view.memory_unit
    trials = [view.trial(n) for n in numbers]
    trials = [t for t in trials if t.phase_peak_mem_bytes or t.number in parts]
    if not trials or not phases:
        return None
    x: list[list[str]] = [[], []]
    for trial in trials:
        for phase in phases:
            x[0].append(f"#{trial.number}" + (" best" if trial.number == view.best else "")
                        + (" start" if trial.number == view.start else ""))
            x[1].append(phase)
    fig = go.Figure()

    def column(get: Callable[[PhaseParts], int]) -> list[float | None]:
        values = []
        for trial in trials:
            for phase in phases:
                part = parts.get(trial.number, {}).get(phase)
                values.append(None if part is None else get(part) / size)
        return values

    if parts:
        for name, get, color in (("model states", lambda p: p.states_bytes, "#457b9d"),
                                 ("transient (calibrated)", lambda p: p.transient_bytes,
                                  "#a8dadc"),
                                 ("context (calibrated)", lambda p: p.context_bytes, "#e5e5e5")):
            fig.add_trace(go.Bar(x=x, y=column(get), name=f"model: {name}",
                                 marker_color=color))
    measured = [(t.phase_peak_mem_bytes.get(p) or 0) / size or None
                for t in trials for p in phases]
    fig.add_trace(go.Scatter(x=x, y=measured, mode="markers", name="measured peak",
                             marker={"symbol": "diamond", "size": 12, "color": "#1d3557"}))
    memory_lines(fig, view, vertical=False)
    fig.update_layout(**LAYOUT, barmode="stack", yaxis_title=f"device memory ({unit})")
    return fig


def best_so_far(trials: list[TrialView], ranked: list[int]) -> list[float | None]:
    """Along `trials` in the order given, the tokens/s of the best feasible config so far (by
    the study's objective, whose order `ranked` is)."""
    rank = {number: i for i, number in enumerate(ranked)}
    best: TrialView | None = None
    out = []
    for trial in trials:
        if trial.number in rank and (best is None or rank[trial.number] < rank[best.number]):
            best = trial
        out.append(best.tokens_per_s if best is not None else None)
    return out


def sweep_over_time(view: StudyView) -> Figure | None:
    """Best so far by probe and by wall-clock hour, each trial's outcome marked."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not view.trials:
        return None
    completed = [(t, t.completed) for t in view.trials if t.completed is not None]
    completed.sort(key=lambda pair: pair[1])
    timed = [t for t, _ in completed]
    origin = min((t.started or end for t, end in completed), default=None)
    seconds = [(end - origin).total_seconds() for _, end in completed] if origin else []
    unit_s, unit = (3600, "hours") if max(seconds, default=0) >= 2 * 3600 else (60, "minutes")
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True,
                        subplot_titles=("by trial", f"by wall-clock {unit}"))
    for col, trials, xs in ((1, view.trials, [t.number for t in view.trials]),
                            (2, timed, [s / unit_s for s in seconds])):
        fig.add_trace(go.Scatter(x=xs, y=best_so_far(trials, view.ranked), mode="lines",
                                 line={"shape": "hv", "color": "#1d3557"}, name="best so far",
                                 showlegend=col == 1), row=1, col=col)
        for outcome in OUTCOMES:
            picked = [(x, t) for x, t in zip(xs, trials, strict=True) if t.outcome == outcome]
            if picked:
                fig.add_trace(go.Scatter(
                    x=[x for x, _ in picked], y=[t.tokens_per_s or 0 for _, t in picked],
                    mode="markers", name=outcome, legendgroup=outcome, showlegend=col == 1,
                    marker={"color": COLORS[outcome], "symbol": SYMBOLS[outcome], "size": 9},
                    text=[hover(t, view.memory_unit) for _, t in picked], hoverinfo="text"),
                    row=1, col=col)
    fig.update_layout(**LAYOUT)
    fig.update_xaxes(title_text="trial number", row=1, col=1)
    fig.update_xaxes(title_text=f"{unit} since the first trial started", row=1, col=2)
    fig.update_yaxes(title_text="tokens/s (0: no throughput)", row=1, col=1)
    fig.update_yaxes(rangemode="tozero")
    return fig


def model_vs_measured(view: StudyView, parts: dict[int, dict[str, PhaseParts]]
                      ) -> tuple[Figure | None, str]:
    """Estimate against measurement per phase, before and after calibration (when the study
    has one); with the median errors for the caption."""
    import plotly.graph_objects as go

    rows = [(number, phase, part, measured) for number, phases in parts.items()
            for phase, part in phases.items() if (measured := part.measured_bytes)]
    if not rows:
        return None, ""
    fig = go.Figure()
    size, unit = view.memory_unit
    calibrated = bool(view.calibration)
    prior = median_error([(p.prior_bytes, m) for _, _, p, m in rows])
    fitted = median_error([(p.total_bytes, m) for _, _, p, m in rows])
    series = [(f"prior (median error {prior:.1%})", lambda p: p.prior_bytes, "#e76f51")]
    if calibrated:
        series.append((f"calibrated (median error {fitted:.1%})", lambda p: p.total_bytes,
                       "#2a9d8f"))
    shapes = [PHASE_SYMBOLS.get(phase, "circle") for _, phase, _, _ in rows]
    for name, get, color in series:
        fig.add_trace(go.Scatter(
            x=[m / size for _, _, _, m in rows], y=[get(p) / size for _, _, p, _ in rows],
            mode="markers", name=name, marker={"color": color, "size": 9, "symbol": shapes},
            text=[f"trial {n}, {phase}" for n, phase, _, _ in rows], hoverinfo="text+x+y"))
    top = max(max(m, p.prior_bytes, p.total_bytes) for _, _, p, m in rows) / size
    fig.add_trace(go.Scatter(x=[0, top * 1.05], y=[0, top * 1.05], mode="lines",
                             name="estimate = measured", line={"dash": "dot", "color": "#999"}))
    fig.update_layout(**LAYOUT, xaxis_title=f"measured phase peak ({unit})",
                      yaxis_title=f"memory model's estimate ({unit})")
    note = (f"Over {len(rows)} measured phase peaks: median error {prior:.1%} with the prior "
            "constants" + (f", {fitted:.1%} calibrated" if calibrated else
                           " (no calibration stored yet)"))
    return fig, note


# --- what each knob bought: Optuna's own importance and slice plots ---------------------------
#
# The study's objective values cannot be used as they are: an OOM is told with a sentinel value
# so the sampler learns from it, and importances over sentinels would rank whatever knob causes
# OOMs, not what moves throughput. So the finished feasible probes are copied into an in-memory
# study with two plain metrics, tokens/s and peak memory, and optuna.visualization draws that.

MIN_TRIALS = 3  # fewer feasible probes than this say nothing about a knob's importance


def length_headroom(view: StudyView, numbers: list[int]) -> tuple[Figure | None, str]:
    """Peak memory against the response length, for each of `numbers` (the best configs):
    the study's calibrated memory model, anchored on each probe's measured peaks; the probed
    length is marked, and where a curve crosses the headroom budget is its length headroom."""
    import plotly.graph_objects as go

    from autotune.sweep.feasibility.study_model import StudyModel

    model = StudyModel.of({"request": view.request, "memory_calibration": view.calibration},
                          view.device_capacity_bytes)
    if model is None or view.parsed_request is None or not view.budget_bytes or not numbers:
        return None, "no memory model for this study's model, or no feasible config yet"
    size, unit = view.memory_unit
    fig = go.Figure()
    for number in numbers:
        trial = view.trial(number)
        config = view.config_of(trial)
        reach = model.headroom(config, view.budget_bytes, trial.phase_peak_mem_bytes)
        probed = config.max_response_length
        longest = min(reach.searched_to, max(4 * probed, int(reach.fits_up_to * 1.25)))
        lengths = sorted({max(1, longest * i // 40) for i in range(1, 41)} | {probed})
        peaks = model.curve(config, lengths, trial.phase_peak_mem_bytes)
        name = f"#{number} {describe_params(trial.params)}"[:60]
        fig.add_trace(go.Scatter(
            x=lengths, y=[p / size for p in peaks], mode="lines", name=name,
            hovertemplate=f"{name}<br>%{{x}}-token responses: %{{y:.3g}} {unit}<br>"
                          f"{reach.describe('within the budget')}<extra></extra>"))
        fig.add_trace(go.Scatter(x=[probed], y=[(trial.peak_mem_bytes or 0) / size],
                                 mode="markers", marker={"symbol": "diamond", "size": 9},
                                 showlegend=False, hovertemplate=f"{name}: probed at {probed}"
                                 f" tokens<extra></extra>"))
    memory_lines(fig, view, vertical=False)
    fig.update_layout(**LAYOUT, xaxis_title="response length (tokens)",
                      yaxis_title=f"peak memory ({unit})")
    return fig, ""


def feasible_study(view: StudyView) -> Study:
    """An in-memory Optuna study of the feasible probes: values (tokens/s, peak memory in the
    view's unit)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    with warnings.catch_warnings():  # Optuna flags metric names experimental
        warnings.simplefilter("ignore")
        study.set_metric_names(["tokens/s", f"peak memory ({view.memory_unit[1]})"])
    for trial in view.trials:
        if trial.outcome == "fits" and trial.tokens_per_s and trial.peak_mem_bytes:
            study.add_trial(optuna.trial.create_trial(
                params=trial.params, distributions=trial.distributions,
                values=[trial.tokens_per_s, trial.peak_mem_bytes / view.memory_unit[0]],
                user_attrs={"trial": trial.number}))
    return study


def varied(study: Study) -> list[str]:
    """The knobs that took more than one value among the study's trials, in name order."""
    values: dict[str, set[str]] = {}
    for trial in study.trials:
        for name, value in trial.params.items():
            values.setdefault(name, set()).add(repr(value))
    return sorted(name for name, seen in values.items() if len(seen) > 1)


def importances(study: Study) -> tuple[Figure | None, str]:
    """Both metrics' importances in one bar chart (`study` from feasible_study), or None and
    why not."""
    import optuna.visualization as vis

    params = varied(study)
    if len(study.trials) < MIN_TRIALS or not params:
        return None, (f"needs at least {MIN_TRIALS} feasible probes that differ in some knob "
                      f"(this study has {len(study.trials)} feasible, "
                      f"{len(params)} knobs varied among them)")
    with warnings.catch_warnings():  # Optuna flags its importance API experimental
        warnings.simplefilter("ignore")
        fig = vis.plot_param_importances(study, params=params)
    fig.update_layout(template="plotly_white", height=max(300, 60 + 40 * len(params)),
                      title=None)
    return fig, ""


def slices(study: Study, metric: int) -> tuple[Figure | None, str]:
    """Each varied knob's values against one metric (0: tokens/s, 1: peak memory)."""
    import optuna.visualization as vis

    params = varied(study)
    if len(study.trials) < 2 or not params:
        return None, (f"needs feasible probes that differ in some knob (this study has "
                      f"{len(study.trials)} feasible)")
    assert study.metric_names is not None  # feasible_study names both metrics
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = vis.plot_slice(study, params=params, target=lambda t: t.values[metric],
                             target_name=study.metric_names[metric])
    fig.update_layout(template="plotly_white", height=360, title=None, width=None,
                      autosize=True)  # Optuna sizes it by knob count: fit the page instead
    return fig, ""
