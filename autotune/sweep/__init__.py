"""sweep: from what `autotune run` asked to a finished study. Optuna ask/tell over probes until
a stop rule, resumable, shared.

Owns the plan (plan.py: the options resolved once into a frozen SweepPlan; placement.py: the
topology, real or emulated ranks, the runner and its slots; trainer_target.py; preflight.py),
the run (driver.py: a plan to its end), the loop (tuner.py), how trials are told (record.py,
objective.py) and counted (tally.py), what must not be run (feasibility.py composing
dominance.py, prescreen.py and traced.py), what is left to try (frontier.py), the search
space (search_space.py, space_params.py), where the study lives and who may write it
(storage.py, sharing.py), parallel slots (parallel.py), the files a study leaves
(artifacts.py, best_export.py: the one export of a study's best to a trainer's YAML,
which the driver writes after every probe; study_model.py: the calibrated model of the study's
configs and their length headroom), each config's probes taken
together (measurements.py), the finalists probed again before the pick (finalists.py),
real-rank confirmations (confirm.py), a probe of the user's trainer (command_probe.py), the
progress view (progress.py) and a Ctrl-C that is never lost (interrupts.py). The driver
alone talks to Optuna.
May import batching, config, errors, files, hardware, registry, probe.result, probe.oom,
probe.process_tag, runners, memory and trainers; never torch (probes and traces run in
their own processes), never the CLI.
"""
