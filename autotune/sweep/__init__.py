"""sweep: from what `autotune run` asked to a finished study. Optuna ask/tell over probes until
a stop rule, resumable, shared.

The driver is this package's top floor; each concern under it is a package of its own, on a
floor that imports only the floors below it (tests/test_layout.py holds them to it):

    space/        what a sweep searches: the space, its params, the trainer's rules
    execution/    how its probes run: the ranks and the runner, slots side by side, a probe
                  of the user's trainer, a Ctrl-C that is never lost
    feasibility/  what must not be run and what is left: dominance over measured OOMs, the
                  arithmetic and traced pre-screens, the frontier, the preflight, the study's
                  calibrated memory model
    study/        what a study holds: its storage, who owns a config, how a trial is told,
                  the settings a resumed study shares, each trial's files
    pick/         how configs are judged and picked: their probes taken together, the
                  finalists, real-rank confirmations, trials.csv, best.yaml and the export

Owns, on the top floor, the plan (plan.py: the options resolved once into a frozen
SweepPlan), the run (driver.py: a plan to its end), the loop (tuner.py: the driver alone talks
to Optuna), what the study's finished trials add up to (tally.py) and the progress view
(progress.py).
May import batching, config, errors, files, hardware, registry, process_tag, version,
probe.measure.result, probe.measure.oom, runners, memory, trainers and every floor of its own;
never torch (probes and traces run in their own processes), never the CLI.
"""
