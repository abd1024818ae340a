"""``kvtier bench longdoc``: long-document QA, the recipe of LMCache's ``long-doc-qa``.

``--documents`` documents of ``--document-length`` random tokens, each asked ``--questions``
times (the document, then a ``--question-length`` question, ``--output-length`` answer tokens),
at most ``--max-inflight`` requests at once. Round k is every document's k-th question. Order
(``--order``): ``tile`` (d0 d1 ... dN, d0 d1 ... dN, ...: a document comes back after all the
others, the pattern that spills out of a small cache), ``interleave`` (d0 d0 ..., d1 d1 ...: each
document's questions back to back) or ``random``. Round 0 computes every document; later rounds
are prefix hits, if the cache kept the documents::

    kvtier bench longdoc --model qwen3-0.6b-shape --device cuda --documents 40 --document-length 8000 \\
        --questions 2 --device-blocks 8000 --compare device,host
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any, Callable

from kvtier.bench import serving
from kvtier.flags import positive_int


def order(documents: int, questions: int, how: str, seed: int) -> list[tuple[int, int]]:
    """(document, round) in sending order."""
    if how == "tile":
        return [(d, q) for q in range(questions) for d in range(documents)]
    if how == "interleave":
        return [(d, q) for d in range(documents) for q in range(questions)]
    if how == "random":
        seq = [(d, q) for d in range(documents) for q in range(questions)]
        random.Random(seed).shuffle(seq)
        nth: dict[int, int] = {}
        out = []
        for d, _ in seq:  # a document's k-th ask is round k, whatever came before
            out.append((d, nth.get(d, 0)))
            nth[d] = nth.get(d, 0) + 1
        return out
    raise ValueError(f"unknown --order {how!r}; choose tile, interleave or random")


def workload(args: argparse.Namespace) -> serving.Workload:
    async def run(server: serving.Server, client: Any, tick: Callable[[], None]) -> list[serving.Record]:
        rng = random.Random(args.seed)
        vocab = args.vocab
        docs = [[rng.randrange(vocab) for _ in range(args.document_length)] for _ in range(args.documents)]
        arrivals = serving.Arrivals(float("inf"), args.max_inflight, args.seed)
        records: list[serving.Record] = []

        async def ask(d: int, q: int, question: list[int]) -> None:
            prompt = docs[d] + question
            rec = serving.Record(d, q, len(prompt), args.output_length)
            try:
                await serving.send(client, server, rec, prompt)
            finally:
                arrivals.slots.release()
            records.append(rec)
            tick()

        tasks = []
        for d, q in order(args.documents, args.questions, args.order, args.seed):
            question = [rng.randrange(vocab) for _ in range(args.question_length)]
            await arrivals.admit()  # in order: the next starts when a slot frees
            tasks.append(asyncio.create_task(ask(d, q, question)))
        await asyncio.gather(*tasks)
        return records

    return run


def plan(args: argparse.Namespace, max_model_len: int | None) -> serving.Plan:
    """The workload's shape, once a question (document + question + answer) fits
    ``max_model_len`` (None: not checked); else an error naming the sizes."""
    prompt = args.document_length + args.question_length
    if max_model_len is not None and prompt + args.output_length > max_model_len:
        raise SystemExit(
            f"longdoc: a question is {prompt} prompt ({args.document_length} document + {args.question_length} "
            f"question) + {args.output_length} output tokens > max_model_len {max_model_len} of the served model; "
            f"lower --document-length/--question-length/--output-length or serve a longer --max-model-len"
        )
    return serving.Plan(args.documents * args.questions, (min(args.documents, args.max_inflight), prompt))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtier bench longdoc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--documents", type=positive_int, default=8, help="documents (default 8)")
    ap.add_argument("--document-length", type=positive_int, default=1024, help="tokens per document (default 1024)")
    ap.add_argument("--questions", type=positive_int, default=2, help="times each document is asked (default 2)")
    ap.add_argument("--question-length", type=positive_int, default=16, help="tokens per question (default 16)")
    ap.add_argument("--output-length", type=positive_int, default=16, help="tokens per answer (default 16)")
    ap.add_argument(
        "--order",
        choices=("tile", "interleave", "random"),
        default="tile",
        help="tile: d0..dN repeated; interleave: each document's questions together (default tile)",
    )
    ap.add_argument("--max-inflight", type=positive_int, default=4, help="requests in flight at most (default 4)")
    serving.add_common_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving.run(args, "longdoc", workload(args), lambda max_model_len: plan(args, max_model_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
