"""The trainers' own start-up on autotune's exports, trainer x topology x with/without a base
config (issue 18): every file autotune writes is accepted, and every config it refuses for a
rule is rejected by the trainer too (the same file, written anyway).

TRL: the real GRPOConfig parses each export in-process (always run: the test extra installs
trl). EasyR1 and verl: scripts/check_easyr1_load.py and check_verl_load.py run their real
start-up (config, trainer init, the workers' batch normalisation as rank 0 of W on torch's fake
process group, the rollout's checks; only GPU, Ray, vLLM and weights are stubbed, as their
docstrings say). Those need the trainers' sources: verl's is its PyPI release (0.7.1, the last
with the FSDP workers), downloaded once, run with the test extra's dependencies (hydra-core,
tensordict, codetiming, pillow); AUTOTUNE_VERL_SRC names a checkout instead (volcengine/verl
b178a3c). EasyR1 is not on PyPI: set AUTOTUNE_EASYR1_SRC to a checkout (hiyouga/EasyR1 b44b311)
and AUTOTUNE_TRAINER_PYTHON to a python with its dependencies; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

from autotune.config import Topology
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import ExportPlan, plan_export, resolved_get
from autotune.trainers.measured import MeasuredRun
from autotune.trainers.render import load_trainer_yaml, render_plan
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOPOLOGIES = [(1, 2), (1, 4), (1, 6), (1, 8), (2, 8)]
SEARCHED = ("micro_batch_size_update", "micro_batch_size_experience", "gradient_checkpointing",
            "offload_params", "offload_optimizer")
# a study without a base config: the demo's shapes, scaled to a multi-GPU run
STUDY = {"rollout_batch_size": 16, "rollout_n": 4, "global_batch_size": 8,
         "gradient_checkpointing": True, "offload_params": False, "offload_optimizer": False,
         "max_prompt_length": 64, "max_response_length": 64, "rollout_tensor_parallel": 1,
         "rollout_engine": "hf", "val_batch_size": None}
# a study run with the trainers' real default configs as --base-config: their own shapes
BASE_SHAPES = {
    "easyr1": {"rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
               "max_prompt_length": 2048, "max_response_length": 2048,
               "rollout_tensor_parallel": 2, "dynamic_batching": True},
    "verl": {"rollout_batch_size": 1024, "rollout_n": 1, "global_batch_size": 256,
             "max_prompt_length": 512, "max_response_length": 512,
             "rollout_tensor_parallel": 2, "dynamic_batching": False},
    # grpo.yaml below: 8 generations, 8 per device, 4 accumulation steps
    "trl": {"rollout_n": 8, "max_response_length": 256, "rollout_tensor_parallel": 1}}
# (update, experience): the last two break a rule on some topologies (EasyR1 splits a
# device's share into whole experience micro-batches; verl does not)
MICRO_BATCHES = [(1, 2), (4, 8), (3, 16), (2, 64)]
TRL_BASE = ("num_generations: 8\nmax_completion_length: 256\nper_device_train_batch_size: 8\n"
            "gradient_accumulation_steps: 4\neval_strategy: steps\n"
            "per_device_eval_batch_size: 8\nbf16: false\nuse_cpu: true\nreport_to: none\n")


def cases(trainer: str, with_base: bool, topology: Topology) -> list[dict]:
    """The knobs of the exports tried: a study's best, for several micro-batches."""
    shapes = BASE_SHAPES[trainer] if with_base else {}
    knobs = {**STUDY, **shapes}
    if trainer == "trl" and with_base:  # the whole-run batches TRL's base config makes
        knobs.update(global_batch_size=8 * topology.world_size * 4 // 8,
                     rollout_batch_size=8 * topology.world_size * 4 // 8)
    return [{**knobs, "micro_batch_size_update": update, "micro_batch_size_experience": exp}
            for update, exp in MICRO_BATCHES]


def cpu_study(adapter, topology, base) -> MeasuredRun | None:
    """What a study on TRL_BASE ran: TRL's CPU settings (bf16 false, use_cpu true) are the
    fp32 compute of a CPU study's probes, so such a base is its own run."""
    return MeasuredRun(topology, "tiny-qwen2.5", None, on_cpu=True) \
        if adapter is TRL and base is not None else None


def exported(adapter, knobs, topology, base_path, tmp_path, name, force=False,
             searched=SEARCHED):
    """The file an export writes (written even where autotune refuses it), and the rules it
    breaks (none: autotune writes it; some: autotune refuses it)."""
    base = load_trainer_yaml(str(base_path)) if base_path else None
    plan = plan_export(adapter, knobs, topology, base[0] if base else None,
                       searched=searched, force=force, run=cpu_study(adapter, topology, base))
    conflicts = [p for p in plan.problems if not p.startswith(f"{adapter.name}: ")]
    assert not conflicts, conflicts  # the study's shapes are the base's: no conflict
    path = tmp_path / f"{name}.yaml"
    path.write_text(render_plan(plan, adapter, base, ["test export", ""]))
    return path, plan.problems


def grpo_config(topology: Topology, values: dict, tmp_path: Path):
    """TRL's own GRPOConfig of an export's values, for `topology`'s processes (GRPOConfig
    reads the count from accelerate); ValueError where TRL refuses it."""
    from trl import GRPOConfig

    class Processes(GRPOConfig):
        @property
        def world_size(self):
            return topology.world_size

    return Processes(**{"output_dir": str(tmp_path / "out"), "report_to": "none",
                        "use_cpu": True, "bf16": False,
                        **{k: v for k, v in values.items() if v is not None}})


CHECK_TIMEOUT_S = 300  # one start-up check (the served ones: the script's own default)
VERL_PYPI = "verl==0.7.1"  # the last release on PyPI with the FSDP workers (fsdp_workers.py)
# what check_verl_load.py imports besides this project's own dependencies (the test extra)
VERL_IMPORTS = "import hydra, omegaconf, tensordict, codetiming, PIL"


@functools.cache
def pypi_source(requirement: str, python: str, cache: str | None = None) -> str:
    """`requirement`'s wheel (pip download --no-deps, no install: the check puts it first on
    sys.path), unpacked once into its own folder under ~/.cache/autotune-tests/ (or `cache`).
    PyPI unreachable: the test fails with pip's output, as tests/vllm_env.py does."""
    root = Path(cache or Path.home() / ".cache" / "autotune-tests"
                / requirement.replace("==", "-"))
    if not (root / ".complete").exists():
        wheels = root.with_name(root.name + ".download")
        shutil.rmtree(root, ignore_errors=True)
        done = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "-d",
                               str(wheels), requirement], capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            pytest.fail(f"pip download {requirement} failed:\n{done.stdout}\n{done.stderr}")
        name, version = requirement.split("==")
        with zipfile.ZipFile(next(wheels.glob(f"{name}-{version}-*.whl"))) as wheel:
            wheel.extractall(root)
        (root / ".complete").write_text(requirement)
    return str(root)


