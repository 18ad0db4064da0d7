"""sweep.space: what a sweep searches (the sweep's first floor).

Owns the search space (search_space.py: a YAML space in Optuna's vocabulary, loaded and checked
at once; a trial's params made into its Candidate), one searched parameter and the params'
identity across trials and drivers (params.py: ParamSpec, params_key) and the trainer a sweep
writes its best for, whose rules join the space's (trainer_target.py).
May import batching, config, errors, files, version and trainers; nothing else of the sweep's.
"""
