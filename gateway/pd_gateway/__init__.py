"""pd-gateway: the OpenAI- and Anthropic-compatible entry to a PDDeployment."""
