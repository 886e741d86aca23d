"""Dagster definitions over `pipeline/`: assets, checks, schedule and sensors, and the commands
that run them (`stepledger demo`, `run`, `dev`)."""
