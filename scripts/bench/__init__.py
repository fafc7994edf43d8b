"""The benchmarks: `common` and `runner` are what they share; `python -m scripts.bench` runs `open_grounded`."""
