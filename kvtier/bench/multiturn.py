"""``kvtier bench multiturn``: multi-turn chat, the recipe of SGLang's
``benchmark/hicache/bench_multiturn.py``.

``--clients`` conversations of ``--rounds`` rounds. Round 1 of a client sends ``--request-length``
random tokens; each next round sends the client's whole history (every earlier question and
answer) plus a new ``--request-length`` question, so a history grows to ``rounds x (request +
output)`` tokens and its earlier rounds are a prefix cache hit, if the cache kept them. A
client's next round is sent once its last answer arrived; requests start at Poisson times of
``--request-rate`` per second, at most ``--max-parallel`` at once; with ``--round-barrier`` every
client finishes round r before any starts round r+1. Per round: mean TTFT and cached tokens. A
client's questions come from its own generator (``--seed`` and the client), so its prompts are
the same in every configuration that gives the same answers, whatever order requests finish in.
The last round, ``rounds x (request + output)`` tokens with its answer, must fit the served
model's ``max_model_len``. SGLang's names ``--num-clients`` and ``--num-rounds`` are taken too.

The working set is ``clients x history`` tokens: against a device tier of ``--device-blocks``, a
working set 4x the device tier is the regime where the host and storage tiers pay off::

    kvtier bench multiturn --model qwen3-0.6b-shape --device cuda --clients 32 --rounds 8 \\
        --request-length 1024 --output-length 64 --device-blocks 4400 --compare device,host,storage
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any, Callable

from kvtier.bench import serving
from kvtier.flags import positive_int


def workload(args: argparse.Namespace) -> serving.Workload:
    async def run(server: serving.Server, client: Any, tick: Callable[[], None]) -> list[serving.Record]:
        rngs = [random.Random(args.seed * 1_000_003 + c) for c in range(args.clients)]
        vocab = args.vocab
        arrivals = serving.Arrivals(args.request_rate, args.max_parallel, args.seed)
        histories: list[list[int]] = [[] for _ in range(args.clients)]
        records: list[serving.Record] = []

        async def one_round(c: int, r: int) -> None:
            rng = rngs[c]
            question = [rng.randrange(vocab) for _ in range(args.request_length)]
            prompt = histories[c] + question
            rec = serving.Record(c, r, len(prompt), args.output_length)
            await arrivals.admit()
            try:
                await serving.send(client, server, rec, prompt)
            finally:
                arrivals.slots.release()
            records.append(rec)
            tick()
            histories[c] = prompt + serving.answer_ids(rec, rng, vocab)

        async def conversation(c: int) -> None:
            for r in range(args.rounds):
                await one_round(c, r)

        if args.round_barrier:
            for r in range(args.rounds):
                await asyncio.gather(*(one_round(c, r) for c in range(args.clients)))
        else:
            await asyncio.gather(*(conversation(c) for c in range(args.clients)))
        return records

    return run


def plan(args: argparse.Namespace, max_model_len: int | None) -> serving.Plan:
    """The workload's shape, once its longest request, a conversation's last round, fits
    ``max_model_len`` (None: not checked); else an error naming the sizes."""
    turn = args.request_length + args.output_length
    longest = args.rounds * turn - args.output_length  # the history of rounds - 1 turns + a question
    if max_model_len is not None and longest + args.output_length > max_model_len:
        fit = f" ({max_model_len // turn} rounds fit)" if max_model_len >= turn else ""
        raise SystemExit(
            f"multiturn: round {args.rounds} of a conversation is {longest} prompt + {args.output_length} output "
            f"tokens > max_model_len {max_model_len} of the served model{fit}; lower --rounds/--request-length/"
            f"--output-length or serve a longer --max-model-len"
        )
    return serving.Plan(args.clients * args.rounds, (min(args.clients, args.max_parallel), args.request_length))


def add_workload_flags(ap: argparse.ArgumentParser) -> None:
    """The workload's flags (``kvtier bench pd-soak`` takes them too, with its own defaults). Where
    SGLang's ``bench_multiturn.py`` names a flag of the same meaning otherwise, its name is taken too."""
    ap.add_argument(
        "--clients", "--num-clients", dest="clients", type=positive_int, default=8, help="conversations (default %(default)s)"
    )
    ap.add_argument(
        "--rounds",
        "--num-rounds",
        dest="rounds",
        type=positive_int,
        default=4,
        help="rounds per conversation (default %(default)s)",
    )
    ap.add_argument("--request-length", type=positive_int, default=256, help="tokens of each new question (default %(default)s)")
    ap.add_argument("--output-length", type=positive_int, default=32, help="tokens of each answer (default %(default)s)")
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (default inf: no pacing)"
    )
    ap.add_argument("--max-parallel", type=positive_int, default=16, help="requests in flight at most (default %(default)s)")
    ap.add_argument("--round-barrier", action="store_true", help="all clients finish a round before the next")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtier bench multiturn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_flags(ap)
    serving.add_common_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving.run(args, "multiturn", workload(args), lambda max_model_len: plan(args, max_model_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
