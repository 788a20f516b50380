"""Preference tuning (DPO) on the trainer: pair batches (`data.pairs`), sequence log-probabilities,
the reference policy, and the loss and metrics as TRL's DPOTrainer names and computes them."""
