"""LoRA fine-tuning: adapter settings (`settings`), the adapter layers (`layers`)."""
