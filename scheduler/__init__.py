"""The CPU brain: request queues, the KV block manager, the batching policy, the scheduler process."""
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler

__all__ = ["BlockManager", "Scheduler"]
