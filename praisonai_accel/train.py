"""Training entry point for every launcher:

    python -m praisonai_accel.train CONFIG
    accelerate launch -m praisonai_accel.train CONFIG
    torchrun --nproc_per_node=N -m praisonai_accel.train CONFIG
    python -m praisonai_accel.train train --config CONFIG      (the PraisonAI seed's form)

The worker itself is worker/main.py.
"""

from __future__ import annotations

from .worker.main import exit_now, main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
