"""The operator process itself: entry point, kopf handlers, settings, logs, leader election,
the generic work queue and the controller's policy over it."""
