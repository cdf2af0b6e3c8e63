"""The worker process of one rank: StepPlans in, StepResults out (rank 0 answers for all ranks). Plans come only
from our scheduler, so a bad frame is fatal: the worker says why (WorkerError) and exits non-zero."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import threading
import time

import zmq

from protocol.addresses import Addresses
from protocol.codec import decode, encode
from protocol.config import EngineConfig
from protocol.messages import GrammarMask, Ready, Shutdown, StepPlan, WorkerError
from protocol.shared_masks import SHM_DIR, SharedMasks, masks_path
from protocol.tracing import DECODE_GPU_SPAN, GPU_TRACK, Tracer

log = logging.getLogger("pico_vllm.worker")


def run_worker(config_dict: dict, addresses_dict: dict, rank: int, parent_pid: int | None = None) -> None:
    """`python -m worker`: build the runner, say Ready, serve plans until Shutdown (exit 0) or an error (exit 1)."""
    clock = {"worker_entered": time.time()}  # wall-clock marks: bench/startup places them on its launch's timeline
    config = EngineConfig.from_dict(config_dict)
    addresses = Addresses(**addresses_dict)
    _exit_with_parent(parent_pid or os.getppid())
    ctx = zmq.Context()
    plans, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    plans.connect(addresses.plans[rank])
    results.connect(addresses.results)
    tracer = Tracer(f"worker{rank}", config.trace_dir)
    failed = False
    try:
        runner = _build_runner(config, addresses, rank, clock)
        gc.collect()
        gc.freeze()  # torch's and the model's objects leave the collector's view: no long pauses between steps
        clock["worker_ready"] = time.time()
        if rank == 0:
            from worker.startup import startup_summary  # loaded already, with torch

            log.info("%s", startup_summary(runner.startup, clock))
        info = {"num_kv_blocks": runner.num_kv_blocks, "startup": {**runner.startup, "clock": clock}}
        results.send(encode(Ready(role="worker", rank=rank, info=info)))
        _serve(runner, plans, results, rank, tracer, masks_path(addresses.ipc_dir))
    except Exception as e:  # anything that stops this rank must reach the scheduler as a reason
        log.exception("worker rank %d failed", rank)
        results.send(encode(WorkerError(rank, f"{type(e).__name__}: {e}")))
        failed = True
    finally:
        tracer.flush()
        if config.tensor_parallel_size > 1:  # a gloo group left to static destructors can abort the exit
            from worker.parallel import destroy_tp_group

            destroy_tp_group()
        plans.close(linger=0)
        results.close(linger=2000)  # let a WorkerError get out before the process ends
        ctx.term()
    if failed:
        raise SystemExit(1)


def _build_runner(config: EngineConfig, addresses: Addresses, rank: int, clock: dict[str, float]):
    # While torch imports (1.5-2 s): the driver makes the CUDA context, and Triton hashes its own files (~0.5 s),
    # which every Triton cache key starts with. Both threads mostly run without the GIL.
    local_rank = rank - config.local_ranks.start  # this node's GPU index
    if config.device != "cpu":
        threading.Thread(target=_make_cuda_context, args=(local_rank,), name="cuda-context", daemon=True).start()
    with contextlib.suppress(ImportError):  # private: without it, Triton hashes its files at the first compile
        from triton.runtime.cache import triton_key

        threading.Thread(target=triton_key, name="triton-key", daemon=True).start()
    # Imported here: torch and CUDA load only once this process is committed to being a worker.
    import torch

    from worker.parallel import init_tp_group
    from worker.startup import build_runner, select_device

    clock["torch_imported"] = time.time()
    tp_size = config.tensor_parallel_size
    device = select_device(config.device, local_rank)
    clock["device_selected"] = time.time()
    if device.type == "cuda":  # the host's torch ops are small copies: idle OpenMP threads would spin on every core
        torch.set_num_threads(1)
    if tp_size > 1:
        # One host: a file in the engine's private ipc directory, no TCP port to collide with another engine's.
        init_method = f"file://{addresses.ipc_dir}/tp-rendezvous"
        if config.nnodes > 1 or not addresses.ipc_dir:
            init_method = f"tcp://{config.master_addr}:{config.master_port}"
        init_tp_group(rank, tp_size, device.type, init_method)
    return build_runner(config, rank, tp_size, clock)


def _make_cuda_context(rank: int) -> None:
    """GPU `rank`'s primary context (~0.3 s), made by the driver (ctypes drops the GIL): torch's first call finds it."""
    with contextlib.suppress(OSError):  # no driver: torch reports that itself
        cuda, device, context = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), rank) == 0:
            cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)


def _serve(runner, plans: zmq.Socket, results: zmq.Socket, rank: int, tracer: Tracer, mask_file: str) -> None:
    """Launch each plan as it comes, so plan N+1 queues behind step N on the GPU; collect a step once it is done."""
    pending = masks = None
    while True:
        if pending is not None and not plans.poll(0):
            if runner.is_done(pending):  # spin: a poll is a few microseconds, a step a millisecond
                pending = _finish(runner, pending, results, rank, tracer)
            continue
        msg = decode(plans.recv())
        if isinstance(msg, Shutdown):
            _finish(runner, pending, results, rank, tracer)
            return
        if not isinstance(msg, StepPlan):
            raise ValueError(f"worker received a {type(msg).__name__}: only StepPlan and Shutdown are expected")
        launched, mask = runner.forward(msg), None
        if len(launched.masked):  # step N's result goes out first: step N + 1's masks need it
            pending = _finish(runner, pending, results, rank, tracer)
            rows = _receive_mask(plans, msg.step, tracer)
            if rows is None:
                return
            if masks is None:  # the scheduler made the file before its first GrammarMask
                masks = _map_masks(mask_file, runner)
            mask = masks.slot(msg.step, rows)
        runner.sample(launched, mask)
        _finish(runner, pending, results, rank, tracer)
        pending = launched


def _receive_mask(plans: zmq.Socket, step: int, tracer: Tracer) -> int | None:
    """The number of mask rows step `step`'s GrammarMask names in the shared file; None: Shutdown came instead."""
    with tracer.span("worker.wait_mask", step):
        while not plans.poll(0):  # spin: waking from a blocking recv costs ~0.1 ms, on the step's critical path
            pass
        msg = decode(plans.recv())
    if isinstance(msg, Shutdown):
        return None
    if not isinstance(msg, GrammarMask) or msg.step != step:
        raise ValueError(f"worker received a {type(msg).__name__} while step {step} waited for its GrammarMask")
    return msg.rows


