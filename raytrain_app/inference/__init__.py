"""Using a trained run: scoring and predicting over its workers, exporting its weights, loading its model."""