@functools.cache
def trainer_source(trainer: str) -> str | None:
    """The trainer's sources: AUTOTUNE_<TRAINER>_SRC, else for verl its PyPI release
    (pypi_source; AUTOTUNE_VERL_CACHE names its folder), where the trainer's python has the
    check's dependencies. EasyR1 is not on PyPI."""
    given = os.environ.get(f"AUTOTUNE_{trainer.upper()}_SRC")
    if given or trainer != "verl":
        return given
    python = os.environ.get("AUTOTUNE_TRAINER_PYTHON", sys.executable)
    if subprocess.run([python, "-c", VERL_IMPORTS], capture_output=True).returncode:
        return None
    return pypi_source(VERL_PYPI, python, os.environ.get("AUTOTUNE_VERL_CACHE"))


def verl_default() -> Path:
    """verl's own default config (ppo_trainer, generated whole) of the verl being checked, as
    a base: the fixture is b178a3c's, which another verl may not compose (0.7.1 reads a
    `reward` section b178a3c's has not)."""
    source = trainer_source("verl")
    own = Path(source or "") / "verl" / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return own if source and own.is_file() else FIXTURES / "verl-ppo-trainer.yaml"


def need_source(trainer: str) -> None:
    if trainer_source(trainer) is None:
        pytest.skip(f"AUTOTUNE_{trainer.upper()}_SRC: no {trainer} checkout to run its "
                    "start-up" + (f" (nor the check's dependencies for {VERL_PYPI}: the "
                                  "test extra installs them)" if trainer == "verl" else ""))


class VerlChecks:
    """check_verl_load.py --serve: one import of verl for the module's checks, each check in
    a process forked from it (the script's docstring), so a check costs about 1 s, not 6.
    The server starts without AUTOTUNE_CHECK_JSON (a check names it in its request); its
    stderr goes to a file, so nothing blocks on a pipe no one reads."""

    def __init__(self, python: str, source: str) -> None:
        self.errors = tempfile.TemporaryFile("w+")
        self.server = subprocess.Popen(
            [python, str(ROOT / "scripts" / "check_verl_load.py"), source, "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True,
            env={k: v for k, v in os.environ.items() if k != "AUTOTUNE_CHECK_JSON"})

    def check(self, argv: list[str], env: dict) -> tuple[int, str, str]:
        assert self.server.stdin and self.server.stdout
        if self.server.poll() is None:
            self.server.stdin.write(json.dumps({"argv": argv, "env": env}) + "\n")
            self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], CHECK_TIMEOUT_S + 30)
        line = self.server.stdout.readline() if ready else ""
        try:
            answer = json.loads(line)
        except ValueError:  # it ended (could not import verl: its one line says why) or hung
            self.errors.seek(0)
            said = self.errors.read()[-2000:]
            self.close()
            pytest.fail(f"check_verl_load.py --serve gave no answer within "
                        f"{CHECK_TIMEOUT_S + 30} s: {line.strip()}\n{said}")
        return answer["rc"], answer["out"], answer["err"]

    def close(self) -> None:
        for key, checks in list(VERL_CHECKS.items()):
            if checks is self:
                del VERL_CHECKS[key]
        assert self.server.stdin
        with contextlib.suppress(OSError):
            self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        if self.server.stdout:
            self.server.stdout.close()
        self.errors.close()


VERL_CHECKS: dict[tuple[str, str], VerlChecks] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_verl_checks():
    yield
    for checks in list(VERL_CHECKS.values()):
        checks.close()


def trainer_verdict(trainer: str, path: Path, *overrides: str,
                    quantities: Path | None = None,
                    source: str | None = None) -> tuple[bool, str]:
    """The trainer's start-up on `path`: (accepted, its line); with `quantities`, the check
    writes there every per-GPU quantity the trainer will run (AUTOTUNE_CHECK_JSON); `source`:
    those sources instead of trainer_source's."""
    source = source or trainer_source(trainer)
    assert source is not None
    python = os.environ.get("AUTOTUNE_TRAINER_PYTHON", sys.executable)
    env = {"AUTOTUNE_CHECK_JSON": str(quantities)} if quantities is not None else {}
    if trainer == "verl":
        checks = VERL_CHECKS.get((python, source))
        if checks is None:
            checks = VERL_CHECKS[python, source] = VerlChecks(python, source)
        code, stdout, stderr = checks.check([str(path), *overrides], env)
    else:
        script = ROOT / "scripts" / f"check_{trainer}_load.py"
        out = subprocess.run([python, str(script), source, str(path), *overrides],
                             capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                             env={**os.environ, **env})
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    assert code in (0, 1), stdout + stderr[-2000:]  # 2: the check broke
    return code == 0, stdout.strip()


