"""launch.py's command line: vLLM `serve`'s flags, plus one-prompt and headless modes."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
import socket
from dataclasses import fields
from typing import NoReturn

from frontend.engine_client import EngineDeadError
from frontend.launcher import run_headless, run_node
from frontend.llm import LLM
from frontend.model_resolution import families
from frontend.reasoning import REASONING_PARSERS
from frontend.server import ServerOptions, run_server
from protocol.addresses import check_engine_address
from protocol.config import ARCHITECTURES, KV_CACHE_DTYPES, EngineConfig, require
from protocol.sampling import SamplingParams

_METAVARS = {int: "N", float: "X", str: "STR"}
# A server's step budget: every prompt step stays a CUDA graph and decode rows never wait behind a long chunk.
# LLM(...) keeps EngineConfig's 8,192 for offline throughput (vLLM's server and LLM class differ too).
SERVE_MAX_NUM_BATCHED_TOKENS = 2048
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)} | {"max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS}
_SERVER_DEFAULTS = {f.name: f.default for f in fields(ServerOptions)}
# (flag, type, help) of every EngineConfig field the CLI sets, grouped as --help shows them.
_MODEL_FLAGS = [
    ("--load-format", str, "auto: safetensors when found; dummy: random weights"),
    ("--dtype", str, "weights and activations; auto: the checkpoint's"),
    ("--seed", int, "random seed of the engine (dummy weights, sampling)"),
    ("--max-model-len", int, "longest prompt + output in tokens (default: the model's own limit)"),
    ("--quantization", str, "fp8: linear weights in float8 e4m3, a scale per output channel (FP8 checkpoints: set)"),
]
# EngineConfig checks them again (tests keep the two in step).
_CHOICES = {
    "--load-format": ("auto", "safetensors", "dummy"),
    "--dtype": ("auto", "float32", "float16", "bfloat16"),
    "--device": ("auto", "cpu", "cuda"),
    "--quantization": ("fp8",),
    "--kv-cache-dtype": KV_CACHE_DTYPES,
}
_ENGINE_FLAGS = [
    ("--device", str, "auto: cuda when there is one"),
    ("--gpu-memory-utilization", float, "fraction of the GPU's memory for weights, activations and KV cache"),
    ("--num-kv-blocks", int, "fix the number of KV-cache blocks instead of sizing them from memory"),
    ("--kv-cache-dtype", str, "fp8: K and V in float8 e4m3 (scale 1.0), twice the tokens; auto: the model's dtype"),
    ("--block-size", int, "tokens per KV-cache block: 8, 16, 32, 64 or 128"),
    ("--max-num-seqs", int, "most requests in one running batch"),
    ("--max-num-batched-tokens", int, "token budget of one step; longer prompts are prefilled in chunks"),
    ("--tensor-parallel-size", int, "GPUs to shard the model over (one worker process each)"),
    ("--max-waiting-requests", int, "bound of the waiting queue; past it new requests get 503"),
    ("--step-timeout", float, "seconds a step may make no progress before the engine is declared dead"),
    ("--trace-dir", str, "write Chrome/Perfetto trace JSON of every process to this directory"),
]
_NODE_FLAGS = [
    ("--nnodes", int, "hosts the tensor-parallel ranks are spread over, an equal share each"),
    ("--node-rank", int, "this host's index; node 0 serves, the others run only their workers"),
    ("--master-addr", str, "node 0's IP address: the rendezvous and the scheduler's sockets bind it"),
    ("--master-port", int, "rendezvous port; the scheduler's plan and result sockets take the ports after it"),
]
_SERVER_FLAGS = [
    ("--host", str, "address to bind (0.0.0.0 exposes the server)"),
    ("--port", int, ""),
    (
        "--api-key",
        str,
        "require 'Authorization: Bearer KEY' on every route but /health and /version ($VLLM_API_KEY by default keeps "
        "the key out of `ps`)",
    ),
    ("--shutdown-timeout", float, "on SIGTERM, seconds in-flight requests may take before they are aborted"),
]
_PROMPT_FLAGS = [
    ("--prompt", str, "complete this text, print the completion and exit"),
    ("--max-tokens", int, "tokens to generate for --prompt"),
    ("--temperature", float, "sampling temperature for --prompt; 0 is greedy"),
]
_PROMPT_DEFAULTS = {"prompt": None, "max_tokens": 16, "temperature": 0.0}
_HEADLESS_FLAGS = [  # bool: a switch, off unless given
    ("--headless", bool, "run the scheduler and workers only; frontends attach with AsyncLLM.connect"),
    (
        "--engine-address",
        str,
        "ipc://PATH or tcp://HOST:PORT the engine listens on (tcp binds 127.0.0.1 unless a host is named; default: a "
        "fresh private ipc path)",
    ),
    ("--allow-remote-shutdown", bool, "let any frontend stop the engine with Shutdown (default: only its own signal)"),
]
_NAMED_METAVARS = {"--host": "HOST", "--api-key": "KEY", "--prompt": "TEXT", "--engine-address": "ADDR"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """The error first, then the usage (argparse's order hides the one line that matters under the flags)."""
        self.exit(2, f"{self.prog}: error: {message}\n\n{self.format_usage()}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="launch.py",
        description=f"Serve a model ({', '.join(families())}) with an OpenAI-compatible API (default), "
        "run one prompt (--prompt), or run the engine alone (--headless).",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        help=f"HF directory or hub id ({', '.join(ARCHITECTURES)}), or a short name: "
        + "; ".join(f"{family}: {', '.join(names)}" for family, names in families().items())
        + " (Instruct; add -base for the base model)",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the API answers to (the first is reported); default: --model",
    )
    engine = p.add_argument_group("engine and KV cache")
    nodes = p.add_argument_group("tensor parallel over hosts")
    for group, flags in ((model, _MODEL_FLAGS), (engine, _ENGINE_FLAGS), (nodes, _NODE_FLAGS)):
        _add_flags(group, flags, _DEFAULTS)
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["enable_prefix_caching"],
        help="reuse the KV blocks of prompts that share a prefix (default: on)",
    )
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (slower decode, faster start)")
    engine.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": '
        '4, "prompt_lookup_min": 2} (requests draft from their own tokens), or {"method": "suffix"} (and from recent '
        "requests'); default: off",
    )
    server, offline = p.add_argument_group("HTTP server"), p.add_argument_group("one prompt, no server")
    _add_flags(server, _SERVER_FLAGS, _SERVER_DEFAULTS | {"api_key": os.environ.get("VLLM_API_KEY")})
    _add_flags(offline, _PROMPT_FLAGS, _PROMPT_DEFAULTS)
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="answer a reasoning model's <think> block as message.reasoning_content (vLLM's; not on by default)",
    )
    _add_flags(p.add_argument_group("headless engine, no HTTP"), _HEADLESS_FLAGS, {"engine_address": None})
    return p


