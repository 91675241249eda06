"""The training runner: a job spec becomes a Ray Train run (config, data, models, loop, checkpoints)."""
