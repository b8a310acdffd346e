"""pd_operator."""
