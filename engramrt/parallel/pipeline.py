"""A synchronous pipeline over torch.distributed point-to-point messages.

Rank 0 is the first stage and the driver: it takes a flat batch, hashes and embeds, runs its
layers and sends (metadata, Carry) to rank 1, and so on; the last stage collapses, normalises
and samples, and sends the sampled tokens (and, when asked, the logits) back to rank 0. With one
stage there are no messages and the same code runs in one process.

Tensors travel as raw bytes, so the hand-off is bit-exact whatever the dtype or backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engramrt.model.trace import EngramTrace, Tracer, fanout
from engramrt.sampling import SampleRow, sample_rows, token_logprobs
from engramrt.session import Carry, Session

_STEP, _STOP = 0, 1


@dataclass
class Meta:
    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    block_tables: list[list[int]] | None = None  # None: each slot's fixed blocks
    return_logits: bool = False
    targets: list[int] | None = None  # per token: next-token id to score (-1: none)
    target_k: int = 0  # top-k alternatives reported with each scored target
    sampling: list[SampleRow] | None = None  # per request; None: greedy

    def rows(self) -> list[SampleRow]:
        return self.sampling if self.sampling is not None else [SampleRow()] * len(self.slots)

    @property
    def logprobs_k(self) -> int | None:
        ks = [r.logprobs for r in self.rows() if r.logprobs is not None]
        return max(ks) if ks else None

    @property
    def num_tokens(self) -> int:
        return sum(self.run_lens)

    def encode(self) -> list[int]:
        """Integers only; the sampling rows travel separately as float64."""
        tables, targets = self.block_tables, self.targets
        head = [int(self.return_logits), len(self.slots), int(tables is not None)]
        head += [int(targets is not None), self.target_k]
        body = [*self.slots, *self.run_lens, *self.start_pos]
        if tables is not None:
            body += [len(t) for t in tables] + [b for t in tables for b in t]
        if targets is not None:
            body += targets
        return head + body

    @classmethod
    def decode(cls, v: list[int]) -> Meta:
        ret, b, has_tables, has_targets, target_k = v[:5]
        v = v[5:]
        slots, lens, pos, v = v[:b], v[b : 2 * b], v[2 * b : 3 * b], v[3 * b :]
        tables = None
        if has_tables:
            sizes, v, tables = v[:b], v[b:], []
            for n in sizes:
                tables.append(v[:n])
                v = v[n:]
        targets = v[: sum(lens)] if has_targets else None
        return cls(slots, lens, pos, tables, bool(ret), targets, target_k)


@dataclass
class StepResult:
    tokens: list[int]  # sampled after each request's last token this step (-1: empty run)
    logits: torch.Tensor | None = None  # [T, V] fp32 when asked for
    logprobs: list[float] | None = None  # of each sampled token, when any row asked
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    target_logprobs: list[float] | None = None  # per token, of its target (NaN: none)
    target_top_ids: list[list[int]] | None = None
    target_top_logprobs: list[list[float]] | None = None


class Pipeline:
    def __init__(
        self,
        session: Session,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        trace: EngramTrace | None = None,
        tracer: Tracer | None = None,
    ):
        """``seed`` drives the rows that carry no seed of their own."""
        self.session, self.rank, self.world = session, rank, world
        self.generator = torch.Generator(device=session.device).manual_seed(seed)
        self.trace = trace
        self.tracer = fanout(trace, tracer)
        cfg = session.model.cfg
        self.vocab, self.hc, self.dim = cfg.vocab_size, cfg.hc_mult, cfg.hidden_size
        self.hash_shape = (cfg.engram.num_layers, cfg.engram.n_hash_cols)
        tok = session.tokenizer
        self.token_limit = tok.get_vocab_size(with_added_tokens=True) if tok else None

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    # --- the driver (rank 0) -------------------------------------------------------------

    def step(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        run_lens: Sequence[int],
        start_pos: Sequence[int],
        return_logits: bool = False,
        block_tables: list[list[int]] | None = None,
        sampling: list[SampleRow] | None = None,
        targets: list[int] | None = None,
        target_k: int = 0,
    ) -> StepResult:
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives the pipeline")
        if len(tokens) != sum(run_lens):
            raise ValueError(f"{len(tokens)} tokens but run lengths sum to {sum(run_lens)}")
        meta = Meta(
            list(slots), list(run_lens), list(start_pos), block_tables, return_logits,
            None if targets is None else list(targets), target_k, sampling,
        )  # fmt: skip
        result = self._stage(meta, list(tokens))
        return result if result is not None else self._recv_result(meta)

    def stop(self) -> None:
        """Release the other stages (their ``serve`` returns)."""
        if self.rank == 0 and self.world > 1:
            self._send_header(_STOP, 0)

    # --- every other rank ----------------------------------------------------------------

    def serve(self) -> None:
        while True:
            kind, n = self._recv_header()
            if kind == _STOP:
                if not self.is_last:
                    self._send_header(_STOP, 0)
                return
            self._stage(self._recv_meta(n))

    # --- one stage of one step -----------------------------------------------------------

    def _stage(self, meta: Meta, tokens: list[int] | None = None) -> StepResult | None:
        carry = None if self.rank == 0 else self._recv_carry(meta.num_tokens)
        out = self.session.step(
            tokens, meta.slots, meta.run_lens, meta.start_pos, self.tracer, carry, meta.block_tables
        )
        if self.trace is not None:
            self.trace.end_step()
        if not self.is_last:
            self._send_meta(meta)
            self._send_carry(out)
            return None
        result = self._sample(out, meta)
        if self.rank != 0:
            self._send_result(result)
            return None
        return result

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, meta: Meta) -> StepResult:
        """Sample on the device, reading the tokens back at the end (for a greedy decode batch
        nothing else waits on the GPU). ``logits`` may be a CUDA graph's output, so anything
        kept past this step is a copy."""
        ends = (torch.tensor(meta.run_lens, dtype=torch.int64).cumsum(0) - 1).tolist()
        live = [i for i, n in enumerate(meta.run_lens) if n > 0]
        rows, limit = meta.rows(), self.token_limit
        if meta.return_logits or meta.targets is not None or meta.logprobs_k is not None:
            logits = logits.clone()  # kept or scored whole: mask every row
            if limit is not None:  # head rows with no token: never
                logits[:, limit:] = float("-inf")
        rows_at = [ends[i] for i in live]
        if rows_at == list(range(len(rows_at))):  # decode: no index to copy to the device
            last = logits[: len(rows_at)].clone()
        else:
            last = logits[rows_at]  # a copy
        if limit is not None:
            last[:, limit:] = float("-inf")
        sampled = sample_rows(last, [rows[i] for i in live], self.generator)
        tokens = [-1] * len(rows)
        for i, tok in zip(live, sampled.tokens, strict=True):
            tokens[i] = tok
        result = StepResult(tokens, logits if meta.return_logits else None)
        k = meta.logprobs_k
        if k is not None:  # rows of empty runs are scored on row 0 and ignored by the engine
            picked = [ends[i] if meta.run_lens[i] else 0 for i in range(len(rows))]
            toks = [max(t, 0) for t in tokens]
            result.logprobs, result.top_ids, result.top_logprobs = token_logprobs(
                logits[picked], toks, k
            )
        if meta.targets is not None:
            lp, ids, tops = token_logprobs(logits, [max(t, 0) for t in meta.targets], meta.target_k)
            result.target_logprobs = [
                x if t >= 0 else float("nan") for x, t in zip(lp, meta.targets, strict=True)
            ]
            result.target_top_ids, result.target_top_logprobs = ids, tops
        return result

    # --- messages ------------------------------------------------------------------------

    def _dev(self) -> torch.device:
        """Where messages live: host memory for gloo (also with CUDA stages), else the stage's
        device."""
        if self.world > 1 and dist.get_backend() == "gloo":
            return torch.device("cpu")
        return self.session.device

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous().view(torch.uint8).flatten().to(self._dev()), dst)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._dev())
        dist.recv(buf, src)
        return buf.to(self.session.device).view(dtype).view(shape)

    def _send_header(self, kind: int, n: int) -> None:
        self._send(torch.tensor([kind, n], dtype=torch.int64, device=self._dev()), self.rank + 1)

    def _recv_header(self) -> tuple[int, int]:
        kind, n = self._recv((2,), torch.int64, self.rank - 1).tolist()
        return kind, n

    def _send_meta(self, meta: Meta) -> None:
        body = meta.encode()
        self._send_header(_STEP, len(body))
        self._send(torch.tensor(body, dtype=torch.int64, device=self._dev()), self.rank + 1)
        rows = meta.rows()
        self._send(torch.tensor([r.ints() for r in rows], dtype=torch.int64), self.rank + 1)
        self._send(torch.tensor([r.floats() for r in rows], dtype=torch.float64), self.rank + 1)

    def _recv_meta(self, n: int) -> Meta:
        meta = Meta.decode(self._recv((n,), torch.int64, self.rank - 1).tolist())
        b = len(meta.slots)
        ints = self._recv((b, 4), torch.int64, self.rank - 1).tolist()
        floats = self._recv((b, 3), torch.float64, self.rank - 1).tolist()
        meta.sampling = [SampleRow.from_parts(f, i) for f, i in zip(floats, ints, strict=True)]
        return meta

    def _send_carry(self, carry: Carry) -> None:
        for t in (carry.x, carry.pre, carry.hash_ids, carry.dead):
            self._send(t, self.rank + 1)

    def _recv_carry(self, t: int) -> Carry:
        src, model = self.rank - 1, self.session.model
        return Carry(
            self._recv((t, self.hc, self.dim), model.dtype, src),
            self._recv((t, self.hc), torch.float32, src),
            self._recv((t, *self.hash_shape), torch.int64, src),
            self._recv((t,), torch.bool, src),
        )

    def _send_result(self, result: StepResult) -> None:
        def send(values, dtype):
            self._send(torch.tensor(values, dtype=dtype, device=self._dev()), 0)

        send(result.tokens, torch.int64)
        if result.logprobs is not None:
            send(result.logprobs, torch.float32)
            send(result.top_ids, torch.int64)
            send(result.top_logprobs, torch.float32)
        if result.target_logprobs is not None:
            send(result.target_logprobs, torch.float32)
            send(result.target_top_ids, torch.int64)
            send(result.target_top_logprobs, torch.float32)
        if result.logits is not None:
            self._send(result.logits.float(), 0)

    def _recv_result(self, meta: Meta) -> StepResult:
        last, b, t = self.world - 1, len(meta.run_lens), meta.num_tokens

        def recv(shape, dtype):
            return self._recv(shape, dtype, last).tolist()

        result = StepResult(recv((b,), torch.int64))
        k = meta.logprobs_k
        if k is not None:
            result.logprobs = recv((b,), torch.float32)
            result.top_ids = recv((b, k), torch.int64)
            result.top_logprobs = recv((b, k), torch.float32)
        if meta.targets is not None:
            result.target_logprobs = recv((t,), torch.float32)
            result.target_top_ids = recv((t, meta.target_k), torch.int64)
            result.target_top_logprobs = recv((t, meta.target_k), torch.float32)
        if meta.return_logits:
            result.logits = self._recv((t, self.vocab), torch.float32, last)
        return result
