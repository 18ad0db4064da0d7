"""The command probe: reading trainers' logs, the launch line, and running a command as a probe.

Log parsing is checked on real lines users posted (tests/data/captured_trainer_logs.yaml, each
with its source). The probe itself runs real subprocesses through the SubprocessRunner; the
commands are small Python scripts standing in for verl (they print verl's step line) because
verl and EasyR1 need GPUs and vLLM; TRL, which runs on a CPU, is probed for real in
test_command_trl.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from autotune.config import ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.hardware import Device
from autotune.probe.launch.command import launch_argv
from autotune.probe.launch.trainer_logs import StepLog
from autotune.probe.measure.oom import classify_exit
from autotune.probe.measure.result import (
    TRIAL_DIR_TOKEN,
    ProbeRequest,
    ProbeStatus,
    TrainerCommand,
)
from autotune.process_tag import (
    PROBE_TAG_ENV,
    ProcessTree,
    kill_orphaned,
    tag_scope,
    tagged_processes,
)
from autotune.runners.local import SubprocessRunner
from autotune.sweep.execution.command_probe import command_template, parse_launch
from autotune.trainers import get_adapter

CAPTURED = yaml.safe_load((Path(__file__).parent / "data" / "captured_trainer_logs.yaml")
                          .read_text())
EXPECT_KEYS = {"step_time_s": "timing_s/step", "tokens": "perf/total_num_tokens",
               "throughput_tokens_per_s": "perf/throughput",
               "max_memory_allocated_gib": "perf/max_memory_allocated_gb",
               "max_memory_reserved_gib": "perf/max_memory_reserved_gb",
               "cpu_memory_used_gib": "perf/cpu_memory_used_gb"}


def feed(trainer: str, text: str) -> StepLog:
    log = StepLog(trainer)
    for i, line in enumerate(text.splitlines()):
        log.feed(line, float(i))
    log.finish()
    return log


@pytest.mark.parametrize("entry", [e for e in CAPTURED if e["kind"] != "failure"],
                         ids=lambda e: f"{e['trainer']}-{e['source'].rsplit('/', 1)[-1]}")
def test_real_step_lines_are_read_as_the_trainer_printed_them(entry):
    log = feed(entry["trainer"], entry["text"])
    expect = entry["expect"]
    if entry["kind"] == "summary" or expect.get("step") == 0:
        assert log.steps_seen == 0  # an exit summary or validation before training
        return
    assert log.steps_seen == 1
    record = log.records[0]
    if "step" in expect:
        assert record.step == expect["step"]
    for name, key in EXPECT_KEYS.items():
        if name in expect:
            assert record.values[key] == pytest.approx(expect[name])
    if entry["trainer"] == "trl":
        assert record.values["num_tokens"] > 0


@pytest.mark.parametrize("entry", [e for e in CAPTURED if e["kind"] == "failure"],
                         ids=lambda e: f"{e['trainer']}-{e['source'].rsplit('/', 1)[-1]}")
def test_real_trainer_failures_are_classified(entry):
    status, message = classify_exit(1, entry["text"])
    assert status.value == entry["expect"]["status"]
    assert message


def verl_line(step: int, tokens: int, seconds: float) -> str:
    return (f"\x1b[36m(TaskRunner pid=7)\x1b[0m step:{step} - actor/pg_loss:np.float64(0.01) - "
            f"perf/total_num_tokens:{tokens} - timing_s/step:{seconds} - perf/throughput:"
            f"{tokens / seconds:.3f} - perf/max_memory_allocated_gb:{10 + step}.5")


def test_verl_throughput_is_the_steps_after_the_first():
    log = feed("verl", "\n".join(["step:0 - val-core/acc/mean@1:0.5",  # validation first
                                  verl_line(1, 1000, 9.0), "(TaskRunner pid=7) noise",
                                  verl_line(2, 3000, 2.0), verl_line(3, 5000, 3.0)]))
    assert [r.step for r in log.records] == [1, 2, 3]
    measured = log.throughput()
    assert measured.tokens_per_s == pytest.approx(8000 / 5.0)
    assert measured.step_s == pytest.approx(2.5)
    assert log.trainer_metrics()["perf/max_memory_allocated_gb"] == pytest.approx(13.0)
    assert measured.step_se_s == pytest.approx(0.5)  # stdev 0.707 of 2.0, 3.0 over sqrt 2
    assert log.phase_times() == {}  # no per-phase timer logged


def test_the_trainers_phase_timers_are_the_probes_phases():
    """verl's per-phase timers (`timing_s/gen`, `old_log_prob`, `ref`, `adv`, `update_actor`,
    as in the captured lines), summed into the probe's phases over the steps after the first;
    a phase one of those steps did not log is left out, not averaged over fewer."""
    def line(step: int, gen: float, old: float, update: float, critic: float | None) -> str:
        values = {"timing_s/gen": gen, "timing_s/old_log_prob": old, "timing_s/ref": 1.0,
                  "timing_s/adv": 0.5, "timing_s/update_actor": update,
                  "timing_s/step": gen + old + update + 1.5 + (critic or 0)}
        if critic is not None:
            values["timing_s/update_critic"] = critic
        return f"step:{step} - " + " - ".join(f"{k}:{v}" for k, v in values.items())

    log = feed("verl", "\n".join([line(1, 50.0, 9.0, 30.0, 1.0), line(2, 10.0, 2.0, 6.0, 2.0),
                                  line(3, 12.0, 4.0, 8.0, None)]))
    assert log.phase_times() == pytest.approx({"rollout": 11.0, "experience": 4.5,
                                               "update": 7.0})


def test_easyr1_console_blocks_are_read():
    # No EasyR1 console block was found posted in full; this one is made with the call
    # EasyR1's ConsoleLogger makes, print(f"Step {step}\n" + yaml.dump(unflatten(data),
    # indent=2)), numpy scalars included, each line behind Ray's prefix as the driver sees it.
    import numpy as np

    def block(step: int, tokens: float, seconds: float) -> str:
        data = {"actor": {"pg_loss": np.float64(0.25), "lr": 1e-6},
                "perf": {"max_memory_allocated_gb": np.float64(30.5), "throughput": tokens
                         / seconds / 8, "total_num_tokens": tokens},
                "timing_s": {"gen": seconds / 2, "step": seconds}}
        text = f"Step {step}\n" + yaml.dump(data, indent=2)
        return "\n".join(f"(Runner pid=11) {line}" for line in text.splitlines())

    text = "\n".join([block(1, 1000.0, 10.0), block(2, 4000.0, 2.0),
                      "(Runner pid=11) saving checkpoint", block(3, 2000.0, 2.0)])
    log = feed("easyr1", text)
    assert [r.step for r in log.records] == [1, 2, 3]
    assert log.records[1].values["timing_s/step"] == 2.0
    assert log.records[1].values["actor/lr"] == 1e-6
    assert "perf/max_memory_allocated_gb" not in log.records[1].values  # a numpy object
    assert log.throughput().tokens_per_s == pytest.approx(6000 / 4.0)
    assert log.phase_times() == {"rollout": pytest.approx(1.0)}  # EasyR1's timing_s/gen


def test_trl_records_need_two_rollouts_to_time():
    lines = [str({"loss": "0.1", "num_tokens": str(100 * i), "step_time": "0.5"})
             for i in range(1, 5)]
    log = StepLog("trl", steps_per_cycle=2)  # two optimizer steps per generation
    for i, line in enumerate(lines):
        log.feed(line, float(i))
    # from the end of the first rollout (record 2) to the end of the last (record 4)
    assert log.throughput().tokens_per_s == pytest.approx(200 / 1.0)
    short = StepLog("trl", steps_per_cycle=2)
    short.feed(lines[0], 0.0)
    short.feed(lines[1], 1.0)
    assert short.throughput() is None


@pytest.mark.parametrize("launch, problem", [
    ("", "empty"), ("python3 train.py --config cfg.yaml", "no placeholder"),
    ("python3 'train.py {config}", "quote it"),
    ("no-such-trainer-here --config {config}", "is not a command here"),
])
def test_bad_launch_lines_are_refused(launch, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_launch(launch)


def test_placeholders_are_filled(tmp_path):
    command = TrainerCommand(
        trainer="verl", argv=("python3", "-m", "verl.trainer.main_ppo", "--config-path",
                              "{config_dir}", "--config-name={config_name}", "{overrides}",
                              f"x={TRIAL_DIR_TOKEN}/out"),
        config_text="", overrides=("a.b=1", f"c={TRIAL_DIR_TOKEN}/d"))
    argv = launch_argv(command, tmp_path / "verl.yaml", tmp_path / "t")
    assert argv == ["python3", "-m", "verl.trainer.main_ppo", "--config-path", str(tmp_path),
                    "--config-name=verl", "a.b=1", f"c={tmp_path}/t/d", f"x={tmp_path}/t/out"]


def test_each_trial_gets_the_trainers_short_run_and_its_own_keys():
    template = command_template(get_adapter("verl"), "python3 -m verl.trainer.main_ppo "
                                "{overrides}", Topology(1, 8), None, steps=3, validate=False)
    config = ProbeConfig(rollout_batch_size=64, global_batch_size=16, rollout_n=8,
                         micro_batch_size_update=4, micro_batch_size_experience=8)
    command = template.command_for(
        config, {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.5})
    words = dict(word.split("=", 1) for word in command.overrides)
    assert words["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "4"
    assert words["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.5"
    assert words["trainer.total_training_steps"] == "3"
    assert words["trainer.logger"] == "[console]"
    assert words["trainer.default_local_dir"] == f"{TRIAL_DIR_TOKEN}/checkpoints"
    assert words["trainer.n_gpus_per_node"] == "8"
    text = yaml.safe_load(command.config_text)
    assert text["trainer"]["val_before_train"] is False
    trl = command_template(get_adapter("trl"), "python t.py --config {config}",
                           Topology(1, 1), "beta: 0.04\nsave_strategy: 'no'\n", steps=2,
                           validate=False)
    rendered = trl.command_for(ProbeConfig(rollout_batch_size=8, global_batch_size=4,
                                           rollout_n=4, micro_batch_size_update=4), {})
    values = yaml.safe_load(rendered.config_text)  # read as PyYAML (YAML 1.1) reads it
    assert values["eval_strategy"] == "no" and values["save_strategy"] == "no"
    assert values["beta"] == 0.04  # the user's keys stay
    assert rendered.steps == 4 and rendered.steps_per_cycle == 2  # 2 optimizer steps a rollout


FAKE_VERL = """\
import os, sys, time
print("config:", open(sys.argv[1]).read().count("n_gpus_per_node"), flush=True)
{body}
"""


def probe(tmp_path: Path, body: str, limit_bytes: int | None = None):
    script = tmp_path / "fake_verl.py"
    script.write_text(FAKE_VERL.format(body=textwrap.dedent(body)))
    command = TrainerCommand(trainer="verl", argv=(sys.executable, str(script), "{config}"),
                             config_text="trainer:\n  n_gpus_per_node: 1\n", steps=3)
    req = ProbeRequest(model="verl-run", device=Device("cpu", limit_bytes=limit_bytes),
                       command=command, timeout_s=60)
    return SubprocessRunner().run(req, tmp_path / "logs" / "trial-00000.log")


def test_a_command_probe_times_the_steps_after_the_first_and_ends_the_run(tmp_path):
    body = """
    for step, (tokens, seconds) in enumerate([(100, 5.0), (300, 1.0), (500, 1.0)], 1):
        print(f"step:{step} - perf/total_num_tokens:{tokens} - timing_s/step:{seconds} - "
              f"timing_s/gen:{seconds / 2} - timing_s/update_actor:{seconds / 4}", flush=True)
    time.sleep(60)  # a final validation and checkpoint the probe need not wait for
    """
    started = time.monotonic()
    result = probe(tmp_path, body)
    assert result.status is ProbeStatus.OK, result.message
    assert time.monotonic() - started < 30
    assert result.tokens_per_s == pytest.approx(800 / 2.0)
    assert result.probe_kind == "command" and result.steps_logged == 3
    assert result.phase_s == {"rollout": 0.5, "update": 0.25}  # the trainer's own timers
    assert result.step_se_s == 0.0  # two logged steps of 1.0 s
    assert result.peak_mem_bytes and result.host_peak_rss_bytes
    log = (tmp_path / "logs" / "trial-00000.log").read_text()
    assert "config: 1" in log  # the trial's config was written and handed to the command


def test_a_run_whose_steps_all_came_before_the_first_look_is_sampled_before_it_ends(
        monkeypatch):
    """On a loaded machine the output thread can read every step line before the watch loop
    first looks (seen in a CI run: an OK probe with no peak); the live run is sampled first."""
    from autotune.probe.launch.command import GpuMemory, watch_run

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: the run's anonymous RSS
    log = StepLog("verl")
    for step in range(1, 4):
        log.feed(f"step:{step} - perf/total_num_tokens:100 - timing_s/step:1.0", float(step))
    assert log.steps_seen == 3
    proc = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); "
                             "print('held', flush=True); import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"  # touched
        gpu = GpuMemory()
        memory = ProcessTree(psutil.Process(proc.pid))
        request = ProbeRequest(model="verl-run", device=Device("cpu"))
        watched = watch_run(proc, request, 3, gpu, memory, log, limit=None)
    finally:
        proc.kill()
        proc.wait()
    assert watched.ended_early and watched.killed_for is None
    assert watched.device_peak >= 64 * 2**20 and memory.peak_rss_bytes >= 64 * 2**20


@pytest.mark.parametrize("body, status, words", [
    ("print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB')\n"
     "sys.exit(1)", ProbeStatus.GPU_OOM, "CUDA out of memory"),
    ("print('starting')", ProbeStatus.CRASH, "no step line"),
    ("raise KeyError('reward_model')", ProbeStatus.CRASH, "KeyError"),
    ("buf = bytearray(400 * 2**20)\nfor i in range(0, len(buf), 4096): buf[i] = 1\n"
     "time.sleep(30)", ProbeStatus.GPU_OOM, "device memory limit exceeded"),
])
def test_a_command_that_fails_is_classified(tmp_path, body, status, words):
    result = probe(tmp_path, body, limit_bytes=200 * 2**20)
    assert result.status is status
    assert words in result.message
    assert (tmp_path / "logs" / "trial-00000.log").exists()  # its log is kept


def test_processes_the_run_started_outside_its_tree_are_killed(tmp_path):
    # a trainer's Ray workers are not its children: here, a sleeper in a session of its own
    body = """
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                     start_new_session=True)
    print("escaped", flush=True)
    for step in range(1, 4):
        print(f"step:{step} - perf/total_num_tokens:100 - timing_s/step:1.0", flush=True)
    """
    result = probe(tmp_path, body)
    assert result.status is ProbeStatus.OK
    deadline = time.monotonic() + 10
    while [p for p in psutil.process_iter(["cmdline"])
           if "time.sleep(120)" in " ".join(p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, "a process the run started outlived the probe"
        time.sleep(0.1)


def test_processes_of_a_dead_driver_are_killed_when_its_study_next_probes():
    """A driver SIGKILLed mid-probe leaves tagged processes: making the next runner kills
    nothing (planning has no side effects); its first probe kills those of its own study's
    scope, never another study's nor a live driver's."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, theirs = tag_scope("study-a"), tag_scope("study-b")

    def sleeper(tag: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**os.environ, PROBE_TAG_ENV: tag})

    orphan = sleeper(f"{dead.pid}.1.{mine}.beef")
    stranger = sleeper(f"{dead.pid}.1.{theirs}.beef")  # another study's driver died too
    owned = sleeper(f"{os.getpid()}.{int(psutil.Process().create_time())}.{mine}.cafe")
    try:
        deadline = time.monotonic() + 10
        pids = {orphan.pid, stranger.pid, owned.pid}
        while not pids <= {p.pid for p, _ in tagged_processes()}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runner = SubprocessRunner(scope=mine)
        time.sleep(0.2)
        assert orphan.poll() is None  # made, not started: nothing killed
        runner.start()
        assert orphan.wait(timeout=10) is not None
        assert stranger.poll() is None  # another study's leftovers are its own to clean
        assert owned.poll() is None  # its driver (this test) is alive
        assert kill_orphaned(theirs) == 1 and stranger.wait(timeout=10) is not None
    finally:
        for proc in (orphan, stranger, owned):
            proc.kill()
            proc.wait()