@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", TOPOLOGIES, ids=[f"{n}x{g}" for n, g in TOPOLOGIES])
@pytest.mark.parametrize("trainer", ["easyr1", "verl"])
def test_the_trainers_start_up_accepts_every_export_and_rejects_every_refusal(
        trainer, nnodes, gpus, with_base, tmp_path):
    need_source(trainer)
    adapter, topology = {"easyr1": EASYR1, "verl": VERL}[trainer], Topology(nnodes, gpus)
    base_path = None
    if with_base:
        fixture = FIXTURES / "easyr1-config.yaml" if trainer == "easyr1" else verl_default()
        base_path = tmp_path / fixture.name
        # verl's default trains a critic: the GRPO study's base names its estimator (the
        # refusal of gae is test_verl_rejects_what_autotune_refuses_for_a_critic)
        base_path.write_text(fixture.read_text().replace("adv_estimator: gae",
                                                         "adv_estimator: grpo"))
    verdicts = []
    for index, knobs in enumerate(cases(trainer, with_base, topology)):
        path, problems = exported(adapter, knobs, topology, base_path, tmp_path, f"e{index}")
        accepted, line = trainer_verdict(trainer, path)
        verdicts.append((knobs["micro_batch_size_update"], not problems, accepted))
        assert accepted == (not problems), (knobs, problems, line)
    assert any(ours for _, ours, _ in verdicts) or (nnodes, gpus) == (1, 6), verdicts


@pytest.mark.parametrize("trainer", ["easyr1", "verl"])
def test_the_trainers_start_up_accepts_token_budget_exports(trainer, tmp_path):
    """Dynamic batching kept on: EasyR1 without a base (its default), verl on its default
    config turned to use_dynamic_bsz, with the budgets the study probed."""
    need_source(trainer)
    adapter = {"easyr1": EASYR1, "verl": VERL}[trainer]
    base_path = None
    knobs = {**STUDY, "dynamic_batching": True, "micro_batch_size_update": 2,
             "micro_batch_size_experience": 4}
    if trainer == "verl":
        base_path = tmp_path / "ppo.yaml"
        base_path.write_text(verl_default().read_text()
                             .replace("adv_estimator: gae", "adv_estimator: grpo")
                             .replace("    use_dynamic_bsz: false", "    use_dynamic_bsz: true"))
        # the base's own budget (held fixed, as a sweep on it without budgets searched has it)
        knobs.update(BASE_SHAPES["verl"], dynamic_batching=True, max_token_len_update=16384,
                     max_token_len_experience=16384)
    for nnodes, gpus in ((1, 2), (1, 8)):
        path, problems = exported(adapter, knobs, Topology(nnodes, gpus), base_path, tmp_path,
                                  f"budget{gpus}")
        assert problems == []
        text = path.read_text()
        assert "# batching: token budgets (dynamic batching on, as probed)" in text
        accepted, line = trainer_verdict(trainer, path)
        assert accepted, line


def test_verl_rejects_what_autotune_refuses_for_a_critic(tmp_path):
    need_source("verl")
    base = load_trainer_yaml(str(verl_default()))
    knobs = {**STUDY, **BASE_SHAPES["verl"], "micro_batch_size_update": 4,
             "micro_batch_size_experience": 8}
    refused = plan_export(VERL, knobs, Topology(1, 8), base[0], searched=SEARCHED)
    assert [p.split(" is ")[0] for p in refused.problems] == [
        "algorithm (from algorithm.adv_estimator and critic.enable)"]
    forced = plan_export(VERL, knobs, Topology(1, 8), base[0], searched=SEARCHED, force=True)
    as_is = tmp_path / "gae.yaml"  # what a silent export would have written: gae kept
    as_is.write_text(render_plan(
        ExportPlan({k: v for k, v in forced.values.items()
                    if k not in ("algorithm.adv_estimator", "critic.enable")}),
        VERL, base, ["p", ""]))
    accepted, line = trainer_verdict("verl", as_is)
    assert not accepted and "critic" in line, line
    path = tmp_path / "forced.yaml"
    path.write_text(render_plan(forced, VERL, load_trainer_yaml(
        str(verl_default())), ["p", ""]))
    accepted, line = trainer_verdict("verl", path)
    assert accepted, line


PPO_TOPOLOGIES = [(1, 2), (1, 4), (1, 8), (2, 8)]
# a PPO study's searched critic knobs; a critic micro-batch of 3 splits no GPU's share
PPO_KNOBS = {"algorithm": "ppo", "critic_gradient_checkpointing": True,
             "critic_offload_params": True, "critic_offload_optimizer": False}
PPO_SEARCHED = (*SEARCHED, "critic_micro_batch_size_update", "critic_gradient_checkpointing",
                "critic_offload_params", "critic_offload_optimizer")


def ppo_cases(trainer: str) -> tuple[dict, Path | None]:
    """verl: a PPO study of verl's own ppo_trainer.yaml (gae, its critic) as the base, with
    its shapes; EasyR1: without a base (its default estimator is grpo), the demo's shapes."""
    if trainer == "verl":
        return {**STUDY, **BASE_SHAPES["verl"], **PPO_KNOBS, "micro_batch_size_update": 4,
                "micro_batch_size_experience": 8}, verl_default()
    return {**STUDY, **PPO_KNOBS, "micro_batch_size_update": 2,
            "micro_batch_size_experience": 4}, None


@pytest.mark.parametrize("nnodes, gpus", PPO_TOPOLOGIES,
                         ids=[f"{n}x{g}" for n, g in PPO_TOPOLOGIES])
@pytest.mark.parametrize("trainer", ["easyr1", "verl"])
def test_the_trainers_start_up_accepts_ppo_exports_with_their_critic(trainer, nnodes, gpus,
                                                                    tmp_path):
    """A PPO study's exports through the trainers' start-up with a critic (verl's
    validate_config with use_critic and its CriticWorker; EasyR1's critic checks and worker):
    written ones accepted, refused ones (a critic micro-batch that splits no share) rejected."""
    need_source(trainer)
    adapter, topology = {"easyr1": EASYR1, "verl": VERL}[trainer], Topology(nnodes, gpus)
    knobs, base_path = ppo_cases(trainer)
    for critic_micro in (2, 3):
        path, problems = exported(adapter, {**knobs, "critic_micro_batch_size_update":
                                            critic_micro}, topology, base_path, tmp_path,
                                  f"ppo{critic_micro}", searched=PPO_SEARCHED)
        assert (critic_micro == 2) == (not problems), problems
        accepted, line = trainer_verdict(trainer, path)
        assert accepted == (not problems), (critic_micro, problems, line)
        if critic_micro == 2:
            assert "critic" in path.read_text()


