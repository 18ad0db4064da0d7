"""probe.modeling: the models a probe's step trains, and how they are split (the probe's
second floor).

Owns the models built from their config with random weights or a local checkpoint
(models.py), FSDP1/FSDP2 sharding over real or emulated ranks and the engine's tensor
parallelism (sharding.py), LoRA's adapters through peft (lora.py), Ulysses sequence
parallelism (ulysses.py: each sequence split over ranks, all-to-all around attention), the
log-probs fused with the LM head (logprob.py) and PPO's value model (critic.py).
May import config, errors, registry and version; torch, transformers and peft.
"""
