"""The operator's admission webhook: what labelled pods get, the HTTPS server, its serving certificate."""
