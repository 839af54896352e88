"""Contracts shared by every stage: storage, run layout, Arrow schemas, the CLI convention.
No GPU imports here: the pipeline and the reward image use this package without torch."""