def test_the_command_probe_and_the_built_in_read_one_cpu_device_figure(tmp_path):
    """On a CPU both probes call device memory the anonymous RSS (one definition:
    process_tag.read_statm_bytes): a run that reads a memory-mapped 64 MiB file (a
    safetensors checkpoint, say) and fills 64 MiB of its own holds the file's pages in its RSS
    but not in its device figure, and the command probe's reading from outside the run
    equals the built-in meter's from inside it."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(64 << 20))
    script = textwrap.dedent(f"""
        import mmap, sys
        from autotune.probe.measure.meter import read_anon_rss_bytes
        handle = open({str(weights)!r}, "rb")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        touched = sum(mapped[i] for i in range(0, len(mapped), 4096))
        own = bytearray(64 << 20)
        for i in range(0, len(own), 4096):
            own[i] = 1
        print(read_anon_rss_bytes(), flush=True)
        sys.stdin.readline()
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        inside = int(run.stdout.readline())
        tree = ProcessTree(psutil.Process(run.pid))
        rss = tree.rss_bytes()
        outside = tree.anon_rss_bytes
    finally:
        run.communicate("\n", timeout=30)
    assert abs(outside - inside) < 1 << 20, (outside, inside)
    assert outside >= 64 << 20
    assert rss - outside >= 60 << 20  # the mapped file: resident, but the page cache's
