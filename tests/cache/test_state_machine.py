"""Random programs against the CacheManager, with a model of the bytes in every block.

Every device/host block and storage object carries "content": the key of the block whose KV it
holds (or garbage). The "forward" writes a request's own blocks, ops copy content only when they
succeed, and after every step we check DESIGN §5 via ``assert_invariants()`` plus the property
that matters to users: every block a request reads holds exactly the KV of its tokens, whichever
tier it came from (§5.5), and a block read by an in-flight copy is never overwritten (§5.4).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.cache import CacheManager, SimulatedStorage

BS = 4
PREFIXES = [[(p * 7 + i) % 11 for i in range(24)] for p in range(4)]
GARBAGE = b"garbage"
EXAMPLES = int(os.environ.get("KVTIER_SM_EXAMPLES", "700"))


class Req:
    def __init__(self, creq, tokens):
        self.creq = creq
        self.tokens = tokens
        self.computed = 0      # tokens whose KV the request has (cached or computed)
        self.scheduled = 0     # tokens to compute in the next forward


class CacheMachine(RuleBasedStateMachine):
    policy = "write_through_selective"
    storage_capacity: int | None = 40

    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(block_size=BS, num_device_blocks=10, num_host_blocks=20,
                                storage=SimulatedStorage(self.storage_capacity),
                                write_policy=self.policy, write_through_threshold=2, block_nbytes=64)
        self.reqs: list[Req] = []
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.stored: dict[bytes, bytes] = {}
        self.inflight: list = []   # TransferOps planned, not yet completed
        self.next_rid = 0

    # ------------------------------------------------------------ requests
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), keep=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 10), min_size=1, max_size=5))
    def add_request(self, prefix, keep, suffix):
        tokens = PREFIXES[prefix][:keep] + suffix
        creq = self.mgr.new_request(self.next_rid, tokens)
        self.next_rid += 1
        m = self.mgr.match_prefix(creq)
        assert m.num_blocks * BS < len(tokens)
        if m.num_storage_blocks:
            self.mgr.prefetch(creq)
        self.reqs.append(Req(creq, tokens))

    def _waiting(self):
        return [r for r in self.reqs if not r.creq.admitted]

    def _running(self):
        return [r for r in self.reqs if r.creq.admitted]

    @precondition(lambda self: self._waiting())
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data, chunk):
        r = data.draw(st.sampled_from(self._waiting()))
        m = self.mgr.match_prefix(r.creq)
        cached = (m.num_device_blocks + m.num_host_blocks) * BS
        n = min(len(r.tokens), cached + chunk)
        if self.mgr.allocate(r.creq, n):
            assert len(r.creq.block_table) * BS >= n
            m = r.creq.match   # allocate re-matches if a copy went away since
            cached = (m.num_device_blocks + m.num_host_blocks) * BS
            r.computed, r.scheduled = cached, n - cached

    @precondition(lambda self: any(r.scheduled == 0 for r in self._running()))
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def extend(self, data, chunk):
        """Next prefill chunk, or a decode step that appends a generated token."""
        r = data.draw(st.sampled_from([r for r in self._running() if r.scheduled == 0]))
        if r.computed >= len(r.tokens):
            r.tokens.append(data.draw(st.integers(0, 10)))
        n = min(len(r.tokens), r.computed + chunk)
        if self.mgr.allocate(r.creq, n):
            r.scheduled = n - r.computed

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), keep=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 10), min_size=1, max_size=5),
          fail=st.lists(st.booleans(), max_size=6))
    def serve(self, prefix, keep, suffix, fail):
        """A whole request: match, prefetch, admit, prefill, finish (a few steps)."""
        self.add_request(prefix, keep, suffix)
        r = self.reqs[-1]
        for _ in range(3):
            self.step(fail, [])
            m = self.mgr.match_prefix(r.creq)
            if not m.num_storage_blocks or self.mgr.prefetch(r.creq) == 0:
                break
        if self.mgr.allocate(r.creq, len(r.tokens)):
            m = r.creq.match
            cached = (m.num_device_blocks + m.num_host_blocks) * BS
            r.computed, r.scheduled = cached, len(r.tokens) - cached
            self.step(fail, [])
            self.step([], [])
        self.mgr.free(r.creq)
        self.reqs.remove(r)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(self.reqs))
        self.mgr.free(r.creq)
        self.reqs.remove(r)

    # ------------------------------------------------------------ a step
    @rule(fail=st.lists(st.booleans(), max_size=12), finish=st.lists(st.booleans(), max_size=4))
    def step(self, fail, finish):
        mgr = self.mgr
        self.inflight.extend(mgr.take_plan())
        fails = iter(fail)
        # Loads land before the forward reads them (the runner's per-layer wait).
        rewinds = {}
        for op in [op for op in self.inflight if op.kind == "load"]:
            rewinds.update(self._run(op, fails))
        # The forward: every block it reads holds its tokens' KV; it writes its own blocks.
        reading = self._blocks_read_by_inflight()
        for r in self._running():
            if not r.scheduled:
                continue
            if r.creq.rid in rewinds:
                r.computed = min(r.computed, rewinds[r.creq.rid])
                r.scheduled = 0
                continue
            keys = r.creq.keys
            table = r.creq.block_table
            for i in range(r.computed // BS):
                assert self.device[table[i]] == keys[i], f"request {r.creq.rid} reads wrong KV in block {i}"
            end = r.computed + r.scheduled
            mgr._sync_keys(r.creq, end)
            for i in range(r.computed // BS, -(-end // BS)):
                assert ("device", table[i]) not in reading, "forward writes a block an in-flight copy reads"
                assert i >= len(r.creq.nodes), "forward writes a tree-owned block"
                self.device[table[i]] = keys[i] if (i + 1) * BS <= end else GARBAGE
            r.computed, r.scheduled = end, 0
            mgr.commit(r.creq, r.computed)
        # Other copies complete now or later (async), in any order.
        self.inflight.extend(mgr.take_plan())
        done = iter(finish)
        for op in list(self.inflight):
            oldest_backup = next((o for o in self.inflight if o.kind == "backup"), None)
            if op.kind == "backup" and op is not oldest_backup:
                continue                     # backups land in plan order (one offload stream)
            if next(done, True):
                self._run(op, fails)

    def _blocks_read_by_inflight(self):
        out = set()
        for op in self.inflight:
            out.update((op.src_tier, b) for b in op.src_blocks)
        return out

    def _run(self, op, fails):
        failed = {i for i in range(op.num_blocks) if next(fails, False)}
        src = {"device": self.device, "host": self.host}.get(op.src_tier)
        dst = {"device": self.device, "host": self.host}.get(op.dst_tier)
        for i in range(op.num_blocks):
            if op.kind == "fetch":
                value = self.stored.get(op.keys[i], GARBAGE)
            else:
                value = src[op.src_blocks[i]]
                assert value == op.keys[i], f"{op.kind} reads a block that does not hold its key"
            if op.kind == "put":
                if i not in failed:
                    self.stored[op.keys[i]] = value
            else:
                dst[op.dst_blocks[i]] = GARBAGE if i in failed else value
        self.inflight.remove(op)
        return self.mgr.complete(op.op_id, failed)

    # ------------------------------------------------------------ checks
    @invariant()
    def invariants_hold(self):
        self.mgr.assert_invariants([r.creq for r in self.reqs])
        for node in self.mgr.tree.nodes.values():
            if node.device_block is not None:
                assert self.device.get(node.device_block) == node.key, "tree device copy holds wrong KV"
            if node.host_block is not None and node.host_ready:
                assert self.host.get(node.host_block) == node.key, "tree host copy holds wrong KV"

    def teardown(self):
        for r in self.reqs:
            self.mgr.free(r.creq)
        while self.inflight:
            self._run(self.inflight[0], iter(()))
        self.inflight.extend(self.mgr.take_plan())
        while self.inflight:
            self._run(self.inflight[0], iter(()))
            self.inflight.extend(self.mgr.take_plan())
        self.mgr.assert_invariants()
        tree = self.mgr.tree
        assert all(n.lock_ref == 0 and n.host_reads == 0 and n.device_reads == 0 for n in tree.nodes.values())
        assert self.mgr.device_pool.num_free + tree.num_device_copies == self.mgr.device_pool.num_blocks
        assert self.mgr.host_pool.num_free + tree.num_host_copies == self.mgr.host_pool.num_blocks


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class WriteThroughSelective(CacheMachine):
    policy = "write_through_selective"


class WriteThrough(CacheMachine):
    policy = "write_through"
    storage_capacity = None


class WriteBack(CacheMachine):
    policy = "write_back"


TestWriteThroughSelective = WriteThroughSelective.TestCase
TestWriteThroughSelective.settings = SETTINGS
TestWriteThrough = WriteThrough.TestCase
TestWriteThrough.settings = SETTINGS
TestWriteBack = WriteBack.TestCase
TestWriteBack.settings = SETTINGS
