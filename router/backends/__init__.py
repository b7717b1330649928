"""The tiers as the pipeline sees them: the set of built tiers, local engine tiers and remote ones."""
