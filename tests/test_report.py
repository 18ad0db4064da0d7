"""`autotune report`: real studies rendered, then loaded in a real headless Chromium.

Four real sweeps of the tiny model on the CPU (real probes in their own processes, the four
sweeps side by side) make the studies: the demo study (configs that fit, one that ran out of
memory for real under the 600 MiB cap and those predicted from it), a study where the first
probe already runs out of memory (a 300 MiB cap), a one-trial study and a pareto study, all
with --no-trace (an OOM measured, not traced, whatever the machine's timings). Each
sweep writes its report.html when it ends; each page is opened the way a person opens it, and
must draw every plot it shows, log no console error and ask nothing of the network.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from browser import open_page
from test_sweep_e2e import SPACE  # micro-batch 16 runs out of memory under the 600 MiB cap

from autotune.report.estimates import median_error
from autotune.report.figures import best_so_far
from autotune.report.view import outcome_of

DEMO_SPACE = SPACE.replace("gradient_checkpointing: {type: bool}",
                           "gradient_checkpointing: {type: bool}\n  "
                           "offload_optimizer: {type: bool}")
PARETO_SPACE = SPACE.replace("choices: [2, 16]", "choices: [2, 4]").replace(
    "gradient_checkpointing: {type: bool}", "offload_optimizer: {type: bool}")
STUDIES = {  # name: (space, extra options)
    "demo": (DEMO_SPACE, []),
    "only-oom": (SPACE, ["--gpu-memory-limit", "300MiB"]),
    "one-trial": (SPACE, ["--trials", "1"]),
    "pareto": (PARETO_SPACE, ["--objective", "pareto", "--trials", "2"]),
}
EVERY_FIGURE = {"frontier", "phases", "timeline", "importance", "slice-speed", "slice-memory",
                "model", "length"}


def autotune(*args: str) -> list[str]:
    return [sys.executable, "-m", "autotune", *args]


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Run the four sweeps at once; each one's finished process and its study folder."""
    root = tmp_path_factory.mktemp("report")
    running = {}
    for name, (space, extra) in STUDIES.items():
        (root / f"{name}.yaml").write_text(space)
        command = autotune("run", "--finalists", "0",
                           "--model", "tiny-qwen2.5", "--space", str(root / f"{name}.yaml"),
                           "--study", name, "--results-dir", str(root / "results"),
                           "--device", "cpu", "--threads", "1", "--gpu-memory-limit", "600MiB",
                           "--warmup-steps", "0", "--timed-steps", "1", "--no-trace", *extra)
        running[name] = subprocess.Popen(command, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    done = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=900)
        done[name] = (subprocess.CompletedProcess(process.args, process.returncode, out, err),
                      root / "results" / name)
    return done


def rows(study_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(study_dir / "trials.csv")))


@pytest.mark.slow
def test_every_sweep_writes_its_report_and_show_names_it(studies):
    for name, (run, study_dir) in studies.items():
        assert run.returncode == (1 if name == "only-oom" else 0), run.stderr[-3000:]
        report = study_dir / "report.html"
        assert f"report: {report}" in run.stdout, run.stdout[-2000:]
        assert report.stat().st_size > 1_000_000  # plotly.js is inside it
        show = subprocess.run(autotune("show", "--study", name, "--results-dir",
                                       str(study_dir.parent)), capture_output=True, text=True)
        assert show.returncode == 0 and f"report: {report}" in show.stdout
        if name != "only-oom":  # how long responses may grow: each config, and the best's
            assert "fits to" in show.stdout and "length headroom: " in show.stdout
            best = yaml.safe_load((study_dir / "best.yaml").read_text())
            assert best["length_headroom"]["fits_up_to_response_tokens"] >= \
                best["config"]["max_response_length"]


