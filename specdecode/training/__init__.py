"""Drafter training: losses, the teacher cache, the accelerate loop, checkpoints, the train jobs."""