@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", TOPOLOGIES, ids=[f"{n}x{g}" for n, g in TOPOLOGIES])
def test_trl_grpo_config_accepts_every_export_and_rejects_every_refusal(nnodes, gpus,
                                                                        with_base, tmp_path):
    pytest.importorskip("trl")
    topology = Topology(nnodes, gpus)
    base_path = None
    if with_base:
        base_path = tmp_path / "grpo.yaml"
        base_path.write_text(TRL_BASE)
    verdicts = []
    for index, knobs in enumerate(cases("trl", with_base, topology)):
        update = knobs["micro_batch_size_update"]
        knobs = {**knobs, "micro_batch_size_update": {1: 2}.get(update, update)}
        path, problems = exported(TRL, knobs, topology, base_path, tmp_path, f"t{index}")
        per_step = knobs["micro_batch_size_update"] * topology.world_size
        if (knobs["global_batch_size"] * knobs["rollout_n"]) % per_step:
            assert problems  # no whole gradient_accumulation_steps (GRPOConfig takes a 0)
            verdicts.append((knobs["micro_batch_size_update"], False, False))
            continue
        try:
            grpo_config(topology, yaml.safe_load(path.read_text()), tmp_path)
            accepted = True
        except ValueError:
            accepted = False
        verdicts.append((knobs["micro_batch_size_update"], not problems, accepted))
        assert accepted == (not problems), (knobs, problems)
    # 6 processes do not divide the demo's 64 completions: all refused there
    assert any(ours for _, ours, _ in verdicts) or (nnodes, gpus, with_base) == (1, 6, False)
    assert not all(ours for _, ours, _ in verdicts), verdicts  # a refusal tried too


@pytest.mark.parametrize("engine_gpus", [2, 4, 6])
def test_trl_grpo_config_accepts_a_server_mode_export_for_the_trainers_processes(
        engine_gpus, tmp_path):
    """placement=separate on one node of 8 (issue 68): TRL's server mode, its per-process
    batches for the 8 - engine_gpus trainer processes `accelerate launch` starts. GRPOConfig
    accepts the file on those processes and, where the batches do not split over all 8,
    refuses it there: the file counts the trainer's processes, not the run's GPUs."""
    pytest.importorskip("trl")
    trainers = 8 - engine_gpus
    knobs = {**STUDY, "placement": "separate", "rollout_gpus": engine_gpus, "staleness": 0,
             "rollout_engine": "vllm-like", "rollout_tensor_parallel": engine_gpus,
             "gpu_memory_utilization": 0.9, "rollout_batch_size": 3 * trainers,
             "global_batch_size": trainers, "rollout_n": 4,
             "micro_batch_size_update": 2, "micro_batch_size_experience": 2}
    path, problems = exported(TRL, knobs, Topology(1, 8), None, tmp_path, "server")
    assert problems == []
    values = yaml.safe_load(path.read_text())
    assert values["vllm_mode"] == "server"
    config = grpo_config(Topology(1, trainers), values, tmp_path)
    assert config.vllm_mode == "server" and config.use_vllm
    assert config.per_device_train_batch_size * trainers * config.gradient_accumulation_steps \
        == knobs["global_batch_size"] * knobs["rollout_n"]
    try:  # 12 x trainers completions a generation: over 8 processes of 2 only with 4
        grpo_config(Topology(1, 8), values, tmp_path)
        refused_on_the_run = False
    except ValueError:
        refused_on_the_run = True
    assert refused_on_the_run == (engine_gpus != 4)


# verl's separate placement: its one_step_off_policy recipe (b178a3c), whose code is only in
# verl's checkouts (the PyPI wheel and sdist of 0.7.1 ship its YAML alone)
ONE_STEP_OFF = [(1, 8, 4, 2), (1, 8, 2, 2), (1, 8, 6, 2), (1, 8, 5, 5), (2, 8, 8, 4)]


def need_recipe() -> None:
    need_source("verl")
    recipe = Path(trainer_source("verl") or "") / "verl/experimental/one_step_off_policy"
    if not (recipe / "main_ppo.py").is_file():
        pytest.skip("AUTOTUNE_VERL_SRC: the recipes' refusals are b178a3c's (0.7.1's wheel "
                    "lacks their code; 0.9.1's checks acceptance only: "
                    "test_verl_091_starts_every_separate_export...): give a verl checkout "
                    "(b178a3c) to run its start-up")


@pytest.mark.parametrize("nnodes, gpus, engine_gpus, tp", ONE_STEP_OFF,
                         ids=[f"{n}x{g}-engine{e}-tp{t}" for n, g, e, t in ONE_STEP_OFF])
def test_verl_one_step_off_accepts_every_separate_export_and_rejects_every_refusal(
        nnodes, gpus, engine_gpus, tp, tmp_path):
    """placement=separate at staleness 1 (issue 68): the recipe's start-up (its pools, its
    trainer, the workers on the trainer's pool, the rollout worker and engine replica on the
    engine's) accepts each export autotune writes and rejects each it refuses, the batches
    counted on the trainer's GPUs (48 responses do not split over 5 or 6, a micro-batch of 3
    splits none), the engine's replicas sized as the recipe's agent loop sizes them (5 GPUs of
    tensor parallel beside 3 training GPUs: refused by both)."""
    need_recipe()
    run = Topology(nnodes, gpus)
    trainers = run.without_engine(engine_gpus)
    assert trainers is not None
    verdicts = []
    for prompts, micro in ((12, 1), (12, 2), (4 * trainers.world_size, 3)):
        knobs = {**STUDY, "placement": "separate", "rollout_gpus": engine_gpus,
                 "staleness": 1, "rollout_engine": "vllm-like", "rollout_tensor_parallel": tp,
                 "gpu_memory_utilization": 0.9, "rollout_batch_size": prompts,
                 "global_batch_size": prompts // 2, "micro_batch_size_update": micro,
                 "micro_batch_size_experience": 2}
        path, problems = exported(VERL, knobs, run, None, tmp_path, f"sep-{prompts}-{micro}")
        figures = tmp_path / f"sep-{prompts}-{micro}.json"
        accepted, line = trainer_verdict("verl", path, quantities=figures)
        assert accepted == (not problems), (knobs, problems, line)
        verdicts.append(accepted)
        if accepted:  # the trainer's pool trains, the engine's generates
            held = json.loads(figures.read_text())
            assert (held["world_size"], held["engine_world_size"]) == (
                trainers.world_size, engine_gpus), held
            assert held["responses_per_step"] == prompts * 4 // trainers.world_size
            assert "one_step_off_policy" in line
    assert not all(verdicts) and (any(verdicts) or tp == 5), verdicts


