"""The training mesh: train state, optimizer, data-parallel train and eval steps."""
