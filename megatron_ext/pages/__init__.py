"""Self-contained HTML pages (no network, no server): a training run's report (`run_report`), and what
the model sees of a dataset's samples (`inspector_page`)."""
