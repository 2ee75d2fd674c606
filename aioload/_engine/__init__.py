"""The engine: one orchestrator per pass (dispatch, reorder, health, shutdown), resume, pinning."""
