"""autotune's exports through EasyR1's and verl's own start-up, trainer x topology x base.

For each trainer (EasyR1, verl), topology (1x2, 1x4, 1x6, 1x8, 2x8), base config (none, or the
trainer's real default config) and micro-batch pair, the export is planned as `autotune export`
plans it and written, even where autotune refuses it (then the file is what a silent export
would have written); scripts/check_{easyr1,verl}_load.py runs the trainer's real start-up on
it. The cases are tests/test_trainer_startup.py's. Target: every file autotune writes is
accepted, every refusal is rejected by the trainer. Then the round trip (issue 30): a study's
export, per topology and base, read back from the trainer's normalised worker config
quantity by quantity against what the probe ran per GPU. Target: 0 differences.

    AUTOTUNE_EASYR1_SRC=path/to/EasyR1 AUTOTUNE_VERL_SRC=path/to/verl \\
    AUTOTUNE_TRAINER_PYTHON=python-with-their-deps python benchmarks/trainer_startup.py

Writes benchmarks/results/trainer_startup.txt. With `--ppo`, only PPO studies (issue 32):
verl on its own ppo_trainer.yaml (gae, its critic on), EasyR1 without a base, on 1x2, 1x4,
1x8 and 2x8, a critic micro-batch that splits each GPU's share and one that does not; writes
benchmarks/results/trainer_startup_ppo.txt.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_trainer_startup import (  # noqa: E402  (the test's cases, run here with a table)
    FIXTURES,
    PPO_SEARCHED,
    PPO_TOPOLOGIES,
    TOPOLOGIES,
    cases,
    exported,
    ppo_cases,
    round_trip,
    trainer_verdict,
)

from autotune.config import Topology  # noqa: E402
from autotune.trainers import get_adapter  # noqa: E402

BASES = {"easyr1": "easyr1-config.yaml", "verl": "verl-ppo-trainer.yaml"}


def rows_for(trainer: str, work: Path) -> list[dict]:
    adapter, rows = get_adapter(trainer), []
    for nnodes, gpus in TOPOLOGIES:
        topology = Topology(nnodes, gpus)
        for with_base in (False, True):
            base_path = None
            if with_base:  # the GRPO study's base: verl's estimator set to grpo
                base_path = work / f"{trainer}-{nnodes}x{gpus}.yaml"
                base_path.write_text((FIXTURES / BASES[trainer]).read_text().replace(
                    "adv_estimator: gae", "adv_estimator: grpo"))
            for index, knobs in enumerate(cases(trainer, with_base, topology)):
                path, problems = exported(adapter, knobs, topology, base_path, work,
                                          f"{trainer}-{nnodes}x{gpus}-{with_base}-{index}")
                start_s = time.perf_counter()
                accepted, line = trainer_verdict(trainer, path)
                row = {"trainer": trainer, "gpus": f"{nnodes}x{gpus}",
                       "base": "default config" if with_base else "none",
                       "micro": f"{knobs['micro_batch_size_update']}/"
                                f"{knobs['micro_batch_size_experience']}",
                       "autotune": "refused" if problems else "written",
                       "trainer_start": "accepted" if accepted else "rejected",
                       "check_s": time.perf_counter() - start_s,
                       "why": problems[0] if problems else line}
                print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)[:100]
                                 for v in row.values()), flush=True)
                rows.append(row)
    return rows


def ppo_rows(trainer: str, work: Path) -> list[dict]:
    adapter, rows = get_adapter(trainer), []
    knobs, base_path = ppo_cases(trainer)
    for nnodes, gpus in PPO_TOPOLOGIES:
        for critic_micro in (2, 3):
            topology = Topology(nnodes, gpus)
            path, problems = exported(
                adapter, {**knobs, "critic_micro_batch_size_update": critic_micro}, topology,
                base_path, work, f"ppo-{trainer}-{nnodes}x{gpus}-{critic_micro}",
                searched=PPO_SEARCHED)
            start_s = time.perf_counter()
            accepted, line = trainer_verdict(trainer, path)
            rows.append({"trainer": trainer, "gpus": f"{nnodes}x{gpus}",
                         "base": "ppo_trainer.yaml (gae)" if base_path else "none",
                         "micro": f"critic {critic_micro}",
                         "autotune": "refused" if problems else "written",
                         "trainer_start": "accepted" if accepted else "rejected",
                         "check_s": time.perf_counter() - start_s,
                         "why": problems[0] if problems else line})
            print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)[:100]
                             for v in rows[-1].values()), flush=True)
    return rows


def main_ppo(trainers: list[str]) -> None:
    with tempfile.TemporaryDirectory() as work:
        rows = [row for trainer in trainers for row in ppo_rows(trainer, Path(work))]
    agree = sum((r["autotune"] == "written") == (r["trainer_start"] == "accepted") for r in rows)
    lines = [f"PPO studies' exports (a critic) through the trainers' own start-up "
             f"(scripts/check_*_load.py; EasyR1 b44b311, verl b178a3c), on a CPU: {len(rows)} "
             f"exports, {sum(r['autotune'] == 'written' for r in rows)} written; the trainer "
             f"agreed on {agree} of {len(rows)}", "",
             "trainer | GPUs | base | critic micro-batch | autotune | trainer's start-up | "
             "check s | autotune's rule, or the trainer's line", "---|" * 7 + "---"]
    lines += [f"{r['trainer']} | {r['gpus']} | {r['base']} | {r['micro']} | {r['autotune']} | "
              f"{r['trainer_start']} | {r['check_s']:.1f} | {r['why'][:160]}" for r in rows]
    out = ROOT / "benchmarks" / "results" / "trainer_startup_ppo.txt"
    out.write_text("\n".join(lines) + "\n")
    print(lines[0])
    print(f"wrote {out.relative_to(ROOT)}")


def main() -> None:
    trainers = [t for t in ("easyr1", "verl") if os.environ.get(f"AUTOTUNE_{t.upper()}_SRC")]
    if not trainers:
        sys.exit("set AUTOTUNE_EASYR1_SRC and/or AUTOTUNE_VERL_SRC to the trainers' checkouts")
    if "--ppo" in sys.argv[1:]:
        main_ppo(trainers)
        return
    with tempfile.TemporaryDirectory() as work:
        rows = [row for trainer in trainers for row in rows_for(trainer, Path(work))]
        trips = [(trainer, f"{n}x{g}", with_base, *round_trip(
            trainer, Topology(n, g), with_base, Path(work))) for trainer in trainers
            for n, g in TOPOLOGIES if g != 6 for with_base in (False, True)]
    agree = sum((r["autotune"] == "written") == (r["trainer_start"] == "accepted") for r in rows)
    written = sum(r["autotune"] == "written" for r in rows)
    lines = [f"autotune's exports through the trainers' own start-up "
             f"(scripts/check_*_load.py; EasyR1 b44b311, verl b178a3c), on a CPU: "
             f"{len(rows)} exports, {written} written, {len(rows) - written} refused; "
             f"the trainer agreed on {agree} of {len(rows)}", "",
             "trainer | GPUs | base | micro update/experience | autotune | trainer's start-up "
             "| check s | autotune's rule, or the trainer's line", "---|" * 7 + "---"]
    lines += [f"{r['trainer']} | {r['gpus']} | {r['base']} | {r['micro']} | {r['autotune']} | "
              f"{r['trainer_start']} | {r['check_s']:.1f} | {r['why'][:140]}" for r in rows]
    silent = sum(len(trip[5]) for trip in trips)
    lines += ["", f"round trip: {len(trips)} exports of a study's best, read back from the "
              f"trainer's normalised worker config: {sum(t[3] for t in trips)} accepted, "
              f"{sum(t[6] for t in trips)} per-GPU quantities compared, {silent} differ from "
              "what the probe ran", "",
              "trainer | GPUs | base | accepted | quantities compared | differences",
              "---|" * 5 + "---"]
    lines += [f"{t[0]} | {t[1]} | {'default config' if t[2] else 'none'} | {t[3]} | {t[6]} | "
              f"{t[5] or 'none'}" for t in trips]
    out = ROOT / "benchmarks" / "results" / "trainer_startup.txt"
    out.write_text("\n".join(lines) + "\n")
    print(lines[0])
    print(next(line for line in lines if line.startswith("round trip")))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
