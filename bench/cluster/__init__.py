"""`kvgate sim cluster`: the real gate and balancer over many simulated engines in virtual time."""
