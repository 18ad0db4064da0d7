"""Malformed input, table-driven: every case is one line on stderr, no traceback, exit 2 (or 1
when the environment refuses: a full or read-only disk), and no file that was there changes.

Each command runs through `autotune.cli.main`, the same entry point as the `autotune` script,
in a sandbox folder holding the bad files. The read-only and full-disk cases mount a small
tmpfs (they are skipped where this machine does not allow mounting).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.hardware import Device

SPACE = """
params:
  gradient_checkpointing: {type: bool}
fixed: {rollout_batch_size: 4, rollout_n: 4, global_batch_size: 2, max_prompt_length: 64,
        max_response_length: 64, micro_batch_size_update: 1, micro_batch_size_experience: 2}
"""
# an anchor bomb: 9 aliases of 9 aliases ... 8 deep, 387 million strings once expanded
BOMB = "a: &a [" + ", ".join(["lol"] * 9) + "]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{before}'] * 9)}]\n"
    for before, name in zip("abcdefgh", "bcdefghi", strict=True))
NOT_UTF8 = b"params:\n  gradient_checkpointing: {type: bool}\n# caf\xe9\n"


def make_sandbox(root: Path) -> None:
    """The bad files the table refers to, and one real study (results/s) to show and export."""
    files = {
        "space.yaml": SPACE, "not_utf8.yaml": NOT_UTF8, "binary.yaml": os.urandom(3000),
        "list.yaml": "- 1\n- 2\n", "broken.yaml": "params: {a: [1, 2\n",
        "unknown_knob.yaml": "params:\n  micro_batch: {type: bool}\n",
        "deep.yaml": "[" * 5000, "notjournal.txt": "hello\n", "existing.log": "keep me\n",
        "a_file": "not a folder\n", "badjson/config.json": "{oops", "noconfig/.keep": "",
        "out_exists.yaml": "keep: me\n",
        "bomb_space.yaml": f"{BOMB}{SPACE}".replace("fixed: {", "fixed: {max_num_seqs: *i, "),
        "bomb_knobs.yaml": f"{BOMB}micro_batch_size_update: *i\n",
        "bomb_trainer.yaml": f"{BOMB}data:\n  rollout_batch_size: *i\n",
        "small_bomb.yaml": BOMB.split("f:")[0] + "micro_batch_size_update: *e\n",
        "loop.yaml": "a: &a [1, *a]\nmicro_batch_size_update: 1\n",
        "huge.yaml": "micro_batch_size_update: 1\n" + "# padding\n" * 110_000,
        "dup_space.yaml": SPACE.replace("bool}\n", "bool}\n  gradient_checkpointing: "
                                                "{type: categorical, choices: [true]}\n"),
        "dup_knobs.yaml": "micro_batch_size_update: 1\nmicro_batch_size_update: 2\n",
        "dup_trainer.yaml": "data:\n  rollout_batch_size: 4\n  rollout_batch_size: 8\n",
        "trainer_key.yaml": "params:\n  micro_batch_size_experience: {type: categorical, "
                            "choices: [1, 2]}\n  "
                            "a.b: {type: categorical, choices: [1, 2], memory_direction: 1}\n",
    }
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    make_study(root / "results", "s")
    gc.collect()  # close the study's connections: SQLite folds its log into study.db now
    (root / "zero" / "zero").mkdir(parents=True)
    (root / "zero" / "zero" / "study.db").write_bytes(b"")
    (root / "rand" / "rand").mkdir(parents=True)
    (root / "rand" / "rand" / "study.db").write_bytes(os.urandom(50000))
    whole = (root / "results" / "s" / "study.db").read_bytes()
    (root / "cut" / "cut").mkdir(parents=True)
    (root / "cut" / "cut" / "study.db").write_bytes(whole[:len(whole) // 2])  # truncated
    (root / "foreign" / "foreign").mkdir(parents=True)  # another program's SQLite file
    with contextlib.closing(sqlite3.connect(root / "foreign" / "foreign" / "study.db")) as db:
        db.execute("CREATE TABLE recipes (name TEXT)")
        db.commit()
    (root / "renamed").mkdir()
    shutil.copytree(root / "results" / "s", root / "renamed" / "old")


def make_study(results: Path, name: str) -> None:
    """A real study of 2 scripted probes whose best every trainer accepts on one GPU."""
    from scripted_runner import ScriptedRunner

    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    space_file = results.parent / "space.yaml"
    space_file.write_text(SPACE)
    settings = SweepSettings(study_name=name, study_dir=results / name,
                             space=load_search_space(str(space_file)),
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=2)
    from autotune.sweep.pick.artifacts import write_artifacts

    Sweep(settings, ScriptedRunner(), on_trial=lambda s: write_artifacts(s, settings.study_dir)
          ).run()


RUN = ["run", "--model", "tiny-qwen2.5", "--space", "space.yaml", "--trials", "1"]
EXPORT = ["export", "--study", "s", "--trainer", "trl"]
CASES: list[tuple[list[str], str]] = [
    # run: names, sizes, counts
    (RUN + ["--study", ""], "--study '': give a name"),
    (RUN + ["--study", "x" * 300], "300 characters; use at most 100"),
    (RUN + ["--study", "a/b"], "--study 'a/b'"),
    (RUN + ["--study", ".hidden"], "--study '.hidden'"),
    (RUN + ["--gpu-memory-limit", "0"], "--gpu-memory-limit '0': must be more than zero"),
    # the rollout engine's knobs
    (RUN + ["--set", "gpu_memory_utilization=1.5"],
     "gpu_memory_utilization='1.5': expected a share of the device, more than 0 and at most 1"),
    (RUN + ["--set", "gpu_memory_utilization=lots"], "expected a share of the device"),
    (RUN + ["--set", "rollout_engine=sglang"], "rollout_engine='sglang': expected one of hf, "
                                                "vllm-like, vllm"),
    (RUN + ["--engine", "vllm", "--gpu-memory-limit", "1GiB"],
     "rollout_engine=vllm: vLLM is not installed next to autotune"),  # not in the test venv
    (RUN + ["--set", "kv_cache_memory_bytes=lots"], "kv_cache_memory_bytes 'lots': expected a "
                                                     "size such as 40GiB"),
    (RUN + ["--set", "fused_logprob=true", "--set", "fused_logprob_kernel=triton"],
     "fused_logprob_kernel=triton runs on a CUDA device only"),
    (RUN + ["--device", "cpu", "--engine", "vllm-like"],
     "rollout_engine=vllm-like on the CPU reserves a share of the device cap: add "
     "--gpu-memory-limit"),
    (RUN + ["--set", "rollout_engine=vllm-like", "--gpu-memory-limit", "1GiB", "--set",
            "max_num_batched_tokens=64"], "max_num_batched_tokens=64 is less than"),
    (["probe", "--model", "tiny-qwen2.5", "--set", "sleep_level=3", "--engine", "vllm-like",
      "--gpu-memory-limit", "1GiB"], "sleep_level=3: vLLM sleeps at level 1 or 2"),
    (RUN + ["--host-memory-limit", "0"], "--host-memory-limit '0': must be more than zero"),
    (RUN + ["--gpu-memory-limit", "lots"], "expected a size such as 40GiB"),
    (RUN + ["--gpu-memory-limit", "9999999PiB"], "expected a size such as 40GiB"),
    (RUN + ["--host-memory-limit", "99999999999TB"], "check the unit"),
    (RUN + ["--parallel", "1000"], "--parallel 1000: this machine lets autotune use"),
    (RUN + ["--parallel", "0"], "0 is not in the range"),
    (RUN + ["--timed-steps", "1000000000"], "1000000000 is not in the range 1<=x<=100"),
    (RUN + ["--warmup-steps", "1000000000"], "is not in the range 0<=x<=100"),
    (RUN + ["--finalists", str(2**70)], "is not in the range 0<=x<=32"),
    (RUN + ["--confirm", "1000"], "1000 is not in the range 0<=x<=32"),
    (RUN + ["--set", "lora_rank=8", "--set", "lora_target_modules=warp_proj"],
     "warp_proj is no linear layer of the model's decoder layers; use all-linear or names "
     "among q_proj"),
    (RUN + ["--results-dir", "foreign", "--study", "foreign"],
     "holds tables that are not an Optuna study's (recipes)"),
    (RUN + ["--device", "cuda"], "--device cuda: no NVIDIA GPU"),
    (["run", "--device", "cuda"], "--device cuda: no NVIDIA GPU"),
    (RUN + ["--device", "tpu"], "'tpu' is not one of"),
    (["run", "--model", "qwen2.5-vl7b"], "did you mean qwen2.5-vl-7b"),
    (["run", "--model-path", "missing-dir"], "--model-path missing-dir: no such directory"),
    (["run", "--model-path", "noconfig"], "no config.json there"),
    (["run", "--model-path", "badjson"], "not valid JSON"),
    (["run", "--model", "qwen2.5-vl-7b"], "needs about 168.22 GiB of GPU memory at the "
     "smallest config"),
    (["run", "--model", "qwen2.5-vl-7b", "--gpus-per-node", "8"], "needs about 30.92 GiB of "
     "GPU memory per rank of 8 at the smallest config"),
    (["run", "--model", "qwen2.5-7b", "--space", "space.yaml"], "no NVIDIA GPU found"),
    (["run", "--model", "qwen2.5-7b", "--space", "space.yaml", "--device", "cpu"],
     "of model states in the update alone"),
    (["run", "--model", "tiny-qwen2.5-vl"], "--set max_prompt_length="),
    (RUN[:3] + ["--space", "missing-space"], "unknown search space 'missing-space'"),
    (RUN[:3] + ["--space", "noconfig"], "is a directory; give a .yaml file"),
    (RUN[:3] + ["--space", "not_utf8.yaml"], "not_utf8.yaml:3: not UTF-8 text"),
    (RUN[:3] + ["--space", "binary.yaml"], "not UTF-8 text"),
    (RUN[:3] + ["--space", "list.yaml"], "expected a mapping with 'params'"),
    (RUN[:3] + ["--space", "broken.yaml"], "not valid YAML"),
    (RUN[:3] + ["--space", "unknown_knob.yaml"], "unknown knob 'micro_batch'"),
    (RUN[:3] + ["--space", "deep.yaml"], "not valid YAML"),
    (RUN + ["--base-config", "not_utf8.yaml"], "--base-config not_utf8.yaml:3: not UTF-8"),
    (RUN + ["--base-config", "missing.yaml"], "--base-config missing.yaml: cannot read"),
    (RUN + ["--base-config", "list.yaml"], "expected a mapping of knob names"),
    (RUN + ["--base-config", "deep.yaml"], "not valid YAML"),
    (RUN + ["--set", "micro_batch=4"], "unknown knob 'micro_batch'"),
    (RUN + ["--set", "max_num_seqs=9223372036854775808"], "must be at most 16777216"),
    (RUN + ["--set", "max_prompt_length=0"], "must be at least 1"),
    (RUN + ["--set", "rollout_n"], "expected key=value"),
    (RUN + ["--set", "image_size_px=30"], "not a multiple of 28"),
    (RUN + ["--set", "gradient_checkpointing=true"], "searched by space.yaml"),
    (RUN + ["--headroom", "150%"], "--headroom '150%'"),
    (RUN + ["--timeout", "soon"], "--timeout 'soon'"),
    (RUN + ["--probe-timeout", "0s"], "--probe-timeout '0s'"),
    (RUN + ["--trials", "0"], "0 is not in the range"),
    (RUN + ["--threads", "0"], "0 is not in the range"),
    (RUN + ["--gpus", "a,b"], "--gpus 'a,b': expected ids"),
    (RUN + ["--nnodes", "0"], "0 is not in the range"),
    (RUN + ["--gpus-per-node", "16"], "not divisible by the 16 GPUs"),
    (RUN + ["--storage", "notjournal.txt"], "not an Optuna journal"),
    (RUN + ["--storage", "/dev/full"], "not a regular file"),
    (RUN + ["--storage", "sqlite:///s.db"], "cannot be shared safely"),
    (RUN + ["--storage", "noconfig"], "is a directory; give a journal file path"),
    (RUN + ["--storage", "missing/x.journal"], "folder missing does not exist"),
    (RUN + ["--storage", "postgresql://u:secret@127.0.0.1:1/s"], "cannot open the database"),
    (RUN + ["--address", "auto"], "--address: only with --executor ray"),
    (RUN + ["--storage", "new.journal", "--study", ""], "--study ''"),  # no journal made
    (RUN + ["--trainer", "easyr1", "--base-config", "not_utf8.yaml"], "not UTF-8 text"),
    (RUN + ["--trainer", "verl", "--base-config", "list.yaml"], "expected a mapping of trainer"),
    # PPO for a trainer whose PPO autotune does not write
    (RUN + ["--trainer", "trl", "--algorithm", "ppo"],
     "trl: PPO (a critic) is not supported: autotune writes this trainer's GRPO config"),
    (RUN + ["--algorithm", "ppo", "--set", "algorithm=grpo"],
     "--algorithm ppo but --set algorithm=grpo; give one"),
    (RUN + ["--no-such-flag"], "No such option '--no-such-flag'"),
    # run --launch: the user's own trainer
    (RUN + ["--launch", "python3 t.py --config {config}"], "--launch needs --trainer"),
    (RUN + ["--trainer", "trl", "--launch", "python3 t.py"], "no placeholder for the trial's"),
    (RUN + ["--trainer", "trl", "--launch", "python3 't.py {config}"], "quote it as your"),
    (RUN + ["--trainer", "trl", "--launch", "nope-trainer {config}"], "is not a command here"),
    (RUN + ["--trainer", "trl", "--launch", "python3 t.py --config {config}", "--device", "cpu",
            "--gpus-per-node", "64", "--set", "rollout_batch_size=64", "--set",
            "global_batch_size=32"], "a probe of your trainer runs all of them"),
    (RUN + ["--trainer", "trl", "--launch", "python3 t.py --config {config}", "--space",
            "trainer_key.yaml"], "params.micro_batch_size_experience: trl has no key for it"),
    (["run", "--space", "trainer_key.yaml", "--trials", "1"], "only a run of your trainer"),
    (["nope"], "No such command 'nope'"),
    # a study that is not one, or that another setup made: refused before anything is written
    (RUN + ["--results-dir", "zero", "--study", "zero"], "empty (0 bytes), not a study"),
    (RUN + ["--results-dir", "rand", "--study", "rand"], "not a study database"),
    (RUN + ["--results-dir", "cut", "--study", "cut"], "cut/cut/study.db: not a study database "
     "(database disk image is malformed); it may be damaged: keep a copy"),
    (["show", "--results-dir", "cut"], "cut/cut/study.db: not a study database (database disk "
     "image is malformed); it may be damaged: keep a copy"),
    (RUN + ["--study", "s", "--headroom", "30%"], "was started with a different setup"),
    # contradictions: refused, not silently resolved
    (RUN + ["--set", "max_prompt_length=32", "--set", "max_prompt_length=128"],
     "--set max_prompt_length given twice (32, then 128)"),
    (RUN + ["--device", "cpu", "--gpus", "0"], "--gpus 0: GPU ids, but probes run on the CPU"),
    (RUN + ["--device", "cpu", "--gpus-per-trial", "2"],
     "--gpus-per-trial 2: probes run on the CPU"),
    (RUN + ["--threads", "1000"], "--threads 1000: this machine lets autotune use"),
    (["probe", "--model", "tiny-qwen2.5", "--threads", "1000"], "--threads 1000"),
    # probe
    (["probe", "--model", "tiny-qwen2.5", "--device", "cuda"], "--device cuda: no NVIDIA GPU"),
    (["probe", "--model", "tiny-qwen2.5", "--set", "max_num_seqs=9223372036854775808"],
     "must be at most 16777216"),
    (["probe", "--model", "tiny-qwen2.5", "--log", "existing.log"], "existing.log exists"),
    (["probe", "--model", "tiny-qwen2.5", "--log", "missing/x.log"], "folder missing does not"),
    (["probe", "--model", "qwen2.5-7b"], "no NVIDIA GPU found"),
    (["probe", "--model", "tiny-qwen2.5", "--set", "rollout_batch_size=3"], "not divisible"),
    (["probe", "--model", "tiny-qwen2.5", "--gpu-memory-limit", "0"], "must be more than zero"),
    (["probe", "--model", "tiny-qwen2.5", "--timeout", "9s"], "No such option '--timeout'"),
    # estimate
    (["estimate", "--model", "qwen2.5-7b", "--capacity", "0"], "--capacity '0': must be more"),
    (["estimate", "--model", "qwen2.5-7b", "--capacity", "-5GiB"], "expected a size"),
    (["estimate"], "give --model NAME"),
    (["estimate", "--model", "nope"], "unknown model 'nope'"),
    (["estimate", "--study", "missing"], "--study missing: no results"),
    (["estimate", "--model", "qwen2.5-7b", "--headroom", "2"], "--headroom '2'"),
    (["estimate", "--model", "qwen2.5-7b", "--gpus", "8"], "No such option '--gpus'"),
    (["estimate", "--model", "qwen2.5-7b", "--gpu-memory-limit", "0"],
     "--gpu-memory-limit '0': must be more than zero"),
    (["estimate", "--model", "qwen2.5-7b", "--capacity", "80GiB", "--reserve-gpu-memory",
      "80GiB"], "--reserve-gpu-memory 80.00 GiB: leaves nothing of --capacity 80.00 GiB"),
    (["estimate", "--model", "qwen2.5-7b", "--capacity", "80GiB", "--reserve-gpu-memory",
      "90GiB"], "--reserve-gpu-memory 90.00 GiB: leaves nothing of --capacity 80.00 GiB"),
    (["estimate", "--model", "qwen2.5-7b", "--capacity", "80GiB", "--gpu-memory-limit",
      "100GiB"], "--gpu-memory-limit 100.00 GiB: more than --capacity 80.00 GiB"),
    (RUN + ["--reserve-gpu-memory", "100TiB"], "leaves nothing of this machine's RAM"),
    (["estimate", "--model", "qwen2.5-7b", "--trainer", "verl", "--set",
      "actor_rollout_ref.rollout.n=4", "--set", "n=8"], "--set n=8 and "
     "actor_rollout_ref.rollout.n=4 name one key (actor_rollout_ref.rollout.n); give it once"),
    (["estimate", "--model", "qwen2.5-7b", "--trainer", "verl", "--set", "param_offload=true"],
     "--set param_offload: ambiguous, names actor_rollout_ref.actor.fsdp_config.param_offload, "
     "actor_rollout_ref.ref.fsdp_config.param_offload; spell it in full"),
    (RUN + ["--host-memory", "1MiB"], "--host-memory 1 MiB: less than 1.00 GiB, below any "
                                       "node of a training run"),
    (RUN + ["--host-memory", "1GiB"], "--host-memory 1.00 GiB: the node's start-up alone "
                                       "(its rank processes, the checkpoint read into RAM)"),
    (RUN + ["--device", "cpu", "--gpu-memory-limit", "2GiB", "--host-memory-limit", "1GiB"],
     "--host-memory-limit 1.00 GiB: below the device cap of 2.00 GiB, and on the CPU both cap "
     "the same memory"),
    (RUN + ["--engine", "hf", "--set", "kv_cache_memory_bytes=64MiB"],
     "rollout_engine=hf ignores it"),
    (["estimate", "--model", "qwen2.5-7b", "--bisect-length"], "--bisect-length: only with "
                                                              "--trace"),
    (RUN + ["--seed", "-1"], "-1 is not in the range"),
    (RUN + ["--seed", str(2**70)], "is not in the range"),
    (["export"], "export: give --trainer"),
    (["estimate", "--model", "qwen2.5-7b", "--storage", "x.journal"], "only with --study"),
    (["estimate", "--model", "qwen2.5-7b", "--set", "micro_batch_size_update=3"],
     "not divisible by micro_batch_size_update=3"),
    # token budgets and response lengths
    (["estimate", "--model", "qwen2.5-7b", "--response-length", "0"], "0 is not in the range"),
    (["estimate", "--model", "qwen2.5-7b", "--response-length", "4096"],
     "--response-length 4096: longer than max_response_length=256"),
    (["estimate", "--model", "qwen2.5-7b", "--set", "dynamic_batching=true", "--set",
      "max_token_len_update=100"], "max_token_len_update=100 is less than one sequence"),
    (["estimate", "--model", "qwen2.5-7b", "--set", "max_token_len_update=4096"],
     "read only with dynamic_batching=true"),
    (["estimate", "--model", "qwen2.5-7b", "--set", "dynamic_batching=maybe"],
     "dynamic_batching='maybe': expected true or false"),
    # show
    (["show", "--study", "missing"], "--study missing: no results"),
    (["show", "--results-dir", "noconfig"], "no study in noconfig"),
    (["show", "--results-dir", "zero"], "empty (0 bytes), not a study database"),
    (["show", "--results-dir", "rand"], "not a study database"),
    (["show", "--results-dir", "renamed"], "holds study s, not old"),
    (["show", "--study", "s", "--storage", "notjournal.txt"], "not an Optuna journal"),
    (["show", "--study", "s", "--storage", "missing.journal"], "no such journal file"),
    (["show", "--study", "x" * 5000], "5000 characters; use at most 100"),
    (["report", "--study", "../../etc"], "--study '../../etc'"),
    (EXPORT[:1] + ["--study", "../../etc", "--trainer", "trl"], "--study '../../etc'"),
    (["estimate", "--study", "a/b"], "--study 'a/b'"),
    # report
    (["report", "--study", "missing"], "--study missing: no results"),
    (["report", "--results-dir", "zero"], "empty (0 bytes), not a study database"),
    (["report", "--study", "s", "--out", "existing.log"],
     "exists and is not an autotune report; choose a new path"),
    (["report", "--study", "s", "--out", "missing/r.html"], "folder missing does not exist"),
    (["report", "--study", "s", "--out", "a_file/r.html"], "folder a_file is a file"),
    (["report", "--study", "s", "--out", "noconfig"], "is a folder; give a file name"),
    # export
    (EXPORT + ["--out", "out_exists.yaml"], "out_exists.yaml: file exists"),
    (EXPORT + ["--out", "missing/x.yaml"], "folder missing does not exist"),
    (EXPORT + ["--out", "a_file/x.yaml"], "folder a_file is a file"),
    (EXPORT + ["--base-config", "not_utf8.yaml"], "not UTF-8 text"),
    (EXPORT + ["--base-config", "deep.yaml"], "not valid YAML"),
    (["export", "--trainer", "trl", "--results-dir", "zero"], "empty (0 bytes)"),
    (["export", "--trainer", "trl", "--results-dir", "renamed"], "holds study s, not old"),
    (["export", "--trainer", "deepspeed"], "'deepspeed' is not one of"),
    # hostile YAML: refused in about a second (test_hostile_yaml_is_refused_at_once)
    (["validate", "bomb_space.yaml"], "bomb_space.yaml:7: its aliases expand to more than "
     "1,000,000 values"),
    (RUN[:3] + ["--space", "bomb_space.yaml"], "its aliases expand to more than 1,000,000"),
    (RUN + ["--base-config", "bomb_knobs.yaml"], "bomb_knobs.yaml:7: its aliases expand"),
    (RUN + ["--base-config", "small_bomb.yaml"], "micro_batch_size_update: expected one "
                                                 "value, not a list"),
    (RUN + ["--trainer", "verl", "--base-config", "bomb_trainer.yaml"],
     "--base-config bomb_trainer.yaml:7: its aliases expand"),
    (EXPORT + ["--base-config", "bomb_trainer.yaml"], "its aliases expand"),
    (RUN + ["--base-config", "loop.yaml"], "loop.yaml:1: an alias names a value that holds it"),
    (["validate", "huge.yaml"], "huge.yaml: larger than 1 MiB, not a config"),
    (RUN + ["--base-config", "huge.yaml"], "huge.yaml: larger than 1 MiB"),
    (RUN + ["--trainer", "verl", "--base-config", "huge.yaml"], "larger than 1 MiB"),
    (["validate", "dup_space.yaml"], "dup_space.yaml:4: not valid YAML (key "
     "'gradient_checkpointing' given twice (first on line 3); give it once)"),
    (RUN + ["--base-config", "dup_knobs.yaml"], "dup_knobs.yaml:2: not valid YAML (key "
     "'micro_batch_size_update' given twice"),
    (RUN + ["--trainer", "verl", "--base-config", "dup_trainer.yaml"],
     "dup_trainer.yaml:3: not valid YAML (key 'rollout_batch_size' given twice"),
    (RUN + ["--trainer", "verl", "--set", "data.train_batch_size={a: 1, a: 2}"],
     "key 'a' given twice"),
    # validate
    (["validate", "noconfig"], "is a directory; give a .yaml file"),
    (["validate", "not_utf8.yaml"], "not UTF-8 text"),
    (["validate", "missing.yaml"], "no such file"),
    (["validate", "binary.yaml"], "not UTF-8 text"),
]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def invoke(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as ended:
        main(args)
    return ended.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    make_sandbox(root)
    return root


def test_the_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(args, message, sandbox, capsys,
                                                          monkeypatch):
    monkeypatch.chdir(sandbox)
    before = snapshot(sandbox)
    code, err = invoke(args, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert "secret" not in err  # a database password is never printed
    assert snapshot(sandbox) == before


HOSTILE = [case for case in CASES if any(
    name in arg for arg in case[0] for name in ("bomb", "huge", "loop"))]


@pytest.mark.parametrize("args,message", HOSTILE, ids=[" ".join(a)[:60] for a, _ in HOSTILE])
def test_hostile_yaml_is_refused_at_once(args, message, sandbox, capsys, monkeypatch):
    """An anchor bomb, a file too large: refused within seconds, not after minutes (the pure
    Python loader took minutes on 50 MB; str() of a bomb's value never ends)."""
    import time

    monkeypatch.chdir(sandbox)
    started = time.monotonic()
    code, _ = invoke(args, capsys)
    assert code == 2 and time.monotonic() - started < 3


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs of our own: filled or remounted read-only by the tests."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(mount: Path) -> None:
    with open(mount / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass


def read_only(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)


def test_a_folder_that_takes_no_files_is_named_as_it_is(sandbox, capsys, monkeypatch):
    """/proc exists and takes no new files: the line names the path given and says so, not
    "no such file" about a folder that is there, nor a temporary file of ours."""
    monkeypatch.chdir(sandbox)
    for args, path in ((RUN + ["--results-dir", "/proc"], "/proc/"),
                       (["report", "--study", "s", "--out", "/proc/r.html"], "/proc/r.html")):
        code, err = invoke(args, capsys)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert path in err and "no such file" not in err and ".tmp" not in err, err


def test_environment_errors_are_one_line_exit_1(small_fs, sandbox, capsys, monkeypatch):
    monkeypatch.chdir(sandbox)
    shutil.copytree(sandbox / "results" / "s", small_fs / "s")
    read_only(small_fs)
    results = ["--results-dir", str(small_fs)]
    for args, message in [
        (RUN + results + ["--study", "new"], "read-only file system; pass --results-dir"),
        (RUN + results + ["--study", "s"], "read-only file system"),
        (EXPORT + results, "read-only file system; pass --results-dir (or --out)"),
        (["report", *results, "--study", "s"], "read-only file system"),
    ]:
        before = snapshot(small_fs)
        code, err = invoke(args, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert message in lines[0], lines[0]
        assert snapshot(small_fs) == before
    main(["show", *results, "--study", "s"])  # reading works, and writes nothing
    assert "best: trial" in capsys.readouterr().out


def test_a_full_disk_at_the_start_is_one_line_and_leaves_nothing(small_fs, sandbox, capsys,
                                                                 monkeypatch):
    monkeypatch.chdir(sandbox)
    fill(small_fs)
    before = snapshot(small_fs)
    code, err = invoke(RUN + ["--results-dir", str(small_fs)], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "disk is full" in err or "no space left on device" in err, err
    assert snapshot(small_fs) == before and sorted(os.listdir(small_fs)) == ["filler"]
    (small_fs / "filler").unlink()  # and an export that runs out of room mid-file
    free = os.statvfs(small_fs)
    (small_fs / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 2048))
    code, err = invoke(EXPORT + ["--out", str(small_fs / "best.trl.yaml")], capsys)
    assert code == 1 and "no space left on device" in err, err
    assert not (small_fs / "best.trl.yaml").exists()  # nothing half-written


def test_a_disk_that_fills_mid_sweep_loses_nothing_once_space_is_back(small_fs):
    """The disk fills while a probe runs: the sweep stops with the disk's error, leaves no
    temporary file, and the same sweep resumed after space is freed redoes only that probe."""
    from scripted_runner import ScriptedRunner

    from autotune.cli.main import one_line
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    class FillsTheDisk(ScriptedRunner):
        def run(self, request, log_path=None):
            result = super().run(request, log_path)
            if len(self.calls) == 3:
                fill(small_fs)
            return result

    settings = SweepSettings(study_name="s", study_dir=small_fs / "s",
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=6, seed=4)
    first = FillsTheDisk()
    with pytest.raises(Exception) as stopped:
        Sweep(settings, first).run()
    line, code = one_line(stopped.value)  # what `autotune run` prints
    assert code == 1 and ("no space left" in line or "disk is full" in line), line
    assert not list(small_fs.rglob("*.tmp"))  # no half-written file
    (small_fs / "filler").unlink()
    second = ScriptedRunner()
    study = Sweep(settings, second).run()
    probed = [t for t in study.trials if t.user_attrs.get("probed")]
    assert len(probed) == 6 and not [t for t in study.trials if t.state.name == "RUNNING"]
    keys = [tuple(sorted(t.params.items())) for t in probed]
    assert len(keys) == len(set(keys))  # each config probed to a told result once
    assert len(first.calls) + len(second.calls) <= 6 + 1  # at most the cut-off probe again


def test_a_study_this_user_cannot_write_is_one_line_exit_2(sandbox, tmp_path):
    """study.db readable but not writable by the user who runs the sweep (as root: a copy
    owned by root, run as `nobody`): one line, exit 2, nothing written. (A read-only file
    system is the environment's error, exit 1: test_environment_errors_are_one_line_exit_1.)"""
    import tempfile

    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("running as root without runuser")
        prefix = [runuser, "-u", "nobody", "--"]
        if subprocess.run([*prefix, sys.executable, "-c", "import autotune.cli"],
                          capture_output=True, cwd="/").returncode != 0:
            pytest.skip("`nobody` cannot read this checkout or its Python")
    else:
        prefix = []
    root = Path(tempfile.mkdtemp(prefix="autotune-readonly-"))  # one `nobody` can enter
    try:
        os.chmod(root, 0o755)
        shutil.copytree(sandbox / "results" / "s", root / "results" / "s")
        shutil.copy(sandbox / "space.yaml", root / "space.yaml")
        if not prefix:
            for path in (root / "results" / "s").rglob("*"):
                path.chmod(0o444 if path.is_file() else 0o555)
            (root / "results" / "s").chmod(0o555)
        before = snapshot(root)
        done = subprocess.run([*prefix, sys.executable, "-m", "autotune", *RUN,
                               "--results-dir", "results", "--study", "s"], cwd=root,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HOME": str(root)})
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "read-only here; a sweep records every trial in it" in lines[0], lines[0]
        assert snapshot(root) == before
    finally:
        for path in root.rglob("*"):
            with contextlib.suppress(OSError):
                path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)
