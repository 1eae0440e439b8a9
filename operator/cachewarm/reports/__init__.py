"""What training pods' reporters send the operator: the receiver, the per-cache store."""