def _add_flags(group: argparse._ArgumentGroup, flags: list[tuple[str, type, str]], defaults: dict) -> None:
    """Each (flag, type, help), its default under its snake_case name, shown unless None or the API key (a secret)."""
    for flag, kind, help_text in flags:
        if kind is bool:
            group.add_argument(flag, action="store_true", help=help_text)
            continue
        default = defaults[flag.lstrip("-").replace("-", "_")]
        shown = "" if default is None or flag == "--api-key" else " (default: %(default)s)"
        choices = _CHOICES.get(flag)
        group.add_argument(
            flag,
            type=kind,
            default=default,
            choices=choices,
            metavar=None if choices else _NAMED_METAVARS.get(flag, _METAVARS[kind]),
            help=help_text + shown,
        )


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerOptions]:
    """The engine config and the server options; a bad value exits with a usage message (status 2)."""
    return _parse(argv)[:2]


def _parse(argv: list[str] | None) -> tuple[EngineConfig, ServerOptions, argparse.Namespace, argparse.ArgumentParser]:
    parser = build_parser()
    ns = parser.parse_args(argv)
    args = vars(ns)
    try:  # every value is checked here, before any process starts or any file is read
        config = EngineConfig(**{name: args[name] for name in _DEFAULTS if name in args})
        options = ServerOptions(**{name: args[name] for name in _SERVER_DEFAULTS})
        # ServerOptions does not check them; uvicorn would take a negative timeout as 0 and log an error at SIGTERM
        require(options.shutdown_timeout >= 0, "shutdown_timeout", options.shutdown_timeout, "use 0 or more seconds")
        require(0 <= options.port <= 65535, "port", options.port, "use 1..65535 (0: any free port)")
        SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)
    except ValueError as exc:
        parser.error(_flag_names(str(exc), parser))
    return config, options, ns, parser


def _flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """A config or sampling error in the command line's words: `max_tokens=-3` reads `--max-tokens -3`."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    return re.sub(r"\b([a-z_]+)=", lambda m: f"{flags[m[1]]} " if m[1] in flags else m[0], message)


def main(argv: list[str] | None = None) -> int:
    """launch.py's entry: one prompt, a headless engine, or the OpenAI server (the default)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, options, ns, parser = _parse(argv)
    try:
        if ns.prompt is not None:
            return run_prompt(config, ns.prompt, ns.max_tokens, ns.temperature)
        if config.node_rank > 0:
            return run_node(config)
        if ns.headless:
            if ns.engine_address and ns.engine_address.startswith("tcp://"):
                host, _, port = check_engine_address(ns.engine_address)[len("tcp://") :].rpartition(":")
                check_port_free(host, int(port), f"--engine-address {ns.engine_address}")
            return run_headless(config, ns.engine_address) or 0
        check_port_free(options.host, options.port, f"--host {options.host} --port {options.port}")
        return run_server(config, options)
    except ValueError as exc:  # a model that does not resolve, a too-long --max-model-len, no CUDA: one line
        parser.exit(2, f"{parser.prog}: error: {_flag_names(str(exc), parser)}\n")
    except EngineDeadError as exc:  # the engine failed to start (its process logged why)
        parser.exit(1, f"{parser.prog}: error: {exc}\n")


def check_port_free(host: str, port: int, flags: str) -> None:
    """ValueError naming `flags` if host:port cannot be bound: found before the engine's start-up, not after."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
            sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        raise ValueError(
            f"cannot listen on {flags} ({exc}): stop what holds it or pick another port (or a host of this machine)"
        ) from None


def run_prompt(config: EngineConfig, prompt: str, max_tokens: int, temperature: float) -> int:
    with LLM(**{name: getattr(config, name) for name in inspect.signature(LLM).parameters}) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature), use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0
