"""Pipeline stages: one package per stage, each runnable as `python -m components.<stage>`."""