@pytest.mark.slow
@pytest.mark.browser
def test_demo_report_draws_every_plot_offline_in_chromium(studies, chromium, tmp_path):
    run, study_dir = studies["demo"]
    # half a laptop's screen: the page and every plot must fit it
    page = open_page(chromium, study_dir / "report.html", tmp_path / "demo.png", width_px=800)
    assert page.console_errors == [] and page.page_errors == []
    assert page.network_requests == []
    assert page.figures == {key: True for key in EVERY_FIGURE}, page.notes
    assert page.title == "autotune report: demo" and page.overflow_px <= 0
    assert (tmp_path / "demo.png").stat().st_size > 50_000
    text = (study_dir / "report.html").read_text()
    assert text.count("* plotly.js v") == 1  # embedded once, for every figure
    assert "<script src=" not in text and "<link" not in text
    # the frontier's legend counts what trials.csv says happened
    trials = [r for r in rows(study_dir) if r["reused_from"] == ""]
    fits = sum(r["status"] == "ok" and r["feasible"] == "True" for r in trials)
    ooms = sum(r["status"] == "gpu_oom" and r["predicted"] != "True" for r in trials)
    predicted = sum(r["predicted"] == "True" for r in trials)
    assert ooms == 1 and fits >= 3, run.stderr[-2000:]
    assert f"fits ({fits})" in text and f"oom ({ooms})" in text
    assert (f"predicted oom ({predicted})" in text) == (predicted > 0)


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("name", ["only-oom", "one-trial", "pareto"])
def test_edge_studies_render_and_say_what_they_cannot_draw(studies, chromium, tmp_path, name):
    run, study_dir = studies[name]
    page = open_page(chromium, study_dir / "report.html", tmp_path / f"{name}.png")
    assert page.console_errors == [] and page.page_errors == []
    assert page.network_requests == []
    assert all(page.figures.values()), page.figures  # a figure shown is a figure drawn
    assert page.overflow_px <= 0
    missing = EVERY_FIGURE - set(page.figures)
    assert sum(note.startswith("Not drawn: ") for note in page.notes) == len(missing)
    assert {"frontier", "timeline"} <= set(page.figures)
    text = (study_dir / "report.html").read_text()
    if name == "only-oom":  # nothing fit: no best, no front, no knob plots, but the wall
        assert "No feasible configuration yet" in text and "oom (1)" in text
        assert {"importance", "slice-speed", "model"} <= missing
    if name == "one-trial":
        assert len(rows(study_dir)) == 1 and "Best: trial 0" in text
        assert "importance" in missing and "model" in page.figures
    if name == "pareto":
        assert "pareto" in text and missing <= {"importance"}


def test_missing_plotly_is_one_line(tmp_path):
    shadow = tmp_path / "shadow" / "plotly"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named plotly')\n")
    out = subprocess.run(autotune("report", "--results-dir", str(tmp_path)), capture_output=True,
                         text=True, env={"PYTHONPATH": str(shadow.parent), "PATH": ""})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "pip install 'autotune[report]'" in lines[0]


def test_outcomes_a_reader_tells_apart():
    assert outcome_of({"status": "ok", "feasible": True}) == "fits"
    assert outcome_of({"status": "ok", "feasible": False}) == "over headroom"
    assert outcome_of({"status": "cache_oom"}) == "oom"
    assert outcome_of({"status": "gpu_oom", "predicted": True}) == "predicted oom"
    assert outcome_of({"status": "invalid", "predicted": True}) == "invalid"
    assert outcome_of({"status": "timeout"}) == "failed"


def test_best_so_far_follows_the_objective_not_raw_speed():
    from types import SimpleNamespace as T

    trials = [T(number=0, tokens_per_s=100.0), T(number=1, tokens_per_s=None),
              T(number=2, tokens_per_s=300.0), T(number=3, tokens_per_s=200.0)]
    # the objective ranks #3 (less memory) above #2 (faster): the line takes #3's speed
    assert best_so_far(trials, ranked=[3, 2, 0]) == [100.0, 100.0, 300.0, 200.0]
    assert best_so_far(trials, ranked=[]) == [None] * 4
    assert median_error([(110, 100), (90, 100), (100, 100)]) == pytest.approx(0.1)
    assert median_error([]) is None


def test_knob_plots_fit_the_page_whatever_the_knob_count(tmp_path):
    """Optuna widens a slice plot by 300 px a knob past 3 knobs; the page fits it instead (a
    real study of five searched knobs, probed on a device the memory model describes
    exactly: a stand-in for the probe, which this test is not about)."""
    from scripted_runner import model_study

    from autotune.report.figures import feasible_study, importances, slices
    from autotune.report.view import read_study
    from autotune.sweep.study.storage import load_study

    model_study(tmp_path, "knobs", 10)
    study = feasible_study(read_study(load_study(str(tmp_path), "knobs")))
    assert len(study.trials) >= 3 and len(study.trials[0].params) == 5
    for metric in (0, 1):
        figure, why = slices(study, metric)
        assert why == "" and figure.layout.width is None
        assert len([axis for axis in figure.layout if axis.startswith("xaxis")]) >= 4
    figure, why = importances(study)
    assert why == "" and {bar.name for bar in figure.data} == {"tokens/s", "peak memory (GiB)"}
