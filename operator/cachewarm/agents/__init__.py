"""What runs in users' pods (warmer Jobs, training pods): standard library at import time, nothing of
cachewarm; jax, etils and gcsfs only inside the functions that need them. Shipped as single files
(agents/payload.py lists them)."""
