"""Ray Serve: one engine per replica, the OpenAI routes served by our FastAPI app through Serve's ingress.

`serve run frontend.ray_serve:build model=qwen2.5-1.5b num_replicas=2` takes launch.py's flags as key=value (a flag
without a value as key=true). Each replica asks Ray for one GPU per tensor-parallel rank (none with device=cpu), so
Ray places replicas over the cluster's hosts: this is the multi-host path for data parallel."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from ray import serve

from frontend.api_params import generation_defaults
from frontend.async_llm import AsyncLLM
from frontend.cli import parse_args
from frontend.engine_client import EngineClient
from frontend.model_resolution import resolve_config
from frontend.server import ServerOptions, ServerState, build_app
from protocol.config import EngineConfig


@serve.deployment
@serve.ingress()
class EngineReplica:
    """A replica is ready once its engine is: Serve sends it no request before."""

    async def __init__(self, config: EngineConfig, options: ServerOptions) -> None:
        self.config = resolve_config(config)
        self.options = options
        self.engine = await asyncio.to_thread(lambda: AsyncLLM(client=EngineClient(self.config)))

    def __serve_build_asgi_app__(self) -> FastAPI:
        state = ServerState(self.options, self.config.model, generation_defaults(self.config.model_path))
        return build_app(state, lambda: self.engine)  # the app's lifespan shuts the engine down with the replica

    def check_health(self) -> None:
        """Serve's health probe: a dead engine makes Serve replace the replica."""
        if not self.engine.is_alive:
            raise RuntimeError(f"the engine is dead: {self.engine.dead_reason}")


def build(args: dict[str, str]) -> serve.Application:
    """The application `serve run` builds: launch.py's flags as key=value, plus num_replicas (default 1)."""
    args = dict(args)
    num_replicas = int(args.pop("num_replicas", 1))
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value == "true" else [flag, value]
    config, options = parse_args(argv)
    num_gpus = 0 if config.device == "cpu" else config.tensor_parallel_size
    deployment = EngineReplica.options(num_replicas=num_replicas, ray_actor_options={"num_gpus": num_gpus})
    return deployment.bind(config, options)
