"""Load an exported YAML the way EasyR1's verl/trainer/main.py does: structured PPOConfig,
merge the file, to_object, deep_post_init. EasyR1's real config modules are imported; only the
package __init__ files that pull in vLLM and the GPU workers are skipped.

    git clone https://github.com/hiyouga/EasyR1 && pip install "omegaconf==2.3.0" codetiming
    cd EasyR1 && python /path/to/autotune/scripts/check_easyr1_load.py . best.easyr1.yaml

(omegaconf 2.4 rejects EasyR1's own examples/config.yaml: `logger: Tuple[str]` holds two.)
Run it from the checkout: deep_post_init resolves the example's relative paths.
"""

import importlib
import sys
import types

from omegaconf import OmegaConf

root = sys.argv[1]  # a checkout of hiyouga/EasyR1
sys.path.insert(0, root)
for pkg in ["verl", "verl.utils", "verl.workers", "verl.workers.actor", "verl.workers.critic",
            "verl.workers.reward", "verl.workers.rollout", "verl.trainer"]:
    module = types.ModuleType(pkg)
    module.__path__ = [f"{root}/{pkg.replace('.', '/')}"]
    sys.modules[pkg] = module
for pkg in ["verl.workers.actor", "verl.workers.critic", "verl.workers.reward",
            "verl.workers.rollout"]:
    config = importlib.import_module(pkg + ".config")
    vars(sys.modules[pkg]).update({k: v for k, v in vars(config).items() if not k.startswith("_")})
from verl.trainer.config import PPOConfig  # noqa: E402

default = OmegaConf.structured(PPOConfig())
merged = OmegaConf.merge(default, OmegaConf.load(sys.argv[2]))
config = OmegaConf.to_object(merged)
config.deep_post_init()
a = config.worker.actor
print("EasyR1 loaded it:", "rollout_batch_size", config.data.rollout_batch_size, "n",
      config.worker.rollout.n, "global_batch_size", a.global_batch_size, "mbu",
      a.micro_batch_size_per_device_for_update, "mbe",
      a.micro_batch_size_per_device_for_experience,
      "gc", a.model.enable_gradient_checkpointing, "offload", a.offload.offload_params,
      a.offload.offload_optimizer)
