"""The CPU brain: request queues, the KV block manager, the batching policy, the scheduler process."""
