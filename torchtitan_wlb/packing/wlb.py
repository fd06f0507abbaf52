"""WLB-LLM packing: variable-length micro-batches with multi-level outlier queues (Algorithm 1).

``wlb_paper`` is Algorithm 1 as published (a per-document Python loop, the reference); ``wlb``
keeps its queues, carry-over, K and flush and changes what docs/packing.md ("What ``wlb``
changes") lists; the comments below say where each change happens.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import DocPool, Packer, PackingConfig
from torchtitan_wlb.packing.end_of_data import plan_drain
from torchtitan_wlb.packing.placement import fill_rounds, lpt_place

_TOKEN_FILL = 0.98  # admission keeps 2 % of the step's token capacity for regular documents


def default_thresholds(cost_model: CostModel, context_len: int, levels: int = 3) -> tuple[int, ...]:
    """Queue thresholds from the cost model: level i starts where one document costs
    ``2**(i-1) / 2`` micro-batches of linear work (docs/packing.md); below it, the other documents
    of its micro-batch can always balance it."""
    a, b = cost_model.attn_coef, cost_model.linear_coef
    unit = b * context_len
    if unit == 0:  # attention-only cost: use fractions of a full-context document
        unit = cost_model.doc_cost(np.array([context_len]))[0]
    out = []
    for i in range(levels):
        c = unit * 0.5 * 2**i  # the length d whose cost a d^2 + b d is c:
        d = int(c / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * c)) / (2 * a))
        if d < context_len and (not out or d > out[-1]):
            out.append(max(d, 1))
    return tuple(out) or (context_len,)


class _QueuedPacker(Packer):
    """State shared by both WLB packers: carried regular documents, the outlier ``queue`` (its
    ``tag`` is the queue level 1..n; kept in arrival order, so a level's documents are FIFO) and
    the ``backlog`` that back-pressure handed back (offered first next step)."""

    variable_length = True
    _pools = ("carry", "queue", "backlog")

    def __init__(self, config: PackingConfig, cost_model: CostModel) -> None:
        super().__init__(config, cost_model)
        self.cap = config.smax if config.smax is not None else int(1.25 * config.context_len)
        self.queue = DocPool()
        self.backlog = DocPool()

    @property
    def cost_model(self) -> CostModel:
        return self._cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        """Thresholds not set in the config follow the model in use: the online cost model swaps
        it between steps (always the same model for the same step, resumed or not), and the
        thresholds of the initial model would queue the wrong documents once the machine's
        attention price is known (docs/cost_model.md, "What a refit changes in packing")."""
        self._cost_model = model
        th = self.config.queue_thresholds
        if th is None:
            th = default_thresholds(model, self.config.context_len)
        self.thresholds = np.asarray(th, np.int64)

    def tokens_wanted(self) -> int:
        held = int(self.carry.lens.sum()) + int(self.backlog.lens.sum())
        return max(0, self.n * self.config.context_len - held)

    def queue_depths(self) -> list[int]:
        return np.bincount(self.queue.tag - 1, minlength=self.thresholds.size).tolist()

    def _intake(self, ids: np.ndarray, lens: np.ndarray, flush: bool = False) -> DocPool:
        """Queue the new outliers; return the regular documents: carry, then those handed back
        last step (they precede this pull in the stream and enter the packing order now), then new.
        The pull that ends the data holds the read-ahead: each document arrives at the step the
        budget rule would have pulled it (one global batch a step), so delays count from there.
        """
        level = np.searchsorted(self.thresholds, lens, side="right")
        back, self.backlog = self.backlog, DocPool()
        handed_back = DocPool(back.ids, back.lens, self._step, 0, back.pulled)
        arrival: np.ndarray | int = self._step
        if flush and lens.size:
            before = np.cumsum(lens) - lens  # tokens ahead of each document in this pull
            arrival = self._step + before // (self.n * self.config.context_len)
        new = DocPool.concat([handed_back, DocPool(ids, lens, arrival, level)])
        self.queue = DocPool.concat([self.queue, new.take(np.flatnonzero(new.tag > 0))])
        regular = DocPool.concat([self.carry, new])
        regular.tag = np.zeros(len(regular), np.int64)
        self.carry = DocPool()
        return regular


class WLBPaperPacker(_QueuedPacker):
    """Algorithm 1 of the paper, document by document (reference implementation)."""

    name = "wlb_paper"

    def _plan(self, ids, lens, flush):
        n, cap = self.n, self.cap
        regular = self._intake(ids, lens)
        loads = np.zeros(n)
        tokens = np.zeros(n, np.int64)
        out_docs: list[DocPool] = []
        out_mb: list[np.ndarray] = []
        # Full queues release N documents FIFO, one per micro-batch (the longest to the
        # micro-batch with the fewest tokens, so that releases of several queues stay under
        # S_max; a document that does not fit waits for the next step).
        for level in range(1, self.thresholds.size + 1):
            while True:
                idx = np.flatnonzero(self.queue.tag == level)
                if idx.size < n:
                    break
                idx = idx[:n]
                by_len = idx[np.argsort(-self.queue.lens[idx], kind="stable")]
                bins = np.argsort(tokens, kind="stable")
                fit = tokens[bins] + self.queue.lens[by_len] <= cap
                if not fit.any():
                    break
                group = self.queue.subset(by_len[fit])
                self.queue.take(by_len[fit])
                out_docs.append(group)
                out_mb.append(bins[fit])
                loads[bins[fit]] += self.cost_model.doc_cost(group.lens)
                tokens[bins[fit]] += group.lens
                if not fit.all():
                    break
        # Documents past their max wait (or everything, at the end) join the regular ones.
        due = self._step - self.queue.arrival >= self.config.max_delay_steps
        forced = self.queue.take(np.flatnonzero(due | flush))
        rest = DocPool.concat([regular, forced])
        order = np.argsort(-rest.lens, kind="stable")  # carry first among equal lengths
        costs = self.cost_model.doc_cost(rest.lens)
        mb = np.full(len(rest), -1, np.int64)
        for i in order.tolist():
            d = rest.lens[i]
            j = int(np.argmin(loads))
            if tokens[j] + d > cap:
                j = int(np.argmin(tokens))
                if tokens[j] + d > cap:
                    continue
            mb[i] = j
            loads[j] += costs[i]
            tokens[j] += d
        placed = mb >= 0
        self.carry = rest.subset(np.flatnonzero(~placed))
        out_docs.append(rest.subset(np.flatnonzero(placed)))
        out_mb.append(mb[placed])
        return DocPool.concat(out_docs), np.concatenate(out_mb)


class WLBPacker(_QueuedPacker):
    """Improved WLB: admission and release of outliers by cost, vectorised placement."""

    name = "wlb"
    max_release_attempts = 4
    _EMA = 0.1  # weight of the newest step in the running delay
    _WAIT_STEP = 0.5  # change of the effective K per step
    _HEADROOM = 0.5  # running delay under this fraction of the target: K rises faster
    _MAX_RISE = 8.0  # at most this many times ``_WAIT_STEP`` a step

    def __init__(self, config: PackingConfig, cost_model: CostModel) -> None:
        super().__init__(config, cost_model)
        self.k_eff = float(config.max_delay_steps)
        self.delay_ema = float(config.delay_target)
        # Final steps the drain's last plan still has to come (-1: not draining): each drain step
        # plans the held documents again, and never into more steps than that plan promised.
        self.drain_left = -1

    @property
    def _regular_len(self) -> int:
        """A typical regular document (half the first queue threshold): its cost per token is what
        regular tokens add to a micro-batch, for the forced steps' pull (``tokens_wanted``)."""
        first = int(self.thresholds[0]) if self.thresholds.size else self.config.context_len
        return max(1, first // 2)

    def _wait_bound(self) -> int:
        return int(self.k_eff)

    def read_ahead_tokens(self) -> int:
        """``read_ahead_steps`` global batches: the drain then plans the last steps' documents
        together with the held outliers (docs/packing.md, "The end of the data")."""
        return self.config.read_ahead_steps * self.n * self.config.context_len

    def tokens_wanted(self) -> int:
        """One global batch less what is held; before a step that forces outliers out, the regular
        tokens that lift every micro-batch to its costliest forced outlier's cost, which fixes the
        step's maximum anyway (docs/packing.md, "Forced steps pull more")."""
        want = super().tokens_wanted()
        q = self.queue
        due = np.flatnonzero(self._step - q.arrival >= self._wait_bound())
        if due.size == 0:
            return want
        # Both costs from the model in use: the online cost model swaps it between steps.
        cost = self.cost_model.doc_cost(q.lens[due])
        typical = self.cost_model.doc_cost(np.array([self._regular_len]))
        rho = float(typical[0]) / self._regular_len
        need = (self.n * float(cost.max()) - float(cost.sum())) / rho if rho > 0 else 0.0
        room = int(_TOKEN_FILL * self.n * self.cap) - int(q.lens[due].sum())
        held = int(self.carry.lens.sum()) + int(self.backlog.lens.sum())
        return max(want, min(room, int(need)) - held)

    def _adapt_wait(self, docs: DocPool) -> None:
        """Adaptive K (docs/packing.md): rare long documents afford long waits, which buy
        balance; the running token-weighted delay moves K between its bounds."""
        cfg = self.config
        if cfg.adaptive_max_delay_steps <= cfg.max_delay_steps:
            return
        tokens = int(docs.lens.sum())
        delay = float(((self._step - docs.arrival) * docs.lens).sum() / tokens) if tokens else 0.0
        self.delay_ema = (1 - self._EMA) * self.delay_ema + self._EMA * delay
        if self.delay_ema > cfg.delay_target:
            self.k_eff = max(float(cfg.max_delay_steps), self.k_eff - self._WAIT_STEP)
        elif self.delay_ema < 0.9 * cfg.delay_target:
            self.k_eff = min(float(cfg.adaptive_max_delay_steps), self.k_eff + self._rise())

    def _rise(self) -> float:
        """K's rise this step: ``_WAIT_STEP``, or while the running delay is under ``_HEADROOM`` of
        its target, up to ``_MAX_RISE`` times that in proportion to the headroom, so groups of rare
        long documents form within the pass (docs/packing.md, "Adaptive K")."""
        spare = self._HEADROOM * self.config.delay_target
        if self.delay_ema >= spare:
            return self._WAIT_STEP
        return self._WAIT_STEP * min(self._MAX_RISE, spare / max(self.delay_ema, 1e-12))

    def state_dict(self) -> dict[str, Any]:
        extra = {"k_eff": self.k_eff, "delay_ema": self.delay_ema, "drain_left": self.drain_left}
        return {**super().state_dict(), **extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.k_eff = float(state["k_eff"])
        self.delay_ema = float(state["delay_ema"])
        self.drain_left = int(state["drain_left"])

    def _drain(self, regular: DocPool) -> tuple[DocPool, np.ndarray]:
        """End of the data: emit the heaviest of the balanced final steps, hold the rest."""
        held = DocPool.concat([self.queue, regular])  # tag: queue level, 0 for regular
        cost = self.cost_model.doc_cost(held.lens)
        promised = self.drain_left if self.drain_left > 0 else None
        plan = plan_drain(cost, held.lens, self.n, self.cap, max_steps=promised)
        self.drain_left = plan.steps - 1
        now, mb = plan.step == 0, plan.micro_batch.copy()
        # The wait bound holds through the drain: documents due now join this step if they fit.
        late = np.flatnonzero(~now & (self._step - held.arrival >= self._wait_bound()))
        if late.size:
            loads = np.bincount(mb[now], weights=cost[now], minlength=self.n)
            tokens = np.bincount(mb[now], weights=held.lens[now], minlength=self.n).astype(np.int64)
            late = late[np.argsort(-cost[late], kind="stable")]
            mb[late] = lpt_place(loads, tokens, cost[late], held.lens[late], self.cap)
            now[late] = mb[late] >= 0
        rest = held.subset(np.flatnonzero(~now))
        self.queue = rest.subset(np.flatnonzero(rest.tag > 0))
        self.carry = rest.subset(np.flatnonzero(rest.tag == 0))
        return held.subset(np.flatnonzero(now)), mb[now]

    def _plan(self, ids, lens, flush):
        n, cm = self.n, self.cost_model
        regular = self._intake(ids, lens, flush)
        if flush:
            return self._drain(regular)
        self.drain_left = -1
        loads = np.zeros(n)
        tokens = np.zeros(n, np.int64)
        q = self.queue
        q_cost = cm.doc_cost(q.lens)
        q_bin = np.full(len(q), -1, np.int64)

        # 1. Forced outliers (waited K steps) are placed first: oldest first (no
        #    starvation when the forced work exceeds a step), largest first among equals.
        forced = np.flatnonzero(self._step - q.arrival >= self._wait_bound())
        forced = forced[np.lexsort((-q_cost[forced], q.arrival[forced]))]
        q_bin[forced] = lpt_place(loads, tokens, q_cost[forced], q.lens[forced], self.cap)

        # 2. Regular documents (carried ones included) are placed after the outliers.
        r_cost = cm.doc_cost(regular.lens)

        # 3. Waiting outliers: release a group at a higher level, or admit those under the level.
        loads, tokens, limit = self._place_waiting(loads, tokens, q_cost, q_bin, r_cost, regular)

        # 4. Regular documents fill the micro-batches; what does not fit is carried or handed back.
        r_bin, back = self._place_regular(regular, r_cost, loads, tokens, limit)
        self.backlog = regular.subset(back)
        r_bin[back] = -2  # neither placed nor carried
        self.carry = regular.subset(np.flatnonzero(r_bin == -1))
        released = self.queue.take(np.flatnonzero(q_bin >= 0))
        docs = DocPool.concat([released, regular.subset(np.flatnonzero(r_bin >= 0))])
        self._adapt_wait(docs)
        return docs, np.concatenate([q_bin[q_bin >= 0], r_bin[r_bin >= 0]])

    def _place_waiting(
        self,
        loads: np.ndarray,
        tokens: np.ndarray,
        q_cost: np.ndarray,
        q_bin: np.ndarray,
        r_cost: np.ndarray,
        regular: DocPool,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """Step 3 of :meth:`_plan`: the waiting outliers (those ``q_bin`` has not placed, largest
        first) are released as a group at a higher level when that step still balances (up to
        ``max_release_attempts`` tries), else admitted where they fit under the step's level.
        Fills ``q_bin``; returns the new loads and tokens and the level the regular documents must
        stay under (``inf``: none, no outlier fixes the step's maximum)."""
        n, q = self.n, self.queue
        new_cost = float(r_cost.sum())
        new_tokens = int(regular.lens.sum())
        waiting = np.flatnonzero(q_bin < 0)
        waiting = waiting[np.argsort(-q_cost[waiting], kind="stable")]
        w_cost, w_lens = q_cost[waiting], q.lens[waiting]
        mean0 = (loads.sum() + new_cost) / n
        level0 = max(loads.max(), mean0)
        # An outlier already fixes the step's maximum (a forced one): regular documents must not
        # lift any micro-batch above it, and more queued outliers may go at no extra cost.
        outlier_bound = loads.max() > mean0
        chosen = None
        limit = level0 if outlier_bound else np.inf
        for top in waiting[: self.max_release_attempts]:
            target = q_cost[top]
            if target <= level0:
                break
            age = (self._step - q.arrival[top]) / max(self._wait_bound(), 1)
            tau = self.config.balance_target + self.config.release_slack * age
            trial = self._admit(loads, tokens, w_cost, w_lens, target, new_cost, new_tokens, tau)
            if trial is not None:
                chosen, limit = trial, target
                break
        if chosen is None:
            tok = 0 if outlier_bound else new_tokens
            chosen = self._admit(loads, tokens, w_cost, w_lens, level0, new_cost, tok, None)
        loads, tokens, admitted = chosen
        q_bin[waiting] = admitted
        return loads, tokens, limit

    def _place_regular(
        self,
        regular: DocPool,
        r_cost: np.ndarray,
        loads: np.ndarray,
        tokens: np.ndarray,
        limit: float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Step 4 of :meth:`_plan`: regular documents fill the micro-batches, vectorised and dealt
        (each gets every size: docs/packing.md, "Vectorised placement"); what does not fit under
        the cap (or under the ``limit`` an outlier set) is carried. Carried documents go first;
        past K steps they ignore the level. Fresh ones are offered as a stream prefix
        (:meth:`_offer`). Returns each document's micro-batch (-1: carried) and the documents
        handed back."""
        n, cap, r_lens = self.n, self.cap, regular.lens
        r_bin = np.full(len(regular), -1, np.int64)
        carried = np.flatnonzero(regular.arrival < self._step)
        fresh = np.flatnonzero(regular.arrival == self._step)
        fits = int(r_lens.sum()) + int(tokens.sum()) <= n * cap
        if carried.size and fresh.size and not np.isfinite(limit) and fits:
            # Everything fits: one placement over all documents balances best.
            carried, fresh = np.concatenate([carried, fresh]), fresh[:0]
        if carried.size:
            r_bin[carried] = fill_rounds(
                loads, tokens, r_cost[carried], r_lens[carried], cap, limit, deal=True
            )
        back = fresh[:0]
        if fresh.size:
            fresh, back = self._offer(fresh, r_cost, regular, loads, tokens, limit)
            r_bin[fresh] = fill_rounds(
                loads, tokens, r_cost[fresh], r_lens[fresh], cap, limit, deal=True
            )
        overdue = np.flatnonzero((r_bin < 0) & (self._step - regular.arrival >= self._wait_bound()))
        if overdue.size and np.isfinite(limit):
            r_bin[overdue] = fill_rounds(
                loads, tokens, r_cost[overdue], r_lens[overdue], cap, deal=True
            )
        return r_bin, back

    def _offer(
        self,
        fresh: np.ndarray,
        r_cost: np.ndarray,
        regular: DocPool,
        loads: np.ndarray,
        tokens: np.ndarray,
        limit: float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Back-pressure (docs/packing.md): this step's fresh regular documents (stream order)
        split into the prefix the room left can hold, offered, and the suffix, handed back."""
        lens = regular.lens[fresh]
        tok_room = float((self.cap - tokens).sum())
        cost_room = float(np.maximum(limit - loads, 0.0).sum()) if np.isfinite(limit) else np.inf
        if lens.sum() <= tok_room and r_cost[fresh].sum() <= cost_room:
            return fresh, fresh[:0]
        k = min(
            int(np.cumsum(lens).searchsorted(tok_room, side="right")),
            int(np.cumsum(r_cost[fresh]).searchsorted(cost_room, side="right")),
        )
        old = np.flatnonzero(self._step - regular.pulled[fresh] >= self._wait_bound())
        if old.size:
            k = max(k, int(old[-1]) + 1)
        return fresh[:k], fresh[k:]

    def _admit(
        self,
        loads: np.ndarray,
        tokens: np.ndarray,
        costs: np.ndarray,
        lens: np.ndarray,
        level: float,
        new_cost: float,
        new_tokens: int,
        tau: float | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Place the waiting outliers (largest first) under ``level``, before the regular
        documents ``new_cost``/``new_tokens``. With ``tau`` (a release) keep the result only if
        the predicted max/mean stays within it, else ``None``; without, keep a 2 % token margin
        for the regular documents. Returns (loads, tokens, bin per waiting document)."""
        n, cap = self.n, self.cap
        must_balance = tau is not None
        loads, tokens = loads.copy(), tokens.copy()
        fits = costs <= level
        if must_balance:
            budget = loads.sum() + new_cost + costs[fits].sum()
            if budget * tau < n * level:
                return None  # not enough work to lift every micro-batch to the level
            # The final test below, bounded before placing (docs/packing.md): an outlier adds at
            # most its cost beyond the regular work its tokens displace (rho per token).
            rho = new_cost / new_tokens if new_tokens else 0.0
            fill = np.minimum(np.maximum(level - loads, 0.0), (cap - tokens) * rho).sum()
            gain = np.maximum(costs[fits] - lens[fits] * rho, 0.0).sum()
            top = loads.sum() + min(new_cost + costs[fits].sum(), fill + gain)
            if n * level > tau * (1 + 1e-9) * top:
                return None
        token_budget = int(_TOKEN_FILL * n * cap) - int(tokens.sum())
        if not must_balance:
            token_budget -= new_tokens
        out = np.full(costs.size, -1, np.int64)
        # One outlier at a time (each placement changes the next one's bin): the bins in a heap
        # by (load, index), stale entries dropped as met, so that finding the least-loaded bin
        # with room (the first of equals) costs O(log N), not a scan of N bins per outlier (which
        # made the plan grow with the square of the documents per step at large DP degrees);
        # ``loads`` stays in step for its (pairwise) sum.
        bin_load, bin_tok = loads.tolist(), tokens.tolist()
        cost_of, len_of = costs.tolist(), lens.tolist()
        heap = [(load, b) for b, load in enumerate(bin_load)]
        heapq.heapify(heap)
        fewest = min(bin_tok, default=0)  # no bin has room for a longer outlier than cap - this
        at_fewest = bin_tok.count(fewest)  # tokens only grow: recounted when none is left there
        for i in np.flatnonzero(fits).tolist():  # O(#waiting outliers), bounded by the queues
            d = len_of[i]
            if d > token_budget or fewest > cap - d:
                continue
            j, low = _least_loaded_with_room(heap, bin_load, bin_tok, cap - d)
            if j < 0:
                continue
            c = cost_of[i]
            dyn = level if must_balance else max(level, (loads.sum() + c + new_cost) / n)
            if low + c > dyn:
                continue
            out[i] = j
            was = bin_tok[j]
            bin_load[j] += c
            bin_tok[j] += d
            heapq.heappush(heap, (bin_load[j], j))
            if was == fewest:
                at_fewest -= 1
                if not at_fewest:
                    fewest = min(bin_tok)
                    at_fewest = bin_tok.count(fewest)
            loads[j], tokens[j] = bin_load[j], bin_tok[j]
            token_budget -= d
        if must_balance:
            if not (out >= 0).any():
                return None
            fill = np.minimum(np.maximum(level - loads, 0.0), (cap - tokens) * rho).sum()
            mean = (loads.sum() + min(new_cost, fill)) / n
            if mean <= 0 or max(level, loads.max()) / mean > tau:
                return None
        return loads, tokens, out


def _least_loaded_with_room(
    heap: list[tuple[float, int]], load: list[float], tok: list[int], room: int
) -> tuple[int, float]:
    """The bin of least load (the first of equals) with at most ``room`` tokens, and its load;
    ``(-1, inf)`` when none. ``heap`` holds ``(load, bin)`` entries, some stale (a bin's load has
    grown since): those are dropped; the current entries of full bins are kept."""
    full = []
    found = (-1, math.inf)
    while heap:
        entry_load, b = heap[0]
        if entry_load != load[b]:  # stale: the bin has a newer entry
            heapq.heappop(heap)
            continue
        if tok[b] <= room:
            found = (b, entry_load)
            break
        full.append(heapq.heappop(heap))
    for entry in full:
        heapq.heappush(heap, entry)
    return found
