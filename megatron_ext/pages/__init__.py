"""Self-contained HTML pages (no network, no server): a training run's report (`run_report`)."""
