"""The generate command end to end: it starts its own server, streams tokens, and stops the server."""

import json
import subprocess
import sys

from protocol import SamplingParams
from tests.e2e.in_process import in_process_greedy


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=300,
                          check=False)


def test_generate_from_token_ids_prints_the_greedy_tokens():
    proc = run_cli("generate", "--prompt-token-ids", "5,6,7,8,9", "--max-tokens", "6", "--ignore-eos",
                   "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB")
    assert proc.returncode == 0, proc.stderr
    printed = [int(t) for t in proc.stdout.split()]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert printed == in_process_greedy([[5, 6, 7, 8, 9]], params, max_model_len=256, kv_cache_memory_bytes=4 << 20)[0]
    assert "finished: length, 6 tokens" in proc.stderr


def test_generate_from_a_prompts_file_tags_each_prompt(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n4,5,6,7\n")
    proc = run_cli("generate", "--prompts-file", str(prompts), "--max-tokens", "3", "--ignore-eos",
                   "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("[0] ") for line in lines) == 3 and sum(line.startswith("[1] ") for line in lines) == 3
    assert proc.stderr.count("finished: length, 3 tokens") == 2


def test_generate_refuses_a_text_prompt_without_a_tokenizer():
    proc = run_cli("generate", "--prompt", "hello")
    assert proc.returncode == 2 and "--prompt needs --model" in proc.stderr


def test_generate_rejects_malformed_token_ids_with_one_line(tmp_path):
    proc = run_cli("generate", "--prompt-token-ids", "1,two,3")
    assert proc.returncode == 2 and "not a list of token ids: '1,two,3'" in proc.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\nx y\n")
    proc = run_cli("generate", "--prompts-file", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not a list of token ids" in proc.stderr


def test_generate_and_bench_say_when_no_server_answers(tmp_path):
    for command in ("generate", "bench"):
        args = [command, "--connect", f"ipc://{tmp_path}/nobody.sock"]
        proc = run_cli(*args, *(["--prompt-token-ids", "1,2"] if command == "generate" else []))
        assert proc.returncode == 1, proc.stderr
        assert f"no kvengine server answers at ipc://{tmp_path}/nobody.sock" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_bench_with_more_prompts_than_a_clients_limit_gets_every_answer():
    """bench keeps at most the server's default per-client limit in flight: 1,100 prompts, none refused."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "bench", "--num-prompts", "1100", "--input-len", "16", "--output-len", "2",
         "--kv-cache-memory-bytes", "64MiB", "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    summary = json.loads(done.stdout)
    assert summary["requests"] == 1100 and summary["failed"] == 0, summary
