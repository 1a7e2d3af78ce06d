"""Scoring a model on lm-eval tasks: the run's model (its adapter on its base), base against tuned, across ranks."""
