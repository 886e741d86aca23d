"""stepledger: measured LLM inference steps, split exactly among the tenants that caused them."""
