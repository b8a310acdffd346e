"""pd_agent."""
