"""energon datasets for LLaVA training.

Building (no torch needed until `energon prepare`): `sources` (LLaVA JSON / JSONL records ->
webdataset samples or preference pairs, or skip reasons; `tasks` names the two), `build` (shards + `energon prepare` + report, all or nothing).
Reading: `prepared` (sample counts per split, torch-free),
`conversation` (chat messages from samples), `chat_template` (templates and the assistant-token
mask), `packing` (knapsack, packed attention masks), `task_encoder` (the energon TaskEncoder and
the batch contract), `loader` (train / val loaders and their saved position).
"""
