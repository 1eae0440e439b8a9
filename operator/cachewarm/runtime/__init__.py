"""The operator process itself: entry point, kopf handlers, settings, logs, metrics, leader
election, the work queue and the controller's policy over it."""
