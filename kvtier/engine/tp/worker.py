"""A tensor-parallel rank r > 0: its shard of the model, its KV and host tiers and transfer
engine, running what rank 0 sends in the order it sends it (engine/tp/ranks.py lists the
messages). Nothing is decided here.

Started by rank 0 as ``python -m kvtier.engine.tp.worker FD`` (FD: its end of a socket pair).
It exits when told to, when rank 0's end closes, when its parent process is gone, or after
sending ("error", text) when anything it runs raises.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

import numpy as np
import torch

log = logging.getLogger("kvtier.tp")


def main(fd: int) -> int:
    conn = Connection(fd)
    parent = os.getppid()
    try:
        msg = conn.recv()
    except EOFError:
        return 0
    _, rank, size, store, model, config = msg
    from kvtier.log_setup import RedactingFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    logging.basicConfig(level=os.environ.get("KVTIER_LOG_LEVEL", "WARNING").upper(), handlers=[handler])
    try:
        rank_state = _Rank(conn, rank, size, store, model, config)
        rank_state.serve(parent)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # rank 0 is gone
    except BaseException as e:  # told to rank 0, which stops the engine
        text = f"{e!r}\n{traceback.format_exc(limit=8)}"
        log.error("rank %d failed: %s", rank, text)
        try:
            conn.send(("error", f"{e!r}"))
        except OSError:
            pass
        return 1
    return 0


class _Rank:
    def __init__(self, conn: Connection, rank: int, size: int, store: str, model: str, config) -> None:
        from kvtier.engine.sizing import block_nbytes, size_device_blocks
        from kvtier.engine.tp.ranks import backend_for, init_group, rank_device
        from kvtier.model import load_model
        from kvtier.model.shard import TPShard

        # ``config``: rank 0's, with its dtype, attention backend and context length resolved
        self.conn = conn
        self.config = config
        self.rank, self.size = rank, size
        device = rank_device(torch.device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        group = init_group(backend_for(device), store, rank, size, config.tp_timeout, device)
        from kvtier.model.kv_quant import is_fp8, kv_cache_torch_dtype

        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.model = load_model(
            model,
            device,
            self.dtype,
            config.attention_backend,
            load_format=config.load_format,
            tp=TPShard(rank, size, group),
            mtp=config.num_speculative_tokens > 0,
        )
        fits = config.num_device_blocks or size_device_blocks(
            device,
            block_nbytes(self.model.config, config.block_size, self.kv_dtype),  # (this rank's heads)
            config.block_size,
            config.max_num_seqs,
            config.max_model_len,
            config.gpu_memory_utilization,
        )
        conn.send(("sized", int(fits)))
        if is_fp8(self.kv_dtype):  # with rank 0, once every rank is sized (engine/build.py)
            from pathlib import Path

            from kvtier.model.kv_scales import kv_scales_for, set_kv_scales

            set_kv_scales(self.model, kv_scales_for(Path(model), self.model, self.kv_dtype, config.load_format)[0], device)
        msg = conn.recv()
        assert msg[0] == "build", msg
        self._build(*msg[1:])
        conn.send(("ready",))

    def _build(self, config, pool: tuple | None) -> None:
        """The tiers (``pool``: rank 0's storage namespace and model fingerprint, when there is a
        pool), kernels, graphs and runner, as rank 0 builds its own (engine/build.py), under
        ``config``: rank 0's, its tiers sized too, on this rank's device."""
        from dataclasses import replace

        from kvtier.engine.build import allocate_tiers, build_runner
        from kvtier.engine.startup import Startup
        from kvtier.transfer.engine import TransferEngine

        self.config = c = replace(config, device=str(self.device))
        self.kv_caches, self.host = allocate_tiers(self.model.config, c, self.kv_dtype)
        host_kv = self.host.tensor if self.host is not None else None
        self.transfer = TransferEngine(self.kv_caches, host_kv, None)
        self.storage = None
        if pool is not None:
            from kvtier.engine.pool import bind_pool, open_pool

            namespace, fingerprint = pool
            self.storage, _ = open_pool(c)  # (rank 0's cost model decides for every rank)
            assert self.storage is not None and host_kv is not None  # (a pool always comes with a host tier)
            if self.storage.namespace != namespace:
                raise ValueError(f"rank {self.rank}: pool namespace {self.storage.namespace!r}, rank 0's {namespace!r}")
            replicated = self.model.config.kv_kind == "latent"  # one object a block, rank 0's routing rows in it
            self.storage.shard(self.rank, self.size, replicated=replicated)
            bind_pool(self.storage, None, host_kv, self._routing_rows(c) if replicated else None, fingerprint)
        # (the same MTP passes as rank 0's: engine/spec.py draft_passes)
        self.runner, _, _ = build_runner(self.model, self.kv_caches, host_kv, c, None, self.transfer.gates, Startup())

    def _routing_rows(self, c) -> np.ndarray | None:
        """Where this rank reads the routing rows of a replicated block (rank 0's, which it
        captures; this rank only checks and drops them): as many as rank 0's host store holds."""
        m = self.model.config
        if not (m.is_moe and c.capture_routing):
            return None
        from kvtier.engine.experts import routing_store

        return routing_store(c.num_host_blocks, c.block_size, m.num_moe_layers, m.top_k, m.num_experts)

    def serve(self, parent: int) -> None:
        conn, transfer, storage = self.conn, self.transfer, self.storage
        held: list[tuple] = []  # loads (op, mode): submitted when the forward that reads them is

        def submit_held() -> None:
            try:
                for op, mode in held:
                    transfer.load_mode = mode
                    transfer.submit(op)
            finally:
                transfer.load_mode = "whole"
                held.clear()

        def start_loads(mode: str):
            submit_held()
            return transfer.layer_hook()

        while True:
            busy = transfer.num_in_flight or (storage is not None and storage.num_in_flight)
            if not conn.poll(0.001 if busy else 1.0):
                if os.getppid() != parent:
                    return  # rank 0's process is gone
                self._report(self._poll())
                continue
            msg = conn.recv()
            kind = msg[0]
            if kind == "ops":
                for op, mode in msg[1]:
                    if op.kind == "load":
                        held.append((op, mode))
                    elif op.kind in ("fetch", "put"):
                        assert storage is not None  # (rank 0 has a pool only if every rank has)
                        storage.submit(op)
                    else:
                        transfer.submit(op)
            elif kind == "forward":
                self.runner.follow(msg[1], start_loads)
            elif kind == "wait":
                submit_held()
                if msg[1] == "storage_drain":
                    assert storage is not None
                    self._report(storage.drain())
                else:
                    self._report(transfer.wait_loads() if msg[1] == "wait_loads" else transfer.drain())
                conn.send(("ack", msg[2]))
                continue
            elif kind == "score":
                self.runner.score(msg[1], msg[2])
            elif kind == "draft":
                from kvtier.engine.sampling import to_device
                from kvtier.engine.spec import draft_passes

                runner = self.runner
                assert runner.spec is not None and runner.followed is not None, "drafts without a drafting forward"
                inputs, hidden, hook = runner.followed
                runner.followed = None
                next_ids, rows, positions, tables = msg[1:]
                dev = runner.device
                ids, rows, positions = (to_device(v, dev, torch.long) for v in (next_ids, rows, positions))
                model, kv, chain = runner.model, runner.kv_caches, runner.spec.chain
                draft_passes(model, kv, chain, inputs, hidden, hook, ids, rows, positions, tables)
            elif kind == "close":
                from kvtier.engine.tp.ranks import destroy_group

                self.runner.release_graphs()  # (NCCL's teardown waits for graphs that hold its kernels)
                destroy_group()  # beside rank 0's (NCCL's teardown waits for every rank)
                if storage is not None:
                    storage.drain()
                    storage.close()
                if self.host is not None:
                    self.host.release()
                return
            else:
                raise ValueError(f"unknown message {kind!r} from rank 0")
            self._report(self._poll())

    def _poll(self) -> list:
        landed = self.transfer.poll()
        if self.storage is not None:
            landed += self.storage.poll()
        return landed

    def _report(self, landed: list) -> None:
        if landed:
            self.conn.send(("landed", landed))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
