"""The engine of one tier: intake, the step loop, output post-processing, warm-up, isolation of a
failing request, and the admission forecasts. May import every other ``tiers`` package."""
