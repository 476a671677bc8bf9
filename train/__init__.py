"""train package: GRPO on LoRA adapters from trajectory Parquet.

    accelerate launch --config_file train/configs/cpu.yaml train/grpo.py \
        --trajectories T.parquet --model DIR_OR_NAME --output ADAPTER_DIR
    accelerate launch --config_file train/configs/cpu.yaml train/sft.py \
        --trajectories T.parquet --model DIR_OR_NAME --output ADAPTER_DIR [--min-reward R]

sft.py is supervised fine-tuning on the same files (the NLL of the sampled tokens); grpo.py --adapter continues
from its output.

grpo.py is the algorithm, read top to bottom; losses.py (advantages, weights, truncation, the clipped objective),
logprobs.py (chunked log-probs), data.py (reading, checking, packing), policy.py (the LoRA model, shared with
sft.py) and runtime.py (command line, metrics, checkpoints, saving) are what it calls; configs/ holds the
Accelerate configs (CPU, one GPU, DDP, FSDP, DeepSpeed ZeRO-2/3).
"""
