"""What a run is, before torch is imported: the trainer's options, the run plan (every default filled in
and every check made once, by the launcher and the trainer alike), execution choices, tokenizer files."""
