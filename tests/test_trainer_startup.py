"""The trainers' own start-up on autotune's exports, trainer x topology x with/without a base
config (issue 18): every file autotune writes is accepted, and every config it refuses for a
rule is rejected by the trainer too (the same file, written anyway).

TRL: the real GRPOConfig parses each export in-process (always run: the test extra installs
trl). EasyR1 and verl: scripts/check_easyr1_load.py and check_verl_load.py run their real
start-up (config, trainer init, the workers' batch normalisation as rank 0 of W on torch's fake
process group, the rollout's checks; only GPU, Ray, vLLM and weights are stubbed, as their
docstrings say). Those need the trainers' sources, which CI cannot download: set
AUTOTUNE_EASYR1_SRC and AUTOTUNE_VERL_SRC to checkouts (hiyouga/EasyR1 b44b311, volcengine/verl
b178a3c) and AUTOTUNE_TRAINER_PYTHON to a python with their dependencies; skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import Topology
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export import load_trainer_yaml, render_plan
from autotune.trainers.plan import ExportPlan, plan_export
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


def exported(adapter, knobs, topology, base_path, tmp_path, name, force=False):
    """The file an export writes (written even where autotune refuses it), and the rules it
    breaks (none: autotune writes it; some: autotune refuses it)."""
    base = load_trainer_yaml(str(base_path)) if base_path else None
    plan = plan_export(adapter, knobs, topology, base[0] if base else None,
                       searched=SEARCHED, force=force)
    conflicts = [p for p in plan.problems if not p.startswith(f"{adapter.name}: ")]
    assert not conflicts, conflicts  # the study's shapes are the base's: no conflict
    path = tmp_path / f"{name}.yaml"
    path.write_text(render_plan(plan, adapter, base, ["test export", ""]))
    return path, plan.problems


def trainer_verdict(trainer: str, path: Path) -> tuple[bool, str]:
    source = os.environ.get(f"AUTOTUNE_{trainer.upper()}_SRC")
    python = os.environ.get("AUTOTUNE_TRAINER_PYTHON", sys.executable)
    script = ROOT / "scripts" / f"check_{trainer}_load.py"
    out = subprocess.run([python, str(script), source, str(path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode in (0, 1), out.stdout + out.stderr[-2000:]  # 2: the check broke
    return out.returncode == 0, out.stdout.strip()


@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", TOPOLOGIES, ids=[f"{n}x{g}" for n, g in TOPOLOGIES])
@pytest.mark.parametrize("trainer", ["easyr1", "verl"])
def test_the_trainers_start_up_accepts_every_export_and_rejects_every_refusal(
        trainer, nnodes, gpus, with_base, tmp_path):
    if not os.environ.get(f"AUTOTUNE_{trainer.upper()}_SRC"):
        pytest.skip(f"AUTOTUNE_{trainer.upper()}_SRC: no {trainer} checkout to run its start-up")
    adapter, topology = {"easyr1": EASYR1, "verl": VERL}[trainer], Topology(nnodes, gpus)
    base_path = None
    if with_base:
        fixture = FIXTURES / ("easyr1-config.yaml" if trainer == "easyr1"
                              else "verl-ppo-trainer.yaml")
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
    if not os.environ.get(f"AUTOTUNE_{trainer.upper()}_SRC"):
        pytest.skip(f"AUTOTUNE_{trainer.upper()}_SRC: no {trainer} checkout to run its start-up")
    adapter = {"easyr1": EASYR1, "verl": VERL}[trainer]
    base_path = None
    knobs = {**STUDY, "dynamic_batching": True, "micro_batch_size_update": 2,
             "micro_batch_size_experience": 4}
    if trainer == "verl":
        base_path = tmp_path / "ppo.yaml"
        base_path.write_text((FIXTURES / "verl-ppo-trainer.yaml").read_text()
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
    if not os.environ.get("AUTOTUNE_VERL_SRC"):
        pytest.skip("AUTOTUNE_VERL_SRC: no verl checkout to run its start-up")
    base = load_trainer_yaml(str(FIXTURES / "verl-ppo-trainer.yaml"))
    knobs = {**STUDY, **BASE_SHAPES["verl"], "micro_batch_size_update": 4,
             "micro_batch_size_experience": 8}
    refused = plan_export(VERL, knobs, Topology(1, 8), base[0], searched=SEARCHED)
    assert [p.split(" is ")[0] for p in refused.problems] == ["algorithm.adv_estimator"]
    forced = plan_export(VERL, knobs, Topology(1, 8), base[0], searched=SEARCHED, force=True)
    as_is = tmp_path / "gae.yaml"  # what a silent export would have written: gae kept
    as_is.write_text(render_plan(
        ExportPlan({k: v for k, v in forced.values.items() if k != "algorithm.adv_estimator"}),
        VERL, base, ["p", ""]))
    accepted, line = trainer_verdict("verl", as_is)
    assert not accepted and "critic" in line, line
    path = tmp_path / "forced.yaml"
    path.write_text(render_plan(forced, VERL, load_trainer_yaml(
        str(FIXTURES / "verl-ppo-trainer.yaml")), ["p", ""]))
    accepted, line = trainer_verdict("verl", path)
    assert accepted, line


@pytest.mark.parametrize("with_base", [False, True], ids=["defaults", "base"])
@pytest.mark.parametrize("nnodes, gpus", TOPOLOGIES, ids=[f"{n}x{g}" for n, g in TOPOLOGIES])
def test_trl_grpo_config_accepts_every_export_and_rejects_every_refusal(nnodes, gpus,
                                                                        with_base, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    topology = Topology(nnodes, gpus)

    class Processes(GRPOConfig):  # GRPOConfig reads the process count from accelerate
        @property
        def world_size(self):
            return topology.world_size

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
        values = yaml.safe_load(path.read_text())
        values = {k: v for k, v in values.items() if v is not None}
        try:
            Processes(**{"output_dir": str(tmp_path / "out"), "report_to": "none",
                         "use_cpu": True, "bf16": False, **values})
            accepted = True
        except ValueError:
            accepted = False
        verdicts.append((knobs["micro_batch_size_update"], not problems, accepted))
        assert accepted == (not problems), (knobs, problems)
    # 6 processes do not divide the demo's 64 completions: all refused there
    assert any(ours for _, ours, _ in verdicts) or (nnodes, gpus, with_base) == (1, 6, False)
    assert not all(ours for _, ours, _ in verdicts), verdicts  # a refusal tried too
