"""`kvengine generate`: send prompts to a server (or a server of its own) and print tokens as they stream."""

import argparse
import asyncio
import contextlib
import re
import sys
from typing import TYPE_CHECKING

from launch.client import AsyncEngineClient, EngineDeadError, install_uvloop
from launch.commands.config_args import add_config_args, config_from_args
from launch.commands.local_server import (
    LOCAL_SERVER_AREAS,
    Interrupted,
    LocalServer,
    ServerStartError,
    run_until_signal,
)
from protocol import SamplingParams
from protocol.config import EngineConfig
from protocol.model.check import check_model

if TYPE_CHECKING:
    from protocol.model.tokenizer import TextTokenizer


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from token-id prompts (or text, with a GGUF model's tokenizer)",
                       description="Without --connect, starts its own server with the engine flags below; that "
                                   "server stops with this command, also when it is killed. SIGINT / SIGTERM: "
                                   "one line and exit code 130 / 143.")
    p.add_argument("--connect", metavar="ADDRESS", default=None, help="address of a running `kvengine serve`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-token-ids", action="append", metavar="IDS", type=parse_token_ids,
                     help="a prompt as token ids, e.g. '1,2,3' (repeat for several prompts)")
    src.add_argument("--prompts-file", metavar="FILE",
                     help="one prompt per line, token ids separated by spaces or commas")
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a text prompt, tokenised here with the tokenizer of --model (a GGUF file)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_config_args(p, LOCAL_SERVER_AREAS)
    p.set_defaults(func=cmd_generate)


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token ids: {text!r} (use e.g. 1,2,3)") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"no token ids in {text!r}")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, LOCAL_SERVER_AREAS)
        check_model(config.model.model)  # one line for a --model that cannot load, before any process starts
        prompts, tokenizer = read_prompts(args, config.model.model)
    except ValueError as e:
        print(f"kvengine generate: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    install_uvloop()
    try:
        return run_until_signal(_generate(args, config, prompts, params, tokenizer))
    except (EngineDeadError, ServerStartError) as e:
        print(f"kvengine generate: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(flush=True)  # end the line of streamed tokens
        print(f"kvengine generate: {e}", file=sys.stderr)
        return e.exit_code


def read_prompts(args: argparse.Namespace, model: str | None) -> tuple[list[list[int]], "TextTokenizer | None"]:
    """The prompts as token ids, and the tokenizer of text prompts; ValueError (one line) when they cannot be had."""
    if args.prompt:
        tokenizer = text_tokenizer(model)
        return [tokenizer.encode(text) for text in args.prompt], tokenizer
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                return [parse_token_ids(line) for line in f if line.strip()], None
        except (OSError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{args.prompts_file}: {e}") from None
    return args.prompt_token_ids, None


def text_tokenizer(model: str | None) -> "TextTokenizer":
    """The tokenizer of --model, for --prompt; ValueError naming the model when it has none or it cannot be read."""
    instead = "give the prompt as token ids (--prompt-token-ids)"
    if not model:
        raise ValueError(f"--prompt needs --model with a tokenizer; the built-in model has none: {instead}")
    from protocol.model.tokenizer import load_tokenizer  # here: the tokenizers library is slow to import

    try:
        return load_tokenizer(model)
    except FileNotFoundError:
        raise ValueError(f"{model}: no tokenizer.json, so --prompt cannot be tokenised (kvengine make-model writes "
                         f"none): {instead}, or copy the model's tokenizer.json into the folder") from None
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a plain Exception for a malformed file)
        raise ValueError(f"{model}: its tokenizer cannot be read: {e}") from None


async def _generate(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]], params: SamplingParams,
                    tokenizer) -> int:
    server = contextlib.nullcontext() if args.connect else LocalServer(config)
    async with server as local:
        address = local.address if local else args.connect
        async with AsyncEngineClient(address) as client:
            await client.wait_ready()
            results = await asyncio.gather(*(
                _stream(client, i, prompt, params, tokenizer, len(prompts) > 1) for i, prompt in enumerate(prompts)
            ))
    return 0 if all(r in ("length", "stop") for r in results) else 1


async def _stream(client: AsyncEngineClient, index: int, prompt: list[int], params: SamplingParams, tokenizer,
                  tag: bool) -> str | None:
    prefix = f"[{index}] " if tag else ""
    tokens: list[int] = []
    printed = ""
    async for out in client.generate(prompt, params):
        tokens += out.new_token_ids
        if tokenizer is None:
            text = " ".join(map(str, out.new_token_ids))
            print(f"{prefix}{text}" if tag else text, end="\n" if tag else " ", flush=True)
        elif not tag:  # decode the whole output each time: a token alone may be half a character
            text = tokenizer.decode(tokens)
            print(text[len(printed):], end="", flush=True)
            printed = text
        if out.finished:
            if not tag:
                print()
            if tag and tokenizer is not None:
                print(f"{prefix}{tokenizer.decode(tokens)}")
            note = f" ({out.error})" if out.error else ""
            print(f"{prefix}finished: {out.finish_reason}, {len(tokens)} tokens, "
                  f"{out.num_cached_tokens} prompt tokens from the prefix cache{note}", file=sys.stderr)
            return out.finish_reason
    return None
