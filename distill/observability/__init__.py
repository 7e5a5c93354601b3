"""What a run shows: the metrics store, TensorBoard and W&B tracking, the metrics log read
back, and the FastAPI status server with its dashboard."""