# staleness 2 and more: verl's fully_async_policy recipe (b178a3c), code in its checkouts only
FULLY_ASYNC = [(1, 8, 4, 2, 2), (1, 8, 2, 2, 3), (1, 8, 5, 5, 2)]


@pytest.mark.parametrize("nnodes, gpus, engine_gpus, tp, staleness", FULLY_ASYNC,
                         ids=[f"{n}x{g}-engine{e}-tp{t}-staleness{k}"
                              for n, g, e, t, k in FULLY_ASYNC])
def test_verl_fully_async_accepts_every_export_and_rejects_every_refusal(
        nnodes, gpus, engine_gpus, tp, staleness, tmp_path):
    """placement=separate at staleness k >= 2 (issue 68): the fully_async_policy recipe's
    start-up (its pools, rollouter and trainer with their asserts on the async keys, the
    workers on the trainer's pool, the rollout worker and engine replica on the engine's)
    accepts each export autotune writes and rejects each it refuses: a micro-batch of 3 splits
    no trainer's share, and 5 GPUs of tensor parallel beside 3 training GPUs no replica."""
    need_recipe()
    run = Topology(nnodes, gpus)
    trainers = run.without_engine(engine_gpus)
    assert trainers is not None
    verdicts = []
    for prompts, micro in ((4 * trainers.world_size, 1), (4 * trainers.world_size, 3)):
        knobs = {**STUDY, "placement": "separate", "rollout_gpus": engine_gpus,
                 "staleness": staleness, "rollout_engine": "vllm-like",
                 "rollout_tensor_parallel": tp, "gpu_memory_utilization": 0.9,
                 "rollout_batch_size": prompts, "global_batch_size": prompts // 2,
                 "micro_batch_size_update": micro, "micro_batch_size_experience": 2}
        path, problems = exported(VERL, knobs, run, None, tmp_path, f"async-{micro}")
        accepted, line = trainer_verdict("verl", path)
        assert accepted == (not problems), (knobs, problems, line)
        verdicts.append(accepted)
        if accepted:
            assert f"fully_async_policy: {prompts // 2} prompts a trainer step, the rollouter " \
                f"holding at most {prompts * (staleness + 1)}" in line, line
    assert not all(verdicts) and (any(verdicts) or tp == 5), verdicts


# verl 0.9.1 (PyPI) ships both recipes; its recipe modules import uvicorn and fastapi
VERL_091 = "verl==0.9.1"
SYNC_BACKEND = "actor_rollout_ref.rollout.checkpoint_engine.backend"


def separate_exports(kind: str, tmp_path: Path):
    """(topology, engine GPUs, staleness, prompts, the file) of every export autotune writes
    (no problems) among the separate-placement families' cases above."""
    rows = ([(n, g, e, t, 1) for n, g, e, t in ONE_STEP_OFF] if kind == "one_step_off"
            else FULLY_ASYNC)
    for nnodes, gpus, engine_gpus, tp, staleness in rows:
        run = Topology(nnodes, gpus)
        trainers = run.without_engine(engine_gpus)
        assert trainers is not None
        shapes = ((12, 1), (12, 2), (4 * trainers.world_size, 3)) if kind == "one_step_off" \
            else ((4 * trainers.world_size, 1), (4 * trainers.world_size, 3))
        for prompts, micro in shapes:
            knobs = {**STUDY, "placement": "separate", "rollout_gpus": engine_gpus,
                     "staleness": staleness, "rollout_engine": "vllm-like",
                     "rollout_tensor_parallel": tp, "gpu_memory_utilization": 0.9,
                     "rollout_batch_size": prompts, "global_batch_size": prompts // 2,
                     "micro_batch_size_update": micro, "micro_batch_size_experience": 2}
            name = f"{kind}-{nnodes}x{gpus}-e{engine_gpus}-tp{tp}-{prompts}-{micro}"
            path, problems = exported(VERL, knobs, run, None, tmp_path, name)
            if not problems:
                yield trainers, engine_gpus, staleness, prompts, path


@pytest.mark.parametrize("kind", ["one_step_off", "fully_async"])
def test_verl_091_starts_every_separate_export_through_its_first_weight_sync(kind, tmp_path):
    """verl 0.9.1 from PyPI (its wheel ships both recipes' code, so this runs without a
    checkout): every export autotune writes for the ONE_STEP_OFF and FULLY_ASYNC topologies
    passes the recipe's start-up through the first weight sync, which both recipes run before
    any step (one_step_off: OneStepOffRayTrainer.fit -> _fit_update_weights; fully_async:
    _initialize_components' "Param sync before fit"), with the pools, batches and queue the
    b178a3c families check; the same file with ppo_trainer's checkpoint_engine.backend naive
    fails at that sync (DetachActorWorker has no layered_summon), which is why autotune
    writes nccl. 0.9.1 cannot check autotune's refusals: its recipes run only the engine
    workers (verl/workers/engine_workers.py), which split the micro-batches at the first
    update, not at start-up, and it sizes the engine's replicas by the engine's pool
    (separation/utils.py create_resource_pool_manager), so the refused files start too."""
    python = os.environ.get("AUTOTUNE_TRAINER_PYTHON", sys.executable)
    if subprocess.run([python, "-c", VERL_IMPORTS + ", uvicorn, fastapi"],
                      capture_output=True).returncode:
        pytest.skip(f"the check's dependencies for {VERL_091} (the test extra installs them)")
    source = pypi_source(VERL_091, python)
    written = list(separate_exports(kind, tmp_path))
    assert len(written) >= 2, written  # FULLY_ASYNC: 2 (its tp 5 cases are refused)
    for trainers, engine_gpus, staleness, prompts, path in written:
        assert yaml.safe_load(path.read_text())["actor_rollout_ref"]["rollout"][
            "checkpoint_engine"]["backend"] == "nccl"
        figures = path.with_suffix(".json")
        accepted, line = trainer_verdict("verl", path, quantities=figures, source=source)
        assert accepted and "first weight sync nccl" in line, (path.name, line)
        held = json.loads(figures.read_text())
        assert (held["world_size"], held["engine_world_size"]) == (
            trainers.world_size, engine_gpus), held
        step = prompts if kind == "one_step_off" else prompts // 2  # a trainer step's prompts
        assert held["responses_per_step"] == step * 4 // trainers.world_size, held
        if kind == "one_step_off":
            assert "one_step_off_policy" in line, line
        else:
            assert f"fully_async_policy: {prompts // 2} prompts a trainer step, the rollouter " \
                f"holding at most {prompts * (staleness + 1)}" in line, line
    accepted, line = trainer_verdict("verl", path, f"{SYNC_BACKEND}=naive", source=source)
    assert not accepted and "first_sync" in line and "layered_summon" in line, line

