"""Kernel tiling constants the probe runs and the memory model and trace count with: the
chunk and tile sizes of the fused log-prob heads and the entropy, and how a VL prompt's image
becomes tokens. Each cites the trainer code it copies."""

from __future__ import annotations

# backend: verl/utils/experimental/torch_functional.py chunk_size=512)
FUSED_CHUNK_TOKENS = 512
# entropy_chunking: positions per chunk of the entropy (verl's entropy_from_logits_with_chunking,
# verl/utils/torch_functional.py chunk_size=2048)
ENTROPY_CHUNK_ROWS = 2048
# fused_logprob_kernel=triton: verl's Triton linear cross-entropy
# (verl/utils/kernel/kernels.py): the forward reduces the vocabulary in splits of 1,024
# ([tokens, splits] fp32 partials of the max, the sum and the entropy's b), the backward
# (its default _Split_Dlogits_N) writes the logits' gradient 9,504 vocabulary columns at a time
TRITON_VOCAB_SPLIT = 1024
TRITON_DLOGITS_COLUMNS = 9504
# fused_logprob_kernel=trl: TRL's fused LM head (trl/trainer/utils.py add_fused_lm_head,
# trl/kernels/chunked_logprob.py ChunkedLogProbFunction): the logits of 4,096 tokens x 32,768
# vocabulary columns at a time, every position on a device without Triton (a CPU), the
# completion tokens only on one with it
TRL_VOCAB_CHUNK = 32768
TRL_TOKEN_TILE = 4096

IMAGE_TOKEN_PX = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 make one LLM token
IMAGE_FRAME_TOKENS = 3  # vision start, vision end, and at least one text token