def _map_masks(path: str, runner) -> SharedMasks:
    masks = SharedMasks(path, runner.max_rows, runner.model_config.vocab_size)
    if runner.device.type == "cuda" and path.startswith(SHM_DIR):  # page-locked: copies read the shared pages
        import torch

        if error := int(torch.cuda.cudart().cudaHostRegister(masks.slots.ctypes.data, masks.slots.nbytes, 0)):
            raise RuntimeError(f"cudaHostRegister of the grammar mask file {path} failed with CUDA error {error}")
    return masks


def _finish(runner, launched, results: zmq.Socket, rank: int, tracer: Tracer) -> None:
    if launched is None:  # no step pending
        return
    result = runner.collect(launched)
    if t := result.timings:
        tracer.record("worker.launch", t["start_ns"], t["end_ns"] - t["start_ns"], result.step)
        if "gpu_ns" in t:  # the GPU finished about when the host's wait for it returned
            name = DECODE_GPU_SPAN if t["decode"] else "gpu.step"
            tracer.record(name, t["synced_ns"] - t["gpu_ns"], t["gpu_ns"], result.step, GPU_TRACK)
    if rank == 0:
        results.send(encode(result), copy=False)


def _exit_with_parent(parent: int) -> None:
    """A worker outliving its launcher would hold the GPU forever: exit when the parent is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
