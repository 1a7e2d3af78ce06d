"""A run's directory: its checkpoints and manifests, the run lock, output dirs, its metrics and report."""
