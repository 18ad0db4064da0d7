"""Fresh studies' exports, read back by the trainers' own config code (issue 30).

For each study given (a real `autotune run --trainer T` study), `autotune export --trainer T`
writes the file as a user gets it (no --force: a difference from the measured run would be
refused); the trainer's own code loads it (EasyR1 and verl: scripts/check_*_load.py, their
normalised worker config written as JSON; TRL: its GRPOConfig) and every per-GPU quantity it
will run is compared with the study's best.yaml: the knobs the probe ran and the share of the
batches it recorded (provenance.topology.share). Target: 0 differences.

    autotune run --model tiny-qwen2.5 --trainer easyr1 --gpus-per-node 2 --engine vllm-like \\
        --gpu-memory-limit 2GiB --trials 3 --results-dir res --study e2    # and verl, trl
    AUTOTUNE_EASYR1_SRC=... AUTOTUNE_VERL_SRC=... AUTOTUNE_TRAINER_PYTHON=... \\
        python benchmarks/export_round_trip.py res e2 v2 t2

Writes benchmarks/results/export_round_trip.txt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_trainer_startup import grpo_config, trainer_verdict, trl_quantities  # noqa: E402

from autotune.batching import with_token_budgets  # noqa: E402
from autotune.config import KNOB_NAMES, ProbeConfig, Topology  # noqa: E402
from autotune.trainers.export_plan import measured_knobs  # noqa: E402


def probed(best: dict) -> dict:
    """What the probe ran per GPU, from best.yaml: its knobs and the share it recorded."""
    knobs = with_token_budgets(measured_knobs(best["config"]))
    config = ProbeConfig(**{k: v for k, v in knobs.items() if k in KNOB_NAMES})
    share = best["provenance"]["topology"]["share"]
    budgets = ("max_token_len_update", "max_token_len_experience", "ref_max_token_len")
    values = {**knobs, "world_size": share["world_size"],
              "responses_per_step": share["responses_per_step"],
              "responses_per_minibatch": share["responses_per_minibatch"],
              "ref_micro_batch_size": config.micro_batch_size_experience,
              "ref_max_token_len": knobs.get("max_token_len_experience"),
              "offload_ref_params": config.ref_on_host, "sequence_parallel": 1}
    return {k: v for k, v in values.items() if config.dynamic_batching or k not in budgets}


def trainer_of(study_dir: Path) -> str:
    found = sorted(p.name.split(".")[1] for p in study_dir.glob("best.*.yaml"))
    if len(found) != 1:
        sys.exit(f"{study_dir}: expected one best.<trainer>.yaml (a run with --trainer)")
    return found[0]


def round_trip(results: Path, study: str, work: Path) -> dict:
    study_dir = results / study
    trainer, best = trainer_of(study_dir), yaml.safe_load((study_dir / "best.yaml").read_text())
    out = work / f"{study}.{trainer}.yaml"
    export = subprocess.run([sys.executable, "-m", "autotune", "export", "--study", study,
                             "--results-dir", str(results), "--trainer", trainer,
                             "--out", str(out)], capture_output=True, text=True)
    row = {"study": study, "trainer": trainer, "exported": export.returncode == 0,
           "line": export.stderr.strip()[:200], "compared": 0, "differ": {}}
    if not row["exported"]:
        return row
    topology = best["provenance"]["topology"]
    if trainer == "trl":
        world = topology["nnodes"] * topology["gpus_per_node"]
        ran = trl_quantities(grpo_config(Topology(topology["nnodes"], topology["gpus_per_node"]),
                                         yaml.safe_load(out.read_text()), work), world)
        ran.update(world_size=world)
    else:
        os.environ["AUTOTUNE_CHECK_JSON"] = str(work / f"{study}.json")
        accepted, row["line"] = trainer_verdict(trainer, out)
        if not accepted:
            row["exported"] = False
            return row
        ran = json.loads((work / f"{study}.json").read_text())
    expected = probed(best)
    compared = [key for key in ran if key in expected]
    row.update(compared=len(compared), differ={
        key: (ran[key], expected[key]) for key in compared if ran[key] != expected[key]})
    return row


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: export_round_trip.py RESULTS_DIR STUDY [STUDY ...]")
    results = Path(argv[0])
    with tempfile.TemporaryDirectory() as work:
        rows = [round_trip(results, study, Path(work)) for study in argv[1:]]
    silent = sum(len(row["differ"]) for row in rows)
    lines = [f"fresh studies' exports read back by the trainers' own config code: {len(rows)} "
             f"studies, {sum(r['exported'] for r in rows)} exported and loaded, "
             f"{sum(r['compared'] for r in rows)} per-GPU quantities compared with best.yaml, "
             f"{silent} differ", "",
             "study | trainer | exported and loaded | quantities compared | differences",
             "---|---|---|---|---"]
    lines += [f"{r['study']} | {r['trainer']} | {r['exported']} | {r['compared']} | "
              f"{r['differ'] or 'none'}" for r in rows]
    out = ROOT / "benchmarks" / "results" / "export_round_trip.txt"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
