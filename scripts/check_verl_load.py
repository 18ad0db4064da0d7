"""Compose verl's own config with an export's override line and run verl's validate_config,
as verl/trainer/main_ppo.py does before building workers (Hydra, ppo_trainer.yaml, the
dataclass conversion with its __post_init__ checks).

    git clone https://github.com/volcengine/verl && pip install hydra-core ray tensordict
    line=$(autotune export --trainer verl --gpus-per-node 2 | sed -n 's/^launch: .*main_ppo //p')
    python scripts/check_verl_load.py path/to/verl actor_rollout_ref.rollout.name=vllm $line

verl (b178a3c) pins transformers 4.x; with transformers 5 the one class it imports under its
old name is aliased here.
"""

import sys

import transformers
from hydra import compose, initialize_config_dir

root = sys.argv[1]  # a checkout of volcengine/verl
sys.path.insert(0, root)
if not hasattr(transformers, "AutoModelForVision2Seq"):
    transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
with initialize_config_dir(config_dir=f"{root}/verl/trainer/config", version_base=None):
    config = compose(config_name="ppo_trainer", overrides=sys.argv[2:])

from verl.utils.config import validate_config  # noqa: E402

validate_config(config, use_reference_policy=True, use_critic=False)
actor = config.actor_rollout_ref.actor
print("verl accepted it: train_batch_size", config.data.train_batch_size, "ppo_mini_batch_size",
      actor.ppo_mini_batch_size, "ppo_micro_batch_size_per_gpu",
      actor.ppo_micro_batch_size_per_gpu)
