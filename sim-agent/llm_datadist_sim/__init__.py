"""llm_datadist_sim."""
