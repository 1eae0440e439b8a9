"""The `cachewarm` command: run (the operator), warm (the warmer), inspect."""
