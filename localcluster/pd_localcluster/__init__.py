"""pd_localcluster."""
