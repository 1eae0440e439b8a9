"""The vocabulary every layer shares: the CRD's typed model, cluster-visible names (constants,
metric names), conditions, Events, what a bucket looks like, the time format."""
