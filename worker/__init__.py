"""The GPU hands: model definitions, weight loading, model runner, sampler, worker process."""
