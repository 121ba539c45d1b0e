"""What runs in each Ray Train worker: the training loop and the state it checkpoints. Imports nothing of the
driver's."""