# -- round trip (issue 30): what the trainer's own config code will run is what was probed ----

ROUND_TRIP = {**STUDY, "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.55,
              "enable_sleep": True, "max_num_batched_tokens": 8192, "max_num_seqs": 128,
              "sleep_level": 1, "use_kl": True, "offload_ref_params": None,
              "offload_params": True, "micro_batch_size_update": 2,
              "micro_batch_size_experience": 4}


def probed(knobs: dict, topology: Topology) -> dict:
    """Every per-GPU quantity the probe ran for `knobs` on `topology`: the share the probe
    splits (config.device_share) and the knobs as the export resolves them."""
    from autotune.batching import with_token_budgets
    from autotune.config import KNOB_NAMES, ProbeConfig, device_share
    from autotune.trainers.export_plan import measured_knobs

    resolved = with_token_budgets(measured_knobs(knobs))
    config = ProbeConfig(**{k: v for k, v in resolved.items() if k in KNOB_NAMES})
    share = device_share(config, topology.world_size)
    budgets = ("max_token_len_update", "max_token_len_experience", "ref_max_token_len")
    values = {**resolved, "world_size": topology.world_size,
              "responses_per_step": share.responses_per_step,
              "responses_per_minibatch": share.responses_per_minibatch,
              "ref_micro_batch_size": config.micro_batch_size_experience,
              "ref_max_token_len": resolved.get("max_token_len_experience"),
              "offload_ref_params": config.ref_on_host, "sequence_parallel": 1,
              "model": "Qwen/Qwen2.5-7B-Instruct"}
    return {k: v for k, v in values.items() if config.dynamic_batching or k not in budgets}


def round_trip_base(trainer: str, tmp_path: Path) -> Path:
    """The trainer's default config as a study's base: GRPO, Qwen2.5-7B, KL on (so the study
    held a reference model, as these bases run it)."""
    if trainer == "easyr1":
        text = (FIXTURES / "easyr1-config.yaml").read_text()
    else:
        text = (verl_default().read_text()
                .replace("adv_estimator: gae", "adv_estimator: grpo")
                .replace("use_kl_loss: false", "use_kl_loss: true")
                .replace("path: ~/models/deepseek-llm-7b-chat", "path: Qwen/Qwen2.5-7B-Instruct"))
    path = tmp_path / f"{trainer}-base.yaml"
    path.write_text(text)
    return path


def round_trip(trainer: str, topology: Topology, with_base: bool, tmp_path: Path
               ) -> tuple[bool, str, dict, int]:
    """Export a study's knobs (a study run on the trainer's default config when `with_base`),
    load the file through the trainer's own start-up, and read back every per-GPU quantity
    from its normalised worker config: (accepted, its line, the quantities that differ from
    what the probe ran, how many were compared)."""

    adapter = {"easyr1": EASYR1, "verl": VERL}[trainer]
    base_path = round_trip_base(trainer, tmp_path) if with_base else None
    base = load_trainer_yaml(str(base_path)) if base_path else None
    knobs = {**ROUND_TRIP, "rollout_tensor_parallel": 2}
    if base:  # a study run on the base holds what it reads there, and searched the rest
        read = adapter.read_knobs(lambda key, default: resolved_get(base[0], key, default),
                                  topology)
        knobs.update({k: v for k, v in read.items() if k not in SEARCHED},
                     offload_params=False)
    run = MeasuredRun(topology, "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
                      "Qwen/Qwen2.5-7B-Instruct" if base else None, True if base else None)
    plan = plan_export(adapter, knobs, topology, base[0] if base else None,
                       searched=SEARCHED, run=run)
    assert plan.problems == []
    path = tmp_path / f"{trainer}-{topology.nnodes}x{topology.gpus_per_node}-{with_base}.yaml"
    path.write_text(render_plan(plan, adapter, base, ["round trip", ""]))
    quantities = path.with_suffix(".json")
    accepted, line = trainer_verdict(trainer, path, quantities=quantities)
    if not accepted:
        return False, line, {}, 0
    ran, expected = json.loads(quantities.read_text()), probed(knobs, topology)
    compared = [key for key in ran if key in expected]
    return True, line, {key: (ran[key], expected[key]) for key in compared
                        if ran[key] != expected[key]}, len(compared)


@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", [(1, 2), (1, 8), (2, 8)], ids=["1x2", "1x8", "2x8"])
@pytest.mark.parametrize("trainer", ["easyr1", "verl"])
def test_the_trainer_runs_every_per_gpu_quantity_the_probe_ran(trainer, nnodes, gpus,
                                                                with_base, tmp_path):
    """Export, load through the trainer's own start-up (its normalised worker config), read
    back every per-GPU quantity, compare with what the probe ran: equal."""
    need_source(trainer)
    accepted, line, differ, compared = round_trip(trainer, Topology(nnodes, gpus), with_base,
                                                  tmp_path)
    assert accepted, line
    assert differ == {}, differ
    assert compared >= 18  # every quantity the probe ran


