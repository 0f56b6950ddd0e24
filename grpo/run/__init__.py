"""One launch, top-down: what each rank builds for its role, the sync and async steps, evaluation,
and the run loop with its checkpoints and exports."""
