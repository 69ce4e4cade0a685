"""kvengine simulate, the command: table and ceiling check, JSON and sweep, bad input, the plot, and
the engine flags it shares with serve."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import main
from tests.launch.simulate_support import write_trace


def test_cli_table_and_ceiling_check(tmp_path, capsys):
    rc = main(["simulate", "--trace", write_trace(tmp_path), "--check-ceiling", "--no-progress",
               "--prefix-caching-hash-algo", "xxhash"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "4,432" in out and "66.67%" in out and "per request equal: True" in out


def test_cli_json_and_sweep(tmp_path, capsys):
    trace = write_trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "--kv-cache-tokens", "3k"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["result"]["kv_cache_tokens"] == 2992 and data["problems"] == []
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "--sweep", "--sweep-min", "1000",
                 "--sweep-max", "1e5", "--sweep-points", "3", "--max-num-batched-tokens", "512"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["kv_cache_tokens"] for r in data["sweep"]] == [992, 10000, 100000]
    assert data["problems"] == []


def test_cli_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["simulate", "--trace", str(bad), "--no-progress"]) == 2
    assert "not a Mooncake trace record" in capsys.readouterr().err
    assert main(["simulate", "--trace", write_trace(tmp_path), "--block-size", "48", "--no-progress"]) == 2


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(["simulate", "--trace", write_trace(tmp_path), "--no-progress", "--sweep", "--sweep-min", "1000",
                 "--sweep-max", "1e4", "--sweep-points", "2", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert "plot written" in capsys.readouterr().out


def test_cli_engine_flags_reach_the_engine(tmp_path, capsys):
    """Block count and block size from serve's flags; the scheduler flags from the config come along."""
    trace = write_trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "--num-gpu-blocks-override", "200",
                 "--block-size", "32", "--scheduling-policy", "priority"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert (result["num_blocks"], result["block_size"], result["kv_cache_tokens"]) == (200, 32, 199 * 32)


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-tokens", "3k", "--num-gpu-blocks-override", "100"], "not both"),
    (["--kv-cache-memory-bytes", "1G"], "--kv-cache-memory-bytes has no effect"),
    (["--model", "/no/such/model"], "--model has no effect"),
    (["--kv-cache-tokens", "8", "--block-size", "16"], "at least one block"),
])
def test_cli_refuses_settings_a_replay_cannot_use(tmp_path, capsys, flags, message):
    assert main(["simulate", "--trace", write_trace(tmp_path), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err


def test_simulate_never_imports_torch():
    """A replay runs where no model could: the command and its package stay torch-free."""
    code = "import sys, launch.commands.simulate; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
