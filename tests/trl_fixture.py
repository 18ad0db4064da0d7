"""A real TRL GRPO training run on the CPU, set up the way a TRL user sets one up.

`make_trl_workspace(root)` writes, with nothing downloaded:

- `model/`: a tiny Qwen2 causal LM (the registry's tiny-qwen2.5 architecture, random weights,
  a 512-token vocab by default) and a byte-level BPE tokenizer trained here on synthetic
  words, both saved with `save_pretrained`, so `AutoTokenizer` /
  `AutoModelForCausalLM.from_pretrained` load it offline;
- `train_grpo.py`: a standalone GRPO script (no autotune import) that parses `GRPOConfig` with
  `trl.TrlParser`, so `python train_grpo.py --config grpo.yaml` works;
- `grpo.yaml`: a base config for it (CPU, float32, no vLLM, 3 steps, a log line every step).

`TrlWorkspace.command()` / `.env()` give the subprocess argv and environment;
`parse_log_dicts(text)` pulls the per-step `{'loss': ..., 'num_tokens': ...}` dicts that the
Trainer's PrinterCallback prints to stdout (with `disable_tqdm: true`).
"""

from __future__ import annotations

import ast
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# The registry's tiny-qwen2.5 numbers (autotune/registry.py, _TINY_TEXT), with the vocab
# cut to the local tokenizer's and the token ids pointed at its special tokens.
_TINY_QWEN2 = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 768, "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

BASE_CONFIG: dict[str, Any] = {
    "max_steps": 3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "per_device_train_batch_size": 4,  # completions per device per step, not prompts
    "num_generations": 4,  # generation batch (bs * GA * world) must divide by this
    "max_completion_length": 16,
    "gradient_accumulation_steps": 1,
    "gradient_checkpointing": False,  # TRL's default is True
    "bf16": False,  # TRL's default is True (when fp16 is off)
    "fp16": False,
    "use_cpu": True,
    "use_vllm": False,
    "learning_rate": 1.0e-5,
    "beta": 0.04,  # KL coefficient; > 0 loads a reference model
    "seed": 0,
    "dataloader_num_workers": 0,
    "model_init_kwargs": {"dtype": "float32"},
    "num_prompts": 64,
}

TRAIN_SCRIPT = '''\
"""GRPO on a local model, offline, the TRL way: python train_grpo.py --config grpo.yaml"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import random
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="model", metadata={"help": "local model directory"})
    num_prompts: int = field(default=64, metadata={"help": "synthetic prompts in the dataset"})
    prompt_words: int = field(default=8, metadata={"help": "words per synthetic prompt"})


def make_prompts(tokenizer, n, words, seed):
    rng = random.Random(seed)
    vocab = sorted(t.lstrip("\\u0120") for t in tokenizer.get_vocab()
                   if t.startswith("\\u0120") and len(t) > 2)
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def length_reward(completions, **kwargs):
    """Prefer completions of about 20 characters."""
    return [-abs(len(completion) - 20) / 20.0 for completion in completions]


def main():
    parser = TrlParser((ScriptArguments, GRPOConfig))
    script_args, training_args = parser.parse_args_and_config()
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    prompts = make_prompts(tokenizer, script_args.num_prompts, script_args.prompt_words,
                           training_args.seed)
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(
        model=script_args.model_name_or_path,
        reward_funcs=length_reward,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()


if __name__ == "__main__":
    main()
'''


@dataclass(frozen=True)
class TrlWorkspace:
    root: Path
    model_dir: Path
    script: Path
    config: Path
    output_dir: Path

    def command(self, config: Path | None = None, python: str | None = None) -> list[str]:
        """The argv a TRL user runs: python train_grpo.py --config grpo.yaml."""
        return [python or sys.executable, str(self.script), "--config", str(config or self.config)]

    def env(self, **extra: str) -> dict[str, str]:
        """The current environment, offline, with no GPU visible."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        env.update(extra)
        return env

    def write_config(self, name: str = "grpo.yaml", **overrides: Any) -> Path:
        """A config next to the base one: the base values with `overrides` (None drops a key)."""
        return write_config(self.root / name, self.model_dir, self.output_dir, **overrides)


def write_config(path: Path, model_dir: Path, output_dir: Path, **overrides: Any) -> Path:
    import yaml

    values = {"model_name_or_path": str(model_dir), "output_dir": str(output_dir),
              **BASE_CONFIG, **overrides}
    values = {k: v for k, v in values.items() if v is not None}
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def _synthetic_words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = {"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
             for _ in range(n * 2)}
    return sorted(words)[:n]


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (Qwen-style) trained on synthetic words, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = _synthetic_words(max(400, 2 * vocab_size))
    rng = random.Random(1)
    rng.shuffle(words)
    corpus = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, padding_side="left",
                                   model_max_length=8192)
    return fast


def make_trl_workspace(root: Path, *, vocab_size: int = VOCAB_SIZE,
                       architecture: dict[str, Any] | None = None,
                       **config_overrides: Any) -> TrlWorkspace:
    """Model, tokenizer, script and grpo.yaml under `root`; `config_overrides` go into the yaml.

    `vocab_size` sizes the tokenizer and the model's embedding (16384 gives the registry's
    tiny-qwen2.5 exactly: larger logits, so host memory grows faster with the batch);
    `architecture`: other Qwen2 config numbers (a registry model's, for a GPU run), its
    embedding padded past the tokenizer's vocab."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    root = Path(root)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save_pretrained(model_dir)
    vocab = max(vocab_size, len(tokenizer))  # the embedding may be padded past the tokenizer
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    numbers = {**_TINY_QWEN2, "vocab_size": vocab, **(architecture or {})}
    numbers["vocab_size"] = max(numbers["vocab_size"], len(tokenizer))
    config = Qwen2Config(**numbers, bos_token_id=pad_id, eos_token_id=eos_id,
                         pad_token_id=pad_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id)
    model.save_pretrained(model_dir)

    script = root / "train_grpo.py"
    script.write_text(TRAIN_SCRIPT)
    output_dir = root / "grpo-out"
    config_path = write_config(root / "grpo.yaml", model_dir, output_dir, **config_overrides)
    return TrlWorkspace(root=root, model_dir=model_dir, script=script, config=config_path,
                        output_dir=output_dir)


def parse_log_dicts(text: str) -> list[dict[str, Any]]:
    """The `{...}` dict lines the Trainer prints (per-step logs and the train_runtime summary)."""
    logs = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            value = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, dict):
            logs.append(value)
    return logs


if __name__ == "__main__":  # python tests/trl_fixture.py DIR [key=value ...]: build, print argv
    import yaml

    ws = make_trl_workspace(Path(sys.argv[1]), **{k: yaml.safe_load(v) for k, v in
                                                  (a.split("=", 1) for a in sys.argv[2:])})
    print(" ".join(ws.command()))
