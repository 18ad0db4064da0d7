"""probe.step: the built-in GRPO/PPO training step, a module per phase (the probe's third floor).

Owns what the phases share (state.py: StepState, the allocator's settings), the build
(build.py), where states live between phases and the engine's wake-up and sleep (offload.py),
the rollout (rollout.py), the forwards over responses (forwards.py), the experience
(experience.py), the actor's and the critic's updates (update.py), the probe that runs them in
the trainer's order and times them (training.py: TrainingProbe), and the rollout engines the
rollout wakes (engine.py: the Rollout protocol and the stand-ins; vllm_engine.py: the real
vLLM, imported only when that engine starts); one side of a split probe (split_step.py: the
engine's or the trainer's part of a separate placement's pipelined step, and their link).
May import batching, config, errors, files, hardware, registry, version, memory.replay,
probe.measure and probe.modeling.
"""
