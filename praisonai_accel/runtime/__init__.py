"""What a process knows of the run it belongs to: the launcher's handoff, the torchrun environment."""
