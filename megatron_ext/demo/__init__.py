"""The demo a user runs after installing: its pipeline (`pipeline.py`), the tiny random models it
starts from (`tiny_models.py`) and its synthetic images, questions and preference pairs
(`synthetic_data.py`). Tests and benchmarks build their inputs with the same pieces."""
