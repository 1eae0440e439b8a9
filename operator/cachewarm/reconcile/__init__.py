"""The operator's reconcile of one CompilationCache, one module per concern: cache orchestration,
status, bucket, warm-up (pure planner and its apply), pods."""