@pytest.mark.parametrize("engine", ["hf", "vllm-like"])
@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", [(1, 1), (1, 2), (2, 8)], ids=["1x1", "1x2", "2x8"])
def test_trl_runs_every_per_gpu_quantity_the_probe_ran(nnodes, gpus, with_base, engine,
                                                       tmp_path):
    """The same round trip through TRL's own GRPOConfig (its __post_init__ does the batch
    arithmetic): per-process batches, generations, lengths, reference model, engine."""
    pytest.importorskip("trl")
    topology = Topology(nnodes, gpus)
    base = None
    if with_base:  # TRL's batches spelled with steps_per_generation, no reference model
        path = tmp_path / "grpo.yaml"
        path.write_text(TRL_BASE.replace("eval_strategy: steps", "eval_strategy: 'no'")
                        + "steps_per_generation: 8\nbeta: 0.0\n")
        base = load_trainer_yaml(str(path))
    knobs = {**ROUND_TRIP, "rollout_engine": engine, "offload_params": False,
             "rollout_n": 8, "max_response_length": 256, "micro_batch_size_update": 4,
             "use_kl": not with_base,  # the base's 8 per device x 4 accumulation and
             # 8 steps per generation, over 8 generations
             "global_batch_size": 4 * topology.world_size,
             "rollout_batch_size": 8 * topology.world_size}
    plan = plan_export(TRL, knobs, topology, base[0] if base else None, searched=SEARCHED,
                       run=cpu_study(TRL, topology, base))
    assert plan.problems == []
    values = yaml.safe_load(render_plan(plan, TRL, base, ["round trip", ""]))
    ran = trl_quantities(grpo_config(topology, values, tmp_path), topology.world_size)
    expected = probed(knobs, topology)
    assert {key: (ran[key], expected[key]) for key in ran if ran[key] != expected[key]} == {}


def trl_quantities(config, world: int) -> dict:
    """Every per-process quantity GRPOTrainer will run, from its normalised GRPOConfig."""
    ran = {"micro_batch_size_update": config.per_device_train_batch_size,
           "responses_per_minibatch": config.per_device_train_batch_size
           * config.gradient_accumulation_steps,
           "responses_per_step": config.generation_batch_size // world,
           "rollout_n": config.num_generations, "max_response_length":
           config.max_completion_length, "use_kl": config.beta != 0,
           "gradient_checkpointing": config.gradient_checkpointing,
           "rollout_engine": "vllm-like" if config.use_vllm and config.vllm_mode == "colocate"
           else "hf"}
    if config.use_vllm:
        ran.update(gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                   enable_sleep=config.vllm_enable_sleep_mode,
                   rollout_tensor_parallel=config.vllm_tensor_parallel_size)
    return ran


def test_verl_start_up_accepts_the_fused_log_prob_and_entropy_keys(tmp_path):
    """use_fused_kernels with the Triton backend and the actor's entropy keys, as a study with
    them on exports them, pass verl's own config checks."""
    need_source("verl")
    knobs = {**STUDY, "micro_batch_size_update": 1, "micro_batch_size_experience": 1,
             "fused_logprob": True, "fused_logprob_kernel": "triton", "entropy_coeff": 0.001,
             "entropy_chunking": True, "entropy_checkpointing": True}
    searched = (*SEARCHED, "fused_logprob", "entropy_chunking", "entropy_checkpointing")
    path, problems = exported(VERL, knobs, Topology(1, 8), None, tmp_path, "fused",
                              searched=searched)
    assert problems == []
    accepted, line = trainer_verdict("verl", path)
    assert accepted, line


