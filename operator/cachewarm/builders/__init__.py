"""Pure builders: spec in, dict out. No I/O and no clock reads."""
