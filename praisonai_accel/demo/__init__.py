"""The demos' tasks and tiny models."""