def test_the_verl_check_alone_gives_the_served_checks_verdicts(tmp_path):
    """check_verl_load.py run alone, as docs/trainers-and-export.md tells a user to, answers
    as the forked checks the tests use do: one accepted file, one rejected by an override, one
    usage error (exit 2)."""
    need_source("verl")
    source = trainer_source("verl")
    knobs = {**STUDY, "micro_batch_size_update": 2, "micro_batch_size_experience": 4}
    path, problems = exported(VERL, knobs, Topology(1, 4), None, tmp_path, "alone")
    assert problems == []
    script = ROOT / "scripts" / "check_verl_load.py"
    python = os.environ.get("AUTOTUNE_TRAINER_PYTHON", sys.executable)  # as trainer_verdict
    bad = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"
    for overrides in ([], [bad]):
        alone = subprocess.run([python, str(script), source, str(path), *overrides],
                               capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        assert (alone.returncode == 0, alone.stdout.strip()) == trainer_verdict(
            "verl", path, *overrides), alone.stderr[-2000:]
    assert alone.returncode == 1 and "ppo_micro_batch_size_per_gpu 3" in alone.stdout
    usage = subprocess.run([python, str(script), source, str(path), "oops"],
                           capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert usage.returncode == 2 and "key=value" in usage.stdout


# -- issue 53 / issue 51: keys the trainers check, and the new knobs, through their start-up ----

def test_verl_accepts_a_dynamic_batching_study_exported_for_1_2_4_8_gpus(tmp_path):
    """A verl study that batched by tokens held a per-GPU micro-batch it never ran (8, above
    the normalised mini-batch on 8 GPUs): written as null, every export passes verl's worker
    start-up; the same file with the micro-batch kept is what fsdp_workers.py rejects."""
    need_source("verl")
    knobs = {**STUDY, "dynamic_batching": True, "micro_batch_size_update": 8,
             "micro_batch_size_experience": 8}
    for gpus in (1, 2, 4, 8):
        path, problems = exported(VERL, knobs, Topology(1, gpus), None, tmp_path, f"dyn{gpus}")
        assert problems == []
        tree = yaml.safe_load(path.read_text())
        assert tree["actor_rollout_ref"]["actor"].get("ppo_micro_batch_size_per_gpu") is None
        accepted, line = trainer_verdict("verl", path)
        assert accepted, line
    accepted, line = trainer_verdict("verl", path,
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    assert not accepted and "should be divisible by ppo_micro_batch_size_per_gpu 8" in line, line


LORA_SP_KNOBS = {**STUDY, "lora_rank": 32, "lora_alpha": 64,
                 "lora_target_modules": "q_proj,v_proj", "ulysses_sequence_parallel_size": 2,
                 "micro_batch_size_update": 2, "micro_batch_size_experience": 4}


def lora_sp_export_ran(adapter, trainer: str, gpus: int, where) -> dict:
    """A LoRA + SP 2 study exported for `gpus` GPUs with no base, accepted by the trainer's
    own start-up: the quantities it ran, as its check reports them."""
    where.mkdir(parents=True)
    searched = [*SEARCHED, "lora_rank", "ulysses_sequence_parallel_size"]
    path, problems = exported(adapter, LORA_SP_KNOBS, Topology(1, gpus), None, where, "run",
                              searched=searched)
    assert problems == []
    quantities = path.with_suffix(".json")
    accepted, line = trainer_verdict(trainer, path, quantities=quantities)
    assert accepted, line
    return json.loads(quantities.read_text())


def test_verl_runs_the_lora_and_sequence_parallel_knobs_as_probed(tmp_path):
    """LoRA (rank, alpha, target modules as a list) and Ulysses SP 2, exported for 2 and 8
    GPUs and read back from verl's own normalised worker config: the same knobs, the
    mini-batch normalised over the SP data-parallel size as the probe split it; SP without
    use_remove_padding is refused by autotune and by verl alike."""
    need_source("verl")
    for gpus in (2, 8):
        ran = lora_sp_export_ran(VERL, "verl", gpus, tmp_path / f"lora{gpus}")
        assert {k: ran[k] for k in ("lora_rank", "lora_alpha", "lora_target_modules",
                                    "sequence_parallel", "ref_sequence_parallel")} == {
            "lora_rank": 32, "lora_alpha": 64, "lora_target_modules": ["q_proj", "v_proj"],
            "sequence_parallel": 2, "ref_sequence_parallel": 2}
        # the probe's share: the data-parallel rank's (GPUs over SP) mini-batch
        assert ran["responses_per_minibatch"] == 8 * 4 // (gpus // 2)
    base = tmp_path / "no-padding.yaml"  # verl's default with the actor's padding kept
    text = verl_default().read_text()
    assert "    use_remove_padding: true\n" in text
    base.write_text(text.replace("adv_estimator: gae", "adv_estimator: grpo")
                    .replace("    use_remove_padding: true\n", "    use_remove_padding: false\n"))
    path, problems = exported(VERL, LORA_SP_KNOBS, Topology(1, 2), base, tmp_path, "nopad",
                              searched=[*LORA_SP_KNOBS])
    assert any("you must enable `use_remove_padding`" in p for p in problems)
    accepted, line = trainer_verdict("verl", path)
    assert not accepted and "use_remove_padding" in line, line


def test_trl_loads_lora_exports_and_refuses_what_its_base_changes(tmp_path):
    """TRL's own loader (TrlParser over GRPOConfig and ModelConfig, as trl's grpo script
    parses one file): LoRA's keys land on ModelConfig's peft fields; a base's Liger kernel or
    LoRA is refused, and forced the file reads back as the measured run."""
    pytest.importorskip("trl")
    from trl import GRPOConfig, ModelConfig, TrlParser

    def load(plan, base=None):
        path = tmp_path / "trl.yaml"
        path.write_text(render_plan(plan, TRL, base, ["p", ""]))
        values = {k: v for k, v in yaml.safe_load(path.read_text()).items() if v is not None}
        return TrlParser((GRPOConfig, ModelConfig)).parse_dict(
            {"output_dir": str(tmp_path / "out"), "report_to": "none", "use_cpu": True,
             "bf16": False, **values})

    knobs = {**STUDY, "micro_batch_size_update": 2, "lora_rank": 16, "lora_alpha": 32,
             "lora_target_modules": "all-linear"}
    plan = plan_export(TRL, knobs, Topology(1, 2), None, searched=[*SEARCHED, "lora_rank"])
    assert plan.problems == []
    _, model = load(plan)
    assert (model.use_peft, model.lora_r, model.lora_alpha, model.lora_target_modules) == \
        (True, 16, 32, "all-linear")
    for text, key in (("use_liger_kernel: true\n", "use_liger_kernel"),
                      ("use_peft: true\nlora_r: 8\n", "lora_rank (from use_peft and lora_r)")):
        base_path = tmp_path / "grpo.yaml"
        base_path.write_text(TRL_BASE + text)
        base = load_trainer_yaml(str(base_path))
        study = {**knobs, **BASE_SHAPES["trl"], "lora_rank": 0, "micro_batch_size_update": 8,
                 "global_batch_size": 8, "rollout_batch_size": 8}
        refused = plan_export(TRL, study, Topology(1, 2), base[0], searched=SEARCHED)
        assert any(p.startswith(key) for p in refused.problems), refused.problems
        forced = plan_export(TRL, study, Topology(1, 2), base[0], searched=SEARCHED,
                             force=True)
        assert forced.problems == []
        args, model = load(forced, load_trainer_yaml(str(base_path)))
        assert not args.use_liger_kernel and not model.use_peft


def test_easyr1_runs_the_lora_and_sequence_parallel_knobs_as_probed(tmp_path):
    """EasyR1's own start-up on a LoRA study with ulysses_size 2: its LoraConfig (target
    modules a string) and its global batch per device over GPUs // ulysses_size, as the
    probe split it."""
    need_source("easyr1")
    for gpus in (2, 8):
        ran = lora_sp_export_ran(EASYR1, "easyr1", gpus, tmp_path / f"e{gpus}")
        assert {k: ran[k] for k in ("lora_rank", "lora_alpha", "lora_target_modules",
                                    "sequence_parallel")} == {
            "lora_rank": 32, "lora_alpha": 64, "lora_target_modules": "q_proj,v_proj",
            "sequence_parallel": 2}
        assert ran["responses_per_minibatch"] == 8 * 4 // (gpus // 2)
