"""What a dataset is for (`--task`): conversations to fine-tune on (``sft``) or preference pairs
for DPO (``preference``). Apart from `build` so the CLI offers them without importing it."""

SFT, PREFERENCE = "sft", "preference"
TASKS = (SFT, PREFERENCE)
