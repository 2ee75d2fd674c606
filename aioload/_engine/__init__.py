"""The engine: one orchestrator per pass (dispatch, reorder, health, shutdown), resume, pinning,
tuning, and the loader's setup (its arguments checked, each pass described)."""
