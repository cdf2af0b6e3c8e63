"""A newcomer's first commands, as the README gives them: they run on a CPU with no download and no weights."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", README, re.S)


def _run(command: str, **kwargs) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done


def test_the_readme_recipe_writes_a_tiny_checkpoint_that_launch_py_runs(tmp_path):
    run_block = next(code for lang, code in BLOCKS if lang == "bash" and "python -m tests.checkpoints" in code)
    build, prompt = [line.split("  #")[0].strip() for line in run_block.splitlines()[:2]]
    assert build.startswith("python -m tests.checkpoints ") and prompt.startswith("python launch.py --model ")
    directory = build.split()[-1]
    assert f"--model {directory} --device cpu --prompt" in prompt
    _run(build.replace(directory, str(tmp_path / "tiny")))
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and (tmp_path / "tiny" / "tokenizer.json").is_file()
    assert _run(prompt.replace(directory, str(tmp_path / "tiny"))).stdout.strip()  # the completion


def test_the_readme_python_snippet_runs_with_dummy_weights(tiny_ckpt):
    (snippet,) = [code for lang, code in BLOCKS if lang == "python" and "from frontend import LLM" in code]
    assert 'load_format="dummy"' in snippet and "max_tokens=" in snippet
    # The tiny checkpoint's config stands in for the short name's: random weights either way, and seconds on a CPU.
    assert _run(f"python -c {shlex.quote(snippet.replace('qwen2.5-1.5b', str(tiny_ckpt)))}").stdout.strip()


def _calls(code: str) -> list[str]:
    """The text of every `.create(...)` call in a Python snippet (parentheses matched)."""
    calls = []
    for match in re.finditer(r"\.create\(", code):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        calls.append(code[match.start() : end])
    return calls


def test_every_readme_request_example_sets_a_token_limit():
    """Without one, an example runs until the context is full: minutes on a CPU."""
    calls = [call for lang, code in BLOCKS if lang == "python" for call in _calls(code)]
    bodies = [
        json.loads(body) for lang, code in BLOCKS if lang == "bash" for body in re.findall(r"-d '(\{.*?\})'", code)
    ]
    assert len(calls) >= 4 and len(bodies) >= 2  # openai chat and completions, anthropic, responses; two curls
    for call in calls:
        assert "max_tokens=" in call or "max_output_tokens=" in call, call
    for body in bodies:
        assert "max_tokens" in body, body
