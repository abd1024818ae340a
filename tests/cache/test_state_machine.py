"""Random programs against the CacheManager, with a model of the bytes in every block.

Every device/host block and storage object carries "content": the key of the block whose KV it
holds (or garbage). The "forward" writes a request's own blocks, ops copy content only when they
succeed, and after every step we check DESIGN §5 via ``assert_invariants()`` plus the property
that matters to users: every block a request reads holds exactly the KV of its tokens, whichever
tier it came from (§5.5), and a block read or written by an in-flight copy is never overwritten
(§5.4).

Copies run asynchronously, as in the engine (kvtier/engine/llm.py ``step``, DESIGN §7):

* loads are submitted before the forward; the forward waits for their bytes GPU-side, but the
  manager may learn of their completion only after the forward (``late``), possibly after a
  ``commit`` that must then wait (``num_loading`` > 0) and catch up once the loads are reported;
  a failed load is reported as a rewind of exactly the requests that read garbage;
* backups, puts and fetches complete across steps in any order (backups in submission order:
  one offload stream), and several steps may pass with everything in flight (``submit_only``);
* preemption by swap (``swap_out``) and the request coming back later (``come_back``);
* the scheduler's wait: when an allocation fails and the blocks copies in flight will free would
  let it succeed (``wait_would_fit``: ``num_device_blocks_freeing`` > 0) it frees nothing more and
  waits; once the in-flight backups and early loads (preloads) have landed, at
  least that many more device blocks must be free or evictable (``_wait_for_backups``).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.cache import CacheManager, SimulatedStorage

BS = 4
PREFIXES = [[(p * 7 + i) % 11 for i in range(24)] for p in range(4)]
GARBAGE = b"garbage"
# examples per machine: 250 in the default run (~10 s each on 2 cores), 1,500 in the slow pass
# (the Deep classes below); KVTIER_SM_EXAMPLES sets the default run's
EXAMPLES = int(os.environ.get("KVTIER_SM_EXAMPLES", "250"))
DEEP_EXAMPLES = 1500


class Req:
    def __init__(self, creq, tokens):
        self.creq = creq
        self.tokens = tokens
        self.computed = 0  # tokens whose KV the request has (cached or computed)
        self.scheduled = 0  # tokens to compute in the next forward


class CacheMachine(RuleBasedStateMachine):
    policy = "write_through_selective"
    storage_capacity: int | None = 40

    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(
            block_size=BS,
            num_device_blocks=10,
            num_host_blocks=20,
            storage=SimulatedStorage(self.storage_capacity),
            write_policy=self.policy,
            write_through_threshold=2,
            block_nbytes=64,
            fetch_chunk_blocks=2,
        )  # prefetches of several chunks, landing in any order
        self.reqs: list[Req] = []
        self.swapped: list[list[int]] = []  # token sequences of requests preempted by swap
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.stored: dict[bytes, bytes] = {}
        self.inflight: list = []  # TransferOps planned, not yet completed
        self.next_rid = 0

    # ------------------------------------------------------------ requests
    def _add(self, tokens):
        creq = self.mgr.new_request(self.next_rid, tokens)
        self.next_rid += 1
        m = self.mgr.match_prefix(creq)
        assert m.num_blocks * BS < len(tokens)
        if m.num_storage_blocks:
            self.mgr.prefetch(creq)
        self.reqs.append(Req(creq, tokens))
        return m

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        keep=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 10), min_size=1, max_size=5),
    )
    def add_request(self, prefix, keep, suffix):
        self._add(PREFIXES[prefix][:keep] + suffix)

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
            m = r.creq.match  # allocate re-matches if a copy went away since
            cached = (m.num_device_blocks + m.num_host_blocks) * BS
            r.computed, r.scheduled = cached, n - cached
        elif self.mgr.wait_would_fit(r.creq, n) and data.draw(st.booleans()):
            self._wait_for_backups(data.draw(st.lists(st.booleans(), max_size=4)))

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
            return
        if not self.mgr.wait_would_fit(r.creq, n) or not data.draw(st.booleans()):
            return
        # The scheduler's choice: device blocks are on their way out, so wait rather than preempt.
        self._wait_for_backups(data.draw(st.lists(st.booleans(), max_size=4)))
        need = -(-n // BS) - len(r.creq.block_table)
        reclaimable = self._reclaimable()
        if self.mgr.allocate(r.creq, n):
            r.scheduled = n - r.computed
        else:
            # only a shortfall, or write_back turning evictions into backups, may still refuse
            assert need > reclaimable or (self.policy == "write_back" and self.mgr.num_device_blocks_freeing), (
                f"allocate of {need} blocks refused with {reclaimable} free or evictable"
            )

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        keep=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 10), min_size=1, max_size=5),
        fail=st.lists(st.booleans(), max_size=6),
        late=st.booleans(),
        early_commit=st.booleans(),
    )
    def serve(self, prefix, keep, suffix, fail, late, early_commit):
        """A whole request: match, prefetch, admit, prefill, finish (a few steps)."""
        self._add(PREFIXES[prefix][:keep] + suffix)
        r = self.reqs[-1]
        for _ in range(3):
            self.step(fail, [], late=late)
            m = self.mgr.match_prefix(r.creq)
            if not m.num_storage_blocks or self.mgr.prefetch(r.creq) == 0:
                break
        if self.mgr.allocate(r.creq, len(r.tokens)):
            m = r.creq.match
            cached = (m.num_device_blocks + m.num_host_blocks) * BS
            r.computed, r.scheduled = cached, len(r.tokens) - cached
            self.step(fail, [], late=late, early_commit=early_commit)
            self.step([], [])
        self.mgr.free(r.creq)
        self.reqs.remove(r)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(self.reqs))
        self.mgr.free(r.creq)
        self.reqs.remove(r)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), back_now=st.booleans())
    def swap_out(self, data, back_now):
        """Preemption by swap: the committed blocks go to host (whatever the write policy)."""
        mgr, tree = self.mgr, self.mgr.tree
        r = data.draw(st.sampled_from(self._running()))
        nodes = list(r.creq.nodes)
        missing = sum(1 for n in nodes if n.host_block is None)
        planned = mgr.swap_out(r.creq)
        self.reqs.remove(r)
        assert r.creq.freed
        assert planned <= missing
        for n in nodes:
            assert tree.alive(n) and n.device_block is not None, "swap_out dropped a committed block"
            if n.host_block is None:  # no host copy, not even one on its way: only if host is full
                assert mgr.host_pool.num_free == 0, f"swap_out left {n} without a host copy"

        def unlocked_below(n):  # freed leaf-first: a locked device descendant (another
            return n.lock_ref == 0 and all(
                unlocked_below(c)
                for c in tree.children_of(n)  # request,
                if c.device_block is not None
            )  # a prefetch) keeps it

        out = [n for n in nodes if n.host_block is not None and not n.host_ready and unlocked_below(n)]
        assert mgr.num_device_blocks_freeing >= len(out), "swapped-out blocks not counted as freeing"
        if back_now:  # comes straight back: its whole committed prefix is still a hit
            m = self._add(list(r.tokens))
            assert m.num_device_blocks >= min(len(nodes), (len(r.tokens) - 1) // BS), (m, len(nodes))
        else:
            self.swapped.append(list(r.tokens))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), away=st.sampled_from(["briefly", "off device", "off host"]))
    def come_back(self, data, away):
        """A swapped-out request returns: its prefix comes from any tier, or is recomputed. While
        it was away, its blocks may have been pushed off the device, or off the host too."""
        tokens = self.swapped.pop(data.draw(st.integers(0, len(self.swapped) - 1)))
        if away != "briefly":
            self._drain()
            self.mgr.table.evict_device(self.mgr.device_pool.num_blocks)
            self._drain()  # write_back: device copies go once their backups land
            if away == "off host":
                self.mgr.table.evict_host(self.mgr.host_pool.num_blocks)
                self._drain()  # write_back: host copies go once stored
        self._add(tokens)

    @rule(device=st.integers(0, 10), host=st.integers(0, 20))
    def pressure(self, device, host):
        """Other requests' demand: evict what allocate would evict to find this many blocks."""
        self.mgr.table.evict_device(device)
        self.mgr.table.evict_host(host)

    @rule()
    def submit_only(self):
        """A step that plans copies and sees none of them complete."""
        self.inflight.extend(self.mgr.take_plan())

    @precondition(lambda self: self.mgr.num_device_blocks_freeing)
    @rule(fail=st.lists(st.booleans(), max_size=4))
    def wait_for_backups(self, fail):
        self._wait_for_backups(fail)

    # ------------------------------------------------------------ a step
    @rule(
        fail=st.lists(st.booleans(), max_size=12),
        finish=st.lists(st.booleans(), max_size=6),
        rest=st.booleans(),
        late=st.booleans(),
        early_commit=st.booleans(),
        reverse=st.booleans(),
    )
    def step(self, fail, finish, rest=True, late=False, early_commit=False, reverse=False):
        mgr = self.mgr
        self.inflight.extend(mgr.take_plan())
        fails = iter(fail)
        loads = [op for op in self.inflight if op.kind == "load"]
        if reverse:
            loads.reverse()
        # Loads land before the forward reads them (the runner's per-layer wait, GPU-side); the
        # manager hears of it before the forward, or (late) only after it.
        landed = [(op, self._land(op, fails)) for op in loads]
        bad = {op.dst_blocks[i] for op, failed in landed for i in failed}
        expected = {}  # rid -> first position a request reads from a failed load: its rewind
        for r in self._running():
            first_bad = next((i for i in range(r.computed // BS) if r.creq.block_table[i] in bad), None)
            if r.scheduled and first_bad is not None:
                expected[r.creq.rid] = first_bad * BS
        rewinds = {}
        if not late:
            for op, failed in landed:
                rewinds.update(self._complete(op, failed))
            assert rewinds == expected, f"rewinds {rewinds}, failed loads read at {expected}"
        # The forward: every block it reads holds its tokens' KV; it writes its own blocks. A
        # request that read a failed load (its rewind not known yet) computes garbage.
        reading = self._blocks_used_by_inflight()
        forwarded = []
        for r in self._running():
            if not r.scheduled:
                continue
            rid = r.creq.rid
            if rid in rewinds:
                r.computed = min(r.computed, rewinds[rid])
                r.scheduled = 0
                continue
            keys = r.creq.keys
            table = r.creq.block_table
            for i in range(expected.get(rid, r.computed) // BS):
                assert self.device[table[i]] == keys[i], f"request {rid} reads wrong KV in block {i}"
            end = r.computed + r.scheduled
            mgr.sync_keys(r.creq, end)
            for i in range(r.computed // BS, -(-end // BS)):
                assert ("device", table[i]) not in reading, "forward writes a block an in-flight copy uses"
                assert i >= len(r.creq.nodes), "forward writes a tree-owned block"
                full = (i + 1) * BS <= end and rid not in expected
                self.device[table[i]] = keys[i] if full else GARBAGE
            r.computed, r.scheduled = end, 0
            forwarded.append(r)
        if late:
            if early_commit:  # the step's update before the manager learns the loads landed
                for r in forwarded:
                    before = (list(r.creq.nodes), list(r.creq.block_table), len(mgr.tree))
                    mgr.commit(r.creq, r.computed)
                    if r.creq.num_loading:
                        assert before == (list(r.creq.nodes), list(r.creq.block_table), len(mgr.tree)), (
                            "commit changed the tree while the request's loads are in flight"
                        )
            for op, failed in landed:
                rewinds.update(self._complete(op, failed))
            assert rewinds == expected, f"rewinds {rewinds}, failed loads read at {expected}"
            for r in forwarded:
                if r.creq.rid in rewinds:
                    r.computed = rewinds[r.creq.rid]  # the step's output is discarded
        for r in forwarded:
            if r.creq.rid not in rewinds:
                mgr.commit(r.creq, r.computed)  # catches up on an early commit that had to wait
        # Other copies complete now or later (async), in any order.
        self.inflight.extend(mgr.take_plan())
        done = iter(finish)
        for op in list(self.inflight):
            if op.kind == "load":
                continue  # the next step's forward waits for it
            oldest_backup = next((o for o in self.inflight if o.kind == "backup"), None)
            if op.kind == "backup" and op is not oldest_backup:
                continue  # backups land in plan order (one offload stream)
            if next(done, rest):
                self._run(op, fails)

    def _blocks_used_by_inflight(self):
        out: set[tuple[str, int]] = set()
        for op in self.inflight:
            out.update((op.src_tier, b) for b in op.src_blocks)
            out.update((op.dst_tier, b) for b in op.dst_blocks)
        return out

    def _land(self, op, fails):
        """The op's bytes land (items drawn from ``fails`` fail); the manager is not told yet."""
        failed = {i for i in range(op.num_blocks) if next(fails, False)}
        src = {"device": self.device, "host": self.host}.get(op.src_tier)
        dst = {"device": self.device, "host": self.host}.get(op.dst_tier)
        for i in range(op.num_blocks):
            if op.kind == "fetch":
                value = self.stored.get(op.keys[i], GARBAGE)
            else:
                assert src is not None, op
                value = src[op.src_blocks[i]]
                assert value == op.keys[i], f"{op.kind} reads a block that does not hold its key"
            if op.kind == "put":
                if i not in failed:
                    self.stored[op.keys[i]] = value
            else:
                assert dst is not None, op
                dst[op.dst_blocks[i]] = GARBAGE if i in failed else value
        return failed

    def _complete(self, op, failed):
        self.inflight.remove(op)
        return self.mgr.complete(op.op_id, failed)

    def _run(self, op, fails):
        return self._complete(op, self._land(op, fails))

    def _reclaimable(self):
        """Free device blocks plus device copies that leaf-first eviction can reach: the copy and
        every device copy below it are unlocked and unread."""
        tree = self.mgr.tree
        blocked = set()
        for n in tree.nodes.values():
            if n.device_block is not None and (n.lock_ref or n.device_reads):
                while not n.is_root and id(n) not in blocked:
                    blocked.add(id(n))
                    assert n.parent is not None  # (only the root has none)
                    n = n.parent
        return self.mgr.device_pool.num_free + sum(
            1 for n in tree.nodes.values() if n.device_block is not None and id(n) not in blocked
        )

    def _wait_for_backups(self, fail):
        """The scheduler waits (frees nothing) until the device->host copies in flight land; the
        blocks ``num_device_blocks_freeing`` promised must then be free or evictable."""
        mgr = self.mgr
        promised = mgr.num_device_blocks_freeing
        before = self._reclaimable()
        self.inflight.extend(mgr.take_plan())
        fails = iter(fail)
        for op in [op for op in self.inflight if op.kind in ("backup", "preload")]:
            self._run(op, fails)
        after = self._reclaimable()
        assert after >= before + promised, (
            f"{promised} device blocks promised by in-flight backups and preloads, {after - before} came"
        )

    # ------------------------------------------------------------ checks
    @invariant()
    def invariants_hold(self):
        self.mgr.assert_invariants([r.creq for r in self.reqs])
        for node in self.mgr.tree.nodes.values():
            if node.device_block is not None:
                assert self.device.get(node.device_block) == node.key, "tree device copy holds wrong KV"
            if node.host_block is not None and node.host_ready:
                assert self.host.get(node.host_block) == node.key, "tree host copy holds wrong KV"
        for r in self._running():
            if not r.scheduled and not r.creq.num_loading:  # every computed full block committed
                assert len(r.creq.nodes) == r.computed // BS, (r.creq.rid, len(r.creq.nodes), r.computed)

    def _drain(self):
        """Every copy planned lands (successfully), and those its completion plans too."""
        self.inflight.extend(self.mgr.take_plan())
        while self.inflight:
            assert not self._run(self.inflight[0], iter(())), "rewind without a failed load"
            self.inflight.extend(self.mgr.take_plan())

    def teardown(self):
        for r in self.reqs:
            self.mgr.free(r.creq)
        self._drain()
        self.mgr.assert_invariants()
        tree = self.mgr.tree
        assert self.mgr.num_device_blocks_freeing == 0 and self.mgr.num_pending_ops == 0
        assert all(n.lock_ref == 0 and n.host_reads == 0 and n.device_reads == 0 for n in tree.nodes.values())
        assert self.mgr.device_pool.num_free + tree.num_device_copies == self.mgr.device_pool.num_blocks
        assert self.mgr.host_pool.num_free + tree.num_host_copies == self.mgr.host_pool.num_blocks


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class WriteThroughSelective(CacheMachine):
    policy = "write_through_selective"


class WriteThrough(CacheMachine):
    policy = "write_through"
    storage_capacity = None


class WriteBack(CacheMachine):
    policy = "write_back"


DEEP = settings(SETTINGS, max_examples=DEEP_EXAMPLES)
TestWriteThroughSelective = WriteThroughSelective.TestCase
TestWriteThroughSelective.settings = SETTINGS
TestWriteThrough = WriteThrough.TestCase
TestWriteThrough.settings = SETTINGS
TestWriteBack = WriteBack.TestCase
TestWriteBack.settings = SETTINGS


@pytest.mark.slow
class TestWriteThroughSelectiveDeep(WriteThroughSelective.TestCase):  # type: ignore[valid-type,misc]  # (built at run time)
    settings = DEEP


@pytest.mark.slow
class TestWriteThroughDeep(WriteThrough.TestCase):  # type: ignore[valid-type,misc]  # (built at run time)
    settings = DEEP


@pytest.mark.slow
class TestWriteBackDeep(WriteBack.TestCase):  # type: ignore[valid-type,misc]  # (built at run time)
    settings = DEEP
