"""praisonai-accel: fine-tune LLMs from one YAML file on one GPU or every GPU of a machine, through Accelerate."""

__version__ = "0.1.0"
