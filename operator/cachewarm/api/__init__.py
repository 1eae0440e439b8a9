"""The vocabulary every layer shares: the CRD's typed model, cluster-visible names, conditions,
Events, the time format."""
